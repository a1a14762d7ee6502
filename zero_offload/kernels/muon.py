"""Muon's step over one whole matrix: ``torch.optim.Muon``'s update, bitwise.

Newton–Schulz's matrix products are torch's (on the device where there is one: Note
[Newton-Schulz where the matmuls are fast]); around them, on the host, ``muon_step`` makes
two numba passes (Note [Muon's host passes]), and on a resident bucket's device tensors
``muon_step_torch`` runs torch's own operations in torch's order (Note [Muon as torch steps
it]). Pure, as every kernel here: every input explicit, checked before anything is
written.
"""

from __future__ import annotations

import math
import threading

import numpy as np
import torch
from numba import njit, prange, types
from numba.extending import intrinsic

from ._validate import BF16, FP16, FP32, as_kernel_array, check_float, chunking, run_with_threads
from .convert import (
    FASTMATH_ELEMENTWISE,
    KERNEL_OPTIONS,
    bf16_to_f32,
    f32_to_bf16,
    load_f32,
    out_view,
    store_f32,
)

__all__ = [
    "adjusted_lr",
    "muon_step",
    "muon_step_torch",
    "newton_schulz",
    "release_update_buffer",
    "update_buffer",
]

# Note [Muon as torch steps it]
# torch.optim.Muon (torch/optim/_muon.py, its only path: a for-loop, foreach refused) steps
# a 2-D parameter p with gradient g and momentum buffer B as
#     B.lerp_(g, 1 - momentum)
#     U = g.lerp(B, momentum) if nesterov else B
#     O = NS(U): in bfloat16 on every device, transposed when it has more rows than columns,
#         O /= max(||O||_F, eps), then ns_steps times: A = O O^T; A' = b A + c A A;
#         O = a O + A' O (two addmm)
#     p.mul_(1 - lr * weight_decay); p.add_(O, alpha=-lr * ratio(shape, adjust_lr_fn))
# with fp32 p, g and B here (the master, the gradient as fp32 times grad_scale, the fp32
# buffer). Each of these is the same torch operation on the same dtypes as torch's, so for
# the same gradient the step is bitwise torch's on the same machine; a scaled gradient
# (clipping, loss scaling) differs from torch's in-place scaled one only by where the
# product is rounded, which is the same one rounding of g * scale.


# Note [Newton-Schulz where the matmuls are fast]
# Newton-Schulz is ns_steps rounds of three matrix products per matrix: about 6 ns_steps
# m n min(m, n) flops, 2 TFLOP for one 4096 x 4096 matrix at 5 steps, seconds on a host's
# cores and milliseconds on a GPU. So on CUDA (``ns_device``) the update goes to the device
# in bf16 (2 bytes per element, the dtype torch's Newton-Schulz runs in anyway), is
# orthogonalized there, one matrix at a time, and comes back in bf16 (2 bytes): 4 PCIe bytes
# per matrix element per step beside the gradient's and the weights', and each matrix's
# round trip is synchronous on the thread that steps it (the momentum, the master and the
# rest of the step stay on the host). It is torch's own Newton-Schulz on the same device
# torch's Muon would use for a CUDA parameter. On the host accelerator it runs on the CPU.
# A matrix whose state is resident on the device steps there whole (``muon_step_torch``
# over device tensors), Newton-Schulz included, and nothing crosses PCIe (Note [whole
# parameters stepped on the device] in optim/state/whole_resident.py).


