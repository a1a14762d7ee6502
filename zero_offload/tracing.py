"""Named phases: ``torch.profiler`` ranges plus timings for the traffic profiler.

``with phase("cpu_adam", track="cpu_optimizer"):`` shows up as ``zero_offload::cpu_adam``
inside a user's ``torch.profiler`` trace, and, while a ``zero_offload.profile()`` is active,
is reported to it with its start and end on the ``time.perf_counter()`` clock. With no
listener the cost is one ``record_function`` (a few microseconds); use it per bucket or per
tile, never per element.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

__all__ = ["PhaseListener", "add_phase_listener", "phase"]

#: Called as ``listener(name, track, start, end)`` when a phase ends.
PhaseListener = Callable[[str, str, float, float], None]

_listeners: list[PhaseListener] = []
_lock = threading.Lock()  # guards _listeners


def add_phase_listener(listener: PhaseListener) -> Callable[[], None]:
    """Report every phase to ``listener`` from now on; returns the function that stops it."""
    with _lock:
        _listeners.append(listener)

    def remove() -> None:
        with _lock:
            if listener in _listeners:
                _listeners.remove(listener)

    return remove


@contextmanager
def phase(name: str, *, track: str = "compute") -> Iterator[None]:
    """Time the body as phase ``name`` on ``track`` (compute, cpu_optimizer, copy, comm)."""
    with torch.profiler.record_function(f"zero_offload::{name}"):
        if not _listeners:
            yield
            return
        start = time.perf_counter()
        try:
            yield
        finally:
            end = time.perf_counter()
            with _lock:
                listeners = list(_listeners)
            for listener in listeners:
                listener(name, track, start, end)
