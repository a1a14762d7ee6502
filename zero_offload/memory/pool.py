"""BlockPool: one buffer allocated once, handed out as best-fit blocks, compacted on demand.

Offload lives or dies by its buffers. A pool makes three failures impossible by construction,
and a fourth rare:

- rounding waste: the buffer is allocated once at exactly ``capacity_bytes`` (no power-of-two
  rounding of pinned memory), and blocks are carved out of it;
- pinning on the fly: pinning happens once, in ``BlockPool.host``; ``alloc`` never pins;
- unlimited pinned memory: ``BlockPool.host`` checks the size against the host RAM available
  now (see ``check_host_ram``) and refuses before allocating anything;
- fragmentation OOM, outside backward and for movable blocks: when a request fits the free
  bytes but no free block, ``alloc`` defragments (compacts live blocks) and retries before
  giving up. Compaction cannot move a block pinned by a view (Note [views pin unregistered
  blocks]) and is refused on a thread running a backward pass (``DefragmentationRefused``,
  Note [no compaction inside backward] in moves.py); there a request can still fail with
  enough free bytes, and the message gives the free bytes, the largest free block and the
  request. Size such a pool so no order of requests can split it (for the activation
  offloader's device pool: Note [a reload can find the free bytes split] in
  ``activations/pools.py``).

Freed blocks whose copies are still pending wait in ``InFlightBlocks``: see Note [block
reuse waits on events] in ``pending_blocks.py``.

A pool dropped without ``close()`` releases its buffer only after its copies: Note [a pool
outlives its copies] in ``buffer_lifetime.py``.

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

import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from itertools import chain

import torch

from ..accelerator import Accelerator, Event, Stream
from ..config import format_bytes
from ..errors import PoolExhausted
from .block import Block, BlockState, MoveCallback, view_shape
from .buffer_lifetime import BufferLifetime, pruned
from .compaction import compact_locked
from .freelist import FreeList, check_align, check_pool_args
from .host_ram import check_host_ram
from .moves import Scratch, device_scratch, no_scratch, refuse_inside_backward
from .pending_blocks import InFlightBlocks, name_range, pending_events

__all__ = [
    "Block",
    "BlockPool",
    "BlockState",
    "check_host_ram",
]


@dataclass
class _Counters:
    """Running stats of a pool; all guarded by the pool's lock. Units in the names' docs."""

    bytes_in_use: int = 0  # bytes (rounded sizes) of IN_USE blocks
    bytes_requested: int = 0  # bytes asked for (unrounded) by IN_USE blocks
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
        - compaction: ``defragment()`` slides movable blocks toward the start
          (``compact_locked`` in compaction.py); see Note [views pin unregistered blocks]
          and Note [overlap-safe moves] in moves.py. It runs automatically when a request
          fits the free bytes but not the largest free range.

    Lock: ``_lock`` (a plain ``threading.Lock``) guards the free list, the live and in-flight
    sets, every block's ``offset``/``state``/events/callbacks, ``_counters`` and
    ``_watchers`` (``watch_use``); copy-stream workers free blocks too. It is never held
    while waiting on an event or while running an ``on_move`` callback (callbacks may call
    back into the pool). Owners must not use a block's views while a ``defragment()`` runs.

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
        self._lifetime = BufferLifetime(buffer, release)
        self._finalizer = weakref.finalize(self, self._lifetime.drain)
        self._lock = threading.Lock()
        self._free = FreeList()
        self._free.insert(0, self.usable)
        self._live: set[Block] = set()  # IN_USE blocks
        self._in_flight = InFlightBlocks()  # freed, copies pending
        self._counters = _Counters()
        self._watchers: list[Callable[[int], None]] = []  # told each change of bytes_in_use
        self._closed = False
        if accelerator.race_checker is not None:
            accelerator.race_checker.track(
                buffer, f"pool {name!r} ({kind})", namer=self._name_range
            )

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
        capacity, alignment = check_pool_args(capacity_bytes, alignment)
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
            scratch=no_scratch,  # CPU moves are memmoves, see Note [overlap-safe moves]
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
        capacity, alignment = check_pool_args(capacity_bytes, alignment)
        device_buffer = accelerator.allocate_device(capacity, what=f"block pool {name!r}")

        return cls(
            accelerator,
            device_buffer.tensor,
            name=name,
            kind="device",
            alignment=alignment,
            sized_by=sized_by,
            auto_defragment=auto_defragment,
            scratch=device_scratch(accelerator, name),
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
            pending = self._in_flight.pending_events()
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
        wait: bool = True,
    ) -> Block:
        """A block of at least ``nbytes`` (rounded up to the pool's alignment).

        ``align`` (a power of two, bytes) raises the offset's alignment above the pool's.
        ``stream``: the stream that will use the block first; lets the pool hand out bytes
        whose copies are still pending, with ``stream`` waiting on them instead of the CPU.
        When nothing fits, in order: reuse pending bytes on ``stream``, wait for pending
        copies of freed blocks, oldest first, defragment (if the free bytes would hold the
        request), then raise ``PoolExhausted``; with ``wait=False`` raise instead of waiting
        or compacting (never blocks). See Note [block reuse waits on events].
        """
        if stream is not None and not isinstance(stream, Stream):
            raise TypeError(f"stream must be an accelerator Stream or None, got {stream!r}")
        if not isinstance(wait, bool):
            raise TypeError(f"wait must be True or False, got {wait!r}")
        if type(nbytes) is not int:  # bool and float are refused too
            raise TypeError(f"nbytes must be an int, got {type(nbytes).__name__} {nbytes!r}")
        if nbytes <= 0:
            raise ValueError(f"nbytes must be > 0, got {nbytes} (owner {owner!r})")
        base = self.alignment
        block_align = base if align is None else max(check_align(align, "align"), base)
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
                for event in block.events:
                    stream.wait_event(event)
            return block
        if not wait:  # the caller would rather go without than block (a prefetch)
            with self._lock:
                raise PoolExhausted(self._exhausted_message(nbytes, size, block_align, owner))
        return self._alloc_slow(nbytes, size, block_align, owner)

    def _reuse_in_flight_locked(
        self, nbytes: int, size: int, align: int, owner: str
    ) -> Block | None:
        old = self._in_flight.take(size, align)
        if old is None:
            return None
        block = self._new_block_locked(old.offset, size, nbytes, align, owner)
        block.inherit_events(old)  # Note [block reuse waits on events]
        if old.size > size:  # the tail stays IN_FLIGHT, behind the same copies
            tail = Block(self, old.offset + size, old.size - size, 0, self.alignment, old.owner)
            tail.inherit_events(old)
            self._in_flight.add(tail)
        self._counters.stream_reuses += 1
        return block

    def _alloc_slow(self, nbytes: int, size: int, align: int, owner: str) -> Block:
        request = (nbytes, size, align, owner)
        while True:
            with self._lock:
                block = self._try_alloc_locked(*request)
                if block is not None:
                    return block
                pending = self._in_flight.oldest_pending()
                worth_compacting = self._free.free_bytes >= size
            if not pending:
                break
            # Synchronisation point, the last resort, for the oldest block in flight only:
            # see Note [block reuse waits on events].
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
            for add in self._watchers:
                add(-block.size)
            block.drop_move_callbacks()
            if block.keep_events(self._in_flight.settle):
                self._in_flight.add(block)
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
        refuse_inside_backward(self, None if request is None else request[0])
        with self._lock:
            if self._closed:
                raise self._closed_error()
            pending = [*pending_events(self._live), *self._in_flight.pending_events()]
        self._wait(pending)
        with self._lock:
            self._reclaim_locked()
            moved_blocks = compact_locked(
                self._buffer,
                chain(self._live, self._in_flight),
                free=self._free,
                usable=self.usable,
                scratch=self._scratch,
                accelerator=self.accelerator,
                name=self.name,
                counters=self._counters,
            )
            block = None if request is None else self._try_alloc_locked(*request)
        for moved in moved_blocks:
            for callback in moved.move_callbacks:
                if moved.state is BlockState.IN_USE:
                    callback(moved)
        return sum(moved.nbytes for moved in moved_blocks), block

    def stats(self) -> dict[str, int | float]:
        """The pool's stats (blocks whose copies completed count as free); units above."""
        with self._lock:
            self._reclaim_locked()
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
                bytes_in_flight=self._in_flight.nbytes,
                in_flight_blocks=len(self._in_flight),
                free_blocks=len(self._free),
            )
            return stats

    def reset_peak(self) -> None:
        """Start ``peak_bytes_in_use`` afresh from the current use."""
        with self._lock:
            self._counters.peak_bytes_in_use = self._counters.bytes_in_use

    @property
    def closed(self) -> bool:
        """Whether ``close()`` ran: the pool's buffer is given back."""
        return self._closed

    def watch_use(self, add: Callable[[int], None]) -> Callable[[], None]:
        """Call ``add(nbytes)`` with ``bytes_in_use`` now, then with each change of it, under
        the lock (``add`` must be quick and must not call into the pool); returns the call
        that stops it. For an observer of the peak across pools (the profiler's
        ``PoolsPeakWindow``): a call per alloc and free while watched, none otherwise."""
        with self._lock:
            self._watchers.append(add)
            add(self._counters.bytes_in_use)

        def unwatch() -> None:
            with self._lock:
                if add in self._watchers:
                    self._watchers.remove(add)

        return unwatch

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
        return self._new_block_locked(offset, size, nbytes, align, owner)

    def _new_block_locked(
        self, offset: int, size: int, nbytes: int, align: int, owner: str
    ) -> Block:
        block = Block(self, offset, size, nbytes, align, owner)
        self._live.add(block)
        counters = self._counters
        counters.allocations += 1
        counters.bytes_in_use += size
        counters.bytes_requested += nbytes
        counters.peak_bytes_in_use = max(counters.peak_bytes_in_use, counters.bytes_in_use)
        for add in self._watchers:
            add(size)
        return block

    def _reclaim_locked(self) -> None:
        for block in self._in_flight.reclaim():
            self._free.insert(block.offset, block.size)

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
        shape, numel = view_shape(block, dtype, shape)
        itemsize = dtype.itemsize
        with self._lock:
            if block.state is not BlockState.IN_USE:
                raise ValueError(f"cannot view {block!r}: it was freed")
            if block.offset % itemsize:
                raise ValueError(
                    f"{block!r} starts at offset {block.offset}, not a multiple of {dtype}'s "
                    f"{itemsize} bytes; use a pool alignment or align= of at least {itemsize}"
                )
            if not block.move_callbacks:
                block.pin_in_place()  # Note [views pin unregistered blocks]
            flat = self._buffer[block.offset : block.offset + numel * itemsize]
        return flat.view(dtype).view(shape)

    def _register_callback(self, block: Block, callback: MoveCallback) -> None:
        with self._lock:
            if block.state is not BlockState.IN_USE:
                raise ValueError(f"cannot register on_move on {block!r}: it was freed")
            block.add_move_callback(callback)

    def _record_event(self, block: Block, event: Event) -> None:
        if not isinstance(event, Event):
            raise TypeError(f"record_event takes an accelerator Event, got {event!r}")
        with self._lock:
            if block.state is not BlockState.IN_USE:
                raise ValueError(
                    f"cannot record an event on {block!r}: it was freed; record the copy's "
                    f"event before freeing the block"
                )
            block.add_event(event, pruned)
            self._lifetime.add(event)

    def _name_range(self, lo: int, hi: int) -> str:
        # For race reports. No lock: the race checker may call it under this pool's lock.
        return name_range(list(self._live) + list(self._in_flight), lo, hi)

    def _exhausted_message(self, nbytes: int, size: int, align: int, owner: str) -> str:
        free = self._free.free_bytes
        pinned = sum(b.size for b in self._live if b.pinned_in_place)
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
            f"{self._in_flight.nbytes} bytes in flight. Raise {self.sized_by} (now "
            f"{self.capacity} bytes) for pool {self.name!r}, free blocks sooner, or register "
            f"on_move callbacks before taking views so blocks can be compacted."
        )


def _noop() -> None:
    return None
