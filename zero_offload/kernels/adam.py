"""One fused pass of Adam / AdamW over fp32 master weights, in place.

The pass reads each element of param, grad, exp_avg, exp_avg_sq (and max_exp_avg_sq) once,
writes param and the moments once, and optionally writes the updated weight as bf16/fp16
into ``out``: the whole optimizer step, gradient unscaling and clipping included, costs one
trip through memory. See Note [operation order matches torch] for the arithmetic.
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
    KIND_NAMES,
    as_kernel_array,
    check_float,
    check_range,
    check_same_length,
    check_take_written,
    chunking,
    run_with_threads,
)
from .convert import (
    FASTMATH_ELEMENTWISE,
    KERNEL_OPTIONS,
    load_f32,
    out_view,
    store_f32,
    taken_from_out,
    taken_tag,
)

# Note [operation order matches torch]
# torch.optim.Adam(W)'s non-capturable single-tensor path (torch/optim/adam.py,
# `_single_tensor_adam`) computes, in fp32 with each Python scalar rounded to fp32:
#   grad = -grad if maximize
#   param *= 1 - lr * wd                         (AdamW, wd != 0)
#   grad = grad + wd * param                     (Adam L2, wd != 0)
#   exp_avg.lerp_(grad, 1 - beta1)               m + w * (g - m)  if w < 0.5,
#                                                g - (g - m) * (1 - w) otherwise
#   exp_avg_sq = exp_avg_sq * beta2 + (1 - beta2) * grad * grad
#   max_exp_avg_sq = maximum(max_exp_avg_sq, exp_avg_sq)         (amsgrad; NaN wins)
#   denom = sqrt(v) / sqrt(1 - beta2**step) + eps                 (v: max buffer if amsgrad)
#   param += (-lr / (1 - beta1**step)) * exp_avg / denom
# The kernel does the same operations in the same order, each rounded as written (no fused
# multiply-add: Note [every specialisation rounds alike] in convert.py), so fp32 results
# agree with torch up to the fused multiply-adds of torch's own vectorised lerp/addcmul,
# and are bitwise the same whichever dtype the gradient buffer has.
# grad_scale multiplies the raw gradient before anything else; maximize is folded into its
# sign, which is exact because IEEE rounding is symmetric: -(g * s) == g * (-s).


def _amsgrad_max(vmax_t, i, v):
    """AMSGrad: ``vmax_t[i] = max(vmax_t[i], v)``, returned; ``v`` if vmax_t is absent."""


@overload(_amsgrad_max)
def _amsgrad_max_impl(vmax_t, i, v):
    if vmax_t.dtype == types.uint8:
        return lambda vmax_t, i, v: v

    def running_max(vmax_t, i, v):
        # torch.maximum: a NaN in either operand wins (a NaN vmax survives v > vmax)
        vmax = load_f32(vmax_t, i, BF16)
        vmax = v if v > vmax or v != v else vmax
        store_f32(vmax_t, i, vmax)
        return vmax

    return running_max


@njit(fastmath=FASTMATH_ELEMENTWISE, cache=True, error_model="numpy")
def _adam_tile(
    p_t,  # (k,) fp32, updated in place
    g_t,  # (k,) fp32, or uint16 bits of kind grad_kind
    grad_kind,
    m_t,  # (k,) fp32 or uint16 bf16 bits, updated in place
    v_t,  # (k,) same dtype as m_t, updated in place
    vmax_t,  # (k,) same dtype as m_t, or (0,) uint8 when not amsgrad
    out_t,  # (k,) uint16 bf16 / int16 fp16 bits, or (0,) uint8 when absent
    take,  # convert.TAKE_WRITTEN: the master first takes a weight written in out_t, else
    # KEEP_MASTER (Note [the update takes the written weights] in convert.py)
    grad_mul,  # fp32: grad_scale, negated when maximize
    decay,  # fp32: 1 - lr * wd for AdamW, 1 otherwise
    l2,  # fp32: wd for Adam with L2 penalty, 0 otherwise
    use_l2,
    w1,  # fp32: 1 - beta1, the lerp weight
    one_minus_w1,  # fp32: 1 - w1, used when w1 >= 0.5
    beta2,  # fp32
    w2,  # fp32: 1 - beta2
    bc2_sqrt,  # fp32: sqrt(1 - beta2**step)
    eps,  # fp32
    neg_step_size,  # fp32: -lr / (1 - beta1**step)
):
    small_w1 = w1 < np.float32(0.5)
    for i in range(p_t.shape[0]):
        g = load_f32(g_t, i, grad_kind) * grad_mul
        p = taken_from_out(take, out_t, i, p_t[i]) * decay
        if use_l2:
            g = g + l2 * p
        m = load_f32(m_t, i, BF16)
        m = m + w1 * (g - m) if small_w1 else g - (g - m) * one_minus_w1
        v = load_f32(v_t, i, BF16) * beta2 + w2 * g * g
        store_f32(m_t, i, m)
        store_f32(v_t, i, v)
        v = _amsgrad_max(vmax_t, i, v)
        p = p + neg_step_size * m / (np.sqrt(v) / bc2_sqrt + eps)
        p_t[i] = p
        store_f32(out_t, i, p)


# Note [one contiguous slice per thread]
# Each prange iteration is one thread's contiguous chunk, handed to the serial tile loop as
# slices: indexing the whole arrays with lo + i would make numba wrap negative indices,
# and that check alone makes LLVM fetch every lane with a gather (one address per element)
# instead of loading whole vectors: the statistics and accumulation passes ran 4-7x slower
# that way. tests/test_kernels_vectorised.py checks each tile loop's compiled IR.


@njit(fastmath=FASTMATH_ELEMENTWISE, **KERNEL_OPTIONS)
def _adam_kernel(
    param, grad, grad_kind, exp_avg, exp_avg_sq, max_exp_avg_sq, out, take, start, stop,
    nchunks, *scalars,
):  # fmt: skip
    span = stop - start
    for c in prange(nchunks):
        lo = start + span * c // nchunks
        hi = start + span * (c + 1) // nchunks
        _adam_tile(
            param[lo:hi], grad[lo:hi], grad_kind, exp_avg[lo:hi], exp_avg_sq[lo:hi],
            max_exp_avg_sq[lo:hi], out[lo:hi], take, *scalars,
        )  # fmt: skip


def adam_step(
    param,
    grad,
    exp_avg,
    exp_avg_sq,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    decoupled_weight_decay: bool = True,
    maximize: bool = False,
    grad_scale: float = 1.0,
    max_exp_avg_sq=None,
    out=None,
    take_written: bool = False,
    start: int = 0,
    stop: int | None = None,
    num_threads: int | None = None,
) -> None:
    """Apply one Adam (``decoupled_weight_decay=False``) or AdamW step in place, in one pass.

    Matches ``torch.optim.Adam`` / ``torch.optim.AdamW`` (non-capturable, ``step`` counted
    from 1) applied to the gradient ``grad.float() * grad_scale``: ``grad_scale`` multiplies
    the raw gradient first, then ``maximize`` negates it, then Adam's L2 term
    ``weight_decay * param`` is added (AdamW instead scales param by ``1 - lr *
    weight_decay``). Fold loss-scale unscaling and the clipping coefficient into
    ``grad_scale``.

    Arrays are 1-D, contiguous, of equal length, on the CPU: torch tensors, or numpy arrays
    (float32; float16; uint16 holding bf16 bit patterns).

    - ``param``: fp32 master weights, updated in place.
    - ``grad``: fp32, bf16 or fp16; read only.
    - ``exp_avg``, ``exp_avg_sq``: both fp32 or both bf16 (bf16 moments: math in fp32,
      stored rounded to nearest even); updated in place.
    - ``max_exp_avg_sq``: the AMSGrad buffer, same dtype as the moments; AMSGrad runs iff
      it is given.
    - ``out``: optional bf16/fp16 array that receives the updated weights, rounded to
      nearest even exactly as ``param.to(out.dtype)``.
    - ``take_written``: before its step, an element whose ``out`` is not the rounding of its
      ``param`` takes ``out``'s value into ``param`` (a weight written since the last step;
      Note [the update takes the written weights] in ``convert.py``). Needs ``out``.
    - ``start``, ``stop``: update only the tile ``[start, stop)``; tiles compose bitwise.
    - ``num_threads``: defaults to the thread budget's share for the calling thread (Note
      [one thread budget] in ``thread_budget.py``), capped by numba's pool.

    Raises ``TypeError``/``ValueError`` naming the bad argument before writing anything.
    """
    param_a, _ = as_kernel_array(param, "param", (FP32,), writable=True)
    grad_a, grad_kind = as_kernel_array(grad, "grad", (FP32, BF16, FP16))
    m_a, m_kind = as_kernel_array(exp_avg, "exp_avg", (FP32, BF16), writable=True)
    v_a, v_kind = as_kernel_array(exp_avg_sq, "exp_avg_sq", (FP32, BF16), writable=True)
    if v_kind != m_kind:
        raise TypeError(
            f"exp_avg is {KIND_NAMES[m_kind]} but exp_avg_sq is {KIND_NAMES[v_kind]}; "
            "store both moments in the same dtype"
        )
    n = param_a.shape[0]
    arrays = {"grad": grad_a, "exp_avg": m_a, "exp_avg_sq": v_a}
    amsgrad = max_exp_avg_sq is not None
    if amsgrad:
        max_a, max_kind = as_kernel_array(
            max_exp_avg_sq, "max_exp_avg_sq", (FP32, BF16), writable=True
        )
        if max_kind != m_kind:
            raise TypeError(
                f"max_exp_avg_sq is {KIND_NAMES[max_kind]} but the moments are {KIND_NAMES[m_kind]}; "
                "use the moments' dtype"
            )
        arrays["max_exp_avg_sq"] = max_a
    else:
        max_a = np.empty(0, dtype=np.uint8)  # absent, see Note [what is compile-time...]
    if out is None:
        out_a = out_view(None, FP32)
    else:
        out_a, out_kind = as_kernel_array(out, "out", (BF16, FP16), writable=True)
        arrays["out"] = out_a
        out_a = out_view(out_a, out_kind)
    check_same_length(n, arrays, "param")
    start, stop = check_range(start, stop, n)
    take = taken_tag(check_take_written(take_written, out))

    if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 1:
        raise ValueError(f"step={step!r} is invalid; pass the 1-based step count (an int >= 1)")
    lr = check_float("lr", lr, lo=0.0)
    beta1 = check_float("beta1", beta1, lo=0.0, hi=1.0, hi_open=True)
    beta2 = check_float("beta2", beta2, lo=0.0, hi=1.0, hi_open=True)
    eps = check_float("eps", eps, lo=0.0)
    weight_decay = check_float("weight_decay", weight_decay, lo=0.0)
    grad_scale = check_float("grad_scale", grad_scale, nan_ok=True)

    # Scalars are formed in float64 exactly as torch forms them, then rounded to fp32 once.
    f32 = np.float32
    decoupled = bool(decoupled_weight_decay) and weight_decay != 0.0
    use_l2 = not decoupled_weight_decay and weight_decay != 0.0
    w1 = f32(1.0 - beta1)
    scalars = (
        f32(-grad_scale if maximize else grad_scale),
        f32(1.0 - lr * weight_decay) if decoupled else f32(1.0),
        f32(weight_decay) if use_l2 else f32(0.0),
        use_l2,
        w1,
        f32(1.0) - w1,
        f32(beta2),
        f32(1.0 - beta2),
        f32(math.sqrt(1.0 - beta2**step)),
        f32(eps),
        f32(-(lr / (1.0 - beta1**step))),
    )

    def launch(threads: int) -> None:
        _adam_kernel(
            param_a, grad_a, grad_kind, m_a, v_a, max_a, out_a, take, start, stop,
            chunking(stop - start, threads), *scalars,
        )  # fmt: skip

    run_with_threads(num_threads, launch)
