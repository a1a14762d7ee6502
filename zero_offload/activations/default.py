"""The process-wide ActivationOffloader: the one ``checkpoint`` and ``offload_activations``
use when they are given none.
"""

from __future__ import annotations

import threading

from .offloader import ActivationOffloader

__all__ = ["default_offloader"]

_default: ActivationOffloader | None = None
_default_lock = threading.Lock()  # guards _default


def default_offloader() -> ActivationOffloader:
    """The process-wide offloader, built on first use from ``get_accelerator()``."""
    global _default
    with _default_lock:
        if _default is None:
            _default = ActivationOffloader()
        return _default
