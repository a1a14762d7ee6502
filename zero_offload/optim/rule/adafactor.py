"""Adafactor as a rule: ``torch.optim.Adafactor`` (lr as the cap of the relative step,
beta2_decay, eps=(eps1, eps2), the update clipping threshold d, decoupled weight decay,
maximize).

Not elementwise: a parameter's update reads all of it (Note [rules that read a whole
parameter] in ``base.py``). State: the fp32 master per element, and per parameter, shaped by
it, fp32 as torch keeps it: ``row_var`` ``(..., m, 1)`` and ``col_var`` ``(..., 1, n)`` for
two dims or more (a factored second moment: ``m + n`` numbers for ``m * n`` weights), else
``variance`` like the parameter. ``OffloadConfig.moments_dtype`` does not apply: the shaped
state stays fp32 (for matrices it is already sublinear). On the host the step is the
``adafactor_step`` kernel over one whole parameter; state resident on the device steps
there, with torch's operations in the kernel's form (``device_parameter_step``, Note
[whole parameters stepped on the device] in ``state/whole_resident.py``). A matrix's update
is computed from a factor per row and per column, as optax's ``scale_by_factored_rms``
does, within a few ulp of torch's (Note [the update from the factors] in
``kernels/adafactor.py``).

``eps1=None`` means the machine epsilon of the dtype the update runs in, as in torch: the
fp32 master's (torch takes the parameter's dtype, which is the master's when it holds fp32
weights).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ...kernels import adafactor_step, adafactor_update_cap
from .base import ParamField, StateField, StateFields, WholeParameterRule, scaled_gradient
from .values import check_flag, check_number, check_number_or_scalar_tensor

__all__ = ["ADAFACTOR", "AdafactorHyper", "AdafactorRule"]

# Note [Adafactor on the device, without a host sync]
# torch's single-tensor Adafactor reads two norms back to the CPU per parameter
# (``param.norm(2).item()``, ``update.norm(2).item()``) and makes its step size in Python
# floats. On a GPU that would be two host syncs per parameter per step, each waiting for
# every kernel queued before it. ``device_parameter_step`` keeps that arithmetic on the
# device: each fp32 norm is widened to a float64 0-d tensor and divided, clamped and
# multiplied in float64, the IEEE operations torch's Python floats perform, so the step
# size ``alpha`` and the clipping denominator are torch's to the bit. The clamp is Python's
# ``max(lo, x)``, ``x if x > lo else lo``, not ``clamp_``: a NaN norm (a NaN weight, or a NaN
# in U) gives ``lo`` there, as in torch and the host kernel, where ``clamp_`` would spread
# the NaN to every weight of the parameter. The factors (``row_var``, ``col_var``,
# ``variance``) are torch's operations in torch's order, so for the same gradient they are
# torch's bits on the same device. A matrix's U is not torch's
# ``rsqrt(max((R @ C) / r, eps1^2)) * G`` but the host kernel's factored form, with its
# operations (Note [the update from the factors] in ``kernels/adafactor.py``): a row factor
# and a column factor in float64 rounded to fp32 (the row mean r summed in float64 and
# rounded once, as the kernel does), their product clamped at the kernel's cap, times G.
# So a parameter's U is computed alike whether its bucket steps on the host or on the
# device (within a few ulp of torch's, not its bits); what tells them apart is what the
# kernel cannot share with torch: its sums (the norms, the row and column sums of g^2) in
# another order, and torch's lerp, fused on vectorised code. A vector's U is torch's. The last operation differs from torch's
# too: torch adds the update with ``alpha=-alpha / denom`` (that scalar rounded to fp32,
# and a fused multiply-add on vectorised CPU code and on CUDA); here the update is
# multiplied by the fp32 scalar and then added, two roundings, as the host kernel does.


@dataclass(frozen=True)
class AdafactorHyper:
    """One param group's hyper-parameters for a step."""

    lr: float
    beta2_decay: float
    eps1: float  # torch's None resolved: the fp32 machine epsilon
    eps2: float
    d: float
    weight_decay: float
    maximize: bool


