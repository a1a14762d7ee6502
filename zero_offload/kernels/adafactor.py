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
from .convert import FASTMATH_ELEMENTWISE, KERNEL_OPTIONS, load_f32, out_view, store_f32
from .stats import SUM_CHUNK, _as_f32, _sumsq_f32

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
#      norm from the factors]): then pass 2 is not made;
#   2. the sum of squares of U (unfactored: V is updated here, the pass writes it, and it
#      is the first pass: p's sum is taken beside it);
#   3. the update, U recomputed as in pass 2 (the same operations, the same bits), written
#      to p and ``out``.
# Every sum is a float64 sum over fixed blocks of rows or elements, added in block order: a
# function of the shape alone, not of the threads (Note [sums do not depend on the threads]
# in _validate.py), each through stats.py's one reduction loop over fp32 chunks (Note [one
# loop shape for every sum]; U is written into a scratch chunk first), but the column sums
# of pass 1, fp32 over runs of a few rows before float64 (Note [pass 1 four rows at a
# time]: elementwise additions in row order, no reduction loop); and each elementwise
# operation is one fp32 operation rounded as written
# (Note [every specialisation rounds alike] in convert.py; torch's vectorised lerp and
# add(alpha=) fuse a multiply-add, so a weight may differ from torch's in its last bit).
# A norm is rounded to fp32 before it is used, as torch's ``norm().item()`` is. The factors
# R, C and V are torch's to the rounding of their sums; a factored U is computed in another
# form than torch's (Note [the update from the factors]).

# Note [pass 1 four rows at a time]
# Pass 1 sums each column's squares over a block of rows. Row by row into float64
# partials (8 bytes a column: 32 KiB for 4096 columns, past L1), every partial was loaded
# and stored once per row: at 4096 x 4096 on two cores pass 1 took 7.1 ms, its streams
# 2.3 ms. So four rows of one batch are taken at once: a column's sum is loaded, the four
# squares added in row order, and stored once. And the sum is fp32 over a run of
# COLUMN_ROWS rows of one batch (runs counted from the block's first row, so a function of
# the shape), each run's sum then added to the column's float64 partial in run order: fp32
# vectors hold twice the lanes of float64 and need no convert per element. The same
# additions in the same order whatever the threads or the gradient's dtype: the same bits.
# The error: a run's sum of k <= COLUMN_ROWS squares of fp32 values (each square rounded,
# then k - 1 additions of non-negative terms) is within about k * 2^-24 of exact relative
# to itself, under 1e-6 for 16 rows (about sqrt(k) * 2^-24 for random roundings), and the
# float64 sum of the runs adds nothing that shows in fp32; so C_j is within about 16 ulp
# of the exact mean, typically a few (torch sums ``norm(G, dim=-2)`` in fp32 too, and
# rounds the norm to fp32 before squaring it, which alone costs an ulp of C_j). U moves by
# half that (through the rsqrt), far below an ulp of a weight (Note [the update from the
# factors]); against torch over 20 steps the weights stay within torch's own for-loop vs
# foreach spread (two cases moved from 3.6e-7 to 2.4e-7, by chance of the last bits).
# The order within a run: each row's own sum first, through the one reduction loop over
# its chunks (of its scaled values, copied into a scratch chunk, or where it lies for an
# fp32 gradient with grad_mul 1, which is its own scaled values), reading the run's rows
# from memory as one stream; then their column sums, four rows at a time, reading the rows
# again from L2 (256 KiB for 16 rows of 4096 columns); then p's sums. The order before, four
# rows' column sums first and each row's sum over the chunk just loaded, was about 15%
# slower at 4096 x 4096 (4.4 ms against 3.8 on two cores, with the row sums of four rows
# first; a whole run's first gained 4% more): the streams from memory then carried the
# column loop's stores between them.

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

