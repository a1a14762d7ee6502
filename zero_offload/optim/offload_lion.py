"""``OffloadLion``: the facade of the Lion rule (``rule/lion.py``) over ``OffloadOptimizer``,
with lion-pytorch's signature (``lr``, ``betas``, ``weight_decay``) and torch's ``maximize``.

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
from .rule import LION, OptimizerRule

__all__ = ["OffloadLion"]


class OffloadLion(OffloadOptimizer):
    """Lion (Chen et al. 2023) with fp32 master weights, its one moment and gradients
    offloaded to host memory: 8 bytes of host state per parameter, against AdamW's 12.

    Args follow lucidrains' ``lion_pytorch.Lion`` (defaults ``lr=1e-4``, ``betas=(0.9,
    0.99)``, ``weight_decay=0``) and torch's ``maximize``; ``foreach`` and ``fused`` other
    than None, ``capturable`` and ``differentiable`` are refused, as ``OffloadAdamW``
    refuses them. ``config``, ``accelerator``, ``process_group``, ``model`` and ``layers``:
    see ``OffloadOptimizer``.
    """

    rule: OptimizerRule = LION

    def __init__(
        self,
        params: Iterable[torch.Tensor]
        | Iterable[tuple[str, torch.Tensor]]
        | Iterable[dict[str, Any]],
        lr: float | torch.Tensor = 1e-4,
        betas: tuple[float | torch.Tensor, float | torch.Tensor] = (0.9, 0.99),
        weight_decay: float = 0.0,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        config: OffloadConfig | None = None,
        accelerator: Accelerator | None = None,
        process_group: Any = None,
        model: torch.nn.Module | None = None,
        layers: Sequence[torch.nn.Module] | None = None,
    ) -> None:
        refuse_torch_switches(
            type(self).__name__,
            capturable=capturable,
            differentiable=differentiable,
            foreach=foreach,
            fused=fused,
        )
        defaults = {"lr": lr, "betas": betas, "weight_decay": weight_decay, "maximize": maximize}
        super().__init__(
            params,
            defaults,
            config=config,
            accelerator=accelerator,
            process_group=process_group,
            model=model,
            layers=layers,
        )