def newton_schulz(
    update: torch.Tensor,
    *,
    coefficients: tuple[float, float, float],
    steps: int,
    eps: float,
    device: torch.device | None = None,
) -> torch.Tensor:
    """``torch.optim.Muon``'s quintic Newton–Schulz orthogonalization of a 2-D ``update``,
    in bfloat16 as torch runs it (Note [Muon as torch steps it]); a new bf16 tensor on
    ``update``'s device. A bf16 ``update`` on that device is scaled in place (torch's
    ``bfloat16()`` returns it as it is): ``muon_step`` hands it its scratch buffer.
    ``device``: where the products run (Note [Newton-Schulz where the matmuls are fast]);
    ``update``'s own device when None."""
    if update.dim() != 2:
        raise ValueError(f"newton_schulz needs a 2-D matrix, got shape {tuple(update.shape)}")
    if device is not None and device != update.device:
        on = newton_schulz(
            update.to(device, torch.bfloat16), coefficients=coefficients, steps=steps, eps=eps
        )
        return on.to(update.device)  # synchronous: the caller reads it next
    a, b, c = coefficients
    ortho = update.bfloat16()
    tall = update.size(0) > update.size(1)
    if tall:
        ortho = ortho.T
    ortho.div_(ortho.norm().clamp(min=eps))
    for _ in range(steps):
        gram = ortho @ ortho.T
        gram_update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        ortho = torch.addmm(ortho, gram_update, ortho, beta=a)
    return ortho.T if tall else ortho


