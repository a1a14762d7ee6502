"""Gradient accumulation fused with its statistics: one pass over the host gradient buffer.

The optimizer's host worker runs this as each gradient bucket arrives from the device, so
the sum of squares and the overflow flag of the accumulated gradient are known by the time
``step()`` runs, and the step needs no separate statistics pass.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from ._validate import (
    BF16,
    FP16,
    FP32,
    REDUCTION_BLOCK,
    as_kernel_array,
    check_range,
    reduction_blocks,
    run_with_threads,
)
from .convert import FASTMATH_ELEMENTWISE, FASTMATH_REDUCTION, KERNEL_OPTIONS, load_f32
from .stats import SUM_CHUNK, _sumsq_f32


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
