"""torch's own gradient clipping on ``OffloadAdamW``'s parameters: refused, loudly.

Note [torch's clipping cannot see our gradients]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``torch.nn.utils.clip_grad_norm_`` and ``clip_grad_value_`` read ``param.grad``. For a
parameter a live ``OffloadAdamW`` trains, that is ``None`` after backward (the gradient is
already in host memory), so torch's clip would clip nothing and return a norm of 0, and
training would go on unclipped without a word: a plain loop, a plain ``accelerate``
``Accelerator.clip_grad_norm_``, Lightning's clipping. So importing ``zero_offload`` wraps
both functions, in ``torch.nn.utils`` and in ``torch.nn.utils.clip_grad``, with a check:
parameters no live ``OffloadAdamW`` trains go to torch's function unchanged (a dictionary
lookup each; parameters without ``requires_grad`` are not looked up); if any is ours, it
raises before anything is clipped, naming the optimizer and what to call instead
(``opt.clip_grad_norm_``, or the integrations that route clipping there: Note [frameworks
clip through the optimizer] in ``integrations/_optim.py``).

What cannot be seen: a reference to torch's function taken before ``zero_offload`` was
imported (``from torch.nn.utils import clip_grad_norm_`` first), and clipping code that
reads ``param.grad`` itself.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.utils.clip_grad as _clip_module

from .checks import plain_trainer_calling
from .lifetime import OWNERS

__all__ = ["install"]

_WRAPPED = "__zero_offload_guarded__"


def _owner_of(parameters: list[Any]) -> object | None:
    """The live optimizer that trains one of ``parameters``, or None."""
    for param in parameters:
        if isinstance(param, torch.Tensor) and param.requires_grad:
            ref = OWNERS.get(param)
            owner = ref() if ref is not None else None
            if owner is not None:
                return owner
    return None


def _framework_hint(name: str) -> str:
    """The integrations for the frameworks the program has imported (read from
    ``sys.modules``: nothing here imports ``integrations``)."""
    hint = ""
    if "trl" in sys.modules and name == "clip_grad_norm_":
        hint += (
            ", with TRL's SFTTrainer or DPOTrainer zero_offload.integrations.trl."
            "OffloadSFTTrainer or OffloadDPOTrainer"
        )
    if "lightning" in sys.modules or "pytorch_lightning" in sys.modules:
        hint += (
            ", with Lightning derive the module from "
            "zero_offload.integrations.lightning.OffloadLightningModule, which routes "
            "Trainer(gradient_clip_val=..., gradient_clip_algorithm='norm') to "
            "opt.clip_grad_norm_"
        )
    return hint


def _guard(fn: Callable[..., Any], *, name: str) -> Callable[..., Any]:
    @functools.wraps(fn)
    def guarded(parameters: torch.Tensor | Iterable[torch.Tensor], *args: Any, **kwargs: Any):
        if isinstance(parameters, torch.Tensor):
            listed: list[Any] = [parameters]
            passed: Any = parameters
        else:
            listed = passed = list(parameters)  # a generator is read once, here
        owner = _owner_of(listed)
        if owner is not None:
            tail = (
                "To clip by the global norm call opt.clip_grad_norm_(max_norm) between "
                "backward and step (or set OffloadConfig(max_grad_norm=...)); with Hugging "
                "Face Trainer use zero_offload.integrations.transformers.OffloadTrainer, with "
                "accelerate zero_offload.integrations.accelerate.OffloadAccelerator"
                if name == "clip_grad_norm_"
                else "It clips by the global norm only: call opt.clip_grad_norm_(max_norm) "
                "between backward and step, or set OffloadConfig(max_grad_norm=...)"
            )
            raise RuntimeError(
                f"torch.nn.utils.{name} on parameters that {owner!r} trains: their "
                "gradients are in host memory, not in param.grad, so torch would clip "
                f"nothing{' and return a norm of 0' if name == 'clip_grad_norm_' else ''}. "
                f"Nothing was clipped. {tail}{_framework_hint(name)} (Note [torch's clipping "
                "cannot see our gradients])"
            )
        return fn(passed, *args, **kwargs)

    setattr(guarded, _WRAPPED, True)
    return guarded


def install() -> None:
    """Wrap torch's clipping functions; idempotent (Note [torch's clipping cannot see our
    gradients])."""
    for name in ("clip_grad_norm_", "clip_grad_value_"):
        original = getattr(_clip_module, name)
        guarded = original if getattr(original, _WRAPPED, False) else _guard(original, name=name)
        setattr(_clip_module, name, guarded)
        if not getattr(getattr(torch.nn.utils, name), _WRAPPED, False):
            setattr(torch.nn.utils, name, guarded)


def refuse_plain_trainer(optimizer: str, frame: Any) -> None:
    """Raise when a plain HF ``Trainer`` among the callers of ``frame`` steps ``optimizer``:
    it would silently not clip and log grad_norm 0 (``checks.plain_trainer_calling``)."""
    trainer = plain_trainer_calling(frame)
    if trainer is None:
        return
    ours = "OffloadTrainer"
    if type(trainer).__module__.startswith("trl."):
        ours = "OffloadSFTTrainer or OffloadDPOTrainer (zero_offload.integrations.trl)"
    raise RuntimeError(
        f"{type(trainer).__name__} clips (max_grad_norm="
        f"{getattr(trainer.args, 'max_grad_norm', None)!r}) and computes the grad_norm it "
        f"logs with torch.nn.utils.clip_grad_norm_, which cannot see {optimizer}'s "
        "gradients (they live on the host): it would clip nothing and log grad_norm 0. Use "
        f"{ours} (zero_offload.integrations.transformers.OffloadTrainer for a plain Trainer), "
        "which clips inside the optimizer and logs the true norm. Nothing was stepped"
    )
