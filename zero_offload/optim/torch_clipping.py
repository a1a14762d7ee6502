"""torch's own gradient clipping on ``OffloadAdamW``'s parameters: refused, loudly.

Note [torch's clipping cannot see our gradients]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``torch.nn.utils.clip_grad_norm_`` and ``clip_grad_value_`` read ``param.grad``. For a
parameter a live ``OffloadAdamW`` trains, that is ``None`` after backward (the gradient is
already in host memory), so torch's clip would clip nothing and return a norm of 0, and
training would go on unclipped without a word. So importing ``zero_offload`` wraps every
torch clipping primitive that takes parameters: ``clip_grad_norm_``, ``clip_grad_value_``
and ``clip_grads_with_norm_`` (torch >= 2.6), in ``torch.nn.utils`` and in
``torch.nn.utils.clip_grad`` (where torch's own ``clip_grad_norm_`` looks its parts up, so
they are wrapped there under their private names too). Parameters no live ``OffloadAdamW``
trains go to torch's function unchanged (a dictionary lookup each; parameters without
``requires_grad`` are not looked up); if any is ours, it raises before anything is clipped,
naming the optimizer and what to call instead (``opt.clip_grad_norm_``, or the integrations
that route clipping there: Note [frameworks clip through the optimizer] in
``integrations/_optim.py``).

``get_total_norm`` is not wrapped: it takes tensors, not parameters. Frameworks pass it the
gradients they found (``[p.grad for p in params if p.grad is not None]``), from which ours
are already missing, and a user may pass it weights to log their norm, which is right. The
frameworks that filter that way before calling torch (accelerate >= 1.16, Trainer's
mixed-mesh path) are guarded at their own entry points instead: Note [clipping guarded at
each framework's entry point] in ``framework_clipping.py``.

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
from .grads.lifecycle import PENDING
from .lifetime import OWNERS

__all__ = [
    "WRAPPED",
    "install",
    "optimizer_owner",
    "owner_of",
    "refuse_plain_trainer",
    "trainer_refusal",
]

#: Marks a function this package wrapped with a clipping guard (so it is wrapped once).
WRAPPED = "__zero_offload_guarded__"


def owner_of(parameters: Iterable[Any]) -> object | None:
    """The live optimizer that trains one of ``parameters``, or None."""
    for param in parameters:
        if isinstance(param, torch.Tensor) and param.requires_grad:
            ref = OWNERS.get(param)
            owner = ref() if ref is not None else None
            if owner is not None:
                return owner
    return None


# Note [a list filtered on .grad is empty]
# Training code often clips only the parameters that have a gradient (mmengine's optimizer
# wrapper, fairseq, many scripts: ``[p for p in params if p.grad is not None]``). Ours never
# have one there, so the list torch's clipping gets is empty, and it returns 0 and clips
# nothing: the guard above, which looks at the parameters, sees none. So an empty list while
# a live offload optimizer holds gradients of a backward not yet stepped (the moment such
# code clips) is refused too. An empty list with nothing pending goes to torch as before
# (a model with nothing to clip), and so does a list of another model's parameters.


def _pending_owner() -> object | None:
    """A live offload optimizer holding gradients of a backward not yet stepped, or None
    (Note [a list filtered on .grad is empty])."""
    seen: set[int] = set()
    for ref in list(OWNERS.values()):
        owner = ref()
        if owner is None or id(owner) in seen or getattr(owner, "closed", True):
            continue
        seen.add(id(owner))
        if any(bucket.grads.state in PENDING for bucket in owner.buckets):
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
        owner = owner_of(listed)
        if not listed:  # Note [a list filtered on .grad is empty]
            pending = _pending_owner()
            if pending is not None:
                raise RuntimeError(
                    f"torch.nn.utils.{name} got no parameters while {pending!r} holds the "
                    "gradients of a backward it has not stepped: a list filtered on "
                    "p.grad ([p for p in params if p.grad is not None]) finds none of its "
                    "parameters, whose gradients are in host memory, so nothing would be "
                    "clipped. Nothing was clipped. Pass the parameters unfiltered (this "
                    "guard then names what to call), or call opt.clip_grad_norm_(max_norm) "
                    "(Note [torch's clipping cannot see our gradients])"
                )
        if owner is not None:
            tail = (
                "To clip by the global L2 norm (norm_type=2, the only norm the optimizer "
                "takes) call opt.clip_grad_norm_(max_norm) between backward and step (or set "
                "OffloadConfig(max_grad_norm=...)); where several "
                "offload optimizers train the model, zero_offload.clip_grad_norm_([opt1, "
                "opt2, ...], max_norm) clips it by the norm of all their gradients; with Hugging "
                "Face Trainer use zero_offload.integrations.transformers.OffloadTrainer, with "
                "accelerate zero_offload.integrations.accelerate.OffloadAccelerator"
                if name == "clip_grad_norm_"
                else "It clips by the global norm only: call opt.clip_grad_norm_(max_norm) "
                "between backward and step, or set OffloadConfig(max_grad_norm=...); for a "
                "total norm taken elsewhere, opt.clip_grads_with_norm_(max_norm, total_norm), "
                "and for several offload optimizers zero_offload.clip_grad_norm_(optimizers, "
                "max_norm)"
            )
            raise RuntimeError(
                f"torch.nn.utils.{name} on parameters that {owner!r} trains: their "
                "gradients are in host memory, not in param.grad, so torch would clip "
                f"nothing{' and return a norm of 0' if name == 'clip_grad_norm_' else ''}. "
                f"Nothing was clipped. {tail}{_framework_hint(name)} (Note [torch's clipping "
                "cannot see our gradients])"
            )
        return fn(passed, *args, **kwargs)

    setattr(guarded, WRAPPED, True)
    return guarded


#: torch's clipping functions that take parameters: (public name in ``torch.nn.utils``,
#: its names in ``torch.nn.utils.clip_grad``); absent ones (older torch) are skipped.
_GUARDED: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("clip_grad_norm_", ("clip_grad_norm_",)),
    ("clip_grad_value_", ("clip_grad_value_",)),
    ("clip_grads_with_norm_", ("clip_grads_with_norm_", "_clip_grads_with_norm_")),
)


def _guarded(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    return fn if getattr(fn, WRAPPED, False) else _guard(fn, name=name)


def install() -> None:
    """Wrap torch's clipping functions; idempotent (Note [torch's clipping cannot see our
    gradients])."""
    for public, private in _GUARDED:
        original = getattr(torch.nn.utils, public, None)
        if original is None:
            continue
        guarded = _guarded(original, public)
        setattr(torch.nn.utils, public, guarded)
        for name in private:
            inner = getattr(_clip_module, name, None)
            if inner is not None:
                setattr(
                    _clip_module, name, guarded if inner is original else _guarded(inner, public)
                )


def optimizer_owner(optimizer: Any) -> object | None:
    """The live ``OffloadAdamW`` behind ``optimizer`` (unwrapping the frameworks'
    ``.optimizer`` wrappers: accelerate's, Lightning's, Fabric's), or None."""
    for _ in range(8):  # wrappers of wrappers, never a cycle
        inner = getattr(optimizer, "optimizer", None)
        if inner is None or inner is optimizer:
            break
        optimizer = inner
    groups = getattr(optimizer, "param_groups", None)
    if not isinstance(groups, list):
        return None
    return owner_of(p for group in groups for p in group.get("params", ()))


def trainer_refusal(trainer: Any, optimizer: str, what: str) -> str:
    """Why a plain HF ``Trainer`` (or TRL's) must not clip ``optimizer``'s parameters."""
    ours = "OffloadTrainer"
    if type(trainer).__module__.startswith("trl."):
        ours = "OffloadSFTTrainer or OffloadDPOTrainer (zero_offload.integrations.trl)"
    return (
        f"{type(trainer).__name__}.{what} (max_grad_norm="
        f"{getattr(getattr(trainer, 'args', None), 'max_grad_norm', None)!r}) clips and "
        "computes the grad_norm it logs from param.grad, which cannot see "
        f"{optimizer}'s gradients (they live on the host): it would clip nothing and log "
        f"grad_norm 0. Use {ours} (zero_offload.integrations.transformers.OffloadTrainer for "
        "a plain Trainer), which clips inside the optimizer and logs the true norm. Nothing "
        "was clipped or stepped"
    )


def refuse_plain_trainer(optimizer: str, frame: Any) -> None:
    """Raise when a plain HF ``Trainer`` among the callers of ``frame`` steps ``optimizer``:
    it would silently not clip and log grad_norm 0 (``checks.plain_trainer_calling``)."""
    trainer = plain_trainer_calling(frame)
    if trainer is None:
        return
    raise RuntimeError(trainer_refusal(trainer, optimizer, "training_step"))
