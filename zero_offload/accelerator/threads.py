"""ThreadStream: a CPU thread that runs queued work in order, with events; no device needed.

Two things are built on it: the host accelerator's simulated device streams (``host.py``)
and the optimizer's CPU worker (``memory/host_worker.py``), which exists on CUDA too. So it
lives apart from the simulator: the CUDA path imports this module, never ``host.py``.

See Note [stream semantics] and Note [stream errors are sticky] in ``base.py``, and Note
[race checking with vector clocks] in ``race_checker.py`` for the ``checker`` hooks.

Note [when a thread stream's clock moves]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A simulated device stream's work is copies, whose accesses the copy primitive records when
they are *issued*; so its events are stamped, and its waits merged, at issue time, exactly
as the CUDA sanitizer treats a GPU stream. A CPU worker (``memory/host_worker.py``) runs
Python tasks whose accesses are only known while they *run* (they declare them from inside
the task, with ``stream=None``: the worker's own thread). For such a stream
(``clock_at_execution = True``) every clock step happens on the worker thread, in the order
the work runs: a task first merges the clock of the thread that submitted it (as it was at
submission), a queued ``wait_event`` merges its event's stamp when the worker gets to it, and
an event is stamped when the worker reaches it. Doing any of these at issue time would order
work queued *earlier* after things it never waited for, hiding races.

A worker binds its device before anything else (``bind``, by default the device its creator
had current): Note [every library thread binds its device] in ``device_context.py``. A
``guard`` (strict mode's device check, ``strict.py``) runs at every call into the stream and
its events, on the calling thread. What a forked child gets of a stream: Note [a forked
child has no worker threads] in ``forks.py``.
"""

from __future__ import annotations

import queue
import threading
import time
import traceback
import weakref
from collections.abc import Callable
from typing import Any

from ..errors import StreamError, raised_again, without_frames
from . import forks
from .base import Event, Stream
from .device_context import capture_thread_device
from .forks import forked_error
from .host_syncs import LIBRARY_THREAD_PREFIX, count_sync
from .race_checker import RaceChecker, VectorClock

__all__ = [
    "Guard",
    "ThreadEvent",
    "ThreadStream",
    "ThreadTimestamp",
]

_STOP = object()

#: Called with what is being touched (e.g. "stream 'h2d'") at each call into a stream or
#: event; raises if the calling thread may not touch it (strict mode's device check).
Guard = Callable[[str], None]


