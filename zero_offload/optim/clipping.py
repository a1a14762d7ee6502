"""The norm of an offload optimizer's gradients, and clipping by it: one optimizer's own
(``clip_grad_norm_``, ``grad_norm``, ``clip_grads_with_norm_``, the methods
``OffloadOptimizer`` takes from ``GradientClipping``), and a model's that several offload
optimizers train together (``clip_grad_norm_`` over optimizers, exported as
``zero_offload.clip_grad_norm_``: Note [clipping by a total norm] in ``update/policy.py``).

The norm comes from the fused statistics pass over the host gradients and the clipping is
folded into the step's gradient multiplier: no pass of its own.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable
from typing import Any

import torch

from ..error_marks import said_to_caller

__all__ = ["GradientClipping", "check_finite_norm", "clip_grad_norm_", "total_grad_norm"]


class GradientClipping:
    """``OffloadOptimizer``'s clipping methods (a mixin over its ``_policy``,
    ``_check_open`` and ``_collect_stray_grads``)."""

    _policy: Any  # the optimizer's StepPolicy; _check_open, _collect_stray_grads: its own

    @said_to_caller  # Note [an error reaches the caller once]
    def clip_grad_norm_(
        self,
        max_norm: float,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
        foreach: bool | None = None,
    ) -> torch.Tensor:
        """Clip the next step's gradients to ``max_norm``; returns the total norm (as
        torch's). ``norm_type``: 2 only. ``error_if_nonfinite``: raise, clipping nothing,
        when the norm is NaN or infinite, as torch's. ``foreach`` is accepted for torch's
        signature and changes nothing (the norm comes from the fused statistics pass)."""
        self._check_open("clip_grad_norm_")
        self._policy.check_clip_allowed()
        check_clip_arguments(max_norm, norm_type)
        norm = self.grad_norm()
        check_finite_norm(float(norm), error_if_nonfinite, foreach)
        self._policy.clip_once(float(max_norm), window_norm=float(norm))
        return norm

    @torch.no_grad()
    def grad_norm(self) -> torch.Tensor:
        """The global L2 norm of the gradients the next step will use (unscaled; the same
        on every rank), read-only: it sets no clipping."""
        self._check_open("grad_norm")
        self._collect_stray_grads()
        return torch.tensor(self._policy.grad_norm())

    def clip_grads_with_norm_(self, max_norm: float, total_norm: float | torch.Tensor) -> None:
        """Clip the next step's gradients by ``total_norm``, a norm taken over more than this
        optimizer's gradients, as ``torch.nn.utils.clip_grads_with_norm_`` does (Note
        [clipping by a total norm]; ``clip_grad_norm_`` over optimizers takes it for you)."""
        self._check_open("clip_grads_with_norm_")
        self._policy.check_clip_allowed()
        check_clip_arguments(max_norm, 2.0)
        total = _total(total_norm)
        self._collect_stray_grads()
        self._policy.clip_once(float(max_norm), total)


def clip_grad_norm_(
    optimizers: GradientClipping | Iterable[GradientClipping],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for a model that several offload optimizers train
    (``OffloadMuon`` beside an ``OffloadAdamW``): the L2 norm of all their gradients, each
    clipped by torch's coefficient of it; returns that norm. Between backward and step, as
    torch's. Checks every optimizer before it clips any (Note [clipping by a total norm] in
    ``update/policy.py``).

    ``optimizers``: the offload optimizers, or one of them (as torch takes one tensor), or a
    framework's wrapper of one (accelerate's prepared optimizer). Each optimizer counts once:
    one listed twice, or listed both wrapped and unwrapped, is one optimizer, whose gradients
    are in the norm once (counting them twice would make the norm too large by sqrt(2) and
    clip too hard). ``error_if_nonfinite`` and ``foreach`` as ``GradientClipping.
    clip_grad_norm_``'s."""
    listed = _offload_optimizers(optimizers)
    check_clip_arguments(max_norm, norm_type)
    for opt in listed:
        opt._check_open("clip_grad_norm_")
        opt._policy.check_clip_allowed()
    scales = [opt._policy.scaler.scale for opt in listed]
    if len(set(scales)) > 1:
        raise ValueError(
            f"clip_grad_norm_: the optimizers' loss scales differ ({scales}): each unscales "
            "its gradients by its own, and one backward scaled the loss by one of them, so "
            "the others' gradients, and the norm of all, would be off by the ratio. Train an "
            "fp16 model's parameters under one offload optimizer (or a bf16/fp32 model, "
            "whose scale is 1). Nothing was clipped"
        )
    total = total_grad_norm(listed)
    check_finite_norm(total, error_if_nonfinite, foreach)
    for opt in listed:
        opt.clip_grads_with_norm_(max_norm, total)
    return torch.tensor(total)


