"""The cyclic garbage collector's pauses, counted and timed through ``gc.callbacks``.

Note [GC pauses per step]
~~~~~~~~~~~~~~~~~~~~~~~~~
Python's cyclic collector stops the thread that triggered it (and, holding the GIL, every
other) while it walks the objects it tracks; a collection of the oldest generation walks
all of them. Whatever keeps many tracked objects alive across a step (records with events,
Note [the profiler keeps numbers, not events] in ``timeline.py``) makes the training loop
pay for it in pauses that no phase shows. ``GcPauses`` measures them: a callback in
``gc.callbacks`` stamps each collection's start and stop, and ``take()`` returns the
window since the previous call as a ``GcWindow`` (collections per generation, seconds
paused, the longest pause, objects collected). The profiler takes one window per
``prof.step()`` (``ProfileData.gc_steps``, the report's ``gc`` line); the benchmarks take
them around what they time.

A pause is timed in the CPU time of the thread that collects (``time.thread_time``), not
on the wall clock: the callback is Python, so at its start the interpreter may hand the GIL
to another thread, and a wall clock would count that thread's work (milliseconds, when a
stream worker is busy) as the collector's. The collector itself never lets go of the GIL.

Totals are kept as one tuple replaced whole, so ``take()`` reads a consistent sum without
a lock (a lock here could deadlock: a collection can start on the thread that holds it).
The longest pause is the one figure reset per window: a collection that finishes on
another thread while ``take()`` runs may count its pause in either neighbouring window.
The callback costs about a microsecond per collection.
"""

from __future__ import annotations

import gc
import time
from typing import Any, NamedTuple

__all__ = ["GcPauses", "GcWindow"]


class GcWindow(NamedTuple):
    """The collections in one window of time (seconds of the collecting thread's CPU time,
    see Note [GC pauses per step])."""

    gen0: int  # collections of generation 0 only
    gen1: int  # of generations 0 and 1
    gen2: int  # full collections
    seconds: float  # the collector's pauses, summed
    longest: float  # the longest single pause
    collected: int  # unreachable objects the collections found

    @property
    def collections(self) -> int:
        return self.gen0 + self.gen1 + self.gen2

    def __add__(self, other: object) -> GcWindow:  # type: ignore[override]
        if not isinstance(other, GcWindow):
            return NotImplemented
        return GcWindow(
            self.gen0 + other.gen0,
            self.gen1 + other.gen1,
            self.gen2 + other.gen2,
            self.seconds + other.seconds,
            max(self.longest, other.longest),
            self.collected + other.collected,
        )


EMPTY = GcWindow(0, 0, 0, 0.0, 0.0, 0)


class GcPauses:
    """Listens to the collector from construction until ``close()``; see Note [GC pauses
    per step]. Usable as a context manager."""

    def __init__(self) -> None:
        self._began = 0.0  # thread_time at the running collection's start
        self._totals = EMPTY  # since construction, longest since the last take()
        self._mark = EMPTY  # _totals at the last take()
        self._open = True
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        now = time.thread_time()  # a collection starts and stops on one thread
        if phase == "start":
            self._began = now
            return
        pause = now - self._began
        gen = info.get("generation", 0)
        t = self._totals
        self._totals = GcWindow(
            t.gen0 + (gen == 0),
            t.gen1 + (gen == 1),
            t.gen2 + (gen == 2),
            t.seconds + pause,
            max(t.longest, pause),
            t.collected + int(info.get("collected", 0)),
        )

    def take(self) -> GcWindow:
        """The collections since the previous ``take()`` (or construction)."""
        totals, mark = self._totals, self._mark
        self._mark = totals._replace(longest=0.0)
        self._totals = self._totals._replace(longest=0.0)
        return GcWindow(
            totals.gen0 - mark.gen0,
            totals.gen1 - mark.gen1,
            totals.gen2 - mark.gen2,
            totals.seconds - mark.seconds,
            totals.longest,
            totals.collected - mark.collected,
        )

    def close(self) -> None:
        """Stop listening (idempotent)."""
        if self._open:
            self._open = False
            if self._on_gc in gc.callbacks:
                gc.callbacks.remove(self._on_gc)

    def __enter__(self) -> GcPauses:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