class ThreadEvent(Event):
    """Completes when a worker reaches it in its queue; carries the stream's error if any.

    With a race checker, ``race_stamp`` is the recording stream's clock, and a CPU thread
    that waits for the event (``synchronize``) is ordered after it.

    Note [a thread event is a held lock]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    Every copy makes one event (two while a profiler listens), thousands a step. A
    ``threading.Event`` costs about 2 us to build (a ``Condition``, its lock, a deque and
    bound methods: about eight objects the cyclic GC tracks) and a ``notify_all`` to set. So
    a pending event holds one plain lock, acquired at birth; completing it writes
    ``_completed_at`` (and the error) and then releases the lock, and a waiter acquires and
    releases it. ``_completed_at is not None`` is the done flag: it is written last before
    the release, so a thread that sees it also sees the error. An event born complete holds
    no lock.
    """

    __slots__ = (
        "_began",
        "_checker",
        "_completed_at",
        "_error",
        "_guard",
        "_pending",
        "_pid",
        "_query_observes",
        "order",
        "race_stamp",
        "stream_name",
    )

    def __init__(
        self,
        stream_name: str,
        *,
        done: bool = False,
        checker: RaceChecker | None = None,
        stamp: VectorClock | None = None,
        query_observes: bool = False,
        guard: Guard | None = None,
    ) -> None:
        self.stream_name = stream_name
        self._guard = guard
        self.race_stamp = stamp
        self.order = None
        self._checker = checker
        self._query_observes = query_observes
        self._error: StreamError | None = None
        self._completed_at: float | None = None
        # When the worker began the task queued just before this event, written by the
        # worker before completing it: Note [a copy's start is its end event's].
        self._began: float | None = None
        # The process whose worker completes it: Note [a forked child has no worker threads].
        self._pid = forks._PID
        # Held until the event completes: Note [a thread event is a held lock].
        self._pending: threading.Lock | None = None
        if done:
            self._complete()
        else:
            self._pending = threading.Lock()
            self._pending.acquire()

    def _complete(self, error: StreamError | None = None) -> None:
        if self._checker is not None and self.race_stamp is None:
            self.race_stamp = self._checker.stamp(None)  # Note [when a thread stream's clock moves]
        self._error = error
        self._completed_at = time.perf_counter()  # done from here on
        pending = self._pending
        if pending is not None:
            pending.release()  # wakes the waiters: Note [a thread event is a held lock]

    def is_complete(self) -> bool:
        """Whether the worker has reached the event (no guard, no race-checker effect)."""
        return self._completed_at is not None

    def completed_at(self) -> float | None:
        return self._completed_at

    @classmethod
    def completions_of(cls, events: list[Event]) -> list[float | None]:
        if cls is not ThreadEvent:  # a subclass may time itself otherwise (strict compute)
            return super().completions_of(events)
        return list(map(_COMPLETED_SLOT, events))  # the slot, read in C

    @classmethod
    def starts_of(cls, events: list[Event], completed: list[float | None]) -> list[float | None]:
        if cls is not ThreadEvent:
            return super().starts_of(events, completed)
        # ``_began`` is final once ``_completed_at`` is set, and ``completed`` was read first.
        began = list(map(_BEGAN_SLOT, events))
        if not all(began):  # None where no task ran before the event (times are > 0)
            began = [b if b is not None else c for b, c in zip(began, completed, strict=True)]
        return began

    def started_at(self) -> float | None:
        """When the worker began the task queued just before this event (a copy, for the
        copy's end event: Note [a copy's start is its end event's] in ``memory/manager.py``);
        the completion time if no task ran since the previous event; None while pending."""
        completed = self._completed_at  # first: ``_began`` is final once it is set
        if completed is None:
            return None
        began = self._began
        return began if began is not None else completed

    def _touch(self) -> None:
        if self._guard is not None:
            self._guard(f"an event of stream {self.stream_name!r}")

    def query(self) -> bool:
        self._touch()
        # For a simulated device stream, not an observation for the race checker: its copies
        # finish far sooner than a GPU's, so a True here would hide races (code that hands
        # bytes on because a query said done says so itself, as the pool does). A CPU
        # worker's event that is done is done on every machine (``query_observes``).
        done = self._completed_at is not None
        if done and self._query_observes and self._checker is not None:
            self._checker.observed(self.race_stamp)
        return done

    def wait_unobserved(self) -> None:
        """Block until complete without counting as a host synchronisation.

        For a *stream's* wait that happens to block a thread (the host accelerator's
        compute stream runs on the caller): on a GPU the caller would not have waited.
        """
        self._touch()
        if self._completed_at is None:
            pending = self._pending
            if pending is not None:  # Note [a thread event is a held lock]
                if self._pid != forks._PID:  # Note [a forked child has no worker threads]
                    raise forked_error(f"an event of stream {self.stream_name!r}", self._pid)
                pending.acquire()
                pending.release()
        if self._error is not None:
            raise raised_again(self._error)  # Note [a sticky error holds no frames]

    def synchronize(self) -> None:
        count_sync(self.stream_name)  # Note [host syncs are counted where they can block]
        self.wait_unobserved()
        if self._checker is not None:
            self._checker.observed(self.race_stamp)


_COMPLETED_SLOT = ThreadEvent._completed_at.__get__  # type: ignore[attr-defined]
_BEGAN_SLOT = ThreadEvent._began.__get__  # type: ignore[attr-defined]


class ThreadTimestamp(Event):
    """``ThreadStream.record_timestamp``: the time a worker reached it, and nothing to wait
    on. No lock and no race-checker stamp: a fifth of a ``ThreadEvent``'s cost."""

    __slots__ = ("_completed_at", "stream_name")

    def __init__(self, stream_name: str) -> None:
        self.stream_name = stream_name
        self._completed_at: float | None = None  # written by the worker

    def completed_at(self) -> float | None:
        return self._completed_at

    def query(self) -> bool:
        return self._completed_at is not None

    def synchronize(self) -> None:
        raise RuntimeError(
            f"a timestamp of stream {self.stream_name!r} was waited for: timestamps only place "
            "work on a timeline (Stream.record_timestamp); wait for a record_event() (bug)"
        )


class _Worker:
    """The thread behind a ``ThreadStream``; holds no reference to the stream itself.

    ``lock`` guards ``error`` and the hand-over of events to a failed queue.
    """

    def __init__(self, name: str, on_start: Callable[[], None]) -> None:
        self.name = name
        self.tasks: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.error: StreamError | None = None
        self.lock = threading.Lock()
        self.pid = forks._PID  # the process it runs in: Note [a forked child has no ...]
        self._on_start = on_start
        self.thread = threading.Thread(
            target=self._run, name=f"{LIBRARY_THREAD_PREFIX}{name}", daemon=True
        )
        self.thread.start()

    def _run(self) -> None:
        try:
            self._on_start()
        except BaseException as exc:  # e.g. binding the device failed: every task fails with it
            self._fail(exc)
        self._on_start = _noop  # drop the reference (it may name the stream)
        clock = time.perf_counter
        began = None  # when the last task since the previous event began; None if none ran
        while True:
            item = self.tasks.get()
            if item is _STOP:
                return
            if isinstance(item, ThreadEvent):
                item._began = began  # before completing it: Note [a copy's start is ...]
                began = None
                item._complete(self.error)
                continue
            if isinstance(item, ThreadTimestamp):
                item._completed_at = clock()
                continue
            if self.error is not None:
                continue  # drained: the stream failed, see Note [stream errors are sticky]
            began = clock()
            try:
                item()
            except BaseException as exc:
                self._fail(exc)

    def _fail(self, exc: BaseException) -> None:
        error = StreamError(
            f"work on stream {self.name!r} failed with {type(exc).__name__}: {exc}\n"
            f"(original traceback below)\n" + "".join(traceback.format_exception(exc))
        )
        error.__cause__ = without_frames(exc)  # Note [a sticky error holds no frames]
        with self.lock:
            self.error = error


