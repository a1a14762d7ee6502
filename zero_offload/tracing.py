"""Named phases: ``torch.profiler`` ranges plus timings for the traffic profiler.

``with phase("cpu_adam", track="cpu_optimizer"):`` shows up as ``zero_offload::cpu_adam``
inside a user's ``torch.profiler`` trace, and, while a ``zero_offload.profile()`` is active,
is reported to it with its start and end on the ``time.perf_counter()`` clock. With no
listener the cost is one ``record_function`` (a few microseconds); use it per bucket or per
tile, never per element.

A phase may name its ``owner`` (an optimizer's memory manager): a listener added with
``owner=`` hears only that owner's phases (one optimizer's CPU Adam time, when a run has
several), a listener added without hears every phase.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

__all__ = ["PhaseListener", "add_phase_listener", "phase"]

#: Called as ``listener(name, track, start, end)`` when a phase ends.
PhaseListener = Callable[[str, str, float, float], None]

#: ``(listener, owner)``: ``owner`` is a weak reference to the only owner whose phases
#: the listener hears, or None for every phase.
_listeners: list[tuple[PhaseListener, weakref.ReferenceType[Any] | None]] = []
_lock = threading.Lock()  # guards _listeners


def add_phase_listener(listener: PhaseListener, *, owner: object = None) -> Callable[[], None]:
    """Report every phase to ``listener`` from now on (only ``owner``'s phases when given;
    held weakly); returns the function that stops it."""
    entry = (listener, None if owner is None else weakref.ref(owner))
    with _lock:
        _listeners.append(entry)

    def remove() -> None:
        with _lock:
            if entry in _listeners:
                _listeners.remove(entry)

    return remove


@contextmanager
def phase(name: str, *, track: str = "compute", owner: object = None) -> Iterator[None]:
    """Time the body as phase ``name`` on ``track`` (compute, cpu_optimizer, copy, comm),
    on behalf of ``owner`` (see the module docstring)."""
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
            for listener, heard in listeners:
                if heard is None or (owner is not None and heard() is owner):
                    listener(name, track, start, end)
