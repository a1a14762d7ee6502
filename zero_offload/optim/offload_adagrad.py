"""``OffloadAdagrad``: the facade of the Adagrad rule (``rule/adagrad.py``) over
``OffloadOptimizer``, with ``torch.optim.Adagrad``'s signature.

A thin facade, as ``offload_adamw.py``'s: the torch-style constructor and nothing else.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from ..accelerator import Accelerator
from ..config import OffloadConfig
from .checks import refuse_torch_switches
from .offload_optimizer import OffloadOptimizer
from .rule import ADAGRAD, OptimizerRule
from .rule.values import TORCH_SWITCHES

__all__ = ["OffloadAdagrad"]


class OffloadAdagrad(OffloadOptimizer):
    """Adagrad with fp32 master weights, the sum of squared gradients and the gradients
    offloaded to host memory: 8 bytes of host state per parameter.

    Args follow ``torch.optim.Adagrad``; ``initial_accumulator_value`` is the constructor's
    for every group (torch starts every ``sum`` from it and ignores a group's own: a group
    that names another value is refused, here and in ``add_param_group``). ``foreach`` and ``fused`` other than None and
    ``differentiable`` are refused, as ``OffloadAdamW`` refuses them; sparse gradients are
    not supported. ``config``, ``accelerator``, ``process_group``, ``model`` and ``layers``:
    see ``OffloadOptimizer``.
    """

    rule: OptimizerRule = ADAGRAD

    def __init__(
        self,
        params: Iterable[torch.Tensor]
        | Iterable[tuple[str, torch.Tensor]]
        | Iterable[dict[str, Any]],
        lr: float | torch.Tensor = 1e-2,
        lr_decay: float = 0.0,
        weight_decay: float = 0.0,
        initial_accumulator_value: float = 0.0,
        eps: float = 1e-10,
        foreach: bool | None = None,
        *,
        maximize: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        config: OffloadConfig | None = None,
        accelerator: Accelerator | None = None,
        process_group: Any = None,
        model: torch.nn.Module | None = None,
        layers: Sequence[torch.nn.Module] | None = None,
    ) -> None:
        refuse_torch_switches(
            type(self).__name__, differentiable=differentiable, foreach=foreach, fused=fused
        )
        defaults = {
            "lr": lr,
            "lr_decay": lr_decay,
            "weight_decay": weight_decay,
            "initial_accumulator_value": initial_accumulator_value,
            "eps": eps,
            "maximize": maximize,
            # torch's Adagrad's switches at our values (Note [torch's implementation
            # switches in a group] in rule/values.py)
            **{key: TORCH_SWITCHES[key] for key in ("foreach", "fused", "differentiable")},
        }
        super().__init__(
            params,
            defaults,
            config=config,
            accelerator=accelerator,
            process_group=process_group,
            model=model,
            layers=layers,
        )

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """``OffloadOptimizer.add_param_group``, refusing a group whose
        ``initial_accumulator_value`` is not the constructor's: torch's Adagrad starts every
        ``sum`` from the constructor's and ignores the group's, and a group of its own value
        added later would start apart from the others."""
        start = self.defaults["initial_accumulator_value"]
        value = (
            param_group.get("initial_accumulator_value", start)
            if isinstance(param_group, dict)
            else start
        )
        if value != start:
            raise ValueError(
                f"param group {len(self.param_groups)}: initial_accumulator_value={value!r} "
                f"differs from the constructor's ({start!r}); torch.optim.Adagrad starts "
                "every parameter's sum from the constructor's value and ignores a group's "
                "own, so pass it to OffloadAdagrad(..., initial_accumulator_value=...) and "
                "leave it out of the groups"
            )
        super().add_param_group(param_group)
