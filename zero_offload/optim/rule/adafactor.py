"""Adafactor as a rule: ``torch.optim.Adafactor`` (lr as the cap of the relative step,
beta2_decay, eps=(eps1, eps2), the update clipping threshold d, decoupled weight decay,
maximize).

Not elementwise: a parameter's update reads all of it (Note [rules that read a whole
parameter] in ``base.py``). State: the fp32 master per element, and per parameter, shaped by
it, fp32 as torch keeps it: ``row_var`` ``(..., m, 1)`` and ``col_var`` ``(..., 1, n)`` for
two dims or more (a factored second moment: ``m + n`` numbers for ``m * n`` weights), else
``variance`` like the parameter. ``OffloadConfig.moments_dtype`` does not apply: the shaped
state stays fp32 (for matrices it is already sublinear). On the host the step is the
``adafactor_step`` kernel over one whole parameter; there is no device step (resident
state is refused at construction).

``eps1=None`` means the machine epsilon of the dtype the update runs in, as in torch: the
fp32 master's (torch takes the parameter's dtype, which is the master's when it holds fp32
weights).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ...kernels import adafactor_step
from .base import ParamField, StateField, StateFields, WholeParameterRule
from .values import check_flag, check_number, check_number_or_scalar_tensor

__all__ = ["ADAFACTOR", "AdafactorHyper", "AdafactorRule"]


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


#: ``torch.optim.Adafactor``'s rule (``OffloadAdafactor``).
ADAFACTOR = AdafactorRule()
