"""BlockPool: one buffer allocated once, handed out as best-fit blocks, compacted on demand.

Offload lives or dies by its buffers. A pool makes four failures impossible by construction:

- rounding waste: the buffer is allocated once at exactly ``capacity_bytes`` (no power-of-two
  rounding of pinned memory), and blocks are carved out of it;
- pinning on the fly: pinning happens once, in ``BlockPool.host``; ``alloc`` never pins;
- unlimited pinned memory: ``BlockPool.host`` checks the size against the host RAM available
  now (see ``check_host_ram``) and refuses before allocating anything;
- fragmentation OOM: when a request fits the free bytes but no free block,
  ``alloc`` defragments (compacts live blocks) and retries before giving up.

Note [block reuse waits on events]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A copy queued on a stream may still read or write a block after its owner is done with it.
The owner records the copy's event on the block (``block.record_event(event)``). Freeing
never blocks: a block whose events have not all completed becomes IN_FLIGHT and its bytes
stay off the free list. IN_FLIGHT blocks are reclaimed (their bytes returned to the free
list) when ``event.query()`` says their copies are done, checked on every later ``alloc``
and ``free``.

When an allocation does not fit the free list, it takes IN_FLIGHT bytes without the CPU
waiting if the caller names the stream that will use the block (``alloc(stream=S)``), the
way the CUDA caching allocator reuses memory: ``S`` waits on the pending events (a GPU-side
wait), the new block inherits them (so defragmentation leaves it in place until they
complete), and the rest of the reused IN_FLIGHT range stays IN_FLIGHT with the same events.
The bytes go to ``S`` only: nobody else sees them before the events complete. Without a
stream, or when no single IN_FLIGHT range holds the request, ``alloc`` waits for pending
events on the host (a synchronisation, the last resort before defragmenting). Events are
always waited on without the pool's lock held: a copy-stream worker may need the lock to
free a block before the event we wait on can complete.

Note [a pool outlives its copies]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A pinned buffer must not be unpinned and freed while a DMA into or out of it is queued,
and a device buffer must not return to the budget while a copy still touches it. ``close()``
waits for pending events; a pool dropped without ``close()`` (an optimizer a Trainer lets go
of) is finalised by ``_Lifetime.drain``, which holds the buffer, waits for every event ever
recorded on a block that has not yet completed, and only then releases the buffer. That
wait runs in a finalizer, i.e. in whichever thread dropped the last reference: a hidden
host synchronisation, paid only by code that forgot ``close()``.

Note [views pin unregistered blocks]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Defragmentation moves bytes, so every pointer into a moved block must be re-pointed. The
only pointers the pool hands out are the tensors returned by ``Block.view``. A view taken
while the block has an ``on_move`` callback is the owner's to re-take in that callback. A
view taken while the block has no callback cannot be re-pointed, so it pins the block in
place for the rest of its life: defragmentation never moves it (even if a callback is
registered later, as the earlier view may still be held) and compacts the other blocks
around it. A block nobody took a view of has no pointers to fix and moves freely. So no
pointer is ever silently invalidated.
"""

from __future__ import annotations

import math
import threading
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from itertools import chain

import psutil
import torch

from ..accelerator import Accelerator, Event, Stream
from ..config import format_bytes
from ..errors import DeviceBudgetExceeded, PoolExhausted, StreamError
from .block import Block, BlockState, MoveCallback
from .freelist import OFFSET_BITS, FreeList
from .inflight import InFlight, pruned
from .moves import move_within, staging_bytes

__all__ = [
    "HOST_RAM_MARGIN_FRACTION",
    "HOST_RAM_MARGIN_MIN",
    "Block",
    "BlockPool",
    "BlockState",
    "check_host_ram",
]

#: Host RAM left free when sizing a host pool: the larger of this fraction of total RAM...
HOST_RAM_MARGIN_FRACTION = 0.05
#: ...and this many bytes, for the interpreter, torch, the data loader and the page cache.
HOST_RAM_MARGIN_MIN = 1 << 30

