"""``OffloadAdafactor``: the facade of the Adafactor rule (``rule/adafactor.py``) over
``OffloadOptimizer``, with ``torch.optim.Adafactor``'s signature.

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
from .rule import ADAFACTOR, OptimizerRule
from .rule.values import TORCH_SWITCHES

__all__ = ["OffloadAdafactor"]


class OffloadAdafactor(OffloadOptimizer):
    """Adafactor with fp32 master weights, its second moment and the gradients offloaded to
    host memory: 4 bytes of host state per parameter for the master, plus ``4 (m + n)``
    bytes per ``(m, n)`` matrix (its row and column factors) and 4 per element of a
    parameter of fewer than two dimensions (its full second moment).

    Args follow ``torch.optim.Adafactor`` (``lr=1e-2`` caps the relative step,
    ``beta2_decay=-0.8``, ``eps=(None, 1e-3)``, ``d=1.0``, ``weight_decay=0.0``,
    ``maximize``); ``foreach`` other than None is refused, as ``OffloadAdamW`` refuses it.
    ``eps1=None`` is the fp32 master's machine epsilon. The factored statistics need whole
    parameters, so construction refuses ``partition_parameters`` (Note [rules that read a
    whole parameter] in ``rule/base.py``); parameter offload (``offload_parameters``) and
    NVMe state (``nvme_dir``, Note [NVMe tiles follow whole parameters]) work on one rank,
    together too (the weights' homes then stay in RAM), and so do ``offload_fraction`` below
    1 and ``"auto"``: a resident bucket keeps the master and the factors on the device and
    steps each parameter whole there with torch's operations (Note [whole parameters
    stepped on the device] in ``state/whole_resident.py``). On several ranks each parameter
    is stepped whole by one rank (Note [a whole parameter has one owner] in
    ``partition.py``). ``state_dict`` holds torch's ``row_var``/``col_var``/``variance``;
    ``save_streaming`` saves them too (Note [shaped state in a streamed checkpoint]).
    ``config``, ``accelerator``, ``process_group``, ``model`` and ``layers``: see
    ``OffloadOptimizer``.
    """

    rule: OptimizerRule = ADAFACTOR

    def __init__(
        self,
        params: Iterable[torch.Tensor]
        | Iterable[tuple[str, torch.Tensor]]
        | Iterable[dict[str, Any]],
        lr: float | torch.Tensor = 1e-2,
        beta2_decay: float = -0.8,
        eps: tuple[float | None, float] = (None, 1e-3),
        d: float = 1.0,
        weight_decay: float = 0.0,
        *,
        foreach: bool | None = None,
        maximize: bool = False,
        config: OffloadConfig | None = None,
        accelerator: Accelerator | None = None,
        process_group: Any = None,
        model: torch.nn.Module | None = None,
        layers: Sequence[torch.nn.Module] | None = None,
    ) -> None:
        refuse_torch_switches(type(self).__name__, foreach=foreach)
        defaults = {
            "lr": lr,
            "beta2_decay": beta2_decay,
            "eps": eps,
            "d": d,
            "weight_decay": weight_decay,
            "maximize": maximize,
            # torch's Adafactor's switch at our value (Note [torch's implementation
            # switches in a group] in rule/values.py)
            "foreach": TORCH_SWITCHES["foreach"],
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
