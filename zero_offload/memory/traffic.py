"""What moved between tiers and who waited for it: one record per copy and per stall, and
always-on counters.

The memory manager writes these (see Note [one choke point for copies] in ``manager.py``);
the profiler only reads them, so its counts are complete by construction. Every timeline
fact the manager knows is one of the records here, carried by events whose
``completed_at()`` places it on the ``time.perf_counter()`` clock (the device clock, mapped).
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable
from typing import NamedTuple

from ..accelerator import Event

__all__ = [
    "Category",
    "CopyRecord",
    "Direction",
    "Record",
    "RecordListener",
    "StallRecord",
    "TrafficCounters",
]


class Direction(enum.Enum):
    """Which way a copy crosses a tier boundary (device/host, or host/NVMe)."""

    D2H = "device_to_host"
    H2D = "host_to_device"
    #: NVMe tier to host (``TieredMemoryManager.disk_copy``, ``memory/storage.py``).
    NVME_READ = "nvme_to_host"
    #: Host to NVMe tier.
    NVME_WRITE = "host_to_nvme"

    # A member is equal only to itself, so the identity hash (C) agrees with ``==``; Enum's
    # own hashes the name in Python, at every dict lookup keyed by a member (the counters at
    # each copy, the profiler's kinds at each settle).
    __hash__ = object.__hash__


class Category(enum.Enum):
    """What a copy carries; the profiler groups its report by this."""

    GRADIENTS = "gradients"
    WEIGHTS = "weights"
    OPTIMIZER_STATE = "optimizer_state"
    ACTIVATIONS = "activations"

    __hash__ = object.__hash__  # as Direction's


class CopyRecord(NamedTuple):
    """One copy issued through the memory manager.

    ``began()`` is when the copy began on its stream (everything queued before it done),
    ``ended()`` when it finished; None while pending. ``start`` is an event recorded before
    the copy for that purpose, or None where ``end`` carries the start itself
    (``end.started_at()``, a thread stream's): Note [a copy's start is its end event's] in
    ``manager.py``. A named tuple, not a frozen dataclass: built at every listened copy, and
    a tuple is built in half the time (no ``object.__setattr__`` per field).
    """

    seq: int  # issue order, from 0, per manager
    direction: Direction
    category: Category
    nbytes: int
    stream: str  # the stream's name
    issued_at: float  # time.perf_counter() when the copy was queued
    start: Event | None  # None where ``end`` carries the start
    end: Event
    label: str  # free-form: which bucket, which layer

    def began(self) -> float | None:
        """When the copy began on its stream; None while pending (or untimed)."""
        start = self.start
        return self.end.started_at() if start is None else start.completed_at()

    def ended(self) -> float | None:
        """When the copy finished; None while pending (or untimed)."""
        return self.end.completed_at()


class StallRecord(NamedTuple):
    """Compute made to wait for copies (``TieredMemoryManager.wait_for``), on its own clock.

    ``before`` is recorded on the compute stream just before the waits and ``after`` just
    after them, so ``after.completed_at() - before.completed_at()`` is how long the compute
    stream stood still: on CUDA that is the GPU's stall, not the (instant) host call.
    A named tuple, as ``CopyRecord``.
    """

    seq: int  # issue order, shared with the copies' numbering, per manager
    category: Category
    stream: str  # the waiting (compute) stream's name
    issued_at: float  # time.perf_counter() when the waits were queued
    before: Event
    after: Event
    waited_for: int  # how many events compute waited on

    def seconds(self) -> float | None:
        """The stall, in seconds; None while either event is pending (or untimed)."""
        began, ended = self.before.completed_at(), self.after.completed_at()
        if began is None or ended is None:
            return None
        return max(ended - began, 0.0)


#: What the manager hands its listeners.
Record = CopyRecord | StallRecord
RecordListener = Callable[[Record], None]


class TrafficCounters:
    """Copies and bytes per (direction, category) since construction, and the host bytes
    of the passes over gradients on the host (``add_pass``).

    ``_lock`` guards ``_counts`` and ``_passes`` (copies are issued from the caller's
    thread and from stream workers; passes run on the host worker).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[tuple[Direction, Category], list[int]] = {}
        self._passes: dict[str, list[int]] = {}  # name -> [calls, bytes read, bytes written]

    def add_pass(self, name: str, *, read: int, written: int) -> None:
        """Count one host pass ``name`` (statistics, accumulation) over host memory: bytes
        it read and wrote. What host bytes per parameter a step costs beside its copies
        and its optimizer kernel (issue 39)."""
        with self._lock:
            entry = self._passes.get(name)
            if entry is None:
                entry = self._passes[name] = [0, 0, 0]
            entry[0] += 1
            entry[1] += read
            entry[2] += written

    def passes(self) -> dict[str, dict[str, int]]:
        """``{name: {"calls": n, "read": r, "written": w}}`` for every pass seen."""
        with self._lock:
            return {
                name: {"calls": c, "read": r, "written": w}
                for name, (c, r, w) in sorted(self._passes.items())
            }

    def add(self, direction: Direction, category: Category, nbytes: int) -> None:
        """Count one copy of ``nbytes``."""
        key = (direction, category)
        with self._lock:
            entry = self._counts.get(key)
            if entry is None:  # the pair's first copy (no list built per call)
                entry = self._counts[key] = [0, 0]
            entry[0] += 1
            entry[1] += nbytes

    def snapshot(self) -> dict[str, dict[str, int]]:
        """``{"<direction>/<category>": {"copies": n, "bytes": b}}`` for every pair seen."""
        with self._lock:
            return {
                f"{direction.value}/{category.value}": {"copies": count, "bytes": nbytes}
                for (direction, category), (count, nbytes) in sorted(
                    self._counts.items(), key=lambda item: (item[0][0].value, item[0][1].value)
                )
            }

    def bytes(self, direction: Direction, category: Category | None = None) -> int:
        """Bytes moved in ``direction`` (of ``category``, or of all categories)."""
        with self._lock:
            return sum(
                nbytes
                for (d, c), (_, nbytes) in self._counts.items()
                if d is direction and (category is None or c is category)
            )