# Staging for overlapping moves: (tensor, release) or None when none can be had.
Scratch = Callable[[int], "tuple[torch.Tensor, Callable[[], None]] | None"]


def check_host_ram(nbytes: int, *, what: str, sized_by: str) -> None:
    """Raise ``PoolExhausted`` unless ``nbytes`` fit in the host RAM available now.

    Available means ``psutil.virtual_memory().available`` less a safety margin of
    max(``HOST_RAM_MARGIN_FRACTION`` of total RAM, ``HOST_RAM_MARGIN_MIN``), so that
    pinning a pool (which cannot be swapped out) never hands the process to the OOM killer.
    """
    memory = psutil.virtual_memory()
    margin = max(int(memory.total * HOST_RAM_MARGIN_FRACTION), HOST_RAM_MARGIN_MIN)
    allowed = memory.available - margin
    if nbytes > allowed:
        raise PoolExhausted(
            f"refusing to allocate {what} of {format_bytes(nbytes)} ({nbytes} bytes): only "
            f"{format_bytes(memory.available)} of host RAM is available "
            f"(total {format_bytes(memory.total)}), and {format_bytes(margin)} is kept free as a "
            f"safety margin, leaving {format_bytes(max(allowed, 0))}. Lower {sized_by}, or "
            f"free host memory (other pools, processes) before building the pool."
        )


class _Lifetime:
    """Holds a pool's buffer until its copies are done; see Note [a pool outlives its copies].

    ``held`` pairs the buffer with every block event not yet seen complete (Note [a buffer
    travels with its events] in ``inflight.py``); it is guarded by the pool's lock while the
    pool lives. ``drain`` runs once, when the pool is closed or collected.
    """

    def __init__(self, buffer: torch.Tensor, release: Callable[[], None]) -> None:
        self.held: InFlight[torch.Tensor] | None = InFlight(buffer)  # (capacity,) uint8
        self._release = release

    def add(self, event: Event) -> None:
        if self.held is not None:
            self.held.add(event)

    def drain(self) -> None:
        # Synchronisation point (hidden when run as a finalizer): see the Note.
        if self.held is not None:
            for event in self.held.pending():
                try:
                    event.synchronize()
                except StreamError:
                    # Its stream failed, so its work is over and the buffer free to go; the
                    # error reached the stream's user already (Note [stream errors are
                    # sticky]). Raising it again here would print it once more per pool
                    # from the finalizers at exit, burying the one error that matters.
                    continue
            self.held = None
        release, self._release = self._release, _noop
        release()


@dataclass
class _Counters:
    """Running stats of a pool; all guarded by the pool's lock. Units in the names' docs."""

    bytes_in_use: int = 0  # bytes (rounded sizes) of IN_USE blocks
    bytes_requested: int = 0  # bytes asked for (unrounded) by IN_USE blocks
    bytes_in_flight: int = 0  # bytes of IN_FLIGHT blocks (freed, copy pending)
    peak_bytes_in_use: int = 0  # largest bytes_in_use since construction or reset_peak()
    allocations: int = 0  # successful alloc() calls
    frees: int = 0  # free() calls
    defragmentations: int = 0  # compactions run (on demand or automatic)
    bytes_moved: int = 0  # bytes copied by all compactions
    event_waits: int = 0  # events alloc/defragment had to block on (host syncs)
    stream_reuses: int = 0  # allocations that took IN_FLIGHT bytes with a stream-side wait