def adjusted_lr(lr: float, adjust_lr_fn: str | None, shape: tuple[int, ...]) -> float:
    """The learning rate of the orthogonalized update, as torch's ``_adjust_lr``:
    ``sqrt(max(1, A / B))`` for None or ``"original"``, ``0.2 sqrt(max(A, B))`` for
    ``"match_rms_adamw"``, for a matrix of ``(A, B)``."""
    rows, cols = shape[:2]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return lr * math.sqrt(max(1, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    raise ValueError(
        f"adjust_lr_fn must be None, 'original' or 'match_rms_adamw', got {adjust_lr_fn!r}"
    )


# Note [Muon's host passes]
# torch's operations over a host matrix (``muon_step_torch``) make six passes and four new
# tensors: the buffer's lerp (12 B per element), the Nesterov lerp into a new fp32 tensor
# (12), its bf16 copy (6), the decay (8), the add of the bf16 O (cast to a new fp32 tensor
# first, 6, then 12) and the rounding into ``out`` (6): about 60 bytes per element, on
# torch's threads, with the pages of every new tensor faulted in by the pass that first
# writes it. At 4096 x 4096 on two cores that ran at about 120 Mparam/s, an eighth of the
# streams' speed. So on the host the step is two numba passes around Newton-Schulz:
#   before: read g (scaled) and B; write B and U rounded to bf16 into a reused buffer
#           (14 bytes per element for an fp32 gradient, 10 for a 16-bit one);
#   after:  read p and O; write p and ``out`` (10 bytes, 12 with a 16-bit out).
# Bitwise torch's (the same operations, the same roundings, in the same order): where
# torch's vectorised CPU kernels fuse a multiply into an add, so do these passes, with a
# written fma (``_fma``, llvm.fma: the same instruction in every specialisation; Note
# [every specialisation rounds alike] forbids LLVM's own contraction, which it may or may
# not make, not a written one): lerp is fmadd(c, end - start, base) with c = w and base =
# start where |w| < 0.5, else c = w - 1 and base = end; add with alpha is fmadd(other,
# alpha, self). Each Python scalar is rounded to fp32 once, as torch rounds a scalar for an
# fp32 tensor; a gradient is scaled only where grad_scale is not 1, as torch's step is
# given it. Checked against torch's Muon and against ``muon_step_torch`` with NaN, inf and
# -0 (tests/test_muon.py). A torch built without fused vector kernels (no FMA: its
# DEFAULT CPU capability) rounds lerp's product apart, and differs from these passes in the
# last bit of some elements.
# U's buffer is the calling thread's, grown to the largest matrix it has stepped (2 bytes an
# element: the page faults of a new one each step cost more than the pass, as Note [pass
# 1's partials are reused] in adafactor_stats.py found), and Newton-Schulz on the CPU
# divides it in place. The step runs on the caller's thread (or, with ``overlap_step``, on
# the host worker's, which ends at close); ``OffloadOptimizer.close`` frees the closing
# thread's (``release_scratch``). Newton-Schulz returns the transpose of its result for a
# matrix with more rows than columns; the second pass reads O in the weights' order, so
# such an O is copied contiguous first (4 bytes an element).


@intrinsic
def _fma(typingctx, a, b, c):
    """``a * b + c`` rounded once (llvm.fma), fp32."""
    if not (a == types.float32 and b == types.float32 and c == types.float32):
        return None

    def codegen(context, builder, signature, args):
        return builder.fma(*args)

    return types.float32(types.float32, types.float32, types.float32), codegen


@njit(fastmath=FASTMATH_ELEMENTWISE, cache=True, error_model="numpy")
def _momentum_tile(
    g_t,  # (k,) fp32, or uint16 bits of kind grad_kind
    grad_kind,
    b_t,  # (k,) fp32 momentum buffer, updated in place
    u_t,  # (k,) uint16: U rounded to bf16
    scaled,  # whether to multiply g by grad_mul (torch's step is given g * grad_scale)
    grad_mul,  # fp32
    w_coeff,  # fp32: B.lerp_(g, w)'s coefficient, w = 1 - momentum (Note [Muon's host passes])
    w_small,  # whether |w| < 0.5: the lerp's base is B, else g
    m_coeff,  # fp32: g.lerp(B, momentum)'s coefficient (Nesterov)
    m_small,  # whether |momentum| < 0.5: that lerp's base is g, else B
    nesterov,
):
    for i in range(b_t.shape[0]):
        g = load_f32(g_t, i, grad_kind)
        if scaled:
            g = g * grad_mul
        b = b_t[i]
        b = _fma(w_coeff, g - b, b if w_small else g)
        b_t[i] = b
        u = _fma(m_coeff, b - g, g if m_small else b) if nesterov else b
        u_t[i] = f32_to_bf16(u)


@njit(fastmath=FASTMATH_ELEMENTWISE, **KERNEL_OPTIONS)
def _momentum_kernel(grad, grad_kind, buf, update, nchunks, *scalars):
    n = buf.shape[0]
    for c in prange(nchunks):  # Note [one contiguous slice per thread] in adam.py
        lo = n * c // nchunks
        hi = n * (c + 1) // nchunks
        _momentum_tile(grad[lo:hi], grad_kind, buf[lo:hi], update[lo:hi], *scalars)


@njit(fastmath=FASTMATH_ELEMENTWISE, cache=True, error_model="numpy")
def _apply_tile(
    p_t,  # (k,) fp32 master, updated in place
    o_t,  # (k,) uint16: O in bf16, in the weights' order
    out_t,  # (k,) fp32, uint16 bf16 / int16 fp16 bits, or (0,) uint8 when absent
    decay,  # fp32: 1 - lr * weight_decay
    alpha,  # fp32: -lr * the shape's ratio (adjusted_lr)
):
    for i in range(p_t.shape[0]):
        p = _fma(bf16_to_f32(o_t[i]), alpha, p_t[i] * decay)
        p_t[i] = p
        store_f32(out_t, i, p)


@njit(fastmath=FASTMATH_ELEMENTWISE, **KERNEL_OPTIONS)
def _apply_kernel(param, ortho, out, nchunks, decay, alpha):
    n = param.shape[0]
    for c in prange(nchunks):
        lo = n * c // nchunks
        hi = n * (c + 1) // nchunks
        _apply_tile(param[lo:hi], ortho[lo:hi], out[lo:hi], decay, alpha)


def _lerp_coefficient(weight: float) -> tuple[np.float32, bool]:
    """torch's lerp by a scalar ``weight`` on fp32: (the fma's coefficient, whether its
    base is the start), Note [Muon's host passes]."""
    w = np.float32(weight)
    small = bool(abs(w) < np.float32(0.5))
    return (w if small else np.float32(w - np.float32(1.0))), small


_scratch = threading.local()


def update_buffer(numel: int) -> torch.Tensor:
    """A (numel,) bf16 view of the calling thread's buffer for U, grown as needed; its
    values are left over (Note [Muon's host passes])."""
    buffer = getattr(_scratch, "update", None)
    if buffer is None or buffer.numel() < numel:
        buffer = torch.empty(numel, dtype=torch.bfloat16)  # (numel,) bf16: U
        _scratch.update = buffer
    return buffer[:numel]


def release_update_buffer() -> None:
    """Free the calling thread's buffer for U (Note [Muon's host passes])."""
    _scratch.update = None


def _check_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    momentum_buffer: torch.Tensor,
    out: torch.Tensor | None,
    shape: tuple[int, ...],
    ns_steps: int,
    lr: float,
    adjust_lr_fn: str | None,
) -> float:
    """Check one step's arguments, both ways of stepping (before anything is written);
    the update's learning rate (``adjusted_lr``)."""
    if len(shape) != 2:
        raise ValueError(f"muon_step needs a 2-D shape, got {shape}")
    numel = shape[0] * shape[1]
    tensors = {"param": param, "grad": grad, "momentum_buffer": momentum_buffer}
    if out is not None:
        tensors["out"] = out
    for name, tensor in tensors.items():
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.numel() != numel:
            raise ValueError(f"{name} has {tensor.numel()} elements but shape {shape} has {numel}")
        if tensor.device != param.device or not tensor.is_contiguous():
            raise ValueError(
                f"{name} must be contiguous and on param's device ({param.device}), got one "
                f"on {tensor.device}{'' if tensor.is_contiguous() else ', not contiguous'}"
            )
    for name in ("param", "momentum_buffer"):
        if tensors[name].dtype != torch.float32:
            raise ValueError(f"{name} must be fp32, got {tensors[name].dtype}")
    if not 0 < ns_steps < 100:
        raise ValueError(f"ns_steps must be in [1, 100), got {ns_steps!r}")
    return adjusted_lr(lr, adjust_lr_fn, shape)  # checks adjust_lr_fn


def muon_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    momentum_buffer: torch.Tensor,
    *,
    shape: tuple[int, ...],
    lr: float,
    weight_decay: float,
    momentum: float,
    nesterov: bool,
    ns_coefficients: tuple[float, float, float],
    ns_steps: int,
    eps: float,
    adjust_lr_fn: str | None,
    grad_scale: float = 1.0,
    out: torch.Tensor | None = None,
    ns_device: torch.device | None = None,
    num_threads: int | None = None,
) -> None:
    """One Muon step of one whole host matrix of ``shape``, in place: two passes around
    Newton-Schulz (Note [Muon's host passes]), bitwise ``muon_step_torch`` (Note [Muon as
    torch steps it]); Newton-Schulz on ``ns_device`` when given, else on the CPU (Note
    [Newton-Schulz where the matmuls are fast]).

    - ``param``: (rows * cols,) fp32 master weights on the CPU; updated.
    - ``grad``: (rows * cols,) fp32, bf16 or fp16; read only, used as ``grad.float() *
      grad_scale``.
    - ``momentum_buffer``: (rows * cols,) or ``shape``, fp32, contiguous; updated.
    - ``out``: optional (rows * cols,) fp32, bf16 or fp16 array receiving the updated
      weights rounded to nearest even (``param.to(out.dtype)``).
    - ``num_threads``: the passes' threads; the thread budget's share when None.

    Raises ``TypeError``/``ValueError`` naming the bad argument before writing anything.
    """
    step_lr = _check_step(param, grad, momentum_buffer, out, shape, ns_steps, lr, adjust_lr_fn)
    numel = param.numel()
    param_a, _ = as_kernel_array(param, "param", (FP32,), writable=True)
    grad_a, grad_kind = as_kernel_array(grad.reshape(-1), "grad", (FP32, BF16, FP16))
    buf_a, _ = as_kernel_array(momentum_buffer.view(-1), "momentum_buffer", (FP32,))
    out_a = out_view(None, FP32)
    if out is not None:
        out_a, out_kind = as_kernel_array(out, "out", (FP32, BF16, FP16), writable=True)
        out_a = out_view(out_a, out_kind)
    lr = check_float("lr", lr, lo=0.0)
    weight_decay = check_float("weight_decay", weight_decay, lo=0.0)
    momentum = check_float("momentum", momentum, lo=0.0)
    grad_scale = check_float("grad_scale", grad_scale, nan_ok=True)

    update = update_buffer(numel)
    w_coeff, w_small = _lerp_coefficient(1 - momentum)
    m_coeff, m_small = _lerp_coefficient(momentum)
    scalars = (grad_scale != 1.0, np.float32(grad_scale), w_coeff, w_small, m_coeff, m_small,
               bool(nesterov))  # fmt: skip
    u_bits, _ = as_kernel_array(update, "update", (BF16,), writable=True)
    run_with_threads(
        num_threads,
        lambda n: _momentum_kernel(grad_a, grad_kind, buf_a, u_bits, chunking(numel, n), *scalars),
    )
    ortho = newton_schulz(
        update.view(shape), coefficients=ns_coefficients, steps=ns_steps, eps=eps,
        device=ns_device,
    )  # fmt: skip
    # a copy where Newton-Schulz returned its transpose (tall)
    o_bits, _ = as_kernel_array(ortho.contiguous().view(-1), "ortho", (BF16,))
    decay, alpha = np.float32(1 - lr * weight_decay), np.float32(-step_lr)
    run_with_threads(
        num_threads,
        lambda n: _apply_kernel(param_a, o_bits, out_a, chunking(numel, n), decay, alpha),
    )


