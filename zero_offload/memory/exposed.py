"""Exposed transfer time: how long compute stood still waiting for copies, by category,
folded from the manager's stall records as their events complete (``ExposedTime``; the
manager's ``wait_for`` makes the records)."""

from __future__ import annotations

import threading

from .traffic import Category, StallRecord

__all__ = ["ExposedTime"]

# Note [exposed time is measured on the compute stream]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Exposed transfer time is how long compute stood still waiting for copies. On CUDA the
# host call ``wait_event`` returns at once, so timing it measures nothing; instead
# ``wait_for`` records an event on the compute stream before the waits and one after,
# and the stall is the gap between their completion times on the device clock (a
# ``StallRecord``). On the host accelerator the same two events bracket the blocking
# call. Stalls count once both events completed; needing timed events, they are
# measured while the accelerator's events are timed (always on the host accelerator;
# on CUDA while a profiler listens, Note [cuda events: blocking, timed only when asked]).

# Note [stall records are bounded]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Every ``wait_for`` makes a ``StallRecord``, thousands per step with parameter offload.
# The manager keeps only those whose events are still pending: each wait folds the
# completed ones into ``_seconds`` (a few floats), whether or not anyone reads
# ``exposed_seconds``, so the memory held is the stalls in flight, not the stalls ever
# made. Should the events fall far behind (a device queue thousands of waits deep), the
# oldest beyond ``MAX_PENDING`` are dropped unmeasured and counted in
# ``dropped`` (the manager's ``stalls_dropped``): the exposed time is then a lower bound, and says so by that count.


class ExposedTime:
    """Seconds of exposed transfer time by category, and the stalls still pending.

    Fields (guarded by ``_lock``; a stall is added from any thread that waits):
        _seconds: from stalls whose events have completed, by category.
        _pending: stalls not yet complete (Note [stall records are bounded]).
        dropped: stalls dropped unmeasured because more than ``MAX_PENDING`` were pending.
    """

    #: Pending stall records kept at most; Note [stall records are bounded].
    MAX_PENDING = 4096

    def __init__(self) -> None:
        self._seconds: dict[Category, float] = {}
        self._pending: list[StallRecord] = []
        self.dropped = 0
        self._lock = threading.Lock()

    def add(self, stall: StallRecord) -> None:
        """Hold ``stall`` until its events complete; fold the completed ones."""
        with self._lock:
            self._pending.append(stall)
            self._fold_completed()  # Note [stall records are bounded]

    def pending(self) -> int:
        """Stall records held now, awaiting their events."""
        with self._lock:
            return len(self._pending)

    def seconds(self) -> dict[Category, float]:
        """Seconds compute stood still so far, by category (a snapshot); never blocks."""
        with self._lock:
            self._fold_completed()
            return dict(self._seconds)

    def _fold_completed(self) -> None:
        """Fold completed stalls into ``_seconds``; the caller holds ``_lock``."""
        pending = []
        for stall in self._pending:
            seconds = stall.seconds()
            if seconds is None:
                pending.append(stall)
            else:
                self._seconds[stall.category] = self._seconds.get(stall.category, 0.0) + seconds
        excess = len(pending) - self.MAX_PENDING
        if excess > 0:
            self.dropped += excess
            del pending[:excess]
        self._pending = pending
