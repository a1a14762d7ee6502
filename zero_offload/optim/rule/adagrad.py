"""Adagrad as a rule: ``torch.optim.Adagrad`` (lr_decay, L2 weight decay,
initial_accumulator_value, eps, maximize).

State per element: the fp32 master and ``sum``, the running sum of squared gradients (fp32,
or bf16 with ``OffloadConfig(moments_dtype="bfloat16")``), which starts from
``initial_accumulator_value`` (``StateField.initial``). On the host the step is the
``adagrad_step`` kernel, one pass per tile; on the device, torch's single-tensor operations
(Note [Adagrad's operation order] in ``kernels/adagrad.py``). Elementwise: tile and shard
boundaries change no bit.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ...kernels import adagrad_step
from .base import OptimizerRule, StateField, StateFields, scaled_gradient
from .values import check_flag, check_number, check_number_or_scalar_tensor

__all__ = ["ADAGRAD", "AdagradHyper", "AdagradRule"]


@dataclass(frozen=True)
class AdagradHyper:
    """One param group's hyper-parameters for a step."""

    lr: float
    lr_decay: float
    weight_decay: float
    eps: float
    maximize: bool


class AdagradRule(OptimizerRule):
    """Adagrad as ``torch.optim.Adagrad`` steps a dense gradient."""

    name = "adagrad"
    elementwise = True
    takes_written = True

    def __repr__(self) -> str:
        return "AdagradRule()"

    def hyper(self, group: Mapping[str, Any]) -> AdagradHyper:
        return AdagradHyper(
            lr=float(group["lr"]),
            lr_decay=float(group["lr_decay"]),
            weight_decay=float(group["weight_decay"]),
            eps=float(group["eps"]),
            maximize=bool(group["maximize"]),
        )

    def check_group(self, group: Mapping[str, Any], *, where: str) -> None:
        """As torch checks them: every number >= 0; ``lr`` may be a 1-element tensor, as
        torch's Adagrad allows (its value is read where the step reads the group)."""
        check_number_or_scalar_tensor(where, "lr", group["lr"], low=0.0)
        for key in ("lr_decay", "weight_decay", "initial_accumulator_value", "eps"):
            check_number(where, key, group[key], low=0.0)
        check_flag(where, "maximize", group["maximize"])

    def state_fields(
        self, moments_dtype: torch.dtype, groups: Sequence[Mapping[str, Any]]
    ) -> StateFields:
        """One ``sum`` start for the whole segment: its param groups must agree on it."""
        starts = {float(g["initial_accumulator_value"]) for g in groups}
        if len(starts) > 1:
            raise ValueError(
                "OffloadAdagrad: every param group must have the same "
                f"initial_accumulator_value, got {sorted(starts)}; give them one value (a "
                "different start per group is not supported)"
            )
        master = StateField("master", torch.float32)
        start = starts.pop() if starts else 0.0
        return StateFields((master, StateField("sum", moments_dtype, start)))

    def checkpoint_fields(self, group: Mapping[str, Any]) -> tuple[str, ...]:
        return ("sum",)

    def tile_step(
        self,
        fields: Mapping[str, torch.Tensor],
        grad: torch.Tensor,
        *,
        step: int,
        hyper: AdagradHyper,
        grad_scale: float,
        out: torch.Tensor | None,
        take_written: bool = False,
    ) -> None:
        adagrad_step(
            fields["master"],
            grad,
            fields["sum"],
            step=step,
            lr=hyper.lr,
            lr_decay=hyper.lr_decay,
            weight_decay=hyper.weight_decay,
            eps=hyper.eps,
            maximize=hyper.maximize,
            grad_scale=grad_scale,
            out=out,
            take_written=take_written,
        )

    def device_tile_step(
        self,
        fields: Mapping[str, torch.Tensor],
        grad: torch.Tensor,
        *,
        step: int,
        hyper: AdagradHyper,
        grad_scale: float,
        step_tensor: torch.Tensor,
    ) -> None:
        """torch's single-tensor Adagrad over the tile."""
        master, state_sum = fields["master"], fields["sum"]
        grad = scaled_gradient(grad, -grad_scale if hyper.maximize else grad_scale)
        if hyper.weight_decay != 0:
            grad = grad.add(master, alpha=hyper.weight_decay)  # a tile temporary
        clr = hyper.lr / (1 + (step - 1) * hyper.lr_decay)
        state_sum.addcmul_(grad, grad, value=1)
        std = state_sum.sqrt().add_(hyper.eps)  # a tile temporary
        master.addcdiv_(grad, std, value=-clr)

    def device_temporary_bytes(
        self, hyper: AdagradHyper, grad_scale: float, tile_elements: int
    ) -> int:
        """Up to three fp32 tiles at once (scaled gradient, L2 term, the denominator)."""
        return 12 * tile_elements


#: ``torch.optim.Adagrad``'s rule (``OffloadAdagrad``).
ADAGRAD = AdagradRule()