# Note [the update's norm from the factors]
# The update clipping needs ||U||^2 before pass 3 writes anything. Summing the applied U
# takes a pass over G of its own (pass 2), which ran at 0.42-0.45x of G's stream (its column
# factors fall out of L1 on every row of a wide matrix) and made the step 0.64x of the
# roofline of three passes. Where no element is clamped, U_ij = a_i b_j G_ij, and with
# a_i^2 = r_b / R_i (exact arithmetic: a_i = 1 / sqrt(R_i / r_b)) and b_j^2 = 1 / C_j,
#   ||U||^2 = sum_b r_b sum_j b_j^2 sum_{i in b} (G_ij s_i)^2,   s_i = 1 / sqrt(R_i)
# where R_i is the row's new factor. A row's R_i needs only its own sum (and its old
# factor), which pass 1 takes before the row's column sums (Note [pass 1 four rows at a
# time]); so pass 1 also sums (G_ij s_i)^2 by column, the same way as G_ij^2 (fp32 runs of
# COLUMN_ROWS rows, float64 across runs and blocks: a function of the shape). Scaling G by
# s_i before squaring keeps the terms near 1 (R_i is G's mean square on the row): no
# underflow where G is tiny. After the factors are updated, ``_usq_from_factors`` adds
# r_b b_j^2 times those column sums in float64, in column then batch order.
# It holds only where nothing is clamped, so it is used only where every a_i and b_j is
# finite and positive and the largest product of the two, rounded to fp32, is at most cap:
# fp32 rounding is monotone, so then no element's fp32(a_i * b_j) exceeds cap, and min()
# leaves each as it is. Otherwise (a zero row or column: an inf factor; inf or NaN in G or
# the state; a large eps1; a sum that is not finite) pass 2 sums the applied U, as before.
# The rounding: each term is within a few ulp of the applied U_ij^2 (a_i^2 is r_b s_i^2 to
# about 2 ulp, U_ij itself is within 2 ulp of exact), and the sums are float64 but for the
# fp32 runs (about 16 ulp relative at most, as C_j's): ||U|| is within about 1e-6 relative
# of pass 2's sum (tested, over 12 decades of gradients and state), then rounded to fp32,
# and it moves the step only where clipping binds, by that fraction: about lr |U_ij| 1e-6
# at most, below half an ulp of a weight of about 1 at torch's lr of 1e-2. So a weight may
# differ in its last bit from what
# pass 2's norm gives, where the two fp32 norms differ; the weights stay within torch's own
# for-loop vs foreach spread (whose norms differ the same way). The device-resident step
# (optim/rule/adafactor.py) sums the applied U with torch; its norm already differed from
# the host's float64 sums in its last bits; U, which is per element, is still computed
# alike on both sides.

#: At most this many blocks of rows per factored parameter; each keeps its own float64
#: column sums, so their memory is bounded by MAX_BLOCKS * columns * 8 bytes (and by
#: COLUMN_PARTIALS elements in all).
MAX_BLOCKS = 64
COLUMN_PARTIALS = 1 << 22
#: Rows of one batch whose squares pass 1 adds per column in fp32 before adding that sum
#: to the column's float64 partial (Note [pass 1 four rows at a time]).
COLUMN_ROWS = 16


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
def _scaled(g_t, grad_kind, grad_mul, s_t):
    """``s_t[j] = g_t[j] * grad_mul`` in fp32 (returned, the chunk's length)."""
    for j in range(g_t.shape[0]):
        s_t[j] = load_f32(g_t, j, grad_kind) * grad_mul
    return s_t[: g_t.shape[0]]


@njit(fastmath=FASTMATH_ELEMENTWISE, cache=True, nogil=True, error_model="numpy")
def _squares_1row(g_t, grad_kind, grad_mul, s, cf_t, cw_t):
    """``cf_t[j] += x^2`` and ``cw_t[j] += (x * s)^2``, x = ``g_t[j] * grad_mul``, in fp32
    (``s``: the row's 1 / sqrt(R_i), Note [the update's norm from the factors])."""
    for j in range(cf_t.shape[0]):
        x = load_f32(g_t, j, grad_kind) * grad_mul
        cf_t[j] += x * x
        y = x * s
        cw_t[j] += y * y


