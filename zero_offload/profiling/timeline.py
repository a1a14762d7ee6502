"""The copies and stalls a profiler heard, kept as plain numbers once their events completed.

Note [the profiler keeps numbers, not events]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A record (``CopyRecord``, ``StallRecord``) carries two events, and an event is a handful of
objects the cyclic GC tracks. Kept for a whole profile, thousands of records a step, they
made every collection of the oldest generation walk them all: on the host accelerator the
profiler's cost per copy was mostly the collector's (issue 39). So a timeline holds a record
only until its events have completed, and then keeps what the writers read of it, its
times and its sizes, as rows of typed arrays (``array.array``: numbers, not objects) plus
its label (a string, which the GC does not track). The events go; nothing here holds one
after the profiler stops (it waits for the copies in flight).

Records are settled (turned into rows):
- at each ``prof.step()`` and at stop, all of them whose events have completed;
- on the thread that hands one in, when the pending list reaches ``_settle_at``: after each
  settle that mark is ``max(2 * still pending, still pending + SETTLE_EVERY)``, so the list
  stays near ``SETTLE_EVERY`` plus the copies in flight, and each record's events are read
  at most about twice whatever the queue's depth (each read is a field on the host
  accelerator, an event query and an ``elapsed_time`` on CUDA).

``SETTLE_EVERY`` is small on purpose: a pending record is about five tracked objects (the
record, its two events, the end event's lock), and 64 of them stay under the collector's
700-object threshold for its youngest generation, so most records are settled before any
collection sees them. A record alive at two collections is promoted to the oldest
generation, and enough promotions trigger a full collection, which walks every object in
the process (a tenth of a second in a process that imported torch).

The writers iterate ``CopySpan``/``StallSpan`` tuples, made on demand: the settled rows,
then the records still pending (their times ``None`` where an event has not completed).
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from array import array
from collections.abc import Iterator
from typing import Generic, NamedTuple, TypeVar

from ..memory.traffic import Category, CopyRecord, Direction, StallRecord

__all__ = ["SETTLE_EVERY", "CopySpan", "CopyTimeline", "StallSpan", "StallTimeline"]

#: Pending records a timeline lets grow before settling on the appending thread; Note [the
#: profiler keeps numbers, not events].
SETTLE_EVERY = 64


class CopySpan(NamedTuple):
    """One copy as the writers read it (seconds on ``time.perf_counter``'s clock)."""

    manager: int  # index of the manager in ProfileData.managers
    seq: int  # the manager's issue number
    direction: Direction
    category: Category
    nbytes: int
    stream: str
    issued_at: float  # when the copy was queued
    began: float | None  # when it began on its stream; None while pending
    ended: float | None  # when it finished; None while pending
    label: str

    def seconds(self) -> float | None:
        """Start to end on its stream; None while pending."""
        if self.began is None or self.ended is None:
            return None
        return max(0.0, self.ended - self.began)


class StallSpan(NamedTuple):
    """One ``wait_for`` stall of compute (Note [exposed time is measured on the compute
    stream]), as the writers read it."""

    manager: int
    seq: int
    category: Category
    stream: str  # the waiting (compute) stream
    issued_at: float
    began: float | None  # the compute stream's event before the waits; None while pending
    ended: float | None  # the one after them
    waited_for: int  # events compute waited on

    def seconds(self) -> float | None:
        """How long compute stood still; None while pending."""
        if self.began is None or self.ended is None:
            return None
        return max(self.ended - self.began, 0.0)


R = TypeVar("R", CopyRecord, StallRecord)
S = TypeVar("S", CopySpan, StallSpan)


class _Timeline(ABC, Generic[R, S]):
    """Pending records and settled rows; see Note [the profiler keeps numbers, not events].

    A settled row is four ints (manager, seq, kind, and bytes or events waited for) in
    ``_ints``, three floats (issued, began, ended) in ``_floats``, and a label in
    ``_labels``; ``kind`` indexes ``_kinds``, the distinct (direction, category, stream)
    seen. ``_lock`` guards all of it: records arrive from the caller's thread and the
    stream workers.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # Records not yet settled, and their managers' indices (a parallel list of ints: no
        # tuple per record for the collector to track).
        self._pending: list[R] = []
        self._pending_managers: list[int] = []
        self._settle_at = SETTLE_EVERY
        self._kinds: list[tuple[Direction | None, Category, str]] = []
        self._kind_codes: dict[tuple[Direction | None, Category, str], int] = {}
        self._ints = array("q")  # 4 per row
        self._floats = array("d")  # 3 per row
        self._labels: list[str] = []  # 1 per row

    # -- what a subclass says about its records -----------------------------------------

    @staticmethod
    @abstractmethod
    def _times(record: R) -> tuple[float | None, float | None]:
        """(began, ended) of the record's work, None while not known."""

    @staticmethod
    @abstractmethod
    def _fields(record: R) -> tuple[Direction | None, int, str]:
        """(direction or None, bytes or events waited for, label)."""

    @staticmethod
    @abstractmethod
    def _span(manager: int, seq: int, kind: tuple, count: int, times: tuple, label: str) -> S:
        """The public row of a settled record."""

    # -- writing ------------------------------------------------------------------------

    def append(self, manager: int, record: R) -> None:
        """Keep ``record`` (a listener's whole work); settles now and then, see the Note."""
        with self._lock:
            pending = self._pending
            pending.append(record)
            self._pending_managers.append(manager)
            if len(pending) >= self._settle_at:
                self._settle()

    def settle(self) -> None:
        """Turn every record whose events have completed into a row (at step and stop)."""
        with self._lock:
            self._settle()

    def _settle(self) -> None:
        kept: list[R] = []
        kept_managers: list[int] = []
        ints, floats, labels = self._ints, self._floats, self._labels
        times, fields = self._times, self._fields
        last_key: tuple | None = None
        last_code = 0
        for manager, record in zip(self._pending_managers, self._pending, strict=True):
            began, ended = times(record)
            if began is None or ended is None:
                kept.append(record)
                kept_managers.append(manager)
                continue
            direction, count, label = fields(record)
            key = (direction, record.category, record.stream)
            if key != last_key:  # runs of one kind are the rule: one dict lookup per run
                code = self._kind_codes.get(key)
                if code is None:
                    code = self._kind_codes[key] = len(self._kinds)
                    self._kinds.append(key)
                last_key, last_code = key, code
            ints.extend((manager, record.seq, last_code, count))
            floats.extend((record.issued_at, began, ended))
            labels.append(label)
        self._pending, self._pending_managers = kept, kept_managers
        self._settle_at = max(2 * len(kept), len(kept) + SETTLE_EVERY)

    # -- reading ------------------------------------------------------------------------

    @property
    def pending(self) -> int:
        """Records still held with their events (not yet settled)."""
        with self._lock:
            return len(self._pending)

    def __len__(self) -> int:
        with self._lock:
            return len(self._labels) + len(self._pending)

    def __iter__(self) -> Iterator[S]:
        with self._lock:  # a snapshot: records may still arrive while recording
            ints, floats, labels = self._ints[:], self._floats[:], list(self._labels)
            kinds = list(self._kinds)
            pending = list(zip(self._pending_managers, self._pending, strict=True))
        for row, label in enumerate(labels):
            manager, seq, code, count = ints[4 * row : 4 * row + 4]
            times = floats[3 * row : 3 * row + 3]
            yield self._span(manager, seq, kinds[code], count, tuple(times), label)
        for manager, record in pending:
            direction, count, label = self._fields(record)
            times = (record.issued_at, *self._times(record))
            kind = (direction, record.category, record.stream)
            yield self._span(manager, record.seq, kind, count, times, label)


class CopyTimeline(_Timeline[CopyRecord, CopySpan]):
    """The copies heard (``CopySpan`` when iterated)."""

    @staticmethod
    def _times(record: CopyRecord) -> tuple[float | None, float | None]:
        return record.start.completed_at(), record.end.completed_at()

    @staticmethod
    def _fields(record: CopyRecord) -> tuple[Direction | None, int, str]:
        return record.direction, record.nbytes, record.label

    @staticmethod
    def _span(
        manager: int, seq: int, kind: tuple, count: int, times: tuple, label: str
    ) -> CopySpan:
        direction, category, stream = kind
        issued, began, ended = times
        return CopySpan(
            manager, seq, direction, category, count, stream, issued, began, ended, label
        )


class StallTimeline(_Timeline[StallRecord, StallSpan]):
    """The compute stalls heard (``StallSpan`` when iterated)."""

    @staticmethod
    def _times(record: StallRecord) -> tuple[float | None, float | None]:
        return record.before.completed_at(), record.after.completed_at()

    @staticmethod
    def _fields(record: StallRecord) -> tuple[Direction | None, int, str]:
        return None, record.waited_for, ""

    @staticmethod
    def _span(
        manager: int, seq: int, kind: tuple, count: int, times: tuple, label: str
    ) -> StallSpan:
        _, category, stream = kind
        issued, began, ended = times
        return StallSpan(manager, seq, category, stream, issued, began, ended, count)
