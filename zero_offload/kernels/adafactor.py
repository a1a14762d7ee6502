"""Adafactor over one whole parameter's fp32 master, in place, in two or three passes.

``torch.optim.Adafactor``'s update (its single-tensor path, ``_single_tensor_adafactor``)
reads whole-parameter statistics: the RMS of the weights (the step size), the row and column
means of the squared gradient over the last two dimensions (the factored second moment of a
parameter of two or more dimensions), and the RMS of the update (update clipping). So it
cannot run tile by tile: the kernel takes one parameter, flat, with its shape, and makes
two passes over it, three where an element may be clamped (Note [Adafactor's three
passes]). The factored state is sublinear: a
``(..., m, n)`` parameter keeps ``row_var`` ``(..., m, 1)`` and ``col_var`` ``(..., 1, n)``;
a parameter of fewer than two dimensions keeps a full ``variance``.
"""

from __future__ import annotations

import math
import numbers

import numpy as np
from numba import njit, prange

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
from .adafactor_stats import (
    _factored_stats,
    _lerp,
    _row_blocks,
    _update_factors,
    _usq_from_factors,
    column_partials,
)
from .convert import FASTMATH_ELEMENTWISE, KERNEL_OPTIONS, load_f32, out_view, store_f32
from .stats import SUM_CHUNK, _sumsq_f32

__all__ = ["adafactor_step", "adafactor_update_cap", "factored"]

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
# The kernel makes at most three passes over the parameter:
#   1. statistics: the sum of squares of p, and (factored) of G by row and by column, and
#      of G_ij / sqrt(R_i) by column; then the factors are updated, and from them one
#      number per row and per column (small vectors, serially; Note [the update from the
#      factors]), and ||U||^2 from them where no element is clamped (Note [the update's
#      norm from the factors]): then pass 2 is not made. Pass 1, the factors' update and
#      that norm are adafactor_stats.py's (the matrix's statistics), the rest is here;
#   2. the sum of squares of U (unfactored: V is updated here, the pass writes it, and it
#      is the first pass: p's sum is taken beside it);
#   3. the update, U recomputed as in pass 2 (the same operations, the same bits), written
#      to p and ``out``.
# Every sum is a float64 sum over fixed blocks of rows or elements, added in block order: a
# function of the shape alone, not of the threads (Note [sums do not depend on the threads]
# in _validate.py), each through stats.py's one reduction loop over fp32 chunks (Note [one
# loop shape for every sum]; U is written into a scratch chunk first), but the column sums
# of pass 1, fp32 over runs of a few rows before float64 (Note [pass 1 four rows at a
# time] in adafactor_stats.py: elementwise additions in row order, no reduction loop); and each elementwise
# operation is one fp32 operation rounded as written
# (Note [every specialisation rounds alike] in convert.py; torch's vectorised lerp and
# add(alpha=) fuse a multiply-add, so a weight may differ from torch's in its last bit).
# A norm is rounded to fp32 before it is used, as torch's ``norm().item()`` is. The factors
# R, C and V are torch's to the rounding of their sums; a factored U is computed in another
# form than torch's (Note [the update from the factors]).

# Note [the update from the factors]
# torch's factored U_ij = rsqrt(max(fp32(R_i * C_j) / r, eps1^2)) * G_ij (r: the batch's
# max(mean of R, eps1)) costs a division, a square root and a reciprocal per element, in
# pass 2 and again in pass 3: on two cores those, not memory, bounded both passes (the step
# ran at 0.64x its roofline). As optax's ``scale_by_factored_rms`` does, the kernel takes the
# square root once per row and per column instead: between passes 1 and 2 it computes, in
# float64 rounded once to fp32, a_i = 1 / sqrt(R_i / r) per row and b_j = 1 / sqrt(C_j) per
# column (O(m + n)), and per element
#   U_ij = min(a_i * b_j, cap) * G_ij,   cap = fp32(1 / fp32(sqrt(fp32(eps1^2))))
# two multiplies and a select. In exact arithmetic a_i * b_j = rsqrt(R_i C_j / r), and
# max(V, eps1^2) is min(rsqrt(V), 1 / eps1) after the rsqrt, so this is torch's U; cap is
# the value torch's rsqrt gives a clamped element, so a clamped U is torch's bits. The
# clamp keeps its meaning where a factor is 0, inf or NaN (torch's clamp passes NaN):
#   - a zero row or column (R_i = 0 or C_j = 0: V = 0, clamped to cap): a_i or b_j is
#     inf, the product inf, min gives cap (NaN when the other factor is 0, below);
#   - an inf column (C_j = inf: V = inf, U = rsqrt(inf) * G = 0 * G): b_j = 0, U = 0 * G,
#     and NaN where torch's fp32(R_i * C_j) is NaN too (R_i = 0: a_i = inf, inf * 0);
#   - an inf R_i makes its batch's row mean r inf: torch's V is inf / inf = NaN on that row
#     and 0 (clamped) on the others; a_i = 1 / sqrt(inf / inf) is NaN there, and
#     1 / sqrt(R_i / inf) = inf (cap) elsewhere;
#   - NaN in R_i, C_j or r reaches U, as in torch: the select is ``cap if x > cap else x``
#     and r's clamp ``eps1 if mean < eps1 else mean``, both false for NaN (the kernel
#     before this form clamped a NaN V to eps1^2 and a NaN mean to eps1);
#   - eps1 = 0 gives cap = inf, the min a no-op, as torch's clamp at 0 is.
# Where they part: torch rounds R_i * C_j to fp32, which overflows past 3.4e38 (V = inf,
# U = 0) and loses bits below 1.2e-38 (subnormal, or 0 and clamped); the latter matters
# only where V = R_i C_j / r still exceeds eps1^2, so with eps1 below about 2e-13 (r >=
# eps1). The factored form follows exact arithmetic there, its a_i and b_j in range while
# R_i / r and C_j are.
# And the rounding: a_i and b_j are each within half an ulp of exact, the product and the
# multiply by G add half an ulp each, so U is within about 2 ulp of the exact value, as
# torch's (four fp32 roundings) is; the two differ by at most a few ulp of U per element
# (elements within an ulp of the clamp may fall on either side of it, both then within an
# ulp of cap * G). The update scales U by alpha / denom (the weights' RMS times rho, about
# lr for unit weights), so a few ulp of U are far below an ulp of a weight; the clipping
# norm's sum moves by as little. The device-resident step (``device_parameter_step`` in
# optim/rule/adafactor.py) computes U in this same form with the same operations, so the
# host and device buckets of one model round U alike. The unfactored U keeps torch's form:
# its V is per element, there is nothing to share.


