"""Gradient accumulation fused with its statistics: one pass over the host gradient buffer.

The optimizer's host worker runs this as each gradient bucket arrives from the device, so
the sum of squares and the overflow flag of the accumulated gradient are known by the time
``step()`` runs, and the step needs no separate statistics pass.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
from numba import njit, prange

from ._validate import (
    BF16,
    FP16,
    FP32,
    REDUCTION_BLOCK,
    as_kernel_array,
    check_range,
    check_ranges,
    planned,
    range_blocks,
    reduction_blocks,
    run_with_threads,
)
from .convert import FASTMATH_ELEMENTWISE, FASTMATH_REDUCTION, KERNEL_OPTIONS, load_f32
from .stats import SUM_CHUNK, _sumsq_f32, _sumsq_tile


@njit(fastmath=FASTMATH_ELEMENTWISE, cache=True, nogil=True, error_model="numpy")
def _accumulate_tile(acc_t, src_t, src_kind, overwrite):
    # The statistics of each chunk just written: Note [one loop shape for every sum]
    n = acc_t.shape[0]
    total = 0.0
    for lo in range(0, n, SUM_CHUNK):
        hi = min(lo + SUM_CHUNK, n)
        acc_c, src_c = acc_t[lo:hi], src_t[lo:hi]
        for i in range(hi - lo):
            g = load_f32(src_c, i, src_kind)
            if not overwrite:
                g = acc_c[i] + g  # one fp32 add, exactly torch's acc.add_(src.float())
            acc_c[i] = g
        total += _sumsq_f32(acc_c)
    return total


@njit(fastmath=FASTMATH_REDUCTION, **KERNEL_OPTIONS)
def _accumulate_kernel(acc, src, src_kind, overwrite, start, stop, nblocks):
    partial = np.zeros(nblocks, dtype=np.float64)  # one float64 sum of squares per block
    for b in prange(nblocks):
        # Note [sums do not depend on the threads] (_validate.py); a slice, so the loop
        # vectorises (Note [one contiguous slice per thread], adam.py)
        lo = start + b * REDUCTION_BLOCK
        hi = min(lo + REDUCTION_BLOCK, stop)
        partial[b] = _accumulate_tile(acc[lo:hi], src[lo:hi], src_kind, overwrite)
    return partial


def accumulate_grad(
    acc,
    src,
    *,
    overwrite: bool,
    start: int = 0,
    stop: int | None = None,
    num_threads: int | None = None,
    partials: list[float] | None = None,
) -> tuple[float, bool]:
    """``acc[start:stop] = src`` (``overwrite``) or ``+= src``, in fp32; returns the statistics.

    ``acc`` is a 1-D contiguous fp32 CPU tensor or numpy array; ``src`` is fp32, bf16 or
    fp16 of the same length (numpy uint16 means bf16 bits). Returns ``(sum of squares, any
    non-finite)`` of the *updated* ``acc[start:stop]``, accumulated in float64 as in
    ``grad_stats``, bitwise the same sum as ``grad_stats(acc, start=start, stop=stop)``
    afterwards (see Note [non-finite flag from the float64 sum] in stats.py); ``partials``
    as in ``grad_stats``.
    """
    acc_a, _ = as_kernel_array(acc, "acc", (FP32,), writable=True)
    src_a, kind = as_kernel_array(src, "src", (FP32, BF16, FP16))
    if src_a.shape[0] != acc_a.shape[0]:
        raise ValueError(
            f"src has {src_a.shape[0]} elements but acc has {acc_a.shape[0]}; pass equal lengths"
        )
    if not isinstance(overwrite, bool):
        raise TypeError(f"overwrite must be a bool, got {overwrite!r}")
    start, stop = check_range(start, stop, acc_a.shape[0])
    nblocks = reduction_blocks(stop - start)
    partial = run_with_threads(
        num_threads,
        lambda n: _accumulate_kernel(acc_a, src_a, kind, overwrite, start, stop, nblocks),
    )
    if partials is not None:
        partials.extend(partial.tolist())
    total = math.fsum(partial)
    return total, not math.isfinite(total)


# Note [one accumulation launch for many ranges]
# With an accumulator, the host pass over a landed tile adds each parameter piece apart,
# each with its own statistics (Note [the norm does not depend on the bucketing] in
# optim/grads/stat_cells.py). One ``accumulate_grad`` call per piece, and a ``grad_stats``
# call for a cell begun in an earlier tile, made a bucket of 400 small parameters 600
# launches per tile on the host worker (the parameters and the alignment gaps between
# them), the cost Note [one launch for many ranges] in stats.py removed from the statistics
# alone. ``accumulate_grad_ranges`` takes a tile's pieces in one call, two loops in one
# launch:
#   1. every piece cut into the blocks ``accumulate_grad`` cuts it into (``range_blocks``:
#      REDUCTION_BLOCK elements from the piece's start, an empty piece one empty block),
#      each block accumulated and summed by the same ``_accumulate_tile``, in parallel;
#   2. then each piece's re-read range (a cell begun before the piece) cut into the blocks
#      ``grad_stats`` cuts it into and summed by the same ``_sumsq_tile``, reading the
#      accumulator after loop 1 wrote it.
# Each block's sum lands in the partials at the place the calls one by one would append it,
# so they are bitwise the same, in the same order. Running loop 2 after every piece, not
# right after its own, changes nothing as long as no re-read range reaches into a later
# piece, and the pieces may run in parallel only if they do not overlap: both are checked.
# The two loops are kept apart (no parfor fusion), or a re-read could run beside the block
# that writes it. A piece counted whole (its statistics range is the piece) takes its
# partials from loop 1: the accumulated chunk is summed as it is written, the host bytes of
# one pass (Note [one loop shape for every sum] in stats.py makes them grad_stats' sums).


@njit(fastmath=FASTMATH_REDUCTION, **dict(KERNEL_OPTIONS, parallel={"fusion": False}))
def _accumulate_blocks_kernel(
    acc, src, src_kind, overwrite, block_lo, block_hi, block_out, cell_lo, cell_hi, cell_out, n_out
):
    partial = np.zeros(n_out, dtype=np.float64)  # the partials, in the order of the calls
    # 1. Accumulation: Note [sums do not depend on the threads] (_validate.py)
    for b in prange(block_lo.shape[0]):
        lo, hi = block_lo[b], block_hi[b]
        total = _accumulate_tile(acc[lo:hi], src[lo:hi], src_kind, overwrite)
        if block_out[b] >= 0:
            partial[block_out[b]] = total
    # 2. After every block of 1 (Note [one accumulation launch for many ranges]): the cells
    # re-read from the accumulator, as grad_stats(acc, ...) sums them.
    for c in prange(cell_lo.shape[0]):
        partial[cell_out[c]] = _sumsq_tile(acc[cell_lo[c] : cell_hi[c]], FP32)
    return partial


class AccumulateRanges(NamedTuple):
    """Ranges of arrays of ``n`` elements with what each counts, checked and cut into blocks
    once (``plan_accumulate_ranges``), for ``accumulate_grad_ranges`` to launch at every
    call: Note [ranges planned once]. ``blocks``: the kernel's block arguments (the
    accumulated blocks, the re-read cells' blocks, each block's partial, the partials'
    count); ``empty``: no range."""

    n: int
    blocks: tuple
    empty: bool


def plan_accumulate_ranges(ranges: object, n: int) -> AccumulateRanges:
    """``ranges`` (``(start, stop, counted)`` of arrays of ``n`` elements; see
    ``accumulate_grad_ranges``) checked and cut into blocks; a ValueError or TypeError
    naming a bad range."""
    pieces, counted = _split_ranges(ranges)
    bounds = check_ranges(pieces, n)
    if bounds.shape[0] == 0:
        return AccumulateRanges(n, (), True)
    starts, stops = bounds[:, 0], bounds[:, 1]
    overlap = starts[1:] < stops[:-1]
    if overlap.any():
        i = int(np.argmax(overlap)) + 1
        raise ValueError(
            f"ranges[{i}] starts at {int(starts[i])}, before ranges[{i - 1}] ends at "
            f"{int(stops[i - 1])}; pass the ranges in increasing order, without overlap"
        )
    has = np.fromiter((c is not None for c in counted), dtype=bool, count=len(counted))
    cells = check_ranges([c for c in counted if c is not None], n, "counted ranges")
    stat = np.zeros_like(bounds)
    stat[has] = cells
    whole = has & (stat[:, 0] == starts) & (stat[:, 1] == stops)
    reread = has & ~whole
    next_start = np.append(starts[1:], n)
    late = reread & (stat[:, 1] > next_start)
    if late.any():
        i = int(np.argmax(late))
        raise ValueError(
            f"ranges[{i}] counts ({int(stat[i, 0])}, {int(stat[i, 1])}), which reaches past "
            f"the start {int(next_start[i])} of ranges[{i + 1}]; a range's statistics may read "
            "only what the ranges up to it write"
        )
    # Where each range's partials go: Note [one accumulation launch for many ranges].
    block_lo, block_hi, counts, within = range_blocks(starts, stops)
    r = np.flatnonzero(reread)
    cell_lo, cell_hi, cell_counts, cell_within = range_blocks(stat[r, 0], stat[r, 1])
    emitted = np.where(whole, counts, 0)
    emitted[r] = cell_counts
    first = np.cumsum(emitted) - emitted
    owner = np.repeat(np.arange(bounds.shape[0]), counts)
    block_out = np.where(whole[owner], first[owner] + within, -1)
    cell_out = np.repeat(first[r], cell_counts) + cell_within
    blocks = (block_lo, block_hi, block_out, cell_lo, cell_hi, cell_out, int(emitted.sum()))
    return AccumulateRanges(n, blocks, False)


def accumulate_grad_ranges(
    acc,
    src,
    ranges: Sequence[tuple[int, int, tuple[int, int] | None]] | AccumulateRanges,
    *,
    overwrite: bool,
    num_threads: int | None = None,
    partials: list[float] | None = None,
) -> tuple[float, bool]:
    """``accumulate_grad`` over each ``(start, stop, counted)`` of ``ranges`` in one launch.

    Each ``acc[start:stop]`` is set to (``overwrite``) or incremented by ``src[start:stop]``
    in fp32, exactly as ``accumulate_grad`` does. ``counted`` says which statistics the
    range yields, appended to ``partials`` range by range in order, bitwise the partials of
    the calls one by one: ``None``, none; ``(start, stop)`` (the range itself), those of
    ``accumulate_grad(..., partials=...)`` over it; another ``(lo, hi)``, those of
    ``grad_stats(acc, start=lo, stop=hi)`` once the range is accumulated (a cell of which
    the range is the last piece). The ranges must be in increasing order without overlap,
    and a ``counted`` range may not reach past the start of the next range. ``ranges`` may
    be ``plan_accumulate_ranges``' plan for arrays of ``acc``'s length (Note [ranges planned
    once]). Returns ``(sum of squares, any non-finite)`` of the partials. See Note [one
    accumulation launch for many ranges].
    """
    acc_a, _ = as_kernel_array(acc, "acc", (FP32,), writable=True)
    src_a, kind = as_kernel_array(src, "src", (FP32, BF16, FP16))
    n = acc_a.shape[0]
    if src_a.shape[0] != n:
        raise ValueError(f"src has {src_a.shape[0]} elements but acc has {n}; pass equal lengths")
    if not isinstance(overwrite, bool):
        raise TypeError(f"overwrite must be a bool, got {overwrite!r}")
    plan = planned(ranges, n, AccumulateRanges, plan_accumulate_ranges, "acc")
    if plan.empty:
        return 0.0, False
    partial = run_with_threads(
        num_threads,
        lambda threads: _accumulate_blocks_kernel(acc_a, src_a, kind, overwrite, *plan.blocks),
    )
    if partials is not None:
        partials.extend(partial.tolist())
    total = math.fsum(partial)
    return total, not math.isfinite(total)


def _split_ranges(
    ranges: object,
) -> tuple[list[object], list[tuple[int, int] | None]]:
    """``ranges``' ``(start, stop)`` pairs and ``counted`` entries, or a TypeError naming it."""
    pieces: list[object] = []
    counted: list[tuple[int, int] | None] = []
    try:
        for start, stop, count in ranges:  # type: ignore[attr-defined]
            pieces.append((start, stop))
            counted.append(count)
    except (TypeError, ValueError):
        raise TypeError(
            "ranges must be a sequence of (start, stop, counted) with counted None or a "
            f"(lo, hi) pair, got {ranges!r:.80}"
        ) from None
    return pieces, counted
