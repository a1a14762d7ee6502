"""Adafactor over one whole parameter's fp32 master, in place, in three passes.

``torch.optim.Adafactor``'s update (its single-tensor path, ``_single_tensor_adafactor``)
reads whole-parameter statistics: the RMS of the weights (the step size), the row and column
means of the squared gradient over the last two dimensions (the factored second moment of a
parameter of two or more dimensions), and the RMS of the update (update clipping). So it
cannot run tile by tile: the kernel takes one parameter, flat, with its shape, and makes
three passes over it (Note [Adafactor's three passes]). The factored state is sublinear: a
``(..., m, n)`` parameter keeps ``row_var`` ``(..., m, 1)`` and ``col_var`` ``(..., 1, n)``;
a parameter of fewer than two dimensions keeps a full ``variance``.
"""

from __future__ import annotations

import math
import numbers

import numpy as np
from numba import njit, prange, types
from numba.extending import overload

from ._validate import (
    BF16,
    FP16,
    FP32,
    MIN_ELEMENTS_PER_THREAD,
    as_kernel_array,
    check_float,
    chunking,
    run_with_threads,
)
from .convert import FASTMATH_ELEMENTWISE, KERNEL_OPTIONS, load_f32, out_view, store_f32
from .stats import SUM_CHUNK, _as_f32, _sumsq_f32

__all__ = ["adafactor_step", "factored"]

# Note [Adafactor's three passes]
# torch computes, for one parameter p with gradient G (negated when maximize), step t:
#   w = t ** beta2_decay;  rho = min(lr, 1 / sqrt(t))            (Python floats)
#   alpha = max(eps2, ||p|| / sqrt(numel)) * rho                 (||p|| rounded to fp32)
#   p = p * (1 - lr * wd)                                        (wd != 0)
#   factored (dim >= 2):  R = lerp(R, ||G_row||^2 / n, w);  C = lerp(C, ||G_col||^2 / m, w)
#                         V = (R @ C) / max(mean_rows(R), eps1)
#   else:                 V = lerp(V, G * G, w)
#   U = rsqrt(max(V, eps1^2)) * G
#   p = p + (-alpha / max(1, ||U|| / (sqrt(numel) * d))) * U
# The kernel makes three passes over the parameter:
#   1. statistics: the sum of squares of p, and (factored) of G by row and by column;
#      then the factors are updated (small vectors, serially);
#   2. the sum of squares of U (unfactored: V is updated here, the pass writes it);
#   3. the update, U recomputed from the final factors as in pass 2 (the same operations,
#      the same bits), written to p and ``out``.
# Every sum is a float64 sum over fixed blocks of rows or elements, added in block order: a
# function of the shape alone, not of the threads (Note [sums do not depend on the threads]
# in _validate.py), each through stats.py's one reduction loop over fp32 chunks (Note [one
# loop shape for every sum]; U is written into a scratch chunk first), and each elementwise
# operation is one fp32 operation rounded as written
# (Note [every specialisation rounds alike] in convert.py; torch's vectorised lerp and
# add(alpha=) fuse a multiply-add, so a weight may differ from torch's in its last bit).
# A norm is rounded to fp32 before it is used, as torch's ``norm().item()`` is.

# Note [pass 1 four rows at a time]
# Pass 1 adds each row's squares to its block's float64 column partials. Row by row, every
# partial (8 bytes a column: 32 KiB for 4096 columns, past L1) was loaded and stored once
# per row: at 4096 x 4096 on two cores pass 1 took 7.1 ms, its streams 2.3 ms. Four rows of
# one batch are taken at once (4.1 ms): a partial is loaded, the four squares added in row
# order, and stored once; the same additions in the same order, so the same bits. Each row's own sum still goes
# through the one reduction loop over a chunk of its scaled values; an fp32 gradient with
# grad_mul 1 is its own scaled values and is summed where it lies, without the copy.

