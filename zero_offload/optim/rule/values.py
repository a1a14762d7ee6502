"""Checks of hyper-parameter values that every rule shares: each refusal names where, the
key and the value, and what would work."""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Any

import torch

__all__ = [
    "TORCH_SWITCHES",
    "check_flag",
    "check_number",
    "check_number_or_scalar_tensor",
    "check_torch_switches",
    "loaded_torch_switches",
]


def check_number(
    where: str, name: str, value: Any, *, low: float, high: float | None = None
) -> None:
    """``value`` must be a finite real number in ``[low, high)`` (``>= low`` without
    ``high``): a Python ``float`` or ``int``, or any other ``numbers.Real`` such as a numpy
    scalar (a ``LambdaLR`` whose lambda returns ``np.float32`` sets one; torch steps with
    it). The readers take ``float()`` of it (``OptimizerRule.hyper``). A bool, a string,
    ``None`` or a complex number is a ``TypeError``; NaN, an infinity or a value out of range
    a ``ValueError``."""
    if isinstance(value, torch.Tensor):
        raise TypeError(f"{where}: {name} must be a Python float, got a tensor ({value!r})")
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"{where}: {name} must be a real number (a float, an int or a numpy scalar), got "
            f"{type(value).__name__} {value!r}"
        )
    if not math.isfinite(value):
        raise ValueError(f"{where}: {name} must be a finite number, got {value!r}")
    if value < low or (high is not None and value >= high):
        allowed = f"in [{low}, {high})" if high is not None else f">= {low}"
        raise ValueError(f"{where}: {name} must be {allowed}, got {value!r}")


def check_number_or_scalar_tensor(
    where: str, name: str, value: Any, *, low: float, high: float | None = None
) -> None:
    """Like ``check_number``, but a 1-element real tensor is accepted too (torch accepts one for
    ``lr`` and ``betas``: LR schedulers under ``torch.compile`` step a tensor ``lr`` in
    place, so that a new value is not a recompile). Its value is read where the step reads
    the hyper-parameters (hidden cost: for a tensor on a GPU, a host sync per group)."""
    if not isinstance(value, torch.Tensor):
        check_number(where, name, value, low=low, high=high)
        return
    if value.numel() != 1:
        raise ValueError(
            f"{where}: a tensor {name} must have exactly 1 element, got shape "
            f"{tuple(value.shape)}; pass a Python float or a 1-element tensor"
        )
    if value.is_complex() or not value.is_floating_point() or value.requires_grad:
        raise TypeError(
            f"{where}: a tensor {name} must be a real floating-point tensor that does not "
            f"require grad, got {value.dtype} (requires_grad={value.requires_grad})"
        )
    check_number(where, name, float(value), low=low, high=high)


def check_flag(where: str, name: str, value: Any) -> None:
    """``value`` must be a bool (torch's optimizers take no truthy stand-ins)."""
    if not isinstance(value, bool):
        raise TypeError(f"{where}: {name} must be a bool, got {value!r}")


# Note [torch's implementation switches in a group]
# torch's optimizers keep their implementation switches in every param group (AdamW:
# ``foreach``, ``fused``, ``capturable``, ``differentiable``), and code that moves state
# between optimizers by key (``torch.distributed.checkpoint``'s load template and its
# flattened dicts) needs the same keys on both sides. A facade keeps those of the torch
# optimizer it stands for, each at the one value that describes what runs here: our own
# CPU kernel (``foreach``/``fused`` None) outside autograd and CUDA graphs
# (``capturable``/``differentiable`` False). A group that asks for another value
# (``add_param_group``) is refused, as the constructor refuses the argument. A loaded state
# dict says how the optimizer that saved it ran, not what to run here, and none of the
# switches changes what the state means: any torch value (None or a bool) loads and is
# replaced by ours (a fused=True AdamW checkpoint resumes here).

#: torch's implementation switches and the value each has here.
TORCH_SWITCHES: dict[str, bool | None] = {
    "foreach": None,
    "fused": None,
    "capturable": False,
    "differentiable": False,
}


def check_torch_switches(where: str, group: Mapping[str, Any]) -> None:
    """Refuse a switch in ``group`` at a value other than ours (Note [torch's implementation
    switches in a group])."""
    for key, ours in TORCH_SWITCHES.items():
        if key not in group or group[key] is ours:
            continue
        why = (
            "the update runs on the CPU outside autograd and CUDA graphs"
            if ours is False
            else "our own fused CPU kernel always runs"
        )
        raise ValueError(
            f"{where}: {key}={group[key]!r} is not supported ({why}); leave {key}={ours!r} "
            "or omit the key"
        )


def loaded_torch_switches(where: str, group: Mapping[str, Any]) -> dict[str, bool | None]:
    """The switches a loaded ``group`` names, at our values: a torch value (None or a
    bool) is replaced, anything else refused (Note [torch's implementation switches in a
    group])."""
    for key in TORCH_SWITCHES.keys() & group.keys():
        if group[key] is not None and not isinstance(group[key], bool):
            raise TypeError(
                f"{where}: {key!r} must be None or a bool (torch's implementation switch), "
                f"got {type(group[key]).__name__} {group[key]!r}"
            )
    return {key: TORCH_SWITCHES[key] for key in TORCH_SWITCHES.keys() & group.keys()}
