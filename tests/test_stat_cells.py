"""The cells of the gradient statistics (optim/grads/stat_cells.py): whatever the tiles and
the shard, every tile's pieces cover it in order, and the partial sums taken are exactly
one per cell of each parameter (Note [the norm does not depend on the bucketing])."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from zero_offload.kernels._validate import REDUCTION_BLOCK
from zero_offload.optim.grads.stat_cells import Cut, pieces
from zero_offload.partition import ParamSlot

B = REDUCTION_BLOCK


def expected_cells(slots: list[ParamSlot], shard: tuple[int, int]) -> list[tuple[int, int]]:
    """Each slot's cells from its start, cut by the shard, shard-local."""
    out = []
    for slot in slots:
        for lo in range(slot.offset, slot.end, B):
            a, b = max(lo, shard[0]), min(lo + B, slot.end, shard[1])
            if a < b:
                out.append((a - shard[0], b - shard[0]))
    return out


@settings(max_examples=200, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 3 * B + 7), min_size=1, max_size=5),
    gaps=st.lists(st.integers(0, 3), min_size=5, max_size=5),
    tile=st.sampled_from([1024, 1031, 5000, B, 2 * B + 1, 1 << 21]),
    cut=st.tuples(st.floats(0, 1), st.floats(0, 1)),
)
def test_every_cell_is_counted_once_whatever_the_tiles(
    sizes: list[int], gaps: list[int], tile: int, cut: tuple[float, float]
) -> None:
    slots, offset = [], 0
    for i, size in enumerate(sizes):
        offset += gaps[i]
        slots.append(ParamSlot(index=i, shape=(size,), offset=offset, numel=size))
        offset += size
    lo_cut, hi_cut = sorted(int(c * offset) for c in cut)
    shard = (lo_cut, max(hi_cut, lo_cut + 1))
    n = shard[1] - shard[0]
    counted, pos = [], 0
    for lo in range(0, n, tile):
        hi = min(lo + tile, n)
        for piece in pieces(slots, shard, lo, hi):
            assert piece.lo == pos and piece.lo < piece.hi <= hi  # in order, no hole
            pos = piece.hi
            if piece.cut is Cut.CELLS:  # the kernel's blocks, counted from piece.lo
                counted += [(a, min(a + B, piece.hi)) for a in range(piece.lo, piece.hi, B)]
            elif piece.cut is Cut.LAST:
                assert piece.cell is not None and piece.cell[1] == piece.hi
                counted.append(piece.cell)
    assert pos == n
    assert counted == expected_cells(slots, shard)