def muon_step_torch(
    param: torch.Tensor,
    grad: torch.Tensor,
    momentum_buffer: torch.Tensor,
    *,
    shape: tuple[int, ...],
    lr: float,
    weight_decay: float,
    momentum: float,
    nesterov: bool,
    ns_coefficients: tuple[float, float, float],
    ns_steps: int,
    eps: float,
    adjust_lr_fn: str | None,
    grad_scale: float = 1.0,
    out: torch.Tensor | None = None,
    ns_device: torch.device | None = None,
) -> None:
    """One Muon step of one whole matrix of ``shape``, in place, in torch's own operations
    (Note [Muon as torch steps it]): what a resident bucket's step runs on the device
    (Note [whole parameters stepped on the device] in ``optim/state/whole_resident.py``),
    and the reference ``muon_step`` (the host's two passes) is bitwise equal to. Its
    Newton-Schulz on ``ns_device`` when given (Note [Newton-Schulz where the matmuls are
    fast]). Every tensor contiguous on ``param``'s device.

    - ``param``: (rows * cols,) fp32 master weights; updated.
    - ``grad``: (rows * cols,) fp32, bf16 or fp16; read only, used as ``grad.float() *
      grad_scale``.
    - ``momentum_buffer``: (rows * cols,) or ``shape``, fp32; updated.
    - ``out``: optional (rows * cols,) training-dtype array receiving the updated weights
      rounded to nearest even (``param.to(out.dtype)``).
    """
    step_lr = _check_step(param, grad, momentum_buffer, out, shape, ns_steps, lr, adjust_lr_fn)

    weights = param.view(shape)
    buf = momentum_buffer.view(shape)
    g = grad.view(shape).float()
    if grad_scale != 1.0:
        # A new tensor when grad is fp32 too (float() returned grad itself), so the
        # accumulated gradient is never changed: a second step() reads it again.
        g = g * grad_scale
    buf.lerp_(g, 1 - momentum)
    update = g.lerp(buf, momentum) if nesterov else buf
    ortho = newton_schulz(
        update, coefficients=ns_coefficients, steps=ns_steps, eps=eps, device=ns_device
    )
    weights.mul_(1 - lr * weight_decay)
    weights.add_(ortho, alpha=-step_lr)
    if out is not None:
        out.view(shape).copy_(weights)
