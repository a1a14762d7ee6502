"""One fused pass of Lion over fp32 master weights, in place.

Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"; the update of
lucidrains' lion-pytorch) keeps one moment. The pass reads each element of param, grad and
exp_avg once, writes param and exp_avg once, and optionally writes the updated weight as
bf16/fp16 into ``out``: 8 bytes of state per element against Adam's 12. See Note [Lion's
operation order] for the arithmetic.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ._validate import BF16, check_float
from .convert import FASTMATH_ELEMENTWISE, KERNEL_OPTIONS, load_f32, store_f32, taken_from_out
from .step_arrays import step_arrays

# Note [Lion's operation order]
# In fp32, each Python scalar rounded to fp32 once, each operation rounded as written (no
# fused multiply-add: Note [every specialisation rounds alike] in convert.py):
#   g = grad * grad_scale                       (negated when maximize)
#   c = beta1 * m + (1 - beta1) * g
#   param = param * (1 - lr * wd) - lr * sign(c)   (sign as torch.sign: 0 at 0 and NaN)
#   m = beta2 * m + (1 - beta2) * g
# The same order in torch ops (separate multiplies and adds) gives the same bits; the
# device step of rule/lion.py and the reference of tests/test_lion_adagrad.py are written so.
# maximize is folded into the gradient's multiplier: -(g * s) == g * (-s) exactly.


@njit(fastmath=FASTMATH_ELEMENTWISE, cache=True, error_model="numpy")
def _lion_tile(
    p_t,  # (k,) fp32, updated in place
    g_t,  # (k,) fp32, or uint16 bits of kind grad_kind
    grad_kind,
    m_t,  # (k,) fp32 or uint16 bf16 bits, updated in place
    out_t,  # (k,) uint16 bf16 / int16 fp16 bits, or (0,) uint8 when absent
    take,  # convert.TAKE_WRITTEN: the master first takes a weight written in out_t, else
    # KEEP_MASTER (Note [the update takes the written weights] in convert.py)
    grad_mul,  # fp32: grad_scale, negated when maximize
    decay,  # fp32: 1 - lr * wd
    neg_lr,  # fp32: -lr
    beta1,  # fp32
    w1,  # fp32: 1 - beta1
    beta2,  # fp32
    w2,  # fp32: 1 - beta2
):
    one = np.float32(1.0)
    zero = np.float32(0.0)
    for i in range(p_t.shape[0]):
        g = load_f32(g_t, i, grad_kind) * grad_mul
        m = load_f32(m_t, i, BF16)
        c = beta1 * m + w1 * g
        s = one if c > zero else (-one if c < zero else zero)
        p = taken_from_out(take, out_t, i, p_t[i]) * decay + neg_lr * s
        store_f32(m_t, i, beta2 * m + w2 * g)
        p_t[i] = p
        store_f32(out_t, i, p)


@njit(fastmath=FASTMATH_ELEMENTWISE, **KERNEL_OPTIONS)
def _lion_kernel(param, grad, grad_kind, exp_avg, out, take, start, stop, nchunks, *scalars):
    span = stop - start
    for c in prange(nchunks):  # Note [one contiguous slice per thread] in adam.py
        lo = start + span * c // nchunks
        hi = start + span * (c + 1) // nchunks
        _lion_tile(param[lo:hi], grad[lo:hi], grad_kind, exp_avg[lo:hi], out[lo:hi], take,
                   *scalars)  # fmt: skip


def lion_step(
    param,
    grad,
    exp_avg,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    weight_decay: float,
    maximize: bool = False,
    grad_scale: float = 1.0,
    out=None,
    take_written: bool = False,
    start: int = 0,
    stop: int | None = None,
    num_threads: int | None = None,
) -> None:
    """Apply one Lion step in place, in one pass (Note [Lion's operation order]) to the
    gradient ``grad.float() * grad_scale`` (negated when ``maximize``). Fold loss-scale
    unscaling and the clipping coefficient into ``grad_scale``.

    ``param`` (fp32 master) and ``exp_avg`` (fp32 or bf16) are updated in place; ``grad``
    (fp32, bf16 or fp16) is read; ``out`` (bf16/fp16 or None) receives the weights (``take_written``: an element whose ``out`` is not its
    master's rounding first takes it, Note [the update takes the written weights] in
    ``convert.py``); only
    the tile ``[start, stop)`` is stepped (tiles compose bitwise); all as ``step_arrays``
    checks them. ``num_threads``: the thread budget's share when None.

    Raises ``TypeError``/``ValueError`` naming the bad argument before writing anything.
    """
    arrays = step_arrays(param, grad, {"exp_avg": exp_avg}, out, start, stop, take_written)
    lr = check_float("lr", lr, lo=0.0)
    beta1 = check_float("beta1", beta1, lo=0.0, hi=1.0, hi_open=True)
    beta2 = check_float("beta2", beta2, lo=0.0, hi=1.0, hi_open=True)
    weight_decay = check_float("weight_decay", weight_decay, lo=0.0)
    grad_scale = check_float("grad_scale", grad_scale, nan_ok=True)

    f32 = np.float32
    scalars = (
        f32(-grad_scale if maximize else grad_scale),
        f32(1.0 - lr * weight_decay),
        f32(-lr),
        f32(beta1),
        f32(1.0 - beta1),
        f32(beta2),
        f32(1.0 - beta2),
    )
    arrays.launch(_lion_kernel, scalars, num_threads)
