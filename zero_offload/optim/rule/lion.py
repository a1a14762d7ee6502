"""Lion as a rule (Chen et al. 2023; the update of lucidrains' lion-pytorch), with maximize.

State per element: the fp32 master and ``exp_avg`` (fp32, or bf16 with
``OffloadConfig(moments_dtype="bfloat16")``): 8 bytes with fp32 moments, 4 less than AdamW.
On the host the step is the ``lion_step`` kernel, one pass per tile; on the device, the same
operations in torch ops (Note [Lion's operation order] in ``kernels/lion.py``). Elementwise:
tile and shard boundaries change no bit.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ...kernels import lion_step
from .base import OptimizerRule, StateField, StateFields, scaled_gradient
from .values import check_flag, check_number, check_number_or_scalar_tensor

__all__ = ["LION", "LionHyper", "LionRule"]


@dataclass(frozen=True)
class LionHyper:
    """One param group's hyper-parameters for a step."""

    lr: float
    beta1: float
    beta2: float
    weight_decay: float
    maximize: bool


class LionRule(OptimizerRule):
    """Lion: ``c = b1*m + (1-b1)*g; p = p*(1-lr*wd) - lr*sign(c); m = b2*m + (1-b2)*g``."""

    name = "lion"
    elementwise = True
    takes_written = True

    def __repr__(self) -> str:
        return "LionRule()"

    def hyper(self, group: Mapping[str, Any]) -> LionHyper:
        beta1, beta2 = group["betas"]
        return LionHyper(
            lr=float(group["lr"]),
            beta1=float(beta1),
            beta2=float(beta2),
            weight_decay=float(group["weight_decay"]),
            maximize=bool(group["maximize"]),
        )

    def check_group(self, group: Mapping[str, Any], *, where: str) -> None:
        """``lr``, ``weight_decay`` >= 0, betas in [0, 1). ``lr`` and each beta may be a
        1-element tensor, as torch's optimizers allow (docs/optimizer.md): its value is
        read where the step reads the group."""
        check_number_or_scalar_tensor(where, "lr", group["lr"], low=0.0)
        check_number(where, "weight_decay", group["weight_decay"], low=0.0)
        betas = group["betas"]
        if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
            raise ValueError(f"{where}: betas must be a pair (beta1, beta2), got {betas!r}")
        check_number_or_scalar_tensor(where, "betas[0]", betas[0], low=0.0, high=1.0)
        check_number_or_scalar_tensor(where, "betas[1]", betas[1], low=0.0, high=1.0)
        check_flag(where, "maximize", group["maximize"])

    def missing_step(self, where: str) -> str:
        """Lion's update does not read the count; lion-pytorch's state dicts keep none (Note
        [a loaded entry needs its step] in checkpoint/state_dict.py)."""
        return (
            f"{where}: missing ['step'], the parameter's step count, which every state "
            "OffloadLion loads must hold. lion-pytorch's Lion keeps none (only 'exp_avg'): "
            "to load its state dict, give each entry a count first, e.g. `for s in "
            "sd['state'].values(): s.setdefault('step', torch.tensor(1.0))`. Any count gives "
            "the same steps (Lion's update does not read it; it is the count opt.state and "
            "state_dict() report; docs/checkpoints.md). Nothing was loaded"
        )

    def state_fields(
        self, moments_dtype: torch.dtype, groups: Sequence[Mapping[str, Any]]
    ) -> StateFields:
        master = StateField("master", torch.float32)
        return StateFields((master, StateField("exp_avg", moments_dtype)))

    def checkpoint_fields(self, group: Mapping[str, Any]) -> tuple[str, ...]:
        return ("exp_avg",)

    def tile_step(
        self,
        fields: Mapping[str, torch.Tensor],
        grad: torch.Tensor,
        *,
        step: int,
        hyper: LionHyper,
        grad_scale: float,
        out: torch.Tensor | None,
        take_written: bool = False,
    ) -> None:
        lion_step(
            fields["master"],
            grad,
            fields["exp_avg"],
            lr=hyper.lr,
            beta1=hyper.beta1,
            beta2=hyper.beta2,
            weight_decay=hyper.weight_decay,
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
        hyper: LionHyper,
        grad_scale: float,
        step_tensor: torch.Tensor,
    ) -> None:
        """The kernel's operations in torch ops, each rounded as the kernel rounds it."""
        master, exp_avg = fields["master"], fields["exp_avg"]
        grad = scaled_gradient(grad, -grad_scale if hyper.maximize else grad_scale)
        direction = exp_avg * hyper.beta1  # a tile temporary
        direction.add_(grad * (1.0 - hyper.beta1))  # and one more while it is added
        direction.sign_()
        if hyper.weight_decay != 0:
            master.mul_(1.0 - hyper.lr * hyper.weight_decay)
        master.add_(direction, alpha=-hyper.lr)  # exact: sign is 0 or +-1
        del direction
        exp_avg.mul_(hyper.beta2).add_(grad * (1.0 - hyper.beta2))

    def device_temporary_bytes(
        self, hyper: LionHyper, grad_scale: float, tile_elements: int
    ) -> int:
        """Two fp32 tiles (the direction and a product), and the scaled gradient."""
        scaled = grad_scale != 1.0 or hyper.maximize
        return (12 if scaled else 8) * tile_elements


#: Lion's rule (``OffloadLion``).
LION = LionRule()
