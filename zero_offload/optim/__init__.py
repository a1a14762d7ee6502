"""Offloading optimizers."""

from .offload_adamw import OffloadAdam, OffloadAdamW
from .torch_clipping import install as _install_clipping_guard
from .update.modes import StepFailed

__all__ = ["OffloadAdam", "OffloadAdamW", "StepFailed"]

# Note [torch's clipping cannot see our gradients] in torch_clipping.py
_install_clipping_guard()
