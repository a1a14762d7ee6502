"""One compaction of a pool: which blocks move where, how their bytes get there, and what
is free afterwards.

``BlockPool.defragment`` decides *when* (on demand, or when a request fits the free bytes
but no free range), waits for the copies still touching blocks and runs the ``on_move``
callbacks; ``compact_locked`` is the part that runs under the pool's lock: it plans the
slide (``plan_compaction`` in ``moves.py``), declares the moves to the race checker, moves
the bytes (Note [overlap-safe moves]) and rebuilds the free list. Which blocks may move is
Note [views pin unregistered blocks] in ``pool.py``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import torch

from ..accelerator import Accelerator
from .block import Block, BlockState
from .freelist import FreeList
from .moves import Scratch, free_gaps, move_within, plan_compaction, staging_bytes
from .pending_blocks import still_pending

__all__ = ["MoveCounters", "compact_locked"]


class MoveCounters(Protocol):
    """The pool's counters a compaction adds to (``PoolCounters`` in ``block_table.py``)."""

    defragmentations: int  # compactions run
    bytes_moved: int  # bytes copied by all compactions


def compact_locked(
    buffer: torch.Tensor,
    blocks: Iterable[Block],
    *,
    free: FreeList,
    usable: int,
    scratch: Scratch,
    accelerator: Accelerator,
    name: str,
    counters: MoveCounters,
) -> list[Block]:
    """Slide the movable ``blocks`` (live and in flight, any order) of the pool ``name``
    over ``buffer`` toward the start; returns the blocks that moved, in address order.

    Runs under the pool's lock, after the pool waited for every pending event it saw (a
    block with a copy still pending stays where it is). ``free`` is rebuilt from the gaps
    around the blocks, even when a copy fails midway: each block's ``offset`` is always
    where its bytes are. Synchronisation point: the moves are queued on the current stream,
    which is then synchronised.
    """
    occupied = sorted(blocks, key=lambda b: b.offset)
    for block in occupied:
        block.keep_events(still_pending)
    plan = plan_compaction(
        [
            (
                block,
                block.offset,
                block.size,
                block.align,
                block.state is BlockState.IN_USE and not block.pinned_in_place and not block.events,
            )
            for block in occupied
        ]
    )
    counters.defragmentations += 1
    try:
        _move(buffer, plan, scratch=scratch, accelerator=accelerator, name=name, counters=counters)
    finally:
        free.clear()
        for offset, size in free_gaps([(b.offset, b.end) for b in occupied], usable):
            free.insert(offset, size)
    return [block for block, _ in plan]


def _move(
    buffer: torch.Tensor,
    plan: list[tuple[Block, int]],
    *,
    scratch: Scratch,
    accelerator: Accelerator,
    name: str,
    counters: MoveCounters,
) -> None:
    if not plan:
        return
    compute = accelerator.current_stream()
    for block, dest in plan:  # all checked before any byte moves (race checker only)
        what = f"defragmentation moving {block.owner or 'a block'} of pool {name!r}"
        # The old bytes go back to the free list, to be overwritten by anyone: a write.
        source = buffer[block.offset : block.offset + block.nbytes]
        accelerator.declare_access(source, stream=compute, write=True, what=what)
        target = buffer[dest : dest + block.nbytes]
        accelerator.declare_access(target, stream=compute, write=True, what=what)
    need = staging_bytes(buffer, [(dest, b.offset, b.nbytes) for b, dest in plan])
    taken = scratch(need) if need else None
    staging, release = taken if taken is not None else (None, None)
    try:
        for block, dest in plan:
            move_within(buffer, dest, block.offset, block.nbytes, staging=staging)
            block.offset = dest
            counters.bytes_moved += block.nbytes
        # Synchronisation point: the moves were queued on the current stream; owners use
        # their views on any stream after the callbacks, so the moves must be done.
        accelerator.current_stream().synchronize()
    finally:
        if release is not None:
            release()
