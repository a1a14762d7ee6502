"""Muon's step over one whole matrix: ``torch.optim.Muon``'s update, on CPU tensors (or a
resident bucket's device tensors).

Not a numba kernel: the work is Newton–Schulz's five pairs of matrix products, which
torch's CPU matmul does well, so the step is torch's own operations in torch's order (see
Note [Muon as torch steps it]). Pure, as every kernel here: every input explicit, checked
before anything is written.
"""

from __future__ import annotations

import math

import torch

__all__ = ["adjusted_lr", "muon_step", "newton_schulz"]

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
# A matrix whose state is resident on the device steps there whole (``muon_step`` over
# device tensors), Newton-Schulz included, and nothing crosses PCIe (Note [whole
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
    ``update``'s device. ``device``: where the products run (Note [Newton-Schulz where the
    matmuls are fast]); ``update``'s own device when None."""
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
) -> None:
    """One Muon step of one whole matrix of ``shape``, in place (Note [Muon as torch steps
    it]); its Newton-Schulz on ``ns_device`` when given (Note [Newton-Schulz where the
    matmuls are fast]).

    Every tensor contiguous on ``param``'s device: the CPU for a host-side store, the device
    for a resident bucket's (Note [whole parameters stepped on the device] in
    ``optim/state/whole_resident.py``), where the same operations run on the device.

    - ``param``: (rows * cols,) fp32 master weights; updated.
    - ``grad``: (rows * cols,) fp32, bf16 or fp16; read only, used as ``grad.float() *
      grad_scale``.
    - ``momentum_buffer``: (rows * cols,) or ``shape``, fp32; updated.
    - ``out``: optional (rows * cols,) training-dtype array receiving the updated weights
      rounded to nearest even (``param.to(out.dtype)``).
    """
    if len(shape) != 2:
        raise ValueError(f"muon_step needs a 2-D shape, got {shape}")
    numel = shape[0] * shape[1]
    arrays = {"param": param, "grad": grad, "momentum_buffer": momentum_buffer}
    if out is not None:
        arrays["out"] = out
    for name, array in arrays.items():
        if array.numel() != numel:
            raise ValueError(f"{name} has {array.numel()} elements but shape {shape} has {numel}")
        if array.device != param.device or not array.is_contiguous():
            raise ValueError(
                f"{name} must be contiguous and on param's device ({param.device}), got one "
                f"on {array.device}{'' if array.is_contiguous() else ', not contiguous'}"
            )
    for name in ("param", "momentum_buffer"):
        if arrays[name].dtype != torch.float32:
            raise ValueError(f"{name} must be fp32, got {arrays[name].dtype}")
    if not 0 < ns_steps < 100:
        raise ValueError(f"ns_steps must be in [1, 100), got {ns_steps!r}")
    step_lr = adjusted_lr(lr, adjust_lr_fn, shape)  # checks adjust_lr_fn before writing

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
