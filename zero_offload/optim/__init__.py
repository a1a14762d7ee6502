"""Offloading optimizers."""

from .offload_adamw import OffloadAdam, OffloadAdamW
from .stepping import StepFailed

__all__ = ["OffloadAdam", "OffloadAdamW", "StepFailed"]
