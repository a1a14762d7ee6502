"""``OffloadMuon``: the facade of the Muon rule (``rule/muon.py``) over ``OffloadOptimizer``:
``torch.optim.Muon``'s signature for the matrices, AdamW's as ``adamw_*`` for the rest.

A thin facade, as ``offload_adamw.py``'s: the torch-style constructor and nothing else.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from ..accelerator import Accelerator
from ..config import OffloadConfig
from .offload_optimizer import OffloadOptimizer
from .rule import MUON, OptimizerRule
from .rule.muon import MuonHyper

__all__ = ["OffloadMuon"]

#: torch.optim.Muon's Newton–Schulz coefficients (Keller Jordan's).
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


class OffloadMuon(OffloadOptimizer):
    """Muon for every 2-D parameter and AdamW for every other one, with the fp32 master
    weights, the state and the gradients offloaded to host memory (or kept on the device:
    ``offload_fraction``).

    A parameter's shape decides its rule (Note [Muon routes by shape] in
    ``rule/muon.py``): a matrix steps as ``torch.optim.Muon`` steps it (Nesterov momentum,
    Newton–Schulz in bfloat16 on the CPU with torch's coefficients and steps, the learning
    rate adjusted by shape, decoupled weight decay); a bias, a norm's weight or any
    parameter of other than two dims steps as ``torch.optim.AdamW`` does, with the
    ``adamw_*`` hyper-parameters. So ``OffloadMuon(model.parameters(), lr=0.02,
    adamw_lr=3e-4)`` is torch's documented recipe (a Muon over the matrices, an AdamW over
    the rest) as one optimizer, under one LR scheduler too: the AdamW half's rate follows
    ``lr``'s factor from the value it had when its group was made (``adamw_lr * lr /
    adamw_lr_reference``, recorded in the group: Note [the AdamW half follows lr's
    schedule] in ``rule/muon.py``); param groups may set any of these keys. A 2-D parameter
    that should train with AdamW (an embedding, an output head) belongs in a separate
    ``OffloadAdamW``; a group with a ``use_muon`` key is refused.

    Host state per parameter: 8 bytes for a matrix (the fp32 master and momentum buffer),
    12 for any other (the master and AdamW's two fp32 moments); ``moments_dtype`` does not
    apply. ``opt.state`` and ``state_dict`` hold torch's names (torch's Muon's for a matrix,
    torch's AdamW's for the rest: ``rule/muon.py``), with ``step`` and our ``master``.

    Args follow ``torch.optim.Muon`` (``lr=1e-3``, ``weight_decay=0.1``,
    ``momentum=0.95``, ``nesterov=True``, ``ns_coefficients``, ``eps=1e-7``,
    ``ns_steps=5``, ``adjust_lr_fn`` None, ``"original"`` or ``"match_rms_adamw"``) and
    ``torch.optim.AdamW``'s defaults (``adamw_lr=1e-3``, ``adamw_betas=(0.9, 0.999)``,
    ``adamw_eps=1e-8``, ``adamw_weight_decay=1e-2``; AdamW's other switches are off). The
    orthogonalization needs whole matrices, so construction refuses ``partition_parameters``
    (Note [rules that read a whole parameter] in ``rule/base.py``); parameter offload
    (``offload_parameters``) and NVMe state (``nvme_dir``: the master on NVMe, the momentum
    buffer and moments in host RAM, Note [NVMe tiles follow whole parameters]) work on one
    rank, together too (the weights' homes then stay in RAM), and so do ``offload_fraction``
    below 1 and ``"auto"``: a resident bucket keeps its state on the device and steps each
    parameter whole there, Newton–Schulz included (Note [whole parameters stepped on the
    device] in ``state/whole_resident.py``); ``save_streaming`` saves the shaped state (Note
    [shaped state in a streamed checkpoint]). On several ranks each matrix is orthogonalized
    whole by one rank and the others receive its weights (Note [a whole parameter has one
    owner] in ``partition.py``).
    ``config``, ``accelerator``, ``process_group``, ``model`` and ``layers``: see
    ``OffloadOptimizer``.
    """

    rule: OptimizerRule = MUON

    def __init__(
        self,
        params: Iterable[torch.Tensor]
        | Iterable[tuple[str, torch.Tensor]]
        | Iterable[dict[str, Any]],
        lr: float | torch.Tensor = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
        eps: float = 1e-7,
        ns_steps: int = 5,
        adjust_lr_fn: str | None = None,
        *,
        adamw_lr: float = 1e-3,
        adamw_betas: tuple[float, float] = (0.9, 0.999),
        adamw_eps: float = 1e-8,
        adamw_weight_decay: float = 1e-2,
        config: OffloadConfig | None = None,
        accelerator: Accelerator | None = None,
        process_group: Any = None,
        model: torch.nn.Module | None = None,
        layers: Sequence[torch.nn.Module] | None = None,
    ) -> None:
        defaults = {
            "lr": lr,
            "weight_decay": weight_decay,
            "momentum": momentum,
            "nesterov": nesterov,
            "ns_coefficients": ns_coefficients,
            "eps": eps,
            "ns_steps": ns_steps,
            "adjust_lr_fn": adjust_lr_fn,
            "adamw_lr": adamw_lr,
            "adamw_betas": adamw_betas,
            "adamw_eps": adamw_eps,
            "adamw_weight_decay": adamw_weight_decay,
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

    def _group_hyper(self, index: int) -> MuonHyper:
        """The group's hyper-parameters, with Newton-Schulz on the GPU when the model
        computes there (Note [Newton-Schulz where the matmuls are fast] in
        ``kernels/muon.py``)."""
        hyper = super()._group_hyper(index)
        if not isinstance(hyper, MuonHyper) or self.accelerator.computes_on_host:
            return hyper
        return dataclasses.replace(hyper, ns_device=self.accelerator.device)