def total_grad_norm(optimizers: Iterable[GradientClipping]) -> float:
    """The L2 norm of the gradients of several offload optimizers, read-only (from each
    one's ``grad_norm()``; each optimizer once, as in ``clip_grad_norm_``)."""
    norms = [float(opt.grad_norm()) for opt in _offload_optimizers(optimizers)]
    return math.sqrt(math.fsum(n * n for n in norms))


def _offload_optimizers(optimizers: Any) -> list[GradientClipping]:
    """``optimizers`` (one, or an iterable of them) as distinct offload optimizers, in the
    order given: a framework's wrapper (accelerate's prepared optimizer) holds ours as
    ``.optimizer``, and the same optimizer given twice (wrapped and not) is kept once."""
    if isinstance(getattr(optimizers, "optimizer", optimizers), GradientClipping):
        optimizers = [optimizers]
    given = list(optimizers) if isinstance(optimizers, Iterable) else [optimizers]
    listed: list[GradientClipping] = []
    for opt in (getattr(o, "optimizer", o) for o in given):
        if all(opt is not known for known in listed):
            listed.append(opt)
    if not listed or not all(isinstance(opt, GradientClipping) for opt in listed):
        kinds = list(dict.fromkeys(type(o).__name__ for o in given))
        raise TypeError(
            "clip_grad_norm_ takes the offload optimizers that train the model (one, or a "
            f"list of OffloadAdamW, OffloadMuon...), got {type(optimizers).__name__} of "
            f"{kinds}"
        )
    return listed


def check_clip_arguments(max_norm: object, norm_type: object) -> None:
    """``max_norm``: a real number > 0 (a float, an int or a numpy scalar; callers store
    ``float(max_norm)``), ``inf`` included, which measures and clips nothing, as torch's
    coefficient min(1, inf / norm) is 1 (a logging idiom); ``norm_type``: 2 (the L2 norm, the
    one the statistics pass takes). A ``max_norm`` that is no real number (a string,
    ``None``, a bool, a tensor) is a ``TypeError``; one <= 0 or NaN a ``ValueError``."""
    if norm_type != 2.0:
        raise ValueError(
            f"norm_type must be 2.0 (the L2 norm), got {norm_type!r}: the norm comes from the "
            "step's fused statistics pass, which sums squares, so no other norm is taken"
        )
    if isinstance(max_norm, bool) or not isinstance(max_norm, numbers.Real):
        raise TypeError(
            f"max_norm must be a number > 0 (a float, an int or a numpy scalar; float('inf') "
            f"measures without clipping), got {type(max_norm).__name__} {max_norm!r}"
        )
    if not max_norm > 0:  # NaN too
        raise ValueError(
            f"max_norm must be a number > 0 (float('inf') measures without clipping), got "
            f"{max_norm!r}"
        )


def check_finite_norm(norm: float, error_if_nonfinite: object, foreach: object = None) -> None:
    """torch's ``error_if_nonfinite``: a NaN or infinite norm raises, nothing clipped
    (``foreach``: None or a bool, as torch takes it; it changes nothing here)."""
    if foreach is not None and not isinstance(foreach, bool):
        raise TypeError(f"foreach must be None, True or False, got {foreach!r}")
    if not isinstance(error_if_nonfinite, bool):
        raise TypeError(
            "error_if_nonfinite must be True or False, got "
            f"{type(error_if_nonfinite).__name__} {error_if_nonfinite!r}"
        )
    if error_if_nonfinite and not math.isfinite(norm):
        raise RuntimeError(
            f"The total norm of order 2.0 of the gradients is {norm}, so it cannot be "
            "clipped; nothing was clipped. To clip by it anyway (as torch does: an infinite "
            "norm zeroes the gradients, a NaN one makes them NaN), pass "
            "error_if_nonfinite=False; to skip such steps, set "
            "OffloadConfig(skip_nonfinite=True)"
        )


def _total(total_norm: object) -> float:
    """``total_norm`` as a float: a number or a one-element tensor, >= 0 (or NaN, as a NaN
    norm is torch's too)."""
    if isinstance(total_norm, torch.Tensor):
        if total_norm.numel() != 1:
            raise ValueError(
                f"total_norm must be one number, got a tensor of shape {tuple(total_norm.shape)}"
            )
        total_norm = total_norm.item()
    if isinstance(total_norm, bool) or not isinstance(total_norm, numbers.Real):
        raise TypeError(f"total_norm must be a number, got {type(total_norm).__name__}")
    if not (total_norm >= 0 or math.isnan(total_norm)):
        raise ValueError(f"total_norm must be >= 0, got {total_norm!r}")
    return float(total_norm)
