"""Accelerators: one small interface, a CUDA implementation and a host implementation.

``get_accelerator()`` picks CUDA when ``torch.cuda.is_available()``, else the host
accelerator; ``ZERO_OFFLOAD_ACCELERATOR=host|cuda`` overrides the choice.
"""

from __future__ import annotations

import os
import threading

import torch

from ..config import AcceleratorConfig
from .base import (
    Accelerator,
    DeviceBuffer,
    DeviceLedger,
    Event,
    PeakWindow,
    Stream,
    completion_times,
    event_times,
    latest_per_stream,
)
from .cuda import CudaAccelerator, resolve_device_index
from .host import HostAccelerator

__all__ = [
    "ACCELERATOR_ENV",
    "Accelerator",
    "CudaAccelerator",
    "DeviceBuffer",
    "DeviceLedger",
    "Event",
    "HostAccelerator",
    "PeakWindow",
    "Stream",
    "choose_accelerator",
    "completion_times",
    "event_times",
    "get_accelerator",
    "latest_per_stream",
    "set_accelerator",
]

#: Environment variable forcing the accelerator: "host" or "cuda".
ACCELERATOR_ENV = "ZERO_OFFLOAD_ACCELERATOR"

_default: Accelerator | None = None
_default_lock = threading.Lock()


def choose_accelerator() -> tuple[str, str]:
    """Which accelerator ``get_accelerator()`` builds, and why, as ``(name, reason)``."""
    forced = os.environ.get(ACCELERATOR_ENV, "").strip().lower()
    if forced:
        if forced not in ("host", "cuda"):
            raise ValueError(
                f"{ACCELERATOR_ENV}={os.environ[ACCELERATOR_ENV]!r} is not an accelerator; "
                "use 'host' or 'cuda', or unset it to choose automatically"
            )
        if forced == "cuda" and not torch.cuda.is_available():
            raise RuntimeError(
                f"{ACCELERATOR_ENV}=cuda but torch {torch.__version__} sees no CUDA GPU "
                f"(CUDA build: {torch.version.cuda is not None}). Install a CUDA build of torch "
                f"on a GPU machine, or set {ACCELERATOR_ENV}=host."
            )
        return forced, f"forced by {ACCELERATOR_ENV}={forced}"
    if torch.cuda.is_available():
        return "cuda", "torch.cuda.is_available() is True"
    return "host", "no CUDA GPU visible to torch"


def get_accelerator(config: AcceleratorConfig | None = None) -> Accelerator:
    """The process-wide accelerator, built on first use (or anew when ``config`` is given).

    Passing ``config`` replaces the process-wide accelerator with one built from it. A CUDA
    accelerator built before ``torch.cuda.set_device(local_rank)`` is rebuilt for the
    device this rank resolves to now (``resolve_device_index``: a device the user set,
    else ``LOCAL_RANK``, else device 0), so no rank is left on ``cuda:0``.
    """
    global _default
    with _default_lock:
        if _default is None or config is not None or _on_another_device(_default):
            if config is None and _default is not None:
                config = getattr(_default, "config", None)  # same settings, new device
            name, _ = choose_accelerator()
            _default = CudaAccelerator(config) if name == "cuda" else HostAccelerator(config)
        return _default


def _on_another_device(accelerator: Accelerator) -> bool:
    if not isinstance(accelerator, CudaAccelerator):
        return False
    wanted = resolve_device_index(
        None,
        env=os.environ,
        device_count=torch.cuda.device_count(),
        current=torch.cuda.current_device(),
    )
    return accelerator.device.index != wanted


def set_accelerator(accelerator: Accelerator | None) -> None:
    """Replace the process-wide accelerator (``None`` rebuilds it on next use)."""
    global _default
    if accelerator is not None and not isinstance(accelerator, Accelerator):
        raise TypeError(f"accelerator must be an Accelerator or None, got {type(accelerator)}")
    with _default_lock:
        _default = accelerator