def factored(shape: tuple[int, ...]) -> bool:
    """Whether a parameter of ``shape`` keeps a factored second moment (two or more dims)."""
    return len(shape) >= 2


def _element_blocks(numel: int) -> int:
    """Fixed blocks of MIN_ELEMENTS_PER_THREAD elements for the other sums."""
    return max(1, -(-numel // MIN_ELEMENTS_PER_THREAD))


@njit(fastmath=FASTMATH_ELEMENTWISE, cache=True, nogil=True, error_model="numpy")
def _rsqrt_factors(row_var, col_var, m, eps1, row_f, col_f, rmeans):
    """The factors of U (Note [the update from the factors]): ``row_f[r]`` = 1 / sqrt(
    row_var[r] / r_b), r_b = max(mean of batch b's row_var, eps1) rounded to fp32 as torch
    rounds its mean (a NaN mean stays NaN, as under torch's clamp), into ``rmeans[b]``, and
    ``col_f[c]`` = 1 / sqrt(col_var[c]); each in float64, rounded once to fp32."""
    for c in range(col_var.shape[0]):
        col_f[c] = np.float32(1.0 / np.sqrt(np.float64(col_var[c])))
    for b in range(row_var.shape[0] // m):
        acc = 0.0
        for i in range(m):
            acc += np.float64(row_var[b * m + i])
        mean = np.float32(acc / m)
        rmean = np.float64(eps1 if mean < eps1 else mean)
        rmeans[b] = rmean
        for i in range(m):
            row_f[b * m + i] = np.float32(1.0 / np.sqrt(np.float64(row_var[b * m + i]) / rmean))


@njit(fastmath=FASTMATH_ELEMENTWISE, cache=True, nogil=True, error_model="numpy")
def _factored_u(g, a, b, cap):
    """U = min(a * b, cap) * g, NaN passed through (Note [the update from the factors])."""
    x = a * b
    x = cap if x > cap else x
    return x * g


@njit(fastmath=FASTMATH_ELEMENTWISE, cache=True, nogil=True, error_model="numpy")
def _u_row(g_t, grad_kind, grad_mul, cf_t, a, cap, scratch):
    """U over one row's chunk into ``scratch`` (returned, the chunk's length)."""
    for j in range(g_t.shape[0]):
        scratch[j] = _factored_u(load_f32(g_t, j, grad_kind) * grad_mul, a, cf_t[j], cap)
    return scratch[: g_t.shape[0]]


@njit(fastmath=FASTMATH_ELEMENTWISE, cache=True, nogil=True, error_model="numpy")
def _apply_row(p_t, g_t, grad_kind, grad_mul, cf_t, a, cap, decay, coef, out_t):
    """Pass 3 over one row: ``p = p * decay + coef * U``, and ``out``."""
    for j in range(p_t.shape[0]):
        u = _factored_u(load_f32(g_t, j, grad_kind) * grad_mul, a, cf_t[j], cap)
        p = p_t[j] * decay
        p = p + coef * u
        p_t[j] = p
        store_f32(out_t, j, p)


@njit(fastmath=FASTMATH_ELEMENTWISE, **KERNEL_OPTIONS)
def _factored_usq(grad, grad_kind, grad_mul, m, n, row_f, col_f, cap, nblocks, usq):
    """Pass 2: ``usq[blk]`` = the block's sum of U^2 (float64), U written chunk by chunk
    into a scratch buffer and summed by the one reduction loop. ``row_f``/``col_f``: the
    per-row and per-column factors (Note [the update from the factors])."""
    rows = row_f.shape[0]
    for blk in prange(nblocks):
        r0 = rows * blk // nblocks
        r1 = rows * (blk + 1) // nblocks
        scratch = np.empty(min(n, SUM_CHUNK), dtype=np.float32)  # (SUM_CHUNK,) fp32: U
        acc = 0.0
        for r in range(r0, r1):
            base = r * n
            cb = (r // m) * n
            a = row_f[r]
            for lo in range(0, n, SUM_CHUNK):
                hi = min(lo + SUM_CHUNK, n)
                u = _u_row(grad[base + lo : base + hi], grad_kind, grad_mul,
                           col_f[cb + lo : cb + hi], a, cap, scratch)  # fmt: skip
                acc += _sumsq_f32(u)
        usq[blk] = acc


@njit(fastmath=FASTMATH_ELEMENTWISE, **KERNEL_OPTIONS)
def _factored_apply(param, grad, grad_kind, grad_mul, m, n, row_f, col_f, cap, decay, coef,
                    out, nchunks):  # fmt: skip
    """Pass 3: ``p = p * decay + coef * U``, and ``out``; U as in pass 2."""
    rows = row_f.shape[0]
    for c in prange(nchunks):
        r0 = rows * c // nchunks
        r1 = rows * (c + 1) // nchunks
        for r in range(r0, r1):
            base = r * n
            cb = (r // m) * n
            o = out[base : base + n] if out.shape[0] else out
            _apply_row(param[base : base + n], grad[base : base + n], grad_kind, grad_mul,
                       col_f[cb : cb + n], row_f[r], cap, decay, coef, o)  # fmt: skip


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


def adafactor_update_cap(eps1: float) -> float:
    """The largest factored U / G: ``rsqrt(eps1^2)`` as torch's clamp and rsqrt round it,
    fp32(1 / fp32(sqrt(fp32(eps1 * eps1)))) (inf for eps1 = 0; Note [the update from the
    factors])."""
    eps1sq = np.float32(eps1 * eps1)
    with np.errstate(divide="ignore"):
        return float(np.float32(1.0) / np.sqrt(eps1sq))


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
    grad_scale = check_float("grad_scale", grad_scale, nan_ok=True)
    if numel == 0:
        return

    f32 = np.float32
    t = float(step)
    weight = f32(t**beta2_decay)
    rho = min(lr, 1 / (t**0.5))
    grad_mul = f32(-grad_scale if maximize else grad_scale)
    eps1sq = f32(eps1 * eps1)
    cap = f32(adafactor_update_cap(eps1))
    decay = f32(1 - lr * weight_decay)

    def run(threads: int) -> None:
        if factored(shape):
            rows = batches * m
            nblocks = _row_blocks(rows, n, batches * n)
            rowsq = np.empty(rows, dtype=np.float64)  # (rows,) float64
            colpart, colw = column_partials(nblocks, batches * n)  # reused: see the Note
            psq = np.empty(nblocks, dtype=np.float64)
            direct = grad_kind == FP32 and grad_mul == 1
            _factored_stats(param_a, grad_a, grad_kind, grad_mul, m, n, nblocks, rowsq,
                            colpart, psq, direct, row_a, weight, colw)  # fmt: skip
            row_f = np.empty(rows, dtype=np.float32)  # (rows,) 1 / sqrt(R_i / r_b)
            col_f = np.empty(batches * n, dtype=np.float32)  # (batches * n,) 1 / sqrt(C_j)
            rmeans = np.empty(batches, dtype=np.float64)  # (batches,) r_b
            _update_factors(rowsq, colpart, row_a, col_a, m, n, weight)
            _rsqrt_factors(row_a, col_a, m, f32(eps1), row_f, col_f, rmeans)
            usq = np.array([_usq_from_factors(colw, row_f, col_f, rmeans, cap)])
            if usq[0] < 0.0:  # an element may be clamped, or something is not finite: pass 2
                usq = np.empty(nblocks, dtype=np.float64)
                _factored_usq(grad_a, grad_kind, grad_mul, m, n, row_f, col_f, cap, nblocks,
                              usq)  # fmt: skip
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
            _factored_apply(param_a, grad_a, grad_kind, grad_mul, m, n, row_f, col_f, cap,
                            decay, coef, out_a, min(nchunks, batches * m))  # fmt: skip
        else:
            _vector_apply(param_a, grad_a, grad_kind, grad_mul, var_a, eps1sq, decay, coef,
                          out_a, nchunks)  # fmt: skip

    run_with_threads(num_threads, run)