# Note [dividing by the row mean]
# Factored, U costs a division by the batch's row mean r, a square root and a reciprocal
# per element, in pass 2 and again in pass 3. Pass 2 reads only G, so on a few cores the
# divider, not memory, bounds it; there the division is a multiplication, which gives the
# same bits: fp32(t / r) == fp32(t * y), the product taken in float64 with y = 1 / r
# rounded to float64, for all fp32 t, r with t / r >= 2**-126. Proof: write t = A * 2**a,
# r = B * 2**b (integers 1 <= A, B < 2**24, subnormals too) and let M = K * 2**k be a
# midpoint next to t / r between two fp32 values (K odd, 2**24 < K < 2**25, as t / r is
# normal). Then t - r * M = A * 2**a - B * K * 2**(b + k); as t / r > M / 2, a >= b + k
# (else A >= B * K > 2**24), so t - r * M is a multiple of 2**(b + k), and not zero (A's
# odd part would be a multiple of K > A): |t / r - M| >= 2**k / B > 2**(k - 24) >
# M * 2**-49. The float64 product is within (t / r) * 2**-51.9 of t / r (two roundings;
# every product of fp32 t and y is a normal float64), so no midpoint lies between them and
# both round to the same fp32. A quotient below 2**-126 rounds to at most 2**-126 either
# way (the midpoint above 2**-126 has K = 2**24 + 1), and max(v, eps1**2) makes them equal
# when eps1**2 >= 2**-126: pass 2 multiplies then (torch's default eps1 is 1.2e-7) and
# divides otherwise. NaN and inf quotients agree too (r >= eps1 > 0). Pass 2 ran about 10%
# faster so (a quarter of its divider work gone). Pass 3 divides: it also streams p in and
# out, and the product's conversions, more instructions per element, left fewer loads in
# flight (10% slower). Its U has pass 2's bits either way; tests/test_adafactor.py checks the
# identity on random and extreme bits, and the kernel's results with and without it.

#: At most this many blocks of rows per factored parameter; each keeps its own float64
#: column sums, so their memory is bounded by MAX_BLOCKS * columns * 8 bytes (and by
#: COLUMN_PARTIALS elements in all).
MAX_BLOCKS = 64
COLUMN_PARTIALS = 1 << 22
#: The smallest normal fp32 (2**-126): Note [dividing by the row mean].
SMALLEST_NORMAL = float(np.finfo(np.float32).tiny)


def factored(shape: tuple[int, ...]) -> bool:
    """Whether a parameter of ``shape`` keeps a factored second moment (two or more dims)."""
    return len(shape) >= 2


