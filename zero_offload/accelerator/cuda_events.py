"""CUDA events and streams as the accelerator's ``Event`` and ``Stream``, and the clock that
maps the events' times onto the host's.

Note [cuda events: blocking, timed only when asked]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Every event is created with ``blocking=True``: a host ``synchronize()`` on it sleeps in the
driver instead of spinning a core, which the CPU Adam on the other cores needs. Events carry
timing only while someone needs times (``Accelerator.timing``, switched on by the memory
manager while a profiler listens): a timing event costs a timestamp write on the GPU and
cannot be elided by the driver. A timed event's ``completed_at`` is measured from the
nearest *anchor*, an event recorded at most ``ANCHOR_SECONDS`` earlier whose host time is
known, because ``elapsed_time`` returns float32 milliseconds: from a single reference at
the start of a long run, float32 would lose microseconds after minutes and milliseconds
after hours. Each anchor's host time is its predecessor's plus a short (float32-exact to
about a microsecond) elapsed time, summed in float64.
"""

from __future__ import annotations

import threading
import time
import traceback
from collections.abc import Callable
from typing import Any, Protocol

import torch

from ..errors import StreamError, raised_again, without_frames
from .base import Event, Stream
from .host_syncs import count_sync

__all__ = ["ANCHOR_SECONDS", "Anchor", "Clock", "CudaEvent", "CudaStream", "TimedEvent"]

#: Longest gap (seconds) between a timed event and its anchor, Note [cuda events: ...].
ANCHOR_SECONDS = 10.0


class TimedEvent(Protocol):
    def elapsed_time(self, end: Any) -> float: ...
    def query(self) -> bool: ...


class Anchor:
    """A timed event whose ``time.perf_counter()`` time is known, or derivable from ``prev``.

    See Note [cuda events: blocking, timed only when asked]. ``recorded`` is the host time
    at which it was recorded, to decide when a fresher anchor is due.
    """

    def __init__(
        self, event: TimedEvent, *, prev: Anchor | None, time_: float | None, recorded: float
    ) -> None:
        self.event = event
        self.prev = prev
        self.recorded = recorded
        self._time = time_

    def time(self) -> float | None:
        """Host time of this anchor, None while it (or a predecessor) is pending."""
        chain = []  # unresolved anchors, newest first
        anchor: Anchor | None = self
        while anchor is not None and anchor._time is None:
            chain.append(anchor)
            anchor = anchor.prev
        if anchor is None:
            return None
        for later in reversed(chain):  # oldest first, each from its resolved predecessor
            prev = later.prev
            if prev is None or prev._time is None or not later.event.query():
                return None
            later._time = prev._time + prev.event.elapsed_time(later.event) / 1e3  # float64
            later.prev = None  # the chain behind a resolved anchor can go
        return self._time

    def time_of(self, event: TimedEvent) -> float | None:
        """Host time at which ``event`` (recorded after this anchor) completed."""
        base = self.time()
        if base is None or not event.query():
            return None
        return base + self.event.elapsed_time(event) / 1e3


class Clock:
    """Maps CUDA event times onto ``time.perf_counter()`` through a chain of anchors.

    ``_lock`` guards ``_latest``.
    """

    def __init__(self, device: torch.device) -> None:
        torch.cuda.synchronize(device)
        event = torch.cuda.Event(enable_timing=True, blocking=True)
        event.record(torch.cuda.current_stream(device))
        event.synchronize()  # one sync at construction, so the two clocks agree
        now = time.perf_counter()
        self._latest = Anchor(event, prev=None, time_=now, recorded=now)
        self._lock = threading.Lock()

    def anchor(self, stream: torch.cuda.Stream) -> Anchor:
        """The anchor for an event about to be recorded on ``stream`` (a fresh one if due)."""
        now = time.perf_counter()
        with self._lock:
            if now - self._latest.recorded > ANCHOR_SECONDS:
                event = torch.cuda.Event(enable_timing=True, blocking=True)
                event.record(stream)
                self._latest = Anchor(event, prev=self._latest, time_=None, recorded=now)
            return self._latest


class CudaEvent(Event):
    """A blocking ``torch.cuda.Event``, timed when recorded with an ``anchor``."""

    def __init__(self, event: torch.cuda.Event, stream_name: str, anchor: Anchor | None) -> None:
        self.event = event
        self.stream_name = stream_name
        self._anchor = anchor

    def query(self) -> bool:
        return bool(self.event.query())

    def synchronize(self) -> None:
        count_sync(self.stream_name)  # Note [host syncs are counted where they can block]
        self.event.synchronize()  # blocking event: the thread sleeps, no core spins

    def completed_at(self) -> float | None:
        """Host time of completion; None while pending or for an event without timing."""
        if self._anchor is None:
            return None
        return self._anchor.time_of(self.event)


class CudaStream(Stream):
    """A ``torch.cuda.Stream`` with a name, wrapping errors raised while issuing work."""

    def __init__(
        self,
        stream: torch.cuda.Stream,
        name: str,
        *,
        timing: Callable[[], bool],
        clock: Clock,
    ) -> None:
        self.stream = stream
        self.name = name
        self._timing = timing  # the accelerator's ``timing``: whether events are timed now
        self._clock = clock
        self._error: StreamError | None = None
        self._record_lock = threading.Lock()  # guards recording and numbering an event

    def submit(self, fn: Callable[[], Any]) -> None:
        if self._error is not None:
            raise raised_again(self._error)  # Note [a sticky error holds no frames] in base.py
        try:
            with torch.cuda.stream(self.stream):
                fn()
        except BaseException as exc:
            # Note [a sticky error holds no frames] (base.py): the traceback's text, not its
            # frames, whose locals would live as long as the stream.
            error = StreamError(
                f"work on stream {self.name!r} failed: {exc!r}\n(original traceback below)\n"
                + "".join(traceback.format_exception(exc))
            )
            error.__cause__ = without_frames(exc)
            self._error = error
            raise raised_again(error) from exc

    def record_event(self) -> CudaEvent:
        if self._error is not None:
            raise raised_again(self._error)
        timed = self._timing()
        anchor = self._clock.anchor(self.stream) if timed else None
        event = torch.cuda.Event(enable_timing=timed, blocking=True)
        with self._record_lock:  # the record number follows the stream's order
            event.record(self.stream)
            order = self._next_order()
        wrapped = CudaEvent(event, self.name, anchor)
        wrapped.order = order
        return wrapped

    def wait_event(self, event: Event) -> None:
        if not isinstance(event, CudaEvent):
            raise TypeError(f"a CUDA stream can only wait on a CUDA event, got {type(event)}")
        self.stream.wait_event(event.event)

    def synchronize(self) -> None:
        if self._error is not None:
            raise raised_again(self._error)
        count_sync(self.name)
        self.stream.synchronize()
