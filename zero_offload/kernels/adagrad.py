"""One fused pass of Adagrad over fp32 master weights, in place.

``torch.optim.Adagrad``'s dense update: the pass reads each element of param, grad and the
running sum of squares once, writes param and the sum once, and optionally writes the
updated weight as bf16/fp16 into ``out``. See Note [Adagrad's operation order].
"""

from __future__ import annotations

import numbers

import numpy as np
from numba import njit, prange

from ._validate import BF16, check_float
from .convert import FASTMATH_ELEMENTWISE, KERNEL_OPTIONS, load_f32, store_f32, taken_from_out
from .step_arrays import step_arrays

# Note [Adagrad's operation order]
# torch.optim.Adagrad's single-tensor path (torch/optim/adagrad.py, `_single_tensor_adagrad`)
# computes, in fp32 with each Python scalar rounded to fp32:
#   grad = -grad if maximize
#   grad = grad + wd * param                    (wd != 0)
#   clr = lr / (1 + (step - 1) * lr_decay)      (in float64, then rounded)
#   sum = sum + grad * grad                     (addcmul_, value 1)
#   param = param + (-clr * grad) / (sqrt(sum) + eps)     (addcdiv_, value -clr)
# The kernel does the same in the same order, each operation rounded as written (Note [every
# specialisation rounds alike] in convert.py); grad_scale multiplies the raw gradient first,
# and maximize is folded into its sign (-(g * s) == g * (-s) exactly).


@njit(fastmath=FASTMATH_ELEMENTWISE, cache=True, error_model="numpy")
def _adagrad_tile(
    p_t,  # (k,) fp32, updated in place
    g_t,  # (k,) fp32, or uint16 bits of kind grad_kind
    grad_kind,
    s_t,  # (k,) fp32 or uint16 bf16 bits: the sum of squares, updated in place
    out_t,  # (k,) uint16 bf16 / int16 fp16 bits, or (0,) uint8 when absent
    take,  # convert.TAKE_WRITTEN: the master first takes a weight written in out_t, else
    # KEEP_MASTER (Note [the update takes the written weights] in convert.py)
    grad_mul,  # fp32: grad_scale, negated when maximize
    wd,  # fp32: weight decay (0: no L2 term)
    neg_clr,  # fp32: -lr / (1 + (step - 1) * lr_decay)
    eps,  # fp32
):
    for i in range(p_t.shape[0]):
        p = taken_from_out(take, out_t, i, p_t[i])
        g = load_f32(g_t, i, grad_kind) * grad_mul
        g = g + wd * p
        s = load_f32(s_t, i, BF16) + g * g
        store_f32(s_t, i, s)
        p = p + neg_clr * g / (np.sqrt(s) + eps)
        p_t[i] = p
        store_f32(out_t, i, p)


@njit(fastmath=FASTMATH_ELEMENTWISE, **KERNEL_OPTIONS)
def _adagrad_kernel(
    param, grad, grad_kind, state_sum, out, take, start, stop, nchunks, *scalars
):  # fmt: skip
    span = stop - start
    for c in prange(nchunks):  # Note [one contiguous slice per thread] in adam.py
        lo = start + span * c // nchunks
        hi = start + span * (c + 1) // nchunks
        _adagrad_tile(param[lo:hi], grad[lo:hi], grad_kind, state_sum[lo:hi], out[lo:hi], take,
                      *scalars)  # fmt: skip


def adagrad_step(
    param,
    grad,
    state_sum,
    *,
    step: int,
    lr: float,
    lr_decay: float,
    weight_decay: float,
    eps: float,
    maximize: bool = False,
    grad_scale: float = 1.0,
    out=None,
    take_written: bool = False,
    start: int = 0,
    stop: int | None = None,
    num_threads: int | None = None,
) -> None:
    """Apply one Adagrad step in place, in one pass, matching ``torch.optim.Adagrad``
    (``step`` counted from 1) applied to the gradient ``grad.float() * grad_scale`` (Note
    [Adagrad's operation order]). Fold loss-scale unscaling and the clipping coefficient
    into ``grad_scale``.

    ``param`` (fp32 master) and ``state_sum`` (the running sum of squared gradients, fp32
    or bf16) are updated in place; ``grad`` (fp32, bf16 or fp16) is read; ``out`` (bf16/fp16
    or None) receives the weights (``take_written``: an element whose ``out`` is not its
    master's rounding first takes it, Note [the update takes the written weights] in
    ``convert.py``); only the tile ``[start, stop)`` is stepped (tiles compose
    bitwise); all as ``step_arrays`` checks them. ``num_threads``: the thread budget's share
    when None.

    Raises ``TypeError``/``ValueError`` naming the bad argument before writing anything.
    """
    arrays = step_arrays(param, grad, {"state_sum": state_sum}, out, start, stop, take_written)
    if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 1:
        raise ValueError(f"step={step!r} is invalid; pass the 1-based step count (an int >= 1)")
    lr = check_float("lr", lr, lo=0.0)
    lr_decay = check_float("lr_decay", lr_decay, lo=0.0)
    weight_decay = check_float("weight_decay", weight_decay, lo=0.0)
    eps = check_float("eps", eps, lo=0.0)
    grad_scale = check_float("grad_scale", grad_scale, nan_ok=True)

    f32 = np.float32
    scalars = (
        f32(-grad_scale if maximize else grad_scale),
        f32(weight_decay),
        f32(-(lr / (1 + (step - 1) * lr_decay))),
        f32(eps),
    )
    arrays.launch(_adagrad_kernel, scalars, num_threads)