def _row_blocks(rows: int, n: int, columns: int) -> int:
    """Blocks of rows for pass 1 of a factored parameter: a function of its shape only."""
    by_size = -(-(rows * n) // MIN_ELEMENTS_PER_THREAD)
    by_memory = max(1, COLUMN_PARTIALS // max(columns, 1))
    return max(1, min(MAX_BLOCKS, rows, by_size, by_memory))


def _element_blocks(numel: int) -> int:
    """Fixed blocks of MIN_ELEMENTS_PER_THREAD elements for the other sums."""
    return max(1, -(-numel // MIN_ELEMENTS_PER_THREAD))


@njit(fastmath=FASTMATH_ELEMENTWISE, cache=True, nogil=True, error_model="numpy")
def _squares_1row(g_t, grad_kind, grad_mul, cp_t, s_t):
    """``cp_t[j] += (g_t[j] * grad_mul)^2`` in float64, the scaled values into ``s_t``
    (a no-op when absent: Note [what is compile-time, what is a select] in convert.py)."""
    for j in range(cp_t.shape[0]):
        x = load_f32(g_t, j, grad_kind) * grad_mul
        store_f32(s_t, j, x)
        d = np.float64(x)
        cp_t[j] += d * d


@njit(fastmath=FASTMATH_ELEMENTWISE, cache=True, nogil=True, error_model="numpy")
def _squares_4rows(g0, g1, g2, g3, grad_kind, grad_mul, cp_t, s0, s1, s2, s3):
    """``_squares_1row`` of four consecutive rows at once, added to each column's partial in
    row order: one load and store of the partial per four rows (Note [pass 1 four rows at
    a time])."""
    for j in range(cp_t.shape[0]):
        x0 = load_f32(g0, j, grad_kind) * grad_mul
        x1 = load_f32(g1, j, grad_kind) * grad_mul
        x2 = load_f32(g2, j, grad_kind) * grad_mul
        x3 = load_f32(g3, j, grad_kind) * grad_mul
        store_f32(s0, j, x0)
        store_f32(s1, j, x1)
        store_f32(s2, j, x2)
        store_f32(s3, j, x3)
        acc = cp_t[j]
        d = np.float64(x0)
        acc += d * d
        d = np.float64(x1)
        acc += d * d
        d = np.float64(x2)
        acc += d * d
        d = np.float64(x3)
        acc += d * d
        cp_t[j] = acc


@njit(fastmath=FASTMATH_ELEMENTWISE, **KERNEL_OPTIONS)
def _factored_stats(param, grad, grad_kind, grad_mul, m, n, nblocks, rowsq, colpart, psq, direct):
    """Pass 1: ``rowsq[r]`` = sum_j g[r, j]^2; ``colpart[blk, b*n + j]`` = that block's rows'
    g^2 in column j of batch b; ``psq[blk]`` = that block's sum of p^2 (all float64). Each
    row's sums go through the one reduction loop (Note [one loop shape for every sum] in
    stats.py) in chunks of SUM_CHUNK from the row's start: the gradient's over its scaled
    values, copied into a scratch chunk, or over the chunk itself when ``direct`` (an fp32
    gradient and ``grad_mul`` 1: the same values). Rows are taken four at a time (Note
    [pass 1 four rows at a time])."""
    rows = rowsq.shape[0]
    for blk in prange(nblocks):
        r0 = rows * blk // nblocks
        r1 = rows * (blk + 1) // nblocks
        cp = colpart[blk]
        w = min(n, SUM_CHUNK)
        scratch = (np.empty(w, dtype=np.float32), np.empty(w, dtype=np.float32),
                   np.empty(w, dtype=np.float32), np.empty(w, dtype=np.float32))  # fmt: skip
        absent = np.empty(0, dtype=np.uint8)  # no scaled copy (direct)
        pacc = 0.0
        r = r0
        while r < r1:
            four = r + 4 <= r1 and r // m == (r + 3) // m  # four rows of one batch
            k = 4 if four else 1
            base = r * n
            cb = (r // m) * n
            for i in range(k):
                rowsq[r + i] = 0.0
            for lo in range(0, n, SUM_CHUNK):
                hi = min(lo + SUM_CHUNK, n)
                c = hi - lo
                cp_t = cp[cb + lo : cb + hi]
                g0 = grad[base + lo : base + hi]
                if four:
                    g1 = grad[base + n + lo : base + n + hi]
                    g2 = grad[base + 2 * n + lo : base + 2 * n + hi]
                    g3 = grad[base + 3 * n + lo : base + 3 * n + hi]
                    if direct:
                        _squares_4rows(g0, g1, g2, g3, grad_kind, grad_mul, cp_t, absent, absent,
                                       absent, absent)  # fmt: skip
                    else:
                        _squares_4rows(g0, g1, g2, g3, grad_kind, grad_mul, cp_t, scratch[0][:c],
                                       scratch[1][:c], scratch[2][:c], scratch[3][:c])  # fmt: skip
                elif direct:
                    _squares_1row(g0, grad_kind, grad_mul, cp_t, absent)
                else:
                    _squares_1row(g0, grad_kind, grad_mul, cp_t, scratch[0][:c])
                for i in range(k):
                    if direct:
                        g_i = grad[base + i * n + lo : base + i * n + hi]
                        rowsq[r + i] += _sumsq_f32(_as_f32(g_i, grad_kind, scratch[i][:c]))
                    else:
                        rowsq[r + i] += _sumsq_f32(scratch[i][:c])
            for i in range(k):
                row = base + i * n
                for lo in range(0, n, SUM_CHUNK):
                    pacc += _sumsq_f32(param[row + lo : row + min(lo + SUM_CHUNK, n)])
            r += k
        psq[blk] = pacc


@njit(fastmath=FASTMATH_ELEMENTWISE, cache=True, nogil=True, error_model="numpy")
def _lerp(start, end, weight):
    """torch's lerp, one fp32 value (``weight`` fp32)."""
    if weight < np.float32(0.5):
        return start + weight * (end - start)
    return end - (end - start) * (np.float32(1.0) - weight)


@njit(fastmath=FASTMATH_ELEMENTWISE, cache=True, nogil=True, error_model="numpy")
def _update_factors(rowsq, colpart, row_var, col_var, rmean, m, n, weight, eps1):
    """Between passes 1 and 2: the row and column means of g^2 into ``row_var`` and
    ``col_var`` (lerp by ``weight``), and ``rmean[b]`` = max(mean of batch b's row_var,
    eps1), all fp32 as torch rounds them. A column's partials are added in block order."""
    for r in range(rowsq.shape[0]):
        norm = np.float32(np.sqrt(rowsq[r]))
        row_var[r] = _lerp(row_var[r], norm * norm / np.float32(n), weight)
    cols = col_var.shape[0]
    total = np.zeros(cols, dtype=np.float64)  # (cols,) float64 column sums
    for blk in range(colpart.shape[0]):
        part = colpart[blk]
        for c in range(cols):
            total[c] += part[c]
    for c in range(cols):
        norm = np.float32(np.sqrt(total[c]))
        col_var[c] = _lerp(col_var[c], norm * norm / np.float32(m), weight)
    for b in range(rmean.shape[0]):
        acc = 0.0
        for i in range(m):
            acc += np.float64(row_var[b * m + i])
        mean = np.float32(acc / m)
        rmean[b] = mean if mean > eps1 else eps1


def _over_mean(v, scale):
    """``v / r`` for the batch's row mean r (fp32), given as ``scale``: r itself (fp32), or
    its float64 reciprocal, then multiplied (Note [dividing by the row mean])."""


@overload(_over_mean)
def _over_mean_impl(v, scale):
    if scale == types.float64:
        return lambda v, scale: np.float32(np.float64(v) * scale)
    return lambda v, scale: v / scale


@njit(fastmath=FASTMATH_ELEMENTWISE, cache=True, nogil=True, error_model="numpy")
def _factored_u(g, rv, cv, scale, eps1sq):
    v = _over_mean(rv * cv, scale)
    v = v if v > eps1sq else eps1sq
    return (np.float32(1.0) / np.sqrt(v)) * g


@njit(fastmath=FASTMATH_ELEMENTWISE, cache=True, nogil=True, error_model="numpy")
def _u_row(g_t, grad_kind, grad_mul, cv_t, rv, scale, eps1sq, scratch):
    """U over one row's chunk into ``scratch`` (returned, the chunk's length)."""
    for j in range(g_t.shape[0]):
        scratch[j] = _factored_u(load_f32(g_t, j, grad_kind) * grad_mul, rv, cv_t[j], scale,
                                 eps1sq)  # fmt: skip
    return scratch[: g_t.shape[0]]


@njit(fastmath=FASTMATH_ELEMENTWISE, cache=True, nogil=True, error_model="numpy")
def _apply_row(p_t, g_t, grad_kind, grad_mul, cv_t, rv, rm, eps1sq, decay, coef, out_t):
    """Pass 3 over one row: ``p = p * decay + coef * U``, and ``out``."""
    for j in range(p_t.shape[0]):
        u = _factored_u(load_f32(g_t, j, grad_kind) * grad_mul, rv, cv_t[j], rm, eps1sq)
        p = p_t[j] * decay
        p = p + coef * u
        p_t[j] = p
        store_f32(out_t, j, p)


@njit(fastmath=FASTMATH_ELEMENTWISE, **KERNEL_OPTIONS)
def _factored_usq(grad, grad_kind, grad_mul, m, n, row_var, col_var, scales, eps1sq, nblocks,
                  usq):  # fmt: skip
    """Pass 2: ``usq[blk]`` = the block's sum of U^2 (float64), U written chunk by chunk
    into a scratch buffer and summed by the one reduction loop. ``scales[b]``: batch b's
    row mean or its reciprocal (Note [dividing by the row mean])."""
    rows = row_var.shape[0]
    for blk in prange(nblocks):
        r0 = rows * blk // nblocks
        r1 = rows * (blk + 1) // nblocks
        scratch = np.empty(min(n, SUM_CHUNK), dtype=np.float32)  # (SUM_CHUNK,) fp32: U
        acc = 0.0
        for r in range(r0, r1):
            base = r * n
            b = r // m
            cb = b * n
            rv = row_var[r]
            scale = scales[b]
            for lo in range(0, n, SUM_CHUNK):
                hi = min(lo + SUM_CHUNK, n)
                u = _u_row(grad[base + lo : base + hi], grad_kind, grad_mul,
                           col_var[cb + lo : cb + hi], rv, scale, eps1sq, scratch)  # fmt: skip
                acc += _sumsq_f32(u)
        usq[blk] = acc


@njit(fastmath=FASTMATH_ELEMENTWISE, **KERNEL_OPTIONS)
def _factored_apply(param, grad, grad_kind, grad_mul, m, n, row_var, col_var, rmean, eps1sq,
                    decay, coef, out, nchunks):  # fmt: skip
    """Pass 3: ``p = p * decay + coef * U``, and ``out``; ``rmean[b]``: batch b's row mean,
    divided by (Note [dividing by the row mean])."""
    rows = row_var.shape[0]
    for c in prange(nchunks):
        r0 = rows * c // nchunks
        r1 = rows * (c + 1) // nchunks
        for r in range(r0, r1):
            base = r * n
            b = r // m
            cb = b * n
            o = out[base : base + n] if out.shape[0] else out
            _apply_row(param[base : base + n], grad[base : base + n], grad_kind, grad_mul,
                       col_var[cb : cb + n], row_var[r], rmean[b], eps1sq, decay, coef, o)  # fmt: skip


@njit(fastmath=FASTMATH_ELEMENTWISE, cache=True, nogil=True, error_model="numpy")
def _vector_u(g_t, grad_kind, grad_mul, v_t, weight, eps1sq, scratch):
    """V = lerp(V, g*g, weight) written, U into ``scratch`` (returned, the chunk's length)."""
    one = np.float32(1.0)
    for j in range(g_t.shape[0]):
        g = load_f32(g_t, j, grad_kind) * grad_mul
        v = _lerp(v_t[j], g * g, weight)
        v_t[j] = v
        v = v if v > eps1sq else eps1sq
        scratch[j] = (one / np.sqrt(v)) * g
    return scratch[: g_t.shape[0]]


@njit(fastmath=FASTMATH_ELEMENTWISE, **KERNEL_OPTIONS)
def _vector_usq(param, grad, grad_kind, grad_mul, variance, weight, eps1sq, nblocks, usq, psq):
    """Pass 2 of an unfactored parameter (pass 1 is folded in): V = lerp(V, g*g, weight)
    written, ``usq[blk]``/``psq[blk]`` the block's sums of U^2 and p^2 (float64, by the
    one reduction loop)."""
    numel = param.shape[0]
    for blk in prange(nblocks):
        lo = numel * blk // nblocks
        hi = numel * (blk + 1) // nblocks
        scratch = np.empty(min(hi - lo, SUM_CHUNK), dtype=np.float32)  # (SUM_CHUNK,) fp32: U
        ua = 0.0
        pa = 0.0
        for c0 in range(lo, hi, SUM_CHUNK):
            c1 = min(c0 + SUM_CHUNK, hi)
            u = _vector_u(grad[c0:c1], grad_kind, grad_mul, variance[c0:c1], weight, eps1sq,
                          scratch)  # fmt: skip
            ua += _sumsq_f32(u)
            pa += _sumsq_f32(param[c0:c1])
        usq[blk] = ua
        psq[blk] = pa


@njit(fastmath=FASTMATH_ELEMENTWISE, cache=True, nogil=True, error_model="numpy")
def _vector_apply_tile(p_t, g_t, grad_kind, grad_mul, v_t, eps1sq, decay, coef, out_t):
    one = np.float32(1.0)
    for i in range(p_t.shape[0]):
        g = load_f32(g_t, i, grad_kind) * grad_mul
        v = v_t[i]
        v = v if v > eps1sq else eps1sq
        u = (one / np.sqrt(v)) * g
        p = p_t[i] * decay
        p = p + coef * u
        p_t[i] = p
        store_f32(out_t, i, p)


@njit(fastmath=FASTMATH_ELEMENTWISE, **KERNEL_OPTIONS)
def _vector_apply(param, grad, grad_kind, grad_mul, variance, eps1sq, decay, coef, out, nchunks):
    """Pass 3 of an unfactored parameter: ``p = p * decay + coef * U``, and ``out``."""
    numel = param.shape[0]
    for c in prange(nchunks):
        lo = numel * c // nchunks
        hi = numel * (c + 1) // nchunks
        o = out[lo:hi] if out.shape[0] else out
        _vector_apply_tile(param[lo:hi], grad[lo:hi], grad_kind, grad_mul, variance[lo:hi],
                           eps1sq, decay, coef, o)  # fmt: skip


def _f32_norm(sumsq: float) -> float:
    """A norm from a float64 sum of squares, rounded to fp32 as torch's ``norm()`` is."""
    return float(np.float32(math.sqrt(sumsq)))


def _state(x: object, name: str, numel: int) -> np.ndarray:
    array, _ = as_kernel_array(x, name, (FP32,), writable=True)
    if array.shape[0] != numel:
        raise ValueError(f"{name} has {array.shape[0]} elements but needs {numel} for the shape")
    return array


def adafactor_step(
    param,
    grad,
    *,
    shape: tuple[int, ...],
    row_var=None,
    col_var=None,
    variance=None,
    step: int,
    lr: float,
    beta2_decay: float,
    eps1: float,
    eps2: float,
    d: float,
    weight_decay: float,
    maximize: bool = False,
    grad_scale: float = 1.0,
    out=None,
    num_threads: int | None = None,
) -> None:
    """One Adafactor step of one whole parameter of ``shape``, matching
    ``torch.optim.Adafactor`` (``step`` counted from 1) on the gradient ``grad.float() *
    grad_scale`` (negated when ``maximize``; Note [Adafactor's three passes]).

    ``param``: the flat fp32 master (updated in place); ``grad``: flat fp32, bf16 or fp16;
    ``out``: flat bf16/fp16 receiving the weights, or None. With two or more dims,
    ``row_var`` (``prod(shape[:-1])`` elements) and ``col_var`` (``prod(shape[:-2]) *
    shape[-1]``) are the factors, else ``variance`` (every element): flat fp32, updated in
    place. ``eps1``: a number (torch's ``None`` is resolved by the caller). ``num_threads``:
    the thread budget's share when None.

    Raises ``TypeError``/``ValueError`` naming the bad argument before writing anything.
    """
    if not isinstance(shape, tuple) or not all(isinstance(s, int) and s >= 0 for s in shape):
        raise TypeError(f"shape must be a tuple of ints >= 0, got {shape!r}")
    numel = math.prod(shape)
    param_a, _ = as_kernel_array(param, "param", (FP32,), writable=True)
    grad_a, grad_kind = as_kernel_array(grad, "grad", (FP32, BF16, FP16))
    for name, array in (("param", param_a), ("grad", grad_a)):
        if array.shape[0] != numel:
            raise ValueError(f"{name} has {array.shape[0]} elements but shape {shape} has {numel}")
    if out is None:
        out_a = out_view(None, FP32)
    else:
        raw, out_kind = as_kernel_array(out, "out", (BF16, FP16), writable=True)
        if raw.shape[0] != numel:
            raise ValueError(f"out has {raw.shape[0]} elements but shape {shape} has {numel}")
        out_a = out_view(raw, out_kind)
    if factored(shape):
        m, n = shape[-2], shape[-1]
        batches = numel // (m * n) if m * n else 0
        row_a = _state(row_var, "row_var", batches * m)
        col_a = _state(col_var, "col_var", batches * n)
        if variance is not None:
            raise ValueError(f"variance must be None for a factored parameter of shape {shape}")
    else:
        var_a = _state(variance, "variance", numel)
        if row_var is not None or col_var is not None:
            raise ValueError(f"row_var and col_var must be None for a parameter of shape {shape}")
    if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 1:
        raise ValueError(f"step={step!r} is invalid; pass the 1-based step count (an int >= 1)")
    lr = check_float("lr", lr, lo=0.0)
    beta2_decay = check_float("beta2_decay", beta2_decay, hi=0.0)
    eps1 = check_float("eps1", eps1, lo=0.0)
    eps2 = check_float("eps2", eps2, lo=0.0)
    d = check_float("d", d, lo=1.0)
    weight_decay = check_float("weight_decay", weight_decay, lo=0.0)
    grad_scale = check_float("grad_scale", grad_scale)
    if numel == 0:
        return

    f32 = np.float32
    t = float(step)
    weight = f32(t**beta2_decay)
    rho = min(lr, 1 / (t**0.5))
    grad_mul = f32(-grad_scale if maximize else grad_scale)
    eps1sq = f32(eps1 * eps1)
    decay = f32(1 - lr * weight_decay)

    def run(threads: int) -> None:
        if factored(shape):
            rows = batches * m
            nblocks = _row_blocks(rows, n, batches * n)
            rowsq = np.empty(rows, dtype=np.float64)  # (rows,) float64
            colpart = np.zeros((nblocks, batches * n), dtype=np.float64)  # column partials
            psq = np.empty(nblocks, dtype=np.float64)
            direct = grad_kind == FP32 and grad_mul == 1
            _factored_stats(param_a, grad_a, grad_kind, grad_mul, m, n, nblocks, rowsq,
                            colpart, psq, direct)  # fmt: skip
            rmean = np.empty(batches, dtype=np.float32)  # (batches,) max(mean row_var, eps1)
            _update_factors(rowsq, colpart, row_a, col_a, rmean, m, n, weight, f32(eps1))
            # Note [dividing by the row mean]: (batches,) float64 reciprocals, or rmean
            scales = 1.0 / rmean.astype(np.float64) if eps1sq >= SMALLEST_NORMAL else rmean
            usq = np.empty(nblocks, dtype=np.float64)
            _factored_usq(grad_a, grad_kind, grad_mul, m, n, row_a, col_a, scales, eps1sq,
                          nblocks, usq)  # fmt: skip
        else:
            nblocks = _element_blocks(numel)
            usq = np.empty(nblocks, dtype=np.float64)
            psq = np.empty(nblocks, dtype=np.float64)
            _vector_usq(param_a, grad_a, grad_kind, grad_mul, var_a, weight, eps1sq, nblocks,
                        usq, psq)  # fmt: skip
        root = numel**0.5
        alpha = max(eps2, _f32_norm(math.fsum(psq)) / root) * rho
        denom = max(1.0, _f32_norm(math.fsum(usq)) / (root * d))
        coef = f32(-alpha / denom)
        nchunks = chunking(numel, threads)
        if factored(shape):
            _factored_apply(param_a, grad_a, grad_kind, grad_mul, m, n, row_a, col_a, rmean,
                            eps1sq, decay, coef, out_a, min(nchunks, batches * m))  # fmt: skip
        else:
            _vector_apply(param_a, grad_a, grad_kind, grad_mul, var_a, eps1sq, decay, coef,
                          out_a, nchunks)  # fmt: skip

    run_with_threads(num_threads, run)
