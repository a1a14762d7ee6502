"""One-pass gradient statistics: the sum of squares (for the global norm) and overflow flag."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
from numba import njit, prange, types
from numba.extending import overload

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

# Note [non-finite flag from the float64 sum]
# Each square of an fp32 value is exact in float64 (24-bit mantissa squared fits in 53
# bits) and at most 1.2e77, so a float64 sum of finite gradients cannot overflow for any
# array that fits in memory. The sum is therefore non-finite exactly when some gradient is
# NaN or +-inf: the flag costs no extra compare in the loop. 'reassoc' lets LLVM keep
# several partial sums per thread (vectorised); it does not license assuming finiteness,
# see Note [why no nnan/ninf fastmath] in convert.py.


# Note [one loop shape for every sum]
# With 'reassoc', LLVM picks the shape of a reduction (vector width, unrolling, remainder
# loop) per compiled loop: the statistics of fp16 staging and of the fp32 accumulator
# holding the same values differed in the last bit for some lengths. So every sum of
# squares (statistics of any dtype, accumulation) is the one fp32 loop ``_sumsq_f32``
# over chunks of SUM_CHUNK fp32 elements counted from the start of the block, added in
# order in float64: 16-bit gradients are widened chunk by chunk into a scratch buffer
# (it stays in L1), the accumulation pass sums the chunk it just wrote.
SUM_CHUNK = 2048


@njit(fastmath=FASTMATH_REDUCTION, cache=True, nogil=True, error_model="numpy")
def _sumsq_f32(x):
    """Sum of squares of an fp32 chunk, in float64; the only reduction loop."""
    acc = 0.0
    for i in range(x.shape[0]):
        g = np.float64(x[i])
        acc += g * g
    return acc


@njit(fastmath=FASTMATH_ELEMENTWISE, cache=True, nogil=True, error_model="numpy")
def _sumsq_tile(g_t, grad_kind):
    # Note [one loop shape for every sum]
    n = g_t.shape[0]
    scratch = np.empty(min(n, SUM_CHUNK), dtype=np.float32)  # (SUM_CHUNK,) fp32
    total = 0.0
    for lo in range(0, n, SUM_CHUNK):
        hi = min(lo + SUM_CHUNK, n)
        total += _sumsq_f32(_as_f32(g_t[lo:hi], grad_kind, scratch[: hi - lo]))
    return total


def _as_f32(chunk, kind, scratch):
    """``chunk`` as fp32: itself if it is fp32, else widened into ``scratch``."""


@overload(_as_f32)
def _as_f32_impl(chunk, kind, scratch):
    if chunk.dtype == types.float32:
        return lambda chunk, kind, scratch: chunk

    def widen(chunk, kind, scratch):
        for i in range(chunk.shape[0]):
            scratch[i] = load_f32(chunk, i, kind)
        return scratch

    return widen


@njit(fastmath=FASTMATH_REDUCTION, **KERNEL_OPTIONS)
def _sumsq_kernel(grad, grad_kind, start, stop, nblocks):
    partial = np.zeros(nblocks, dtype=np.float64)  # one float64 sum per block
    for b in prange(nblocks):
        # Note [sums do not depend on the threads] (_validate.py); a slice, so the loop
        # vectorises (Note [one contiguous slice per thread], adam.py)
        lo = start + b * REDUCTION_BLOCK
        hi = min(lo + REDUCTION_BLOCK, stop)
        partial[b] = _sumsq_tile(grad[lo:hi], grad_kind)
    return partial


def grad_stats(
    grad,
    *,
    start: int = 0,
    stop: int | None = None,
    num_threads: int | None = None,
    partials: list[float] | None = None,
) -> tuple[float, bool]:
    """Return ``(sum of squares, any non-finite)`` over ``grad[start:stop]`` in one pass.

    ``grad`` is a 1-D contiguous CPU fp32/bf16/fp16 tensor, or a numpy float32/float16
    array or uint16 array of bf16 bits. The sum is accumulated in float64 over fixed blocks
    whose sums are added exactly (``math.fsum``): the result depends only on the values and
    ``start``, not on ``num_threads`` nor on the dtype holding the values (Note [sums do not
    depend on the threads]). ``math.sqrt`` of the sums of all tiles is the global L2 norm to
    float64 accuracy. The flag is True iff some element is NaN or +-inf; the sum is then
    NaN or inf too. ``partials``: a list the block sums are appended to, in order (for a
    caller that adds sums of several calls exactly).
    """
    grad_a, kind = as_kernel_array(grad, "grad", (FP32, BF16, FP16))
    start, stop = check_range(start, stop, grad_a.shape[0])
    nblocks = reduction_blocks(stop - start)
    partial = run_with_threads(
        num_threads, lambda n: _sumsq_kernel(grad_a, kind, start, stop, nblocks)
    )
    if partials is not None:
        partials.extend(partial.tolist())
    total = math.fsum(partial)
    return total, not math.isfinite(total)


@njit(fastmath=FASTMATH_REDUCTION, **KERNEL_OPTIONS)
def _sumsq_blocks_kernel(grad, grad_kind, block_lo, block_hi):
    partial = np.zeros(block_lo.shape[0], dtype=np.float64)  # one float64 sum per block
    for b in prange(block_lo.shape[0]):
        # The same block sums as _sumsq_kernel's: Note [sums do not depend on the threads]
        partial[b] = _sumsq_tile(grad[block_lo[b] : block_hi[b]], grad_kind)
    return partial


# Note [one launch for many ranges]
# The host pass over a landed tile sums each parameter's cells apart (Note [the norm does
# not depend on the bucketing] in optim/grads/stat_cells.py). One ``grad_stats`` call per
# piece made a bucket of 400 small parameters 400 launches on the host worker, each
# checking its arguments and waking the thread team (about 30 µs each: 13 ms a tile, which
# step() then waited for). ``grad_stats_ranges`` takes every range of a tile in one call:
# each range is cut into the blocks ``grad_stats`` would cut it into (REDUCTION_BLOCK
# elements counted from the range's start, an empty range one empty block), and each block
# is summed by the same loop, so the partials are bitwise ``grad_stats``' partials of the
# ranges one by one, in the same order.


class StatsRanges(NamedTuple):
    """Ranges of an array of ``n`` elements, checked and cut into ``grad_stats``' blocks
    once (``plan_stats_ranges``), for ``grad_stats_ranges`` to launch at every call: Note
    [ranges planned once]."""

    n: int
    block_lo: np.ndarray
    block_hi: np.ndarray


def plan_stats_ranges(ranges: object, n: int) -> StatsRanges:
    """``ranges`` (``(start, stop)`` pairs of an array of ``n`` elements) checked and cut
    into blocks for ``grad_stats_ranges``; a ValueError or TypeError naming a bad range."""
    bounds = check_ranges(ranges, n)
    block_lo, block_hi, _, _ = range_blocks(bounds[:, 0], bounds[:, 1])
    return StatsRanges(n, block_lo, block_hi)


def grad_stats_ranges(
    grad,
    ranges: Sequence[tuple[int, int]] | StatsRanges,
    *,
    num_threads: int | None = None,
    partials: list[float] | None = None,
) -> tuple[float, bool]:
    """``grad_stats`` over each ``(start, stop)`` of ``ranges`` in one launch: the same
    block sums, appended to ``partials`` range by range in order, and ``(sum of squares,
    any non-finite)`` of them all. ``ranges`` may be ``plan_stats_ranges``' plan for an
    array of ``grad``'s length. See Note [one launch for many ranges]."""
    grad_a, kind = as_kernel_array(grad, "grad", (FP32, BF16, FP16))
    plan = planned(ranges, grad_a.shape[0], StatsRanges, plan_stats_ranges, "grad")
    if plan.block_lo.shape[0] == 0:
        return 0.0, False
    partial = run_with_threads(
        num_threads,
        lambda threads: _sumsq_blocks_kernel(grad_a, kind, plan.block_lo, plan.block_hi),
    )
    if partials is not None:
        partials.extend(partial.tolist())
    total = math.fsum(partial)
    return total, not math.isfinite(total)
