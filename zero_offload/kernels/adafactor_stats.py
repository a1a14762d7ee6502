"""Adafactor's statistics of a matrix (a parameter of two or more dimensions): pass 1 over
its gradient and weights, the factors updated from it, and the update's norm taken from
them where nothing can be clamped (Note [Adafactor's three passes] in adafactor.py, which
runs them; Note [pass 1 four rows at a time], Note [the update's norm from the factors]).

A seam of the kernel, not a kernel of its own: ``adafactor_step`` validates and calls these
between its passes, and the update (U from the factors, pass 3) stays in adafactor.py.
"""

from __future__ import annotations

import threading

import numpy as np
from numba import njit, prange

from ._validate import MIN_ELEMENTS_PER_THREAD
from .convert import FASTMATH_ELEMENTWISE, KERNEL_OPTIONS, load_f32
from .stats import SUM_CHUNK, _as_f32, _sumsq_f32

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


# Note [pass 1's partials are reused]
# Pass 1's float64 column partials, plain and weighted, are two (blocks, columns) arrays: 4
# MiB for a 4096 x 4096 matrix (64 blocks), up to 2 x 8 x COLUMN_PARTIALS bytes. Made fresh
# each step (``np.zeros``), their pages were first touched inside the kernel, by both
# threads at once, and the page faults cost more than the pass's streams: pass 1 took
# 15-17 ms in the step at 4096 x 4096 on two cores, against 9-10 ms given arrays already
# touched (the step 0.66x its roofline). So each thread that runs the kernel keeps one
# buffer for them, grown to the largest it has needed (``column_partials``), and pass 1
# zeroes each block's own rows at its start, in its own thread. Held: per such thread, 2 x 8
# x max(blocks x columns) bytes over the matrices it stepped, blocks x columns at most
# max(COLUMN_PARTIALS, columns) (``_row_blocks``): 4 MiB at 4096 columns, 64 MiB up to 2^22
# columns, 16 bytes a column past that. The optimizer steps on the caller's thread (or,
# with ``overlap_step``, on its manager's host worker, whose thread ends at close and its
# buffer with it); ``OffloadOptimizer.close`` frees the closing thread's
# (``kernels.release_scratch``), and any other caller of the kernel (a benchmark, a test)
# frees its thread's with ``release_column_partials``.
_partials = threading.local()


def column_partials(nblocks: int, columns: int) -> tuple[np.ndarray, np.ndarray]:
    """Two (nblocks, columns) float64 arrays for pass 1's column partials (plain, weighted),
    views of the calling thread's reused buffer; their values are left over from before
    (``_factored_stats`` zeroes them). Note [pass 1's partials are reused]."""
    size = nblocks * columns
    buffer = getattr(_partials, "buffer", None)
    if buffer is None or buffer.shape[0] < 2 * size:
        buffer = np.empty(2 * size, dtype=np.float64)  # (2 * nblocks * columns,) float64
        _partials.buffer = buffer
    return buffer[:size].reshape(nblocks, columns), buffer[size : 2 * size].reshape(
        nblocks, columns
    )


def release_column_partials() -> None:
    """Free the calling thread's pass 1 buffer (Note [pass 1's partials are reused])."""
    _partials.buffer = None


def _row_blocks(rows: int, n: int, columns: int) -> int:
    """Blocks of rows for pass 1 of a factored parameter: a function of its shape only."""
    by_size = -(-(rows * n) // MIN_ELEMENTS_PER_THREAD)
    by_memory = max(1, COLUMN_PARTIALS // max(columns, 1))
    return max(1, min(MAX_BLOCKS, rows, by_size, by_memory))


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
    ``psq[blk]`` = that block's sum of p^2 (float64). ``colpart`` and ``colw`` may hold
    anything: each block zeroes its own rows first (Note [pass 1's partials are reused]).
    A run's rows' own sums first, then
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
        cp[:] = 0.0  # this thread's own pages: Note [pass 1's partials are reused]
        cwp[:] = 0.0
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
    # Each column's partials added in block order, a block's row at a time (a column at a
    # time strode across the blocks' rows: 1.2 ms at 64 x 4096, for the same additions).
    w = np.zeros(cols, dtype=np.float64)  # (cols,) float64: the columns' weighted sums
    for blk in range(colw.shape[0]):
        part = colw[blk]
        for j in range(cols):
            w[j] += part[j]
    total = 0.0
    for bt in range(rmeans.shape[0]):
        batch = 0.0
        for j in range(bt * n, (bt + 1) * n):
            bj = np.float64(col_f[j])
            batch += w[j] * (bj * bj)
        total += rmeans[bt] * batch
    if not (total < np.inf):  # false for NaN too
        return -1.0
    return total
