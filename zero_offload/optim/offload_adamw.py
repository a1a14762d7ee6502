"""``OffloadAdamW`` and ``OffloadAdam``: the facades of the Adam rule (``rule/adamw.py``) over
``OffloadOptimizer`` (``offload_optimizer.py``), with ``torch.optim.AdamW``'s and
``torch.optim.Adam``'s signatures.

A facade is the torch-style constructor and nothing else: it refuses torch's implementation
switches, fills in the defaults and hands them to ``OffloadOptimizer``, whose rule checks
them. It is the one place outside ``rule/`` that names the rule's hyper-parameters
(Note [the rule is the only place that knows the optimizer] in ``rule/base.py``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from ..accelerator import Accelerator
from ..config import OffloadConfig
from .checks import refuse_torch_switches
from .offload_optimizer import OffloadOptimizer, StepFailed
from .rule import ADAM, ADAMW, OptimizerRule
from .rule.values import TORCH_SWITCHES

__all__ = ["OffloadAdam", "OffloadAdamW", "StepFailed"]

_SWITCHES = ("foreach", "fused", "capturable", "differentiable")  # torch's AdamW's and Adam's


class OffloadAdamW(OffloadOptimizer):
    """AdamW with fp32 master weights, moments and gradients offloaded to host memory.

    Args follow ``torch.optim.AdamW`` (``lr`` and ``betas`` may be 1-element tensors, as in
    torch); ``capturable``, ``differentiable``, ``foreach=False`` and ``fused=False`` have
    no meaning here and are refused. The groups keep torch's ``foreach=None``,
    ``fused=None``, ``capturable=False`` and ``differentiable=False`` (Note [torch's
    implementation switches in a group] in ``rule/values.py``). ``config``, ``accelerator``, ``process_group``,
    ``model`` and ``layers``: see ``OffloadOptimizer``.
    """

    rule: OptimizerRule = ADAMW
    _default_weight_decay = 1e-2

    def _defaults(self, defaults: dict[str, Any]) -> dict[str, Any]:
        """The defaults as torch's ``AdamW`` keeps them (Note [the decay's form is the
        group's] in ``rule/adamw.py``)."""
        return {**defaults, "decoupled_weight_decay": True}

    def __init__(
        self,
        params: Iterable[torch.Tensor]
        | Iterable[tuple[str, torch.Tensor]]
        | Iterable[dict[str, Any]],
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float | torch.Tensor, float | torch.Tensor] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float | None = None,
        amsgrad: bool = False,
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
        defaults = {
            "lr": lr,
            "betas": betas,
            "eps": eps,
            "weight_decay": self._default_weight_decay if weight_decay is None else weight_decay,
            "amsgrad": amsgrad,
            "maximize": maximize,
            # torch's switches at our values (Note [torch's implementation switches in a
            # group] in rule/values.py)
            **{key: TORCH_SWITCHES[key] for key in _SWITCHES},
        }
        super().__init__(
            params,
            self._defaults(defaults),
            config=config,
            accelerator=accelerator,
            process_group=process_group,
            model=model,
            layers=layers,
        )


class OffloadAdam(OffloadAdamW):
    """Adam with coupled L2 weight decay (``torch.optim.Adam``'s semantics, default
    ``weight_decay=0``), offloaded exactly like ``OffloadAdamW``; with
    ``decoupled_weight_decay=True`` AdamW's decay, as torch's Adam (Note [the decay's form
    is the group's] in ``rule/adamw.py``)."""

    rule = ADAM
    _default_weight_decay = 0.0

    def __init__(self, *args: Any, decoupled_weight_decay: bool = False, **kwargs: Any) -> None:
        """``OffloadAdamW``'s arguments, and torch's Adam's ``decoupled_weight_decay``."""
        self._decoupled_default = decoupled_weight_decay
        super().__init__(*args, **kwargs)

    def _defaults(self, defaults: dict[str, Any]) -> dict[str, Any]:
        return {**defaults, "decoupled_weight_decay": self._decoupled_default}
