"""The checks on what an ActivationOffloader is given: its config, and a manager to share
(an optimizer's ``opt.manager``) with the accelerator it implies. Each error names the
argument, the value and what would work.
"""

from __future__ import annotations

from ..accelerator import Accelerator
from ..memory.manager import TieredMemoryManager
from .config import ActivationOffloadConfig

__all__ = ["check_arguments"]


def check_arguments(
    *,
    manager: TieredMemoryManager | None,
    config: ActivationOffloadConfig | None,
    accelerator: Accelerator | None,
) -> ActivationOffloadConfig:
    """The config to use (the default one for None); raises on a config of another type, and
    on a manager that is not one, is closed, or has another accelerator than ``accelerator``."""
    config = ActivationOffloadConfig() if config is None else config
    if not isinstance(config, ActivationOffloadConfig):
        raise TypeError(f"config must be an ActivationOffloadConfig, got {type(config).__name__}")
    if manager is not None:
        if not isinstance(manager, TieredMemoryManager):
            raise TypeError(f"manager must be a TieredMemoryManager, got {type(manager).__name__}")
        if accelerator is not None and accelerator is not manager.accelerator:
            raise ValueError(
                "accelerator= differs from manager.accelerator; pass one of them (the "
                "manager's accelerator is used when sharing a manager)"
            )
        if manager.closed:
            raise ValueError(
                "manager= is closed (its optimizer was closed or dropped), so its copy "
                "streams are stopped; share the manager of a live optimizer, or pass no "
                "manager to build one"
            )
    return config
