"""Declaring stream accesses to the race checker, for the optimizer's buckets.

Every host-side tensor the optimizer touches is declared where it is touched (Note
[declaring stream accesses] in ``accelerator/base.py``); without a race checker these do
nothing. One place, so the gradient path, the state stores and the update say it alike.
"""

from __future__ import annotations

import torch

from ..memory.manager import TieredMemoryManager

__all__ = ["declare_compute", "declare_cpu"]


def declare_compute(
    manager: TieredMemoryManager, tensor: torch.Tensor, *, bucket: int, write: bool, what: str
) -> None:
    """Compute-stream work on ``tensor`` for bucket ``bucket``."""
    acc = manager.accelerator
    acc.declare_access(
        tensor, stream=acc.current_stream(), write=write, what=f"bucket{bucket} {what}"
    )


def declare_cpu(
    manager: TieredMemoryManager, tensor: torch.Tensor, *, bucket: int, write: bool, what: str
) -> None:
    """Work of the calling CPU thread (the caller or the host worker) on ``tensor``."""
    manager.accelerator.declare_access(
        tensor, stream=None, write=write, what=f"bucket{bucket} {what}"
    )
