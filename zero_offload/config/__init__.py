"""Configuration: small frozen dataclasses, validated once at construction.

Every field documents its unit and default. A bad value raises ``ValueError`` naming the
field, the value and the allowed range, so a mistake surfaces where it was made and not
deep inside a training step.

One module per config (``accelerator``, ``loss_scaler``, ``offload``) and the spelling of the
numbers they share (``values``); every name is re-exported here, where users import them.
"""

from __future__ import annotations

# The spelled settings live in settings.py; re-exported here, where OffloadConfig takes them.
from ..settings import GradAccumulation, GradStaging, OverlapLanding, OverlapShadow
from .accelerator import DEVICE_BUDGET_ENV, AcceleratorConfig
from .loss_scaler import LossScalerConfig
from .offload import OffloadConfig
from .values import format_bytes, parse_bytes, parse_bytes_with_unit

__all__ = [
    "DEVICE_BUDGET_ENV",
    "AcceleratorConfig",
    "GradAccumulation",
    "GradStaging",
    "LossScalerConfig",
    "OffloadConfig",
    "OverlapLanding",
    "OverlapShadow",
    "format_bytes",
    "parse_bytes",
    "parse_bytes_with_unit",
]
