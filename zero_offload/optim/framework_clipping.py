"""The frameworks' own clipping entry points on ``OffloadAdamW``'s parameters: refused,
naming the integration that routes them.

Note [clipping guarded at each framework's entry point]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Guarding torch's clipping functions (Note [torch's clipping cannot see our gradients] in
``torch_clipping.py``) holds only while a framework hands them our parameters. accelerate
1.16 stopped doing that: ``Accelerator.clip_grad_norm_`` drops every parameter whose
``.grad`` is None (all of ours), then calls ``get_total_norm`` / ``clip_grads_with_norm_`` on
the rest, so it clipped nothing and returned 0 without a word. Any release may change how a
framework computes the norm inside; what it keeps is its public clipping method and that
method's arguments. So each framework is guarded there, where the call names the
parameters, the optimizer or the model, before any of its code runs:

- accelerate: ``Accelerator.clip_grad_norm_`` and ``clip_grad_value_`` (the parameters);
  the refusal names ``OffloadAccelerator``.
- transformers: ``Trainer._clip_grad_norm`` and ``Trainer._get_grad_norm`` (the model), the
  two methods every Trainer clip and logged ``grad_norm`` goes through (transformers >= 5.3);
  the refusal names ``OffloadTrainer`` (TRL's trainers: ``OffloadSFTTrainer`` /
  ``OffloadDPOTrainer``). They are private, so when a release renames them the guard is
  skipped, and the accelerate guard (Trainer clips through the accelerator) and the check
  at the first ``step()`` (``refuse_plain_trainer``) still refuse.
- Lightning: ``LightningModule.clip_gradients`` (what ``configure_gradient_clipping`` and
  manual optimization call) and ``Precision.clip_gradients`` (the plugin it hands the work
  to), for ``lightning.pytorch`` and ``pytorch_lightning``, when they would clip (a
  ``gradient_clip_val`` above 0: Lightning calls them every step, clipping or not); the
  refusal names ``OffloadLightningModule``. ``Fabric.clip_gradients`` (``lightning.fabric``
  and ``lightning_fabric``), which has no integration class: the refusal names
  ``opt.clip_grad_norm_``.

Each method is wrapped on the class where the framework defines it, so every subclass
inherits the guard, and our own classes, which override these methods and call the
framework's for other optimizers only, pass through it unchanged. The wrap happens when
the framework's module is imported, before or after ``zero_offload`` (Note [a hook on
import, in either order] in ``post_import.py``); frameworks that are never imported are
never touched. What makes this survive the next release is the test, not the guess:
``tests/test_clipping_guards.py`` calls every guarded entry point on our parameters and
expects the refusal, and CI runs it against the newest releases and against the oldest
versions ``pyproject.toml`` allows (``.ci/run``). A release that renames an entry point
fails there, loudly, rather than in a user's run.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

from ..post_import import when_imported
from .torch_clipping import WRAPPED, optimizer_owner, owner_of, trainer_refusal

__all__ = ["install"]

_NORM_INSTEAD = (
    "call opt.clip_grad_norm_(max_norm) between backward and step (or set "
    "OffloadConfig(max_grad_norm=...))"
)


def _refusal(entry: str, owner: object, ours: str) -> RuntimeError:
    return RuntimeError(
        f"{entry} on parameters that {owner!r} trains: their gradients are in host memory, "
        "not in param.grad, so it would clip nothing (and report a norm of 0). Nothing was "
        f"clipped. {ours} (Note [clipping guarded at each framework's entry point])"
    )


def _wrap(cls: type, name: str, check: Callable[..., tuple[Any, ...] | None]) -> None:
    """Wrap ``cls.name`` so that ``check(self, *args, **kwargs)`` runs first; ``check``
    raises to refuse, or returns the arguments to call the original with (a generator of
    parameters is read once, by the check) or None to pass them on unchanged."""
    original = cls.__dict__.get(name)
    if original is None or getattr(original, WRAPPED, False):
        return

    @functools.wraps(original)
    def guarded(self: Any, *args: Any, **kwargs: Any) -> Any:
        replaced = check(self, *args, **kwargs)
        if replaced is not None:
            args = replaced
        return original(self, *args, **kwargs)

    setattr(guarded, WRAPPED, True)
    setattr(cls, name, guarded)


# -- accelerate ------------------------------------------------------------------------


def _accelerate(module: ModuleType) -> None:
    ours = "Use zero_offload.integrations.accelerate.OffloadAccelerator in place of Accelerator"

    def check(entry: str, instead: str) -> Callable[..., tuple[Any, ...]]:
        def parameters_check(self: Any, parameters: Any, *args: Any, **kwargs: Any):
            params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
            owner = owner_of(params)
            if owner is not None:
                raise _refusal(f"Accelerator.{entry}", owner, instead)
            return (params, *args)

        return parameters_check

    norm = f"{ours}: it clips inside the optimizer"
    value = (
        "It clips by the global norm only: accelerator.clip_grad_norm_ under "
        f"OffloadAccelerator, or {_NORM_INSTEAD}"
    )
    _wrap(module.Accelerator, "clip_grad_norm_", check("clip_grad_norm_", norm))
    _wrap(module.Accelerator, "clip_grad_value_", check("clip_grad_value_", value))


# -- transformers ----------------------------------------------------------------------


def _transformers(module: ModuleType) -> None:
    cls = module.Trainer

    def check(what: str) -> Callable[..., None]:
        def trainer_check(self: Any, model: Any = None, *args: Any, **kwargs: Any) -> None:
            if what == "_get_grad_norm" and (args or kwargs.get("grad_norm") is not None):
                return None  # the norm _clip_grad_norm already returned: nothing is read
            target = model if model is not None else getattr(self, "model", None)
            params = target.parameters() if hasattr(target, "parameters") else ()
            owner = owner_of(params)
            if owner is not None:
                raise RuntimeError(trainer_refusal(self, type(owner).__name__, what))
            return None

        return trainer_check

    for name in ("_clip_grad_norm", "_get_grad_norm"):
        _wrap(cls, name, check(name))


# -- Lightning -------------------------------------------------------------------------

_LIGHTNING = (
    "Derive the module from zero_offload.integrations.lightning.OffloadLightningModule, which "
    "routes Trainer(gradient_clip_val=..., gradient_clip_algorithm='norm') to "
    "opt.clip_grad_norm_"
)


def _clip_value(value: Any) -> float:
    """A clip value as Lightning reads it: None or 0 do not clip."""
    try:
        return float(value or 0.0)
    except (TypeError, ValueError):
        return 0.0  # Lightning's own check raises its error for it


def _refuse_lightning(entry: Any, optimizer: Any, clip_val: Any) -> None:
    """Lightning calls its clipping every step: refuse only where it would clip."""
    if _clip_value(clip_val) > 0:
        owner = optimizer_owner(optimizer)
        if owner is not None:
            raise _refusal(f"{type(entry).__name__}.clip_gradients", owner, _LIGHTNING)


def _lightning_module(module: ModuleType) -> None:
    def check(
        self: Any, optimizer: Any, gradient_clip_val: Any = None, *args: Any, **kwargs: Any
    ) -> None:
        if gradient_clip_val is None:  # the Trainer's, as Lightning reads it
            trainer = getattr(self, "_trainer", None)  # no error when it is not attached
            gradient_clip_val = getattr(trainer, "gradient_clip_val", None)
        _refuse_lightning(self, optimizer, gradient_clip_val)

    _wrap(module.LightningModule, "clip_gradients", check)


def _lightning_precision(module: ModuleType) -> None:
    def check(self: Any, optimizer: Any, clip_val: Any = 0.0, *args: Any, **kwargs: Any) -> None:
        _refuse_lightning(self, optimizer, clip_val)

    _wrap(module.Precision, "clip_gradients", check)


def _fabric(module: ModuleType) -> None:
    def check(
        self: Any,
        module_: Any,
        optimizer: Any,
        clip_val: Any = None,
        max_norm: Any = None,
        *args: Any,
        **kwargs: Any,
    ) -> None:
        if clip_val is None and max_norm is None:
            return  # Fabric's own error for it
        owner = optimizer_owner(optimizer)
        if owner is None and hasattr(module_, "parameters"):
            owner = owner_of(module_.parameters())
        if owner is not None:
            raise _refusal(
                "Fabric.clip_gradients", owner, f"Fabric has no integration: {_NORM_INSTEAD}"
            )

    _wrap(module.Fabric, "clip_gradients", check)


#: Where each framework defines the class whose clipping is guarded, and the guard.
_ENTRY_POINTS: tuple[tuple[str, Callable[[ModuleType], None]], ...] = (
    ("accelerate.accelerator", _accelerate),
    ("transformers.trainer", _transformers),
    ("lightning.pytorch.core.module", _lightning_module),
    ("pytorch_lightning.core.module", _lightning_module),
    ("lightning.pytorch.plugins.precision.precision", _lightning_precision),
    ("pytorch_lightning.plugins.precision.precision", _lightning_precision),
    ("lightning.fabric.fabric", _fabric),
    ("lightning_fabric.fabric", _fabric),
)


_installed = False


def install() -> None:
    """Guard each framework's clipping when it is imported (Note [clipping guarded at each
    framework's entry point]); idempotent."""
    global _installed
    if _installed:
        return
    _installed = True
    for name, guard in _ENTRY_POINTS:
        when_imported(name, guard)
