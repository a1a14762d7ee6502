"""The copies and stalls a profiler heard, kept as plain numbers once their events completed.

Note [the profiler keeps numbers, not events]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A record (``CopyRecord``, ``StallRecord``) carries one or two events, and an event is an
object the cyclic GC tracks. Kept for a whole profile, thousands of records a step, they
made every collection of the oldest generation walk them all: on the host accelerator the
profiler's cost per copy was mostly the collector's (issue 39). So a timeline holds a record
only until its events have completed, and then keeps what the writers read of it, its
times and its sizes, as columns of typed arrays (``array.array``: numbers, not objects) plus
its label (a string, which the GC does not track). The events go; nothing here holds one
after the profiler stops (it waits for the copies in flight). Until then a record is kept
as its fields, flat in a list (Note [appending to the profiler takes no lock]): no tuple
per record, so a copy not yet settled costs the collector its end event alone.

Records are settled (turned into rows):
- at each ``prof.step()`` and at stop, all of them whose events have completed;
- on the issuing thread, at the manager's ``tick`` (every ``TICK_EVERY`` copies), when the
  records handed in since the last settle reach ``_settle_at``: after each settle that mark
  is ``max(2 * still pending, still pending + SETTLE_EVERY)`` records, so the pending ones
  stay near ``SETTLE_EVERY`` plus the copies in flight, and each record's events are read
  at most about twice whatever the queue's depth (each read is a field on the host
  accelerator, an event query and an ``elapsed_time`` on CUDA).

``SETTLE_EVERY`` is small on purpose: 256 pending records are 256 tracked objects (their
end events; the fields are numbers and strings in one list), under the collector's
700-object threshold for its youngest generation, so most are settled before any
collection sees them. (It was 64 when a pending record was about five tracked objects: a
record, two events and their locks.) A record alive at two collections is promoted to the
oldest generation, and enough promotions trigger a full collection, which walks every
object in the process (a tenth of a second in a process that imported torch). Each settle
also costs about 8 us whatever its size, a thirtieth of a microsecond per record at 256.

The writers iterate ``CopySpan``/``StallSpan`` tuples, made on demand: the settled rows,
then the records still pending (their times ``None`` where an event has not completed).
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from array import array
from collections.abc import Callable, Iterator
from itertools import chain, compress
from typing import Generic, NamedTuple, TypeVar

from ..accelerator import completion_times, event_times
from ..memory.traffic import Category, CopyRecord, Direction, StallRecord

__all__ = ["SETTLE_EVERY", "CopySpan", "CopyTimeline", "StallSpan", "StallTimeline"]

#: Pending records a timeline lets grow before settling on the appending thread; Note [the
#: profiler keeps numbers, not events].
SETTLE_EVERY = 256


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


class _KindCodes(dict):
    """Kind -> code, numbering a new kind on first sight, so ``map(codes.__getitem__,
    kinds)`` codes a whole batch in C."""

    def __missing__(self, kind: tuple) -> int:
        code = self[kind] = len(self)
        return code


class _Timeline(ABC, Generic[R, S]):
    """Pending records and settled rows; see Note [the profiler keeps numbers, not events].

    A settled row is an entry in each column: ``_managers``, ``_seqs``, ``_codes`` (the
    kind's number in ``_kind_codes``: the distinct (direction, category, stream) of copies,
    (category, stream) of stalls) and ``_counts`` (bytes, or events waited for) as typed
    ints; ``_issued``, ``_began`` and ``_ended`` as typed floats; and a label in
    ``_labels``. Records arrive flattened in ``_inboxes`` (a list per manager, ``_WIDTH``
    items per record) without a lock, from the caller's thread and the stream workers;
    ``_lock`` guards everything else, and taking records out of an inbox (Note [appending
    to the profiler takes no lock]).
    """

    #: The record's fields, by position in its named tuple: how many, seq, the kind's
    #: fields, the count, the issue time, the ending event, and the label (-1: none).
    _WIDTH: int
    _SEQ = 0
    _KIND: tuple[int, ...]
    _COUNT: int
    _ISSUED: int
    _END: int  # the event whose completion ends the record
    _LABEL: int

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # Records not yet settled, flattened, oldest first, per manager index.
        self._inboxes: dict[int, list] = {}
        self._settle_at = SETTLE_EVERY * self._WIDTH  # in inbox items, across inboxes
        self._kind_codes = _KindCodes()
        self._managers = array("q")
        self._seqs = array("q")
        self._codes = array("q")
        self._counts = array("q")
        self._issued = array("d")
        self._began = array("d")
        self._ended = array("d")
        self._labels: list[str] = []

    @staticmethod
    @abstractmethod
    def _times(columns: list[list]) -> tuple[list[float | None], list[float | None]]:
        """(began, ended) of each record in ``columns`` (a list per field), None where not
        known yet."""

    @staticmethod
    @abstractmethod
    def _span(
        manager: int, seq: int, kind: tuple, count: int, times: tuple[float | None, ...], label: str
    ) -> S:
        """The public row of a record; ``times`` is (issued, began, ended)."""

    # -- writing ------------------------------------------------------------------------

    # Note [appending to the profiler takes no lock]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    # A copy's whole cost to the profiler on the issuing thread is one ``inbox.extend``
    # of the copy's fields (``keeper``, subscribed with ``fields=True``: the manager calls
    # the builtin itself, no Python function in between), and a call of ``tick`` every
    # ``TICK_EVERY`` copies. The fields stay, the tuple does not: a copy in flight leaves
    # the collector one tracked object, its end event, which lives until the stream gets to
    # it anyway, rather than a record as well; and the inbox is one long-lived list, which
    # the young collections do not walk. ``list.extend`` of a tuple runs no Python code, so
    # under the GIL it is atomic: no lock, and records never interleave.
    #
    # Settling takes ``_lock`` (one settler at a time) and replaces only the prefix of an
    # inbox it read, ``inbox[:n] = kept`` after reading ``inbox[:n]`` (one C operation that
    # runs no Python code): records added meanwhile land after ``n`` and stay for the next
    # settle, so none is lost and none is settled twice. It works a column at a time
    # (``flat[i::width]`` slices, ``map``, ``fromlist``, all in C), a third of the cost of
    # a loop over records.
    #
    # A tick settles the oldest records up to the first still pending (found by bisection,
    # ``_completed_prefix``): a copy in flight holds nothing the stream does not (its end
    # event is queued there), so only completed records are worth settling, and the ones in
    # flight, hundreds deep when the issuing thread runs ahead of the workers, are not read
    # again and again. ``prof.step()`` and stop settle every completed record, wherever it
    # is.

    def _inbox(self, manager: int) -> list:
        with self._lock:
            return self._inboxes.setdefault(manager, [])

    def keeper(self, manager: int) -> Callable[[tuple], None]:
        """What keeps the records (or their fields) of manager ``manager`` (its index in
        ``ProfileData.managers``): the inbox's ``extend``. Pair it with ``tick``."""
        return self._inbox(manager).extend

    def tick(self) -> None:
        """Settle the completed oldest records once the records kept reach
        ``_settle_at`` (see the Notes)."""
        if sum(map(len, self._inboxes.values())) >= self._settle_at:
            with self._lock:
                self._settle(whole=False)

    def append(self, manager: int, record: R) -> None:
        """Keep ``record``, as ``keeper(manager)`` then ``tick()`` do."""
        self.keeper(manager)(record)
        self.tick()

    def _codes_of(self, kinds: list[list]) -> list[int]:
        """The kind code of each record, from its kind's columns. A batch of one kind (a run
        of gradient copies in a backward, of weight copies in a step) is coded once:
        ``list.count`` compares by identity first, and the members and stream names are
        the same objects copy after copy."""
        count = len(kinds[0])
        if all(column.count(column[0]) == count for column in kinds):
            return [self._kind_codes[tuple(column[0] for column in kinds)]] * count
        return list(map(self._kind_codes.__getitem__, zip(*kinds, strict=True)))

    def _completed_prefix(self, inbox: list, records: int) -> int:
        """How many of the oldest ``records`` in ``inbox`` have completed, found by
        bisection as if they completed in order (they do, stream by stream); a straggler
        inside the prefix is put back when settled. A handful of event reads, however many
        copies are in flight."""
        low, high, width, end = 0, records, self._WIDTH, self._END
        while low < high:
            middle = (low + high) // 2
            if inbox[middle * width + end].completed_at() is None:
                high = middle
            else:
                low = middle + 1
        return low

    def settle(self) -> None:
        """Turn every record whose events have completed into a row (at step and stop)."""
        with self._lock:
            self._settle(whole=True)

    def _settle(self, *, whole: bool) -> None:
        width = self._WIDTH
        still = 0
        for manager, inbox in self._inboxes.items():
            taken = len(inbox)  # Note [appending to the profiler takes no lock]
            if not whole:  # the oldest records up to the first pending: see the Note
                taken = self._completed_prefix(inbox, taken // width) * width
                still += len(inbox) - taken
                if not taken:
                    continue
            flat = inbox[:taken]
            columns = [flat[field::width] for field in range(width)]
            began, ended = self._times(columns)
            kept: list = []
            if not (all(began) and all(ended)):  # some still pending (None): set them apart
                done = [b is not None and e is not None for b, e in zip(began, ended, strict=True)]
                pending = [not d for d in done]
                kept_columns = [list(compress(column, pending)) for column in columns]
                kept = list(chain.from_iterable(zip(*kept_columns, strict=True)))
                columns = [list(compress(column, done)) for column in columns]
                began = list(compress(began, done))
                ended = list(compress(ended, done))
            inbox[:taken] = kept
            if whole:
                still += len(inbox)
            if not began:
                continue
            # fromlist: twice as fast as extend (no iterator); each column is a list here.
            self._managers.fromlist([manager] * len(began))
            self._seqs.fromlist(columns[self._SEQ])
            self._codes.fromlist(self._codes_of([columns[field] for field in self._KIND]))
            self._counts.fromlist(columns[self._COUNT])
            self._issued.fromlist(columns[self._ISSUED])
            self._began.fromlist(began)  # type: ignore[arg-type]
            self._ended.fromlist(ended)  # type: ignore[arg-type]
            if self._LABEL < 0:
                self._labels.extend([""] * len(began))
            else:
                self._labels.extend(columns[self._LABEL])
        self._settle_at = max(2 * still, still + SETTLE_EVERY * width)

    # -- reading ------------------------------------------------------------------------

    def _pending_count(self) -> int:
        return sum(map(len, self._inboxes.values())) // self._WIDTH

    @property
    def pending(self) -> int:
        """Records still held with their events (not yet settled)."""
        with self._lock:
            return self._pending_count()

    def __len__(self) -> int:
        with self._lock:
            return len(self._labels) + self._pending_count()

    def __iter__(self) -> Iterator[S]:
        with self._lock:  # a snapshot: records may still arrive while recording
            rows = (
                self._managers[:],
                self._seqs[:],
                self._codes[:],
                self._counts[:],
                self._issued[:],
                self._began[:],
                self._ended[:],
                list(self._labels),
            )
            kinds = list(self._kind_codes)  # in code order: a dict keeps insertion order
            pending = [(m, inbox[:]) for m, inbox in self._inboxes.items()]
        for manager, seq, code, count, issued, began, ended, label in zip(*rows, strict=True):
            yield self._span(manager, seq, kinds[code], count, (issued, began, ended), label)
        width = self._WIDTH
        for manager, flat in pending:
            columns = [flat[field::width] for field in range(width)]
            for index, (began, ended) in enumerate(zip(*self._times(columns), strict=True)):
                record = flat[index * width : (index + 1) * width]
                kind = tuple(record[field] for field in self._KIND)
                times = (record[self._ISSUED], began, ended)
                label = "" if self._LABEL < 0 else record[self._LABEL]
                yield self._span(
                    manager, record[self._SEQ], kind, record[self._COUNT], times, label
                )


class CopyTimeline(_Timeline[CopyRecord, CopySpan]):
    """The copies heard (``CopySpan`` when iterated)."""

    _WIDTH = len(CopyRecord._fields)
    _KIND = (1, 2, 4)  # direction, category, stream
    _COUNT = 3  # nbytes
    _ISSUED = 5
    _END = 7
    _LABEL = 8

    @staticmethod
    def _times(columns: list[list]) -> tuple[list[float | None], list[float | None]]:
        starts, ends = columns[6], columns[7]
        end_began, ended = event_times(ends)  # Note [a copy's start is its end event's]
        if starts.count(None) == len(starts):  # every end carries its start (thread streams)
            return end_began, ended
        began = [  # a start event was recorded (CUDA, the host's compute stream, NVMe)
            carried if start is None else start.completed_at()
            for start, carried in zip(starts, end_began, strict=True)
        ]
        return began, ended

    @staticmethod
    def _span(
        manager: int, seq: int, kind: tuple, count: int, times: tuple[float | None, ...], label: str
    ) -> CopySpan:
        direction, category, stream = kind
        issued, began, ended = times
        return CopySpan(
            manager, seq, direction, category, count, stream, issued, began, ended, label
        )


class StallTimeline(_Timeline[StallRecord, StallSpan]):
    """The compute stalls heard (``StallSpan`` when iterated)."""

    _WIDTH = len(StallRecord._fields)
    _KIND = (1, 2)  # category, stream
    _COUNT = 6  # waited_for
    _ISSUED = 3
    _END = 5  # after
    _LABEL = -1

    @staticmethod
    def _times(columns: list[list]) -> tuple[list[float | None], list[float | None]]:
        ended = completion_times(columns[5])  # after
        return completion_times(columns[4]), ended  # before

    @staticmethod
    def _span(
        manager: int, seq: int, kind: tuple, count: int, times: tuple[float | None, ...], label: str
    ) -> StallSpan:
        category, stream = kind
        issued, began, ended = times
        return StallSpan(manager, seq, category, stream, issued, began, ended, count)
