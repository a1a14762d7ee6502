"""Where a gradient tile's sum of squares is cut, so the global norm ignores the bucketing.

Note [the norm does not depend on the bucketing]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The global sum of squares is ``math.fsum`` of float64 partial sums (exact, then rounded
once), so it depends only on *which* elements each partial covers. Those sets are fixed
per parameter, whatever the bucket, its offset or the tile boundaries: the cells
``[slot_start + k·REDUCTION_BLOCK, ...)`` of each parameter's slot, the last one ending
at the slot's end (and, with several ranks, cut where this rank's shard is). Each cell's
partial is the kernels' one float64 sum of its elements (Note [sums do not depend on the
threads] in ``kernels/_validate.py``). A tile's host pass asks ``pieces`` how to cut its
range: runs of whole cells starting on a cell boundary (one kernel call, one partial per
cell), pieces of a cell that continues past the tile (accumulated, not counted yet), and
the last piece of a cell begun in an earlier tile (accumulated, then the whole cell summed
again from the finished buffer, one partial). Alignment gaps between slots are zeros:
accumulated, never counted. So one rank's ``last_grad_norm`` is bitwise the same for every
``bucket_bytes`` and ``tile_elements``; several ranks add their sums in the all-reduce.
The pieces cost no launch each: a tile's pass takes them all in one launch, its
statistics alone (Note [one launch for many ranges] in ``kernels/stats.py``) or its
accumulation with them (Note [one accumulation launch for many ranges] in
``kernels/accumulate.py``), with the same partials as one call per piece. The price is
one re-read cell per tile boundary inside a cell (docs/gradient-semantics.md).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from enum import Enum
from typing import NamedTuple

from ...kernels._validate import REDUCTION_BLOCK
from ...partition import ParamSlot

__all__ = ["Cut", "Piece", "pieces"]


class Cut(Enum):
    """What a tile's host pass does with one piece of its range."""

    CELLS = "cells"  # whole cells from a cell boundary: accumulate, one partial per cell
    PART = "part"  # part of a cell continuing past the tile (or a gap): accumulate only
    LAST = "last"  # the last part of a cell begun earlier: accumulate, then sum the cell


class Piece(NamedTuple):
    """``[lo, hi)`` (shard-local) and what to do; ``cell`` the whole cell for ``LAST``."""

    lo: int
    hi: int
    cut: Cut
    cell: tuple[int, int] | None = None


def _cell_of(i: int, start: int, stop: int, shard: tuple[int, int]) -> tuple[int, int]:
    """The cell (shard-local) holding local element ``i`` of the slot at ``[start, stop)``
    (global), cut by the shard."""
    g = shard[0] + i
    lo = start + (g - start) // REDUCTION_BLOCK * REDUCTION_BLOCK
    hi = min(lo + REDUCTION_BLOCK, stop)
    return max(lo, shard[0]) - shard[0], min(hi, shard[1]) - shard[0]


def pieces(slots: Sequence[ParamSlot], shard: tuple[int, int], lo: int, hi: int) -> Iterator[Piece]:
    """Cut the shard-local tile ``[lo, hi)`` into pieces covering it in order; see Note
    [the norm does not depend on the bucketing]."""
    pos = lo
    for slot in slots:
        a = max(lo, slot.offset - shard[0])
        b = min(hi, slot.end - shard[0])
        if a >= b:
            continue
        if pos < a:
            yield Piece(pos, a, Cut.PART)  # an alignment gap (zeros)
        pos = a
        while pos < b:
            c_lo, c_hi = _cell_of(pos, slot.offset, slot.end, shard)
            if c_lo < pos or c_hi > b or (shard[0] + c_lo - slot.offset) % REDUCTION_BLOCK:
                # A cell begun earlier, continuing past the tile, or cut by the shard
                # start: one cell at a time.
                end = min(c_hi, b)
                if c_hi > b:
                    yield Piece(pos, end, Cut.PART)
                elif c_lo < pos:
                    yield Piece(pos, end, Cut.LAST, (c_lo, c_hi))
                else:
                    yield Piece(pos, end, Cut.CELLS)
                pos = end
                continue
            # A run of whole cells from a cell boundary: every cell inside it starts
            # REDUCTION_BLOCK after the previous one (the kernel's blocks).
            run_end = pos
            while run_end < b:
                _, nxt = _cell_of(run_end, slot.offset, slot.end, shard)
                if nxt > b:
                    break
                run_end = nxt
            yield Piece(pos, run_end, Cut.CELLS)
            pos = run_end
    if pos < hi:
        yield Piece(pos, hi, Cut.PART)
