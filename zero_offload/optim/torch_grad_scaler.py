"""torch's ``GradScaler`` on an offload optimizer: refused, loudly, naming what scales instead.

Note [torch's GradScaler cannot see our gradients]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``torch.amp.GradScaler`` unscales ``param.grad`` and looks there for infs and NaNs. An
offload optimizer's gradients are in host memory, never in ``param.grad`` (Note [torch's
clipping cannot see our gradients] in ``torch_clipping.py``), so ``unscale_`` unscaled
nothing without a word (a norm taken after it was ``scale`` times too large), ``step``
failed with torch's bare ``AssertionError: No inf checks were recorded for this
optimizer``, and the next ``unscale_`` with "already been called since the last update()",
hiding the cause. So importing ``zero_offload`` wraps ``GradScaler.unscale_`` and
``GradScaler.step`` (its subclasses, ``torch.cuda.amp``'s and ``torch.cpu.amp``'s, inherit
them): given an optimizer an offload optimizer is, or wraps (accelerate's and Lightning's
wrappers), an enabled scaler raises before it touches anything, naming the optimizer's own
loss scaling: ``opt.backward(loss)`` scales the loss by ``opt.loss_scale``, and the step
unscales, skips an overflowing step and moves the scale (``LossScalerConfig``); for fp16
autocast over fp32 or bf16 weights, ``LossScalerConfig(autocast_fp16=True)``. A disabled
scaler (``GradScaler(enabled=False)``, the usual bf16 setting of the same loop) passes the
call to the optimizer unchanged, as torch's does, and so is not refused. Other optimizers
go to torch's methods unchanged.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from .torch_clipping import WRAPPED, optimizer_owner

__all__ = ["install", "scaler_refusal"]


def scaler_refusal(owner: object, method: str) -> str:
    """Why ``GradScaler.{method}`` cannot serve ``owner`` (an offload optimizer)."""
    return (
        f"torch.amp.GradScaler.{method} on {owner!r}: GradScaler unscales and checks "
        "param.grad for infs, and this optimizer's gradients are in host memory, not in "
        "param.grad, so it would unscale nothing and find no inf (then fail with 'No inf "
        "checks were recorded'). Nothing was unscaled or stepped. The optimizer scales the "
        "loss itself: call opt.backward(loss) in place of scaler.scale(loss).backward(), "
        "and opt.step() in place of scaler.step(opt) and scaler.update() (opt.loss_scale is "
        "the scale, LossScalerConfig its schedule; opt.clip_grad_norm_ clips the unscaled "
        "gradients). That is automatic for an fp16 model; for "
        "torch.autocast(dtype=torch.float16) over fp32 or bf16 weights set "
        "OffloadConfig(loss_scaler=LossScalerConfig(autocast_fp16=True)); bf16 autocast "
        "needs no scaler (GradScaler(enabled=False) passes through). A backward already "
        "taken of scaler.scale(loss) left its gradients multiplied by the scale: call "
        "opt.zero_grad() first (Note [torch's GradScaler cannot see our gradients])"
    )


def _guard(fn: Callable[..., Any], *, method: str) -> Callable[..., Any]:
    @functools.wraps(fn)
    def guarded(self: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        if self.is_enabled():
            owner = optimizer_owner(optimizer)
            if owner is not None:
                raise RuntimeError(scaler_refusal(owner, method))
        return fn(self, optimizer, *args, **kwargs)

    setattr(guarded, WRAPPED, True)
    return guarded


def install() -> None:
    """Wrap ``torch.amp.GradScaler.unscale_`` and ``.step``; idempotent (Note [torch's
    GradScaler cannot see our gradients])."""
    scaler = getattr(torch.amp, "GradScaler", None)
    if scaler is None:
        return
    for method in ("unscale_", "step"):
        original = getattr(scaler, method, None)
        if original is not None and not getattr(original, WRAPPED, False):
            setattr(scaler, method, _guard(original, method=method))