class BlockPool:
    """Best-fit blocks over one buffer of ``capacity`` bytes; build with ``host``/``device``.

    Rules:
        - alignment: every block starts at a multiple of the pool's ``alignment`` (default
          512 bytes, a power of two), relative to the start of the buffer; ``alloc(align=)``
          asks for more. Sizes are rounded up to ``alignment``; the buffer's last
          ``capacity % alignment`` bytes are never used.
        - best fit: a request takes the smallest free range that holds it, lowest address
          first among equals (``FreeList``, O(log n) comparisons per operation).
        - splitting: the unused tail (and any alignment padding before the block) of the
          chosen range goes back to the free list.
        - coalescing: a freed range is merged with free neighbours at once, so no two free
          ranges touch.
        - reuse: see Note [block reuse waits on events].
        - compaction: ``defragment()`` slides movable blocks toward the start; see Note
          [views pin unregistered blocks] and Note [overlap-safe moves] in moves.py. It runs
          automatically when a request fits the free bytes but not the largest free range.

    Lock: ``_lock`` (a plain ``threading.Lock``) guards the free list, the live and in-flight
    sets, every block's ``offset``/``state``/events/callbacks, and ``_counters``; copy-stream
    workers free blocks too. It is never held while waiting on an event or while running an
    ``on_move`` callback (callbacks may call back into the pool). Owners must not use a
    block's views while a ``defragment()`` runs.

    Stats (``stats()``; bytes unless said otherwise): ``capacity_bytes`` (the buffer),
    ``usable_bytes`` (capacity rounded down to alignment), ``bytes_in_use`` (rounded sizes of
    live blocks), ``bytes_requested`` (unrounded), ``bytes_in_flight`` (freed, copy pending),
    ``bytes_free`` (on the free list), ``peak_bytes_in_use``, ``largest_free_block``,
    ``fragmentation`` (a ratio in [0, 1): 1 - largest_free_block / bytes_free, 0 when
    nothing is free), counts ``live_blocks``, ``in_flight_blocks``, ``free_blocks``,
    ``allocations``, ``frees``, ``defragmentations``, ``event_waits`` (events an allocation or
    compaction blocked on), and ``bytes_moved`` (by all compactions).
    """

    def __init__(
        self,
        accelerator: Accelerator,
        buffer: torch.Tensor,
        *,
        name: str,
        kind: str,
        alignment: int,
        sized_by: str,
        auto_defragment: bool,
        scratch: Scratch,
        release: Callable[[], None],
    ) -> None:
        self.accelerator = accelerator
        self.name = name
        self.kind = kind  # "host, pinned" / "host, pageable" / "device", for messages
        self.alignment = alignment  # bytes, a power of two
        self.sized_by = sized_by  # the setting that sizes this pool, for messages
        self.auto_defragment = auto_defragment
        self.capacity = buffer.numel()  # bytes
        self.usable = self.capacity - self.capacity % alignment  # bytes
        self._buffer = buffer  # (capacity,) uint8, host (pinned when available) or device
        self._scratch = scratch
        self._lifetime = _Lifetime(buffer, release)
        self._finalizer = weakref.finalize(self, self._lifetime.drain)
        self._lock = threading.Lock()
        self._free = FreeList()
        self._free.insert(0, self.usable)
        self._live: set[Block] = set()  # IN_USE blocks
        self._in_flight: list[Block] = []  # IN_FLIGHT blocks, oldest first
        self._counters = _Counters()
        self._closed = False
        checker = accelerator.race_checker
        if checker is not None:
            me = weakref.WeakMethod(self._name_range)  # the checker must not keep the pool

            def namer(lo: int, hi: int) -> str:
                method = me()
                return method(lo, hi) if method is not None else "a dropped pool"

            checker.track(buffer, f"pool {name!r} ({kind})", namer=namer)

    # ----------------------------------------------------------------- construction

    @classmethod
    def host(
        cls,
        accelerator: Accelerator,
        capacity_bytes: int,
        *,
        name: str,
        alignment: int = 512,
        pinned: bool = True,
        sized_by: str = "capacity_bytes",
        auto_defragment: bool = True,
    ) -> BlockPool:
        """A pool over one host buffer of exactly ``capacity_bytes``, pinned when possible.

        Checks ``capacity_bytes`` against the host RAM available (``check_host_ram``) before
        allocating. Hidden costs, paid here once and never in a step: pinning page-locks
        every page; a pageable buffer is zero-filled so its pages are faulted in now (and
        counted by the next pool's RAM check) rather than during a copy.
        ``sized_by`` names the setting that chose the size, for error messages.
        """
        capacity, alignment = _check_pool_args(capacity_bytes, alignment)
        pin = bool(pinned) and accelerator.pinned_memory_available
        check_host_ram(capacity, what=f"host pool {name!r}", sized_by=sized_by)
        buffer = accelerator.allocate_host(capacity, pinned=pin)
        if not pin:
            buffer.zero_()  # hidden cost: faults in every page, once, at construction

        return cls(
            accelerator,
            buffer,
            name=name,
            kind="host, pinned" if pin else "host, pageable",
            alignment=alignment,
            sized_by=sized_by,
            auto_defragment=auto_defragment,
            scratch=_no_scratch,  # CPU moves are memmoves, see Note [overlap-safe moves]
            release=_noop,
        )

    @classmethod
    def device(
        cls,
        accelerator: Accelerator,
        capacity_bytes: int,
        *,
        name: str,
        alignment: int = 512,
        sized_by: str = "capacity_bytes",
        auto_defragment: bool = True,
    ) -> BlockPool:
        """A pool over one device buffer of exactly ``capacity_bytes``, counted in the budget.

        Raises ``DeviceBudgetExceeded`` when the budget cannot hold it. ``close()`` returns
        the bytes to the budget.
        """
        capacity, alignment = _check_pool_args(capacity_bytes, alignment)
        device_buffer = accelerator.allocate_device(capacity, what=f"block pool {name!r}")

        def scratch(nbytes: int) -> tuple[torch.Tensor, Callable[[], None]] | None:
            try:
                staging = accelerator.allocate_device(nbytes, what=f"{name!r} defrag staging")
            except DeviceBudgetExceeded:
                # Fall back to short direct chunks, see Note [overlap-safe moves] in moves.py.
                return None
            return staging.tensor, staging.release

        return cls(
            accelerator,
            device_buffer.tensor,
            name=name,
            kind="device",
            alignment=alignment,
            sized_by=sized_by,
            auto_defragment=auto_defragment,
            scratch=scratch,
            release=device_buffer.release,
        )

    def close(self) -> None:
        """Give the buffer back (device pools: to the budget). All blocks must be freed.

        Synchronisation point: waits for the copies of IN_FLIGHT blocks, which may still
        touch the buffer.
        """
        with self._lock:
            if self._live:
                owners = sorted({block.owner or "<no owner>" for block in self._live})
                raise RuntimeError(
                    f"cannot close pool {self.name!r}: {len(self._live)} blocks are still in "
                    f"use (owners: {', '.join(owners[:8])}); free them first"
                )
            pending = _pending_events(self._in_flight)
        self._wait(pending)
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._in_flight.clear()
            self._buffer = self._buffer.new_empty(0)
        self._finalizer()  # every event is complete now: releases the buffer at once

    def __enter__(self) -> BlockPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"BlockPool(name={self.name!r}, kind={self.kind!r}, capacity={self.capacity}, "
            f"alignment={self.alignment})"
        )

    # ----------------------------------------------------------------- alloc / free

    def alloc(
        self,
        nbytes: int,
        *,
        align: int | None = None,
        owner: str = "",
        stream: Stream | None = None,
    ) -> Block:
        """A block of at least ``nbytes`` (rounded up to the pool's alignment).

        ``align`` (a power of two, bytes) raises the offset's alignment above the pool's.
        ``stream``: the stream that will use the block first; lets the pool hand out bytes
        whose copies are still pending, with ``stream`` waiting on them instead of the CPU.
        When nothing fits, in order: reuse pending bytes on ``stream``, wait for pending
        copies of freed blocks, defragment (if the free bytes would hold the request), then
        raise ``PoolExhausted``. See Note [block reuse waits on events].
        """
        if stream is not None and not isinstance(stream, Stream):
            raise TypeError(f"stream must be an accelerator Stream or None, got {stream!r}")
        if type(nbytes) is not int:  # bool and float are refused too
            raise TypeError(f"nbytes must be an int, got {type(nbytes).__name__} {nbytes!r}")
        if nbytes <= 0:
            raise ValueError(f"nbytes must be > 0, got {nbytes} (owner {owner!r})")
        base = self.alignment
        block_align = base if align is None else max(_check_align(align, "align"), base)
        size = -(-nbytes // base) * base
        with self._lock:
            if self._closed:
                raise self._closed_error()
            block = self._try_alloc_locked(nbytes, size, block_align, owner)
            if block is None and stream is not None:
                block = self._reuse_in_flight_locked(nbytes, size, block_align, owner)
        if block is not None:
            if stream is not None:
                # A stream-side wait, no host sync: see Note [block reuse waits on events].
                for event in block._events:
                    stream.wait_event(event)
            return block
        return self._alloc_slow(nbytes, size, block_align, owner)

    def _reuse_in_flight_locked(
        self, nbytes: int, size: int, align: int, owner: str
    ) -> Block | None:
        fits = [b for b in self._in_flight if b.size >= size and b.offset % align == 0]
        if not fits:
            return None
        old = min(fits, key=lambda b: (b.size, b.offset))  # best fit, as for the free list
        self._in_flight.remove(old)
        block = Block(self, old.offset, size, nbytes, align, owner)
        block._events = list(old._events)  # inherited: Note [block reuse waits on events]
        if old.size > size:  # the tail stays IN_FLIGHT, behind the same copies
            tail = Block(self, old.offset + size, old.size - size, 0, self.alignment, old.owner)
            tail.state = BlockState.IN_FLIGHT
            tail._events = list(old._events)
            self._in_flight.append(tail)
        counters = self._counters
        counters.bytes_in_flight -= size
        counters.stream_reuses += 1
        counters.allocations += 1
        counters.bytes_in_use += size
        counters.bytes_requested += nbytes
        counters.peak_bytes_in_use = max(counters.peak_bytes_in_use, counters.bytes_in_use)
        self._live.add(block)
        return block

    def _alloc_slow(self, nbytes: int, size: int, align: int, owner: str) -> Block:
        request = (nbytes, size, align, owner)
        while True:
            with self._lock:
                block = self._try_alloc_locked(*request)
                if block is not None:
                    return block
                pending = _pending_events(self._in_flight)
                worth_compacting = self._free.free_bytes >= size
            if not pending:
                break
            # Synchronisation point, the last resort: see Note [block reuse waits on events].
            self._wait(pending)
        if worth_compacting and self.auto_defragment:
            _, block = self._defragment(request)
            if block is not None:
                return block
        with self._lock:
            raise PoolExhausted(self._exhausted_message(nbytes, size, align, owner))

    def free(self, block: Block) -> None:
        """Give ``block`` back; never blocks. See Note [block reuse waits on events]."""
        if type(block) is not Block:
            raise TypeError(f"free() takes a Block, got {type(block).__name__} {block!r}")
        if block.pool is not self:
            raise ValueError(
                f"{block!r} belongs to pool {block.pool.name!r}, not to pool {self.name!r}; "
                f"free it with its own pool"
            )
        with self._lock:
            if block.state is not BlockState.IN_USE:
                raise ValueError(
                    f"double free of {block!r}: it was already freed (state "
                    f"{block.state.name}); each block is freed exactly once"
                )
            self._live.remove(block)
            counters = self._counters
            counters.bytes_in_use -= block.size
            counters.bytes_requested -= block.nbytes
            counters.frees += 1
            if block._callbacks:
                block._callbacks.clear()
            if block._events:
                block._events = self._settle(block._events)
            if block._events:
                block.state = BlockState.IN_FLIGHT
                self._in_flight.append(block)
                self._counters.bytes_in_flight += block.size
            else:
                block.state = BlockState.FREE
                self._free.insert(block.offset, block.size)
            if self._in_flight:
                self._reclaim_locked()

    # ----------------------------------------------------------------- defragmentation

    def defragment(self) -> int:
        """Compact movable blocks toward the start; returns the bytes moved.

        Synchronisation point: first waits for every pending event of every block (the
        copies of IN_FLIGHT blocks, and copies still touching live blocks), since a block
        with a copy in progress cannot move. Then, under the lock, slides each movable
        block (see Note [views pin unregistered blocks]) down to the lowest aligned offset
        after its predecessor, with overlap-safe copies (Note [overlap-safe moves] in
        moves.py) issued on the current stream, which is then synchronised (a device sync on
        CUDA). Finally calls each moved block's ``on_move`` callbacks, without the lock. With
        nothing pinned in place, all free bytes end as one range at the end of the pool.
        Data is unchanged.
        """
        moved, _ = self._defragment(None)
        return moved

    def _defragment(self, request: tuple[int, int, int, str] | None) -> tuple[int, Block | None]:
        with self._lock:
            if self._closed:
                raise self._closed_error()
            pending = _pending_events(chain(self._live, self._in_flight))
        self._wait(pending)
        with self._lock:
            self._reclaim_locked()
            moved_blocks, moved_bytes = self._compact_locked()
            block = None if request is None else self._try_alloc_locked(*request)
        for moved in moved_blocks:
            for callback in list(moved._callbacks):
                if moved.state is BlockState.IN_USE:
                    callback(moved)
        return moved_bytes, block

    def _compact_locked(self) -> tuple[list[Block], int]:
        occupied = sorted(chain(self._live, self._in_flight), key=lambda b: b.offset)
        plan: list[tuple[Block, int]] = []  # (block, new offset), in address order
        cursor = 0
        for block in occupied:
            block._events = _still_pending(block._events)
            movable = (
                block.state is BlockState.IN_USE
                and not block._pinned_in_place
                and not block._events
            )
            dest = -(-cursor // block.align) * block.align
            if movable and dest < block.offset:
                plan.append((block, dest))
                cursor = dest + block.size
            else:
                cursor = block.end
        self._counters.defragmentations += 1
        try:
            moved_bytes = self._move_locked(plan)
        finally:
            # Rebuilt even if a copy failed midway: each block's offset is where its bytes are.
            self._free.clear()
            cursor = 0
            for block in occupied:
                if block.offset > cursor:
                    self._free.insert(cursor, block.offset - cursor)
                cursor = block.end
            if cursor < self.usable:
                self._free.insert(cursor, self.usable - cursor)
        return [block for block, _ in plan], moved_bytes

    def _move_locked(self, plan: list[tuple[Block, int]]) -> int:
        if not plan:
            return 0
        acc, compute = self.accelerator, self.accelerator.current_stream()
        for block, dest in plan:  # all checked before any byte moves (race checker only)
            what = f"defragmentation moving {block.owner or 'a block'} of pool {self.name!r}"
            # The old bytes go back to the free list, to be overwritten by anyone: a write.
            source = self._buffer[block.offset : block.offset + block.nbytes]
            acc.declare_access(source, stream=compute, write=True, what=what)
            target = self._buffer[dest : dest + block.nbytes]
            acc.declare_access(target, stream=compute, write=True, what=what)
        need = staging_bytes(self._buffer, [(dest, b.offset, b.nbytes) for b, dest in plan])
        scratch = self._scratch(need) if need else None
        staging, release = scratch if scratch is not None else (None, _noop)
        try:
            for block, dest in plan:
                move_within(self._buffer, dest, block.offset, block.nbytes, staging=staging)
                block.offset = dest
                self._counters.bytes_moved += block.nbytes
            # Synchronisation point: the moves were queued on the current stream; owners use
            # their views on any stream after the callbacks, so the moves must be done.
            self.accelerator.current_stream().synchronize()
        finally:
            release()
        return sum(block.nbytes for block, _ in plan)

    # ----------------------------------------------------------------- stats

    def stats(self) -> dict[str, int | float]:
        """A snapshot of the pool's stats; see the class docstring for units."""
        with self._lock:
            free = self._free.free_bytes
            largest = self._free.largest()
            stats: dict[str, int | float] = dict(vars(self._counters))
            stats.update(
                capacity_bytes=self.capacity,
                usable_bytes=self.usable,
                bytes_free=free,
                largest_free_block=largest,
                fragmentation=0.0 if free == 0 else 1.0 - largest / free,
                live_blocks=len(self._live),
                in_flight_blocks=len(self._in_flight),
                free_blocks=len(self._free),
            )
            return stats

    def reset_peak(self) -> None:
        """Start ``peak_bytes_in_use`` afresh from the current use."""
        with self._lock:
            self._counters.peak_bytes_in_use = self._counters.bytes_in_use

    def live_blocks(self) -> list[Block]:
        """The IN_USE blocks, in address order."""
        with self._lock:
            return sorted(self._live, key=lambda b: b.offset)

    # ----------------------------------------------------------------- internals

    def _closed_error(self) -> RuntimeError:
        return RuntimeError(f"pool {self.name!r} is closed; build a new one")

    def _try_alloc_locked(self, nbytes: int, size: int, align: int, owner: str) -> Block | None:
        if self._in_flight:
            self._reclaim_locked()
        offset = self._free.take(size, align, self.alignment)
        if offset is None:
            return None
        block = Block(self, offset, size, nbytes, align, owner)
        self._live.add(block)
        counters = self._counters
        counters.allocations += 1
        counters.bytes_in_use += size
        counters.bytes_requested += nbytes
        counters.peak_bytes_in_use = max(counters.peak_bytes_in_use, counters.bytes_in_use)
        return block

    def _reclaim_locked(self) -> None:
        # See Note [block reuse waits on events]: O(in-flight blocks), one query per event.
        still_in_flight = []
        for block in self._in_flight:
            block._events = self._settle(block._events)
            if block._events:
                still_in_flight.append(block)
            else:
                block.state = BlockState.FREE
                self._counters.bytes_in_flight -= block.size
                self._free.insert(block.offset, block.size)
        self._in_flight = still_in_flight

    def _settle(self, events: list[Event]) -> list[Event]:
        # The events still pending. The bytes of a block whose events are all done may go to
        # any stream now, so the host counts as having seen them complete: see Note [race
        # checking with vector clocks] in accelerator/race_checker.py.
        pending = _still_pending(events)
        checker = self.accelerator.race_checker
        if checker is not None and len(pending) < len(events):
            for event in events:
                if event not in pending:
                    checker.observed(event.race_stamp)
        return pending

    def _wait(self, events: list[Event]) -> None:
        # Called without the lock, see Note [block reuse waits on events].
        for event in events:
            event.synchronize()
        if events:
            with self._lock:
                self._counters.event_waits += len(events)

    def _view(
        self, block: Block, dtype: torch.dtype, shape: tuple[int, ...] | None
    ) -> torch.Tensor:
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {dtype!r}")
        itemsize = dtype.itemsize
        if shape is None:
            numel = block.nbytes // itemsize
            shape = (numel,)
        else:
            shape = tuple(shape)
            if any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in shape):
                raise ValueError(f"shape must be a tuple of ints >= 0, got {shape!r}")
            numel = math.prod(shape)
        if numel * itemsize > block.nbytes:
            raise ValueError(
                f"a {dtype} view of shape {shape} needs {numel * itemsize} bytes but {block!r} "
                f"holds {block.nbytes}; allocate a larger block"
            )
        with self._lock:
            if block.state is not BlockState.IN_USE:
                raise ValueError(f"cannot view {block!r}: it was freed")
            if block.offset % itemsize:
                raise ValueError(
                    f"{block!r} starts at offset {block.offset}, not a multiple of {dtype}'s "
                    f"{itemsize} bytes; use a pool alignment or align= of at least {itemsize}"
                )
            if not block._callbacks:
                block._pinned_in_place = True  # Note [views pin unregistered blocks]
            flat = self._buffer[block.offset : block.offset + numel * itemsize]
        return flat.view(dtype).view(shape)

    def _register_callback(self, block: Block, callback: MoveCallback) -> None:
        with self._lock:
            if block.state is not BlockState.IN_USE:
                raise ValueError(f"cannot register on_move on {block!r}: it was freed")
            block._callbacks.append(callback)

    def _record_event(self, block: Block, event: Event) -> None:
        if not isinstance(event, Event):
            raise TypeError(f"record_event takes an accelerator Event, got {event!r}")
        with self._lock:
            if block.state is not BlockState.IN_USE:
                raise ValueError(
                    f"cannot record an event on {block!r}: it was freed; record the copy's "
                    f"event before freeing the block"
                )
            block._events = [*pruned(block._events), event]
            self._lifetime.add(event)

    def _name_range(self, lo: int, hi: int) -> str:
        # For race reports: the blocks a byte range overlaps. Takes no lock: called by the
        # race checker, possibly while this pool's lock is held by the reporting thread.
        owners = sorted(
            {
                f"{b.owner or '<no owner>'} ({b.state.name})"
                for b in list(self._live) + list(self._in_flight)
                if b.offset < hi and lo < b.end
            }
        )
        return f"block {', '.join(owners)}" if owners else "no live block"

    def _exhausted_message(self, nbytes: int, size: int, align: int, owner: str) -> str:
        free = self._free.free_bytes
        pinned = sum(b.size for b in self._live if b._pinned_in_place)
        hint = (
            "after defragmentation"
            if self.auto_defragment and free >= size
            else "(defragmentation cannot help: the free bytes do not hold the request)"
            if free < size
            else "(automatic defragmentation is off)"
        )
        return (
            f"pool {self.name!r} ({self.kind}) cannot allocate {format_bytes(nbytes)} "
            f"({nbytes} bytes, {size} after rounding to {self.alignment}-byte alignment, "
            f"offset aligned to {align}) for owner {owner!r}: capacity "
            f"{format_bytes(self.capacity)} ({self.capacity} bytes), {free} bytes free in "
            f"{len(self._free)} ranges, largest free block {hint} {self._free.largest()} bytes; "
            f"{self._counters.bytes_in_use} bytes in use by {len(self._live)} blocks "
            f"({pinned} of them pinned in place by views without on_move callbacks), "
            f"{self._counters.bytes_in_flight} bytes in flight. Raise {self.sized_by} (now "
            f"{self.capacity} bytes) for pool {self.name!r}, free blocks sooner, or register "
            f"on_move callbacks before taking views so blocks can be compacted."
        )


def _check_align(value: int, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int power of two, got {type(value).__name__} {value!r}")
    if value <= 0 or value & (value - 1):
        raise ValueError(f"{name} must be a power of two (1, 2, ..., 512, ...), got {value}")
    return value


def _check_pool_args(capacity_bytes: int, alignment: int) -> tuple[int, int]:
    alignment = _check_align(alignment, "alignment")
    if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int):
        raise TypeError(
            f"capacity_bytes must be an int, got {type(capacity_bytes).__name__} {capacity_bytes!r}"
        )
    if capacity_bytes < alignment or capacity_bytes >= 1 << OFFSET_BITS:
        raise ValueError(
            f"capacity_bytes must be at least the alignment ({alignment}) and below "
            f"2**{OFFSET_BITS}, got {capacity_bytes}"
        )
    return capacity_bytes, alignment


def _still_pending(events: list[Event]) -> list[Event]:
    return [event for event in events if not event.query()] if events else events


def _pending_events(blocks: Iterable[Block]) -> list[Event]:
    return [event for block in blocks for event in _still_pending(block._events)]


def _noop() -> None:
    return None


def _no_scratch(nbytes: int) -> None:
    return None
