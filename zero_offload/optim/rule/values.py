"""Checks of hyper-parameter values that every rule shares: each refusal names where, the
key and the value, and what would work."""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch

__all__ = ["check_flag", "check_number", "check_number_or_scalar_tensor"]


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
