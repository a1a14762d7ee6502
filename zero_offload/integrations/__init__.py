"""Framework integrations, each in its own module and imported only when asked for.

- ``zero_offload.integrations.transformers``: ``OffloadTrainer``, a ``transformers.Trainer``
  that builds (the rule ``TrainingArguments.optim`` names), clips, checkpoints and resumes an
  offload optimizer.
- ``zero_offload.integrations.accelerate``: ``OffloadAccelerator``, an
  ``accelerate.Accelerator`` whose ``prepare``, ``backward`` and ``clip_grad_norm_`` know
  that ``OffloadAdamW`` keeps the gradients on the host.
- ``zero_offload.integrations.trl``: ``OffloadSFTTrainer`` and ``OffloadDPOTrainer``, TRL's
  trainers with ``OffloadTrainer``'s optimizer, clipping and checkpoints.
- ``zero_offload.integrations.lightning``: ``OffloadLightningModule``, a
  ``LightningModule`` whose ``gradient_clip_val`` clips inside ``OffloadAdamW``, and
  ``OffloadDDPStrategy`` for several processes without a DDP wrapper.

Nothing here is imported by ``import zero_offload``: neither transformers, accelerate, TRL
nor Lightning is a dependency of the library (docs/design.md, "The layers": nothing
imports ``integrations``).
The class names are also attributes of this package, each importing its module (and its
framework) on first access: ``from zero_offload.integrations import OffloadSFTTrainer``.
"""

from __future__ import annotations

import importlib
from typing import Any

#: Each class this package names, and the module that defines it.
_LAZY = {
    "OffloadTrainer": "transformers",
    "OffloadAccelerator": "accelerate",
    "OffloadSFTTrainer": "trl",
    "OffloadDPOTrainer": "trl",
    "OffloadLightningModule": "lightning",
    "OffloadDDPStrategy": "lightning",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{module}", __name__), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
