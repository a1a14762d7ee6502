"""Activation offload: checkpoint inputs and saved tensors in host memory, with prefetch.

``checkpoint(fn, *args)`` is ``torch.utils.checkpoint`` (non-reentrant) whose kept inputs
go to the host; ``with offload_activations():`` sends any big saved tensor there. Both use
an ``ActivationOffloader`` (pools, copies, prefetch), shareable with ``OffloadAdamW``.
"""

from __future__ import annotations

from .checkpoint import checkpoint
from .config import ActivationOffloadConfig
from .default import default_offloader
from .offloader import ActivationOffloader
from .record import ActivationState
from .saved_tensors import offload_activations, offload_hooks

__all__ = [
    "ActivationOffloadConfig",
    "ActivationOffloader",
    "ActivationState",
    "checkpoint",
    "default_offloader",
    "offload_activations",
    "offload_hooks",
]