class ThreadStream(Stream):
    """A worker thread that runs submitted work in order (``checker``: see the module doc)."""

    #: Each event's ``started_at`` is when the task before it began: Note [a copy's start is
    #: its end event's] in memory/manager.py.
    end_carries_start = True
    deferred = True  # the work runs on this stream's thread
    #: Whether the race checker's clock for this stream moves when work runs rather than
    #: when it is issued: see Note [when a thread stream's clock moves].
    clock_at_execution = False

    def __init__(
        self,
        name: str,
        *,
        checker: RaceChecker | None = None,
        bind: Callable[[], None] | None = None,
        guard: Guard | None = None,
    ) -> None:
        """``bind`` runs first on the worker thread (default: take the creator's current
        device, Note [every library thread binds its device]); ``guard``: see the module doc.
        """
        self.name = name
        self._checker = checker
        self._guard = guard
        me = weakref.ref(self)
        bind_device = bind if bind is not None else capture_thread_device()

        def on_start() -> None:
            bind_device()
            stream = me()
            if checker is not None and stream is not None:
                checker.bind_thread(stream)  # tasks' own waits order this stream

        self._worker = _Worker(name, on_start)
        self._record_lock = threading.Lock()  # guards numbering and queueing an event
        self._closed = False
        weakref.finalize(self, self._worker.tasks.put, _STOP)

    def _check(self) -> None:
        if self._guard is not None:
            self._guard(f"stream {self.name!r}")
        if self._worker.pid != forks._PID:  # Note [a forked child has no worker threads]
            raise forked_error(f"stream {self.name!r}", self._worker.pid)
        if self._worker.error is not None:
            raise raised_again(self._worker.error)  # Note [a sticky error holds no frames]
        if self._closed:
            raise RuntimeError(
                f"stream {self.name!r} is closed: its worker thread has stopped, so it "
                "cannot run or wait for more work (its owner was closed)"
            )

    def submit(self, fn: Callable[[], Any]) -> None:
        self._check()
        checker = self._checker
        if checker is not None and self.clock_at_execution:
            fn = _after_issuer(checker, checker.thread_clock(), fn)
        self._worker.tasks.put(fn)

    def record_event(self) -> ThreadEvent:
        self._check()
        checker = self._checker
        stamp = None
        if checker is not None and not self.clock_at_execution:
            stamp = checker.stamp(self)
        event = ThreadEvent(  # without a stamp here, the worker stamps it when it gets there
            self.name,
            checker=checker,
            stamp=stamp,
            query_observes=self.clock_at_execution,
            guard=self._guard,
        )
        with self._record_lock:  # the record number follows the queue order
            event.order = self._next_order()
            self._worker.tasks.put(event)
        return event

    def record_timestamp(self) -> ThreadTimestamp:
        self._check()
        stamp = ThreadTimestamp(self.name)
        self._worker.tasks.put(stamp)  # the queue's order is the stream's: no lock needed
        return stamp

    def wait_event(self, event: Event) -> None:
        self._check()
        if self._checker is not None and not self.clock_at_execution:
            self._checker.wait(self, event.race_stamp)
        # Run by the worker; with clock_at_execution its synchronize() is the merge.
        self.submit(event.synchronize)

    def synchronize(self) -> None:
        self.record_event().synchronize()
        self._check()

    def is_current(self) -> bool:
        """Whether the calling thread is this stream's worker (running one of its tasks)."""
        return threading.current_thread() is self._worker.thread

    @property
    def closed(self) -> bool:
        """Whether ``close()`` has stopped this stream's worker, or the worker runs in
        another process (Note [a forked child has no worker threads])."""
        return self._closed or self._worker.pid != forks._PID

    def close(self) -> None:
        """Finish the work already queued, stop the worker and wait for its thread to end;
        later calls are no-ops.

        Synchronisation point: waits for the queued work, and raises its error if it failed.
        The thread is joined (it has only ``_STOP`` left to take), so a closed owner leaves no
        library thread behind. In a forked child there is no thread: it raises
        ``ForkedStreamError`` and marks the stream closed (Note [a forked child has no worker
        threads]).
        """
        if self._closed:
            return
        try:
            self.synchronize()
        finally:
            self._closed = True
            if self._worker.pid == forks._PID:
                self._worker.tasks.put(_STOP)
                self._worker.thread.join()


def _after_issuer(checker: RaceChecker, clock: VectorClock, fn: Callable[[], Any]):
    def run() -> Any:
        checker.observed(clock)  # ordered after what the submitting thread had seen
        return fn()

    return run


def _noop() -> None:
    return None