class AdafactorRule(WholeParameterRule):
    """Adafactor as ``torch.optim.Adafactor``'s single-tensor path steps it."""

    name = "adafactor"
    reads_whole = "its second moment is factored over rows and columns"

    def __repr__(self) -> str:
        return "AdafactorRule()"

    def hyper(self, group: Mapping[str, Any]) -> AdafactorHyper:
        eps1, eps2 = group["eps"]
        return AdafactorHyper(
            lr=float(group["lr"]),
            beta2_decay=float(group["beta2_decay"]),
            eps1=torch.finfo(torch.float32).eps if eps1 is None else float(eps1),
            eps2=float(eps2),
            d=float(group["d"]),
            weight_decay=float(group["weight_decay"]),
            maximize=bool(group["maximize"]),
        )

    def check_group(self, group: Mapping[str, Any], *, where: str) -> None:
        """As torch checks them: ``lr`` >= 0 (a float or a 1-element tensor),
        ``beta2_decay`` <= 0, ``eps`` a pair (``eps1`` None or >= 0, ``eps2`` >= 0),
        ``d`` >= 1, ``weight_decay`` >= 0."""
        check_number_or_scalar_tensor(where, "lr", group["lr"], low=0.0)
        beta2_decay = group["beta2_decay"]
        check_number(where, "beta2_decay", beta2_decay, low=-float("inf"))
        if beta2_decay > 0:
            raise ValueError(f"{where}: beta2_decay must be <= 0, got {beta2_decay!r}")
        eps = group["eps"]
        if not (isinstance(eps, (tuple, list)) and len(eps) == 2):
            raise ValueError(
                f"{where}: eps must be a pair (eps1, eps2), eps1 None or a float, got {eps!r}"
            )
        if eps[0] is not None:
            check_number(where, "eps[0]", eps[0], low=0.0)
        check_number(where, "eps[1]", eps[1], low=0.0)
        check_number(where, "d", group["d"], low=1.0)
        check_number(where, "weight_decay", group["weight_decay"], low=0.0)
        check_flag(where, "maximize", group["maximize"])

    def state_fields(
        self, moments_dtype: torch.dtype, groups: Sequence[Mapping[str, Any]]
    ) -> StateFields:
        """The fp32 master per element; the rest is shaped (``param_state``)."""
        return StateFields((StateField("master", torch.float32),), param_state=self.param_state)

    def param_state(self, shape: tuple[int, ...]) -> tuple[ParamField, ...]:
        if len(shape) >= 2:
            return (
                ParamField("row_var", (*shape[:-1], 1)),
                ParamField("col_var", (*shape[:-2], 1, shape[-1])),
            )
        return (ParamField("variance", tuple(shape)),)

    def parameter_step(
        self,
        fields: Mapping[str, torch.Tensor],
        param_state: Mapping[str, torch.Tensor],
        grad: torch.Tensor,
        *,
        shape: tuple[int, ...],
        step: int,
        hyper: AdafactorHyper,
        grad_scale: float,
        out: torch.Tensor | None,
    ) -> None:
        flat = {name: tensor.reshape(-1) for name, tensor in param_state.items()}
        adafactor_step(
            fields["master"],
            grad,
            shape=tuple(shape),
            row_var=flat.get("row_var"),
            col_var=flat.get("col_var"),
            variance=flat.get("variance"),
            step=step,
            lr=hyper.lr,
            beta2_decay=hyper.beta2_decay,
            eps1=hyper.eps1,
            eps2=hyper.eps2,
            d=hyper.d,
            weight_decay=hyper.weight_decay,
            maximize=hyper.maximize,
            grad_scale=grad_scale,
            out=out,
        )

    def device_parameter_step(
        self,
        fields: Mapping[str, torch.Tensor],
        param_state: Mapping[str, torch.Tensor],
        grad: torch.Tensor,
        *,
        shape: tuple[int, ...],
        step: int,
        hyper: AdafactorHyper,
        grad_scale: float,
        step_tensor: torch.Tensor,
    ) -> None:
        """``torch.optim.Adafactor``'s single-tensor update on the device, a matrix's U in the
        host kernel's factored form (Note [Adafactor on the device, without a host
        sync])."""
        param = fields["master"].view(shape)
        g = scaled_gradient(grad, -grad_scale if hyper.maximize else grad_scale).view(shape)
        one_minus_beta2_t = step**hyper.beta2_decay
        rho_t = min(hyper.lr, 1 / (step**0.5))
        root_numel = param.numel() ** 0.5
        rms = param.norm(2).double() / root_numel
        alpha = torch.where(rms > hyper.eps2, rms, hyper.eps2) * rho_t  # Python's max
        if hyper.weight_decay != 0:
            param.mul_(1 - hyper.lr * hyper.weight_decay)
        if len(shape) >= 2:
            row_var, col_var = param_state["row_var"], param_state["col_var"]
            row_mean = torch.norm(g, dim=-1, keepdim=True).square_().div_(g.size(-1))
            row_var.lerp_(row_mean, one_minus_beta2_t)
            col_mean = torch.norm(g, dim=-2, keepdim=True).square_().div_(g.size(-2))
            col_var.lerp_(col_mean, one_minus_beta2_t)
            del row_mean, col_mean
            # Note [the update from the factors] in kernels/adafactor.py: the kernel's form
            # and operations, each factor in float64 rounded once to fp32.
            mean = row_var.double().mean(dim=-2, keepdim=True).float()
            r = mean.clamp_(min=hyper.eps1).double()
            a = row_var.double().div_(r).sqrt_().reciprocal_().float()
            b = col_var.double().sqrt_().reciprocal_().float()
            update = torch.mul(a, b).clamp_(max=adafactor_update_cap(hyper.eps1)).mul_(g)
        else:
            variance = param_state["variance"]
            variance.lerp_(g * g, one_minus_beta2_t)
            update = variance.clone().clamp_(min=hyper.eps1 * hyper.eps1).rsqrt_().mul_(g)
        ratio = update.norm(2).double() / (root_numel * hyper.d)
        denom = torch.where(ratio > 1.0, ratio, 1.0)  # Python's max: a NaN norm gives 1
        update.mul_((-alpha / denom).float())
        param.add_(update)

    def device_parameter_temporary_bytes(
        self, shape: tuple[int, ...], hyper: AdafactorHyper, grad_scale: float
    ) -> int:
        """A parameter of ``n`` elements, at most: the scaled or negated gradient (``4n``,
        when there is one), the update (``4n``), and beside it a vector's ``g * g`` (``4n``)
        or, per row and per column of each matrix, at most 12 bytes (its mean of g^2, or its
        factor in float64 and in fp32); 256 bytes for the 0-d norms."""
        n = math.prod(shape)
        scaled = 4 * n if grad_scale != 1.0 or hyper.maximize else 0
        if len(shape) >= 2:
            beside = 12 * (math.prod(shape[:-1]) + math.prod(shape[:-2]) * shape[-1])
        else:
            beside = 4 * n
        return scaled + 4 * n + beside + 256


#: ``torch.optim.Adafactor``'s rule (``OffloadAdafactor``).
ADAFACTOR = AdafactorRule()
