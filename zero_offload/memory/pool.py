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
from itertools import chain

import torch

from ..accelerator import Accelerator, Event, Stream
from ..errors import PoolExhausted
from .block import Block, BlockState, MoveCallback, view_shape
from .block_table import BlockTable
from .buffer_lifetime import BufferLifetime, pruned
from .compaction import compact_locked
from .freelist import check_align, check_pool_args
from .host_ram import check_host_ram
from .moves import refuse_inside_backward
from .pool_buffer import PoolBuffer, device_buffer, host_buffer

__all__ = [
    "Block",
    "BlockPool",
    "BlockState",
    "check_host_ram",
]


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

    Bookkeeping: ``_blocks``, a ``BlockTable`` (block_table.py), knows which ranges are
    live, in flight and free, and keeps the counts; the pool waits, compacts and hands out
    views around it.

    Lock: ``_lock`` (a plain ``threading.Lock``) guards ``_blocks`` (the free list, the live
    and in-flight sets, the counters and the ``watch_use`` watchers) and every block's
    ``offset``/``state``/events/callbacks; copy-stream workers free blocks too. It is never
    held while waiting on an event or while running an ``on_move`` callback (callbacks may
    call back into the pool). Owners must not use a block's views while a ``defragment()``
    runs.

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
        buffer: PoolBuffer,
        *,
        name: str,
        alignment: int,
        sized_by: str,
        auto_defragment: bool,
    ) -> None:
        self.accelerator = accelerator
        self.name = name
        self.kind = buffer.kind  # "host, pinned" / "host, pageable" / "device", for messages
        self.alignment = alignment  # bytes, a power of two
        self.sized_by = sized_by  # the setting that sizes this pool, for messages
        self.auto_defragment = auto_defragment
        self.capacity = buffer.tensor.numel()  # bytes
        self.usable = self.capacity - self.capacity % alignment  # bytes
        self._buffer = buffer.tensor  # (capacity,) uint8, host (pinned when available) or device
        self._scratch = buffer.scratch  # a compaction's staging (pool_buffer.py)
        self._lifetime = BufferLifetime(buffer.tensor, buffer.release)
        self._finalizer = weakref.finalize(self, self._lifetime.drain)
        self._lock = threading.Lock()
        self._blocks = BlockTable(usable=self.usable, alignment=alignment)  # under _lock
        self._closed = False
        if accelerator.race_checker is not None:
            accelerator.race_checker.track(
                buffer.tensor, f"pool {name!r} ({self.kind})", namer=self._name_range
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
        allocating; pinning or faulting the pages in is paid here, once (``host_buffer`` in
        pool_buffer.py). ``sized_by`` names the setting that chose the size, for error
        messages.
        """
        capacity, alignment = check_pool_args(capacity_bytes, alignment)
        buffer = host_buffer(accelerator, capacity, name=name, pinned=pinned, sized_by=sized_by)
        return cls(
            accelerator,
            buffer,
            name=name,
            alignment=alignment,
            sized_by=sized_by,
            auto_defragment=auto_defragment,
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
        return cls(
            accelerator,
            device_buffer(accelerator, capacity, name=name),
            name=name,
            alignment=alignment,
            sized_by=sized_by,
            auto_defragment=auto_defragment,
        )

    def close(self) -> None:
        """Give the buffer back (device pools: to the budget). All blocks must be freed.

        Synchronisation point: waits for the copies of IN_FLIGHT blocks, which may still
        touch the buffer.
        """
        with self._lock:
            live = self._blocks.live
            if live:
                owners = sorted({block.owner or "<no owner>" for block in live})
                raise RuntimeError(
                    f"cannot close pool {self.name!r}: {len(live)} blocks are still in "
                    f"use (owners: {', '.join(owners[:8])}); free them first"
                )
            pending = self._blocks.in_flight.pending_events()
        self._wait(pending)
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._blocks.in_flight.clear()
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
        request = (nbytes, size, block_align, owner)
        with self._lock:
            if self._closed:
                raise self._closed_error()
            block = self._blocks.take(self, *request)
            if block is None and stream is not None:
                block = self._blocks.take_in_flight(self, *request)
        if block is not None:
            if stream is not None:
                # A stream-side wait, no host sync: see Note [block reuse waits on events].
                for event in block.events:
                    stream.wait_event(event)
            return block
        if not wait:  # the caller would rather go without than block (a prefetch)
            with self._lock:
                raise PoolExhausted(self._exhausted_message(request))
        return self._alloc_slow(request)

    def _alloc_slow(self, request: tuple[int, int, int, str]) -> Block:
        size = request[1]
        while True:
            with self._lock:
                block = self._blocks.take(self, *request)
                if block is not None:
                    return block
                pending = self._blocks.in_flight.oldest_pending()
                worth_compacting = self._blocks.free.free_bytes >= size
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
            raise PoolExhausted(self._exhausted_message(request))

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
            self._blocks.release(block)

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
            pending = self._blocks.pending_events()
        self._wait(pending)
        with self._lock:
            blocks = self._blocks
            blocks.reclaim()
            moved_blocks = compact_locked(
                self._buffer,
                chain(blocks.live, blocks.in_flight),
                free=blocks.free,
                usable=self.usable,
                scratch=self._scratch,
                accelerator=self.accelerator,
                name=self.name,
                counters=blocks.counters,
            )
            block = None if request is None else blocks.take(self, *request)
        for moved in moved_blocks:
            for callback in moved.move_callbacks:
                if moved.state is BlockState.IN_USE:
                    callback(moved)
        return sum(moved.nbytes for moved in moved_blocks), block

    def stats(self) -> dict[str, int | float]:
        """The pool's stats (blocks whose copies completed count as free); units above."""
        with self._lock:
            return self._blocks.stats(capacity=self.capacity, usable=self.usable)

    def reset_peak(self) -> None:
        """Start ``peak_bytes_in_use`` afresh from the current use."""
        with self._lock:
            counters = self._blocks.counters
            counters.peak_bytes_in_use = counters.bytes_in_use

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
            self._blocks.watch(add)

        def unwatch() -> None:
            with self._lock:
                self._blocks.unwatch(add)

        return unwatch

    def live_blocks(self) -> list[Block]:
        """The IN_USE blocks, in address order."""
        with self._lock:
            return sorted(self._blocks.live, key=lambda b: b.offset)

    # ----------------------------------------------------------------- internals

    def _closed_error(self) -> RuntimeError:
        return RuntimeError(f"pool {self.name!r} is closed; build a new one")

    def _wait(self, events: list[Event]) -> None:
        # Called without the lock, see Note [block reuse waits on events].
        for event in events:
            event.synchronize()
        if events:
            with self._lock:
                self._blocks.counters.event_waits += len(events)

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
        return self._blocks.name_range(lo, hi)

    def _exhausted_message(self, request: tuple[int, int, int, str]) -> str:
        return self._blocks.exhausted_message(
            request,
            pool=self.name,
            kind=self.kind,
            capacity=self.capacity,
            sized_by=self.sized_by,
            auto_defragment=self.auto_defragment,
        )