@njit(fastmath=FASTMATH_ELEMENTWISE, cache=True, nogil=True, error_model="numpy")
def _squares_4rows(g0, g1, g2, g3, grad_kind, grad_mul, s0, s1, s2, s3, cf_t, cw_t):
    """``_squares_1row`` of four consecutive rows at once (``s0``..``s3``: their 1 /
    sqrt(R_i)), added to each column's fp32 sums in row order: one load and store of each
    sum per four rows (Note [pass 1 four rows at a time])."""
    for j in range(cf_t.shape[0]):
        x0 = load_f32(g0, j, grad_kind) * grad_mul
        x1 = load_f32(g1, j, grad_kind) * grad_mul
        x2 = load_f32(g2, j, grad_kind) * grad_mul
        x3 = load_f32(g3, j, grad_kind) * grad_mul
        acc = cf_t[j]
        acc += x0 * x0
        acc += x1 * x1
        acc += x2 * x2
        acc += x3 * x3
        cf_t[j] = acc
        y0 = x0 * s0
        y1 = x1 * s1
        y2 = x2 * s2
        y3 = x3 * s3
        wacc = cw_t[j]
        wacc += y0 * y0
        wacc += y1 * y1
        wacc += y2 * y2
        wacc += y3 * y3
        cw_t[j] = wacc


@njit(fastmath=FASTMATH_ELEMENTWISE, cache=True, nogil=True, error_model="numpy")
def _add_columns(cf_t, cp_t, cw_t, cwp_t):
    """``cp_t[j] += cf_t[j]`` and ``cwp_t[j] += cw_t[j]`` (a run's fp32 sums into the
    float64 partials); ``cf_t[j] = cw_t[j] = 0``."""
    for j in range(cp_t.shape[0]):
        cp_t[j] += np.float64(cf_t[j])
        cf_t[j] = np.float32(0.0)
        cwp_t[j] += np.float64(cw_t[j])
        cw_t[j] = np.float32(0.0)


@njit(fastmath=FASTMATH_ELEMENTWISE, cache=True, nogil=True, error_model="numpy")
def _row_scale(rowsq_i, row_var_i, n, weight):
    """1 / sqrt(R_i) for the row's new R_i (``_update_factors``'s value, the same
    operations), in float64 rounded once to fp32."""
    norm = np.float32(np.sqrt(rowsq_i))
    new = _lerp(row_var_i, norm * norm / np.float32(n), weight)
    return np.float32(1.0 / np.sqrt(np.float64(new)))


