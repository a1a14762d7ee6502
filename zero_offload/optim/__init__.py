"""Offloading optimizers."""

from .offload_adamw import OffloadAdam, OffloadAdamW
from .stepping import StepFailed
from .torch_clipping import install as _install_clipping_guard

__all__ = ["OffloadAdam", "OffloadAdamW", "StepFailed"]

# Note [torch's clipping cannot see our gradients] in torch_clipping.py
_install_clipping_guard()
