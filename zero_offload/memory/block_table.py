"""``BlockTable``: where each block of one pool's buffer is (live, in flight, free), and the
pool's counts.

This is the bookkeeping half of ``BlockPool`` (``pool.py``), the way c10's allocator keeps
its block sets apart from the allocator that waits and moves bytes. The table decides where
a request fits: best fit on the free list (``FreeList``), or, for a caller that names its
stream, IN_FLIGHT bytes behind their events (Note [block reuse waits on events] in
``pending_blocks.py``). It never blocks, never waits on an event and never touches the
buffer's bytes: the pool waits, compacts, hands out views and holds the lock.

Lock: none of its own. Every method runs under the pool's ``_lock``, which guards the free
list, the live and in-flight sets, ``counters`` and the use watchers (``BlockPool``, class
docstring); ``name_range`` alone is read without it, for the race checker.

The table holds no reference to its pool (a block does): a pool dropped without ``close()``
must go by reference counting, not wait for the garbage collector (Note [a pool outlives its
copies] in ``buffer_lifetime.py``). The methods that make blocks are given the pool.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..accelerator import Event
from ..config import format_bytes
from .block import Block, BlockOwner, BlockState
from .freelist import FreeList
from .pending_blocks import InFlightBlocks, name_range, pending_events

__all__ = ["BlockTable", "PoolCounters"]


@dataclass
class PoolCounters:
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


class BlockTable:
    """The live, in-flight and free ranges of one pool's first ``usable`` bytes, with blocks
    aligned to ``alignment`` (bytes, a power of two), and the pool's counts."""

    def __init__(self, *, usable: int, alignment: int) -> None:
        self.alignment = alignment  # bytes, the pool's
        self.free = FreeList()
        self.free.insert(0, usable)
        self.live: set[Block] = set()  # IN_USE blocks
        self.in_flight = InFlightBlocks()  # freed, copies pending
        self.counters = PoolCounters()
        self._watchers: list[Callable[[int], None]] = []  # told each change of bytes_in_use

    # ----------------------------------------------------------------- blocks in and out

    def take(
        self, pool: BlockOwner, nbytes: int, size: int, align: int, owner: str
    ) -> Block | None:
        """A new IN_USE block of ``pool`` from the free list (best fit), or None."""
        if self.in_flight:
            self.reclaim()
        offset = self.free.take(size, align, self.alignment)
        if offset is None:
            return None
        return self._new_block(pool, offset, size, nbytes, align, owner)

    def take_in_flight(
        self, pool: BlockOwner, nbytes: int, size: int, align: int, owner: str
    ) -> Block | None:
        """A new IN_USE block over IN_FLIGHT bytes, inheriting their events (its first
        stream must wait on them), or None when no in-flight range holds the request."""
        old = self.in_flight.take(size, align)
        if old is None:
            return None
        block = self._new_block(pool, old.offset, size, nbytes, align, owner)
        block.inherit_events(old)  # Note [block reuse waits on events]
        if old.size > size:  # the tail stays IN_FLIGHT, behind the same copies
            tail = Block(pool, old.offset + size, old.size - size, 0, self.alignment, old.owner)
            tail.inherit_events(old)
            self.in_flight.add(tail)
        self.counters.stream_reuses += 1
        return block

    def release(self, block: Block) -> None:
        """``block`` is freed: IN_FLIGHT while a recorded copy is pending, else FREE."""
        if block.state is not BlockState.IN_USE:
            raise ValueError(
                f"double free of {block!r}: it was already freed (state "
                f"{block.state.name}); each block is freed exactly once"
            )
        self.live.remove(block)
        counters = self.counters
        counters.bytes_in_use -= block.size
        counters.bytes_requested -= block.nbytes
        counters.frees += 1
        for add in self._watchers:
            add(-block.size)
        block.drop_move_callbacks()
        if block.keep_events(self.in_flight.settle):
            self.in_flight.add(block)
        else:
            block.state = BlockState.FREE
            self.free.insert(block.offset, block.size)
        if self.in_flight:
            self.reclaim()

    def reclaim(self) -> None:
        """IN_FLIGHT blocks whose copies completed go back to the free list."""
        for block in self.in_flight.reclaim():
            self.free.insert(block.offset, block.size)

    def pending_events(self) -> list[Event]:
        """Every pending event of every live and in-flight block (for a compaction)."""
        return [*pending_events(self.live), *self.in_flight.pending_events()]

    def _new_block(
        self, pool: BlockOwner, offset: int, size: int, nbytes: int, align: int, owner: str
    ) -> Block:
        block = Block(pool, offset, size, nbytes, align, owner)
        self.live.add(block)
        counters = self.counters
        counters.allocations += 1
        counters.bytes_in_use += size
        counters.bytes_requested += nbytes
        counters.peak_bytes_in_use = max(counters.peak_bytes_in_use, counters.bytes_in_use)
        for add in self._watchers:
            add(size)
        return block

    # ----------------------------------------------------------------- what it tells

    def watch(self, add: Callable[[int], None]) -> None:
        """Call ``add(nbytes)`` with ``bytes_in_use`` now, then with each change of it."""
        self._watchers.append(add)
        add(self.counters.bytes_in_use)

    def unwatch(self, add: Callable[[int], None]) -> None:
        if add in self._watchers:
            self._watchers.remove(add)

    def stats(self, *, capacity: int, usable: int) -> dict[str, int | float]:
        """``BlockPool.stats()``: the counters and the sets (in-flight blocks whose copies
        completed count as free); units in ``BlockPool``'s docstring."""
        self.reclaim()
        free = self.free.free_bytes
        largest = self.free.largest()
        stats: dict[str, int | float] = dict(vars(self.counters))
        stats.update(
            capacity_bytes=capacity,
            usable_bytes=usable,
            bytes_free=free,
            largest_free_block=largest,
            fragmentation=0.0 if free == 0 else 1.0 - largest / free,
            live_blocks=len(self.live),
            bytes_in_flight=self.in_flight.nbytes,
            in_flight_blocks=len(self.in_flight),
            free_blocks=len(self.free),
        )
        return stats

    def name_range(self, lo: int, hi: int) -> str:
        # For race reports. No lock: the race checker may call it under the pool's lock.
        return name_range(list(self.live) + list(self.in_flight), lo, hi)

    def exhausted_message(
        self,
        request: tuple[int, int, int, str],
        *,
        pool: str,
        kind: str,
        capacity: int,
        sized_by: str,
        auto_defragment: bool,
    ) -> str:
        """What ``PoolExhausted`` says when ``request`` (nbytes, rounded size, offset
        alignment, owner) fits nowhere in the pool ``pool``: the table's state and the fix."""
        nbytes, size, align, owner = request
        free = self.free.free_bytes
        pinned = sum(b.size for b in self.live if b.pinned_in_place)
        hint = (
            "after defragmentation"
            if auto_defragment and free >= size
            else "(defragmentation cannot help: the free bytes do not hold the request)"
            if free < size
            else "(automatic defragmentation is off)"
        )
        return (
            f"pool {pool!r} ({kind}) cannot allocate {format_bytes(nbytes)} "
            f"({nbytes} bytes, {size} after rounding to {self.alignment}-byte alignment, "
            f"offset aligned to {align}) for owner {owner!r}: capacity "
            f"{format_bytes(capacity)} ({capacity} bytes), {free} bytes free in "
            f"{len(self.free)} ranges, largest free block {hint} {self.free.largest()} bytes; "
            f"{self.counters.bytes_in_use} bytes in use by {len(self.live)} blocks "
            f"({pinned} of them pinned in place by views without on_move callbacks), "
            f"{self.in_flight.nbytes} bytes in flight. Raise {sized_by} (now "
            f"{capacity} bytes) for pool {pool!r}, free blocks sooner, or register "
            f"on_move callbacks before taking views so blocks can be compacted."
        )