@njit(fastmath=FASTMATH_ELEMENTWISE, **KERNEL_OPTIONS)
def _factored_stats(param, grad, grad_kind, grad_mul, m, n, nblocks, rowsq, colpart, psq, direct,
                    row_var, weight, colw):  # fmt: skip
    """Pass 1: ``rowsq[r]`` = sum_j g[r, j]^2; ``colpart[blk, b*n + j]`` = that block's rows'
    g^2 in column j of batch b, summed in fp32 over runs of COLUMN_ROWS rows and the runs in
    float64; ``colw`` the same of (g[r, j] * s_r)^2, s_r = 1 / sqrt(R_r) of the row's new
    factor (Note [the update's norm from the factors]; ``row_var`` is read, not written);
    ``psq[blk]`` = that block's sum of p^2 (float64). A run's rows' own sums first, then
    their columns four rows at a time, then p's (Note [pass 1 four rows at a time]). A row's
    sum goes through the one reduction loop (Note [one loop shape for every sum] in
    stats.py) in chunks of SUM_CHUNK from the row's start: over its scaled values, copied
    into a scratch chunk, or over the chunk itself when ``direct`` (an fp32 gradient and
    ``grad_mul`` 1: the same values)."""
    rows = rowsq.shape[0]
    for blk in prange(nblocks):
        r0 = rows * blk // nblocks
        r1 = rows * (blk + 1) // nblocks
        cp = colpart[blk]
        cwp = colw[blk]
        cf = np.zeros(n, dtype=np.float32)  # (n,) fp32: the run's column sums
        cw = np.zeros(n, dtype=np.float32)  # (n,) fp32: the run's weighted column sums
        srow = np.empty(COLUMN_ROWS, dtype=np.float32)  # (COLUMN_ROWS,) the run's s_r
        scratch = np.empty(min(n, SUM_CHUNK), dtype=np.float32)  # (SUM_CHUNK,) scaled g
        pacc = 0.0
        r = r0
        while r < r1:
            run_end = min(r + COLUMN_ROWS, r1, (r // m + 1) * m)  # a run: rows of one batch
            cb = (r // m) * n
            for i in range(r, run_end):  # each row's own sum, reading the rows from memory
                acc = 0.0
                for lo in range(0, n, SUM_CHUNK):
                    hi = min(lo + SUM_CHUNK, n)
                    g_i = grad[i * n + lo : i * n + hi]
                    if direct:
                        acc += _sumsq_f32(_as_f32(g_i, grad_kind, scratch[: hi - lo]))
                    else:
                        acc += _sumsq_f32(_scaled(g_i, grad_kind, grad_mul, scratch))
                rowsq[i] = acc
                srow[i - r] = _row_scale(acc, row_var[i], n, weight)
            i = r
            while i < run_end:  # their column sums, four rows at a time, the rows from L2
                k = 4 if i + 4 <= run_end else 1
                base = i * n
                s = srow[i - r : i - r + k]
                for lo in range(0, n, SUM_CHUNK):
                    hi = min(lo + SUM_CHUNK, n)
                    g0 = grad[base + lo : base + hi]
                    if k == 4:
                        _squares_4rows(g0, grad[base + n + lo : base + n + hi],
                                       grad[base + 2 * n + lo : base + 2 * n + hi],
                                       grad[base + 3 * n + lo : base + 3 * n + hi], grad_kind,
                                       grad_mul, s[0], s[1], s[2], s[3], cf[lo:hi],
                                       cw[lo:hi])  # fmt: skip
                    else:
                        _squares_1row(g0, grad_kind, grad_mul, s[0], cf[lo:hi], cw[lo:hi])
                i += k
            _add_columns(cf, cp[cb : cb + n], cw, cwp[cb : cb + n])
            for row in range(r * n, run_end * n, n):  # p's sums
                for lo in range(0, n, SUM_CHUNK):
                    pacc += _sumsq_f32(param[row + lo : row + min(lo + SUM_CHUNK, n)])
            r = run_end
        psq[blk] = pacc


@njit(fastmath=FASTMATH_ELEMENTWISE, cache=True, nogil=True, error_model="numpy")
def _lerp(start, end, weight):
    """torch's lerp, one fp32 value (``weight`` fp32)."""
    if weight < np.float32(0.5):
        return start + weight * (end - start)
    return end - (end - start) * (np.float32(1.0) - weight)


@njit(fastmath=FASTMATH_ELEMENTWISE, cache=True, nogil=True, error_model="numpy")
def _update_factors(rowsq, colpart, row_var, col_var, m, n, weight):
    """Between passes 1 and 2: the row and column means of g^2 into ``row_var`` and
    ``col_var`` (lerp by ``weight``), fp32 as torch rounds them. A column's partials are
    added in block order."""
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
def _usq_from_factors(colw, row_f, col_f, rmeans, cap):
    """||U||^2 from pass 1's weighted column sums, sum_b r_b sum_j b_j^2 sum_i (g_ij s_i)^2
    (float64, the blocks' partials added in block order, then the columns in order), or -1
    where it does not hold: a factor that is not finite and positive, or a product of the
    largest ones above ``cap`` (an element may be clamped), or a sum that is not finite
    (Note [the update's norm from the factors])."""
    amax = np.float32(0.0)
    for r in range(row_f.shape[0]):
        a = row_f[r]
        if not (a > np.float32(0.0) and a < np.inf):
            return -1.0
        amax = a if a > amax else amax
    bmax = np.float32(0.0)
    for c in range(col_f.shape[0]):
        b = col_f[c]
        if not (b > np.float32(0.0) and b < np.inf):
            return -1.0
        bmax = b if b > bmax else bmax
    if amax * bmax > cap:
        return -1.0
    cols = col_f.shape[0]
    n = cols // rmeans.shape[0]
    total = 0.0
    for bt in range(rmeans.shape[0]):
        batch = 0.0
        for j in range(bt * n, (bt + 1) * n):
            w = 0.0
            for blk in range(colw.shape[0]):
                w += colw[blk, j]
            bj = np.float64(col_f[j])
            batch += w * (bj * bj)
        total += rmeans[bt] * batch
    if not (total < np.inf):  # false for NaN too
        return -1.0
    return total


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
    grad_scale = check_float("grad_scale", grad_scale)
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
            colpart = np.zeros((nblocks, batches * n), dtype=np.float64)  # column partials
            colw = np.zeros((nblocks, batches * n), dtype=np.float64)  # weighted, the same
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
