"""The accelerator interface: streams, events, device and host memory, one copy primitive.

Code above this package never asks which accelerator it has. Two implementations exist:
``CudaAccelerator`` (real CUDA streams, events and pinned memory) and ``HostAccelerator``
(a machine without a GPU made to behave like one; see ``host.py``).

Note [stream semantics]
~~~~~~~~~~~~~~~~~~~~~~~
Work submitted to one stream runs in submission order. ``record_event()`` returns an event
that completes when everything submitted to that stream before it has finished.
``wait_event(e)`` makes work submitted to this stream *afterwards* wait until ``e`` has
completed; it does not block the caller (except on the host accelerator's caller stream,
whose work runs inline, so waiting there must block). ``synchronize()`` blocks the caller
until the stream is idle. On CUDA, ``submit(fn)`` runs ``fn`` on the calling thread with the
stream current, so the kernels and copies it launches are queued on that stream; on the host
accelerator a worker thread runs ``fn`` later. Either way ``fn`` must only touch buffers
that are kept alive and unaliased until an event recorded after it completes.

Note [stream errors are sticky]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
An exception raised by work on a stream is never swallowed. It is re-raised to the caller,
as the ``__cause__`` of a ``StreamError`` whose message holds the original traceback's text
(printed whole; Note [a sticky error holds no frames]), at the next synchronisation point: ``Stream.synchronize``, ``Event.synchronize``,
``Accelerator.synchronize``, or the next ``submit``/``record_event`` on the failed stream.
A failed stream refuses all further work with the same error; events recorded on it and
streams that wait on those events fail too.

On CUDA, ``submit`` runs ``fn`` on the calling thread, so a Python exception ``fn`` raises
while *issuing* work reaches the caller at once, and the stream still fails for good. That
is deliberate (issue 22 asked): ``fn`` may have queued part of its kernels and copies before
it raised, so the buffers it touches are half-written with no event that says when, and the
host accelerator, whose worker meets the same exception later, refuses further work too. A
caller that caught the error and went on would pass on one accelerator and corrupt data on
the other. Recovering means a new stream (or, for compute, a new accelerator).

Note [a sticky error holds no frames]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A failed stream keeps its ``StreamError`` for as long as it lives, and a stream lives as long
as its owner (the optimizer's manager). Raising that one object at every later call chained
each call's frames onto its traceback, and frames keep their locals: the optimizer that met
the error stayed alive through its own stream, with its pools, until the cyclic collector
ran, and each further call made the traceback longer. So every call that meets the failed
stream raises a fresh copy (``errors.raised_again``), whose frames are that call's alone,
and the stream keeps the original exception (the ``__cause__``) with no traceback
(``errors.without_frames``): the ``StreamError``'s message carries the traceback's text,
printed whole. Its frames are gone, locals and all (cleared frames would not do: each still
links to the frame that called it, the stream's own, which holds the stream). A
post-mortem debugger finds no frames there; rerun with the failing call made by hand.

Note [declaring stream accesses]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The host accelerator's race checker (``race_checker.py``) sees every copy made through
``copy_``. Work it cannot see must be declared where it is issued, with
``Accelerator.declare_access(tensor, stream=..., write=..., what=...)``: a kernel queued on
the compute stream that reads weights or writes gradients (``stream=current_stream()``), a
CPU loop over pinned memory (``stream=None``: the calling thread), a task queued on the host
worker (``stream=host_worker``). Declaring costs nothing without the checker, and nothing on
CUDA, where ``TORCH_CUDA_SANITIZER=1`` checks the real kernels instead.

Note [metadata ops are recorded on the current stream]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
PyTorch's CUDA sanitizer records every op on the stream current when it is dispatched, and
an op that returns ``Tensor(a!)`` counts as a write of the result's bytes, even when it
touches no byte: ``tensor.set_(storage, ...)`` building a view is a "write" on the default
stream. A copy on another stream into those bytes then races in the sanitizer's eyes unless
that stream waited for the default one. So an op that builds a view of bytes a copy stream
fills next is issued with that stream current, ``with accelerator.stream_context(stream):``
(CUDA: ``torch.cuda.stream``), which is also the true order: nothing reads the view before
the copy's event. On the host accelerator ``current_stream()`` returns ``stream`` inside the
block, so accesses declared there (Note [declaring stream accesses]) are recorded on it, as
the sanitizer records them on CUDA; the ops themselves still run inline on the caller.
"""

from __future__ import annotations

import itertools
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from typing import Any

import torch

from ..config import format_bytes
from ..errors import DeviceBudgetExceeded
from .host_syncs import count_sync
from .ledger import DeviceBuffer, DeviceLedger, PeakWindow
from .race_checker import AccessKind, RaceChecker

__all__ = [
    "Accelerator",
    "DeviceBuffer",
    "DeviceLedger",
    "Event",
    "PeakWindow",
    "Stream",
    "completion_times",
    "event_times",
    "latest_per_stream",
]


class Event(ABC):
    """A point in a stream's work; see Note [stream semantics]."""

    __slots__ = ()  # subclasses may be slotted (Note [a thread event is a held lock])

    #: The recording stream's vector clock when a race checker is on, else None
    #: (Note [race checking with vector clocks] in race_checker.py).
    race_stamp: dict[int, int] | None = None
    #: ``(stream key, record number)`` for an event of a stream that runs its work in order
    #: (every stream here), so it completes after every event recorded before it on that
    #: stream; None for events of no stream (NVMe I/O). See ``latest_per_stream``.
    order: tuple[int, int] | None = None

    @abstractmethod
    def query(self) -> bool:
        """True when the work before the event has finished (or failed). Never blocks."""

    @abstractmethod
    def synchronize(self) -> None:
        """Block until the event completes; raise ``StreamError`` if its stream failed."""

    @abstractmethod
    def completed_at(self) -> float | None:
        """When the event completed, on the ``time.perf_counter()`` clock; None if pending.

        The profiler places copies on a timeline with this. Never blocks.
        """

    @classmethod
    def completions_of(cls, events: list[Event]) -> list[float | None]:
        """``[e.completed_at() for e in events]``, all of type ``cls``; a subclass may read
        them faster in bulk (``completion_times``)."""
        return [event.completed_at() for event in events]

    @classmethod
    def starts_of(cls, events: list[Event], completed: list[float | None]) -> list[float | None]:
        """``[e.started_at() for e in events]``, all of type ``cls``, read after
        ``completed`` (their ``completions_of``); a subclass may read them faster."""
        return [event.started_at() for event in events]

    def started_at(self) -> float | None:
        """When the stream began the work queued just before this event, where the stream
        knows it (a ``ThreadStream``'s worker does); None where it does not (CUDA: its
        copies record a start event, ``Stream.end_carries_start``) or while pending. Never blocks.
        """
        return None


def _one_type(events: list[Event]) -> type[Event]:
    """The events' class where they share one, else ``Event`` (read one by one)."""
    types = set(map(type, events))
    if len(types) == 1:
        (kind,) = types
        if issubclass(kind, Event):
            return kind
    return Event


def completion_times(events: list[Event]) -> list[float | None]:
    """Each event's ``completed_at()``, in bulk where they are of one type: what a
    profiler reads when it settles its records."""
    return _one_type(events).completions_of(events)


def event_times(events: list[Event]) -> tuple[list[float | None], list[float | None]]:
    """``(started_at, completed_at)`` of each event, as ``completion_times``; completions
    first, so a start read for a completed event is final."""
    kind = _one_type(events)
    completed = kind.completions_of(events)
    return kind.starts_of(events, completed), completed


def latest_per_stream(events: Iterable[Event]) -> list[Event]:
    """The events whose completion implies all of ``events``: the last recorded of each
    stream (``Event.order``), then every event of no stream, in the order given.

    Waiting on these orders a stream after all of ``events`` with one wait per stream
    instead of one per event (thousands per step with many tiles).
    """
    last: dict[int, Event] = {}
    loose: list[Event] = []
    for event in events:
        order = event.order
        if order is None:
            loose.append(event)
            continue
        kept = last.get(order[0])
        if kept is None or kept.order[1] < order[1]:  # type: ignore[index]
            last[order[0]] = event
    return [*last.values(), *loose]


_stream_keys = itertools.count(1)


class Stream(ABC):
    """An ordered queue of work; see Note [stream semantics]."""

    name: str
    #: Whether an event recorded right after some work carries when that work began
    #: (``Event.started_at``), so a profiler needs no event before it: a ``ThreadStream``'s
    #: do; CUDA's do not (Note [a copy's start is its end event's] in memory/manager.py).
    end_carries_start = False
    #: Whether submitted work runs later on a thread of its own (``ThreadStream``), so a
    #: collective it runs is issued then, not at ``submit``; CUDA's streams and the caller's
    #: run ``fn`` at once (Note [caller collectives follow the reduce-scatters] in
    #: optim/ranks.py).
    deferred = False

    def _next_order(self) -> tuple[int, int]:
        """The ``Event.order`` of the next event recorded here; call it where the event
        takes its place in the stream's queue, under the lock that orders records."""
        orders = self.__dict__.get("_orders")
        if orders is None:  # the first record: numbered from here (once, not per call)
            orders = self.__dict__.setdefault("_orders", (next(_stream_keys), itertools.count()))
        key, numbers = orders
        return key, next(numbers)

    @abstractmethod
    def submit(self, fn: Callable[[], Any]) -> None:
        """Queue ``fn`` (no arguments) to run after everything submitted before it."""

    @abstractmethod
    def record_event(self) -> Event:
        """An event that completes when all work submitted so far has finished."""

    def record_timestamp(self) -> Event:
        """An event only for ``completed_at()``: when the stream got to this point. Nothing
        may wait for it (``synchronize``/``wait_event``); it places work on a timeline (a
        copy's start, for a profiler). The default is ``record_event()``; a stream that can
        stamp a time more cheaply than it can make a waitable event does (``ThreadStream``).
        """
        return self.record_event()

    @abstractmethod
    def wait_event(self, event: Event) -> None:
        """Make later work on this stream wait for ``event``."""

    @abstractmethod
    def synchronize(self) -> None:
        """Block until all submitted work has finished; raise its error if it failed."""


class Accelerator(ABC):
    """What the library needs from a device; see the module docstring."""

    #: "cuda" or "host".
    name: str
    #: Where "device" tensors live (``cuda:N``, or ``cpu`` for the host accelerator).
    device: torch.device
    #: Counts library-owned device memory against the budget.
    ledger: DeviceLedger
    #: The race checker when one is on (host accelerator, ``check_races``), else None.
    race_checker: RaceChecker | None = None
    #: Whether the model's compute (the caller's forward and backward) runs on the host's
    #: cores: the host accelerator's does, CUDA's does not (Note [one thread budget] in
    #: ``thread_budget.py``: CPU Adam beside it takes a share of the cores, or all of them).
    computes_on_host: bool = True
    #: How many holders want timed events (``hold_timing``); guarded by ``_timing_lock``.
    _timing_holders = 0
    _timing_lock = threading.Lock()
    #: Reads of device values the host waited for (``read_to_host``); ``_reads_lock``.
    blocking_reads = 0
    _reads_lock = threading.Lock()

    @property
    def timing(self) -> bool:
        """Whether events recorded now must carry timing (``completed_at``).

        The host accelerator's events always know their time (it costs nothing there); CUDA
        events are timed only while this is True (Note [cuda events: blocking, timed only
        when asked] in cuda.py).
        """
        return self._timing_holders > 0

    def hold_timing(self) -> Callable[[], None]:
        """Make events carry timing until the returned callable is called (calls nest)."""
        with self._timing_lock:
            self._timing_holders += 1
        released = False

        def release() -> None:
            nonlocal released
            with self._timing_lock:
                if not released:
                    released = True
                    self._timing_holders -= 1

        return release

    @property
    @abstractmethod
    def pinned_memory_available(self) -> bool:
        """Whether ``allocate_host(..., pinned=True)`` returns page-locked memory."""

    @abstractmethod
    def new_stream(self, name: str) -> Stream:
        """A new stream; create each once and say why it exists (STYLE.md)."""

    @abstractmethod
    def current_stream(self) -> Stream:
        """The stream that the caller's compute (forward, backward) runs on."""

    @abstractmethod
    def stream_context(self, stream: Stream) -> AbstractContextManager[None]:
        """Make ``stream`` this thread's current stream inside the ``with`` block.

        For ops that build views of bytes ``stream`` writes next, and for accesses declared
        there: Note [metadata ops are recorded on the current stream]. Work that touches
        bytes goes through ``stream.submit`` or ``copy_``, never through this block.
        """

    @abstractmethod
    def synchronize(self) -> None:
        """Block until every stream of this accelerator is idle; raise the first error."""

    @abstractmethod
    def bind_thread(self) -> None:
        """Make this accelerator's device the calling thread's current device.

        Every thread the library starts calls it before its first call into the accelerator;
        see Note [every library thread binds its device] in ``device_context.py``.
        """

    @abstractmethod
    def allocate_host(self, nbytes: int, *, pinned: bool = True) -> torch.Tensor:
        """A flat ``uint8`` CPU tensor of exactly ``nbytes`` (pinned when asked and available).

        Hidden cost: pinning is slow (page-locking every page) and on CUDA it may synchronise
        the device; call it at construction time, never in a step.
        """

    @abstractmethod
    def _device_empty(self, nbytes: int, *, what: str) -> torch.Tensor:
        """Raw ``(nbytes,) uint8`` device tensor; budget accounting is the caller's."""

    @abstractmethod
    def copy_(
        self,
        dst: torch.Tensor,
        src: torch.Tensor,
        *,
        stream: Stream,
        label: str = "",
        held: bool = False,
    ) -> None:
        """Queue ``dst.copy_(src)`` on ``stream`` (asynchronous where the hardware allows).

        This is the only primitive that moves bytes between tiers; the memory manager is its
        only caller in the library (see Note [one choke point for copies] in the manager).
        ``label`` names the copy in race reports. ``held``: the caller keeps both tensors
        alive until the copy's end event completes or compute waited for it, so the
        allocator need not be told (no ``record_stream`` on CUDA). Raises ``CaptureRefused``
        while a graph captures (Note [no graph capture of library work] in capture.py).
        """

    @abstractmethod
    def describe(self) -> dict[str, Any]:
        """Facts for ``zero-offload info``: device name, memory, budget, link."""

    def declare_access(
        self, tensor: torch.Tensor, *, stream: Stream | None, write: bool, what: str
    ) -> None:
        """Tell the race checker that work issued now on ``stream`` touches ``tensor``.

        ``stream=None`` means the calling CPU thread itself. ``write``: whether the work
        overwrites the bytes. ``what`` names the operation in a ``StreamRaceError``. Raises
        ``StreamRaceError`` when a conflicting access on another stream is not ordered before
        this one; does nothing without a checker. See Note [declaring stream accesses].
        """
        if self.race_checker is None:
            return
        kind = AccessKind.WRITE if write else AccessKind.READ
        self.race_checker.access(tensor, stream=stream, kind=kind, what=what)

    def _check_copy(
        self, dst: torch.Tensor, src: torch.Tensor, *, stream: Stream, label: str
    ) -> None:
        """Record a copy's two accesses with the race checker, if one is on."""
        if self.race_checker is None:
            return
        name = f"{stream.name} copy {label!r}" if label else f"{stream.name} copy"
        self.declare_access(src, stream=stream, write=False, what=f"{name} reading its source")
        self.declare_access(dst, stream=stream, write=True, what=f"{name} writing its destination")

    def allocate_device(self, nbytes: int, *, what: str) -> DeviceBuffer:
        """Library-owned device memory, counted against the budget.

        Raises ``DeviceBudgetExceeded`` (a ``MemoryError``) naming ``what``, the size, the
        budget and the bytes in use, before anything is allocated.
        """
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"nbytes must be an int >= 0, got {nbytes!r} for {what!r}")
        self.ledger.reserve(nbytes, what=what)
        try:
            tensor = self._device_empty(nbytes, what=what)
        except torch.OutOfMemoryError as exc:
            # The budget said yes, the device said no: it is a snapshot (others allocate).
            self.ledger.release(nbytes)
            raise DeviceBudgetExceeded(
                f"cannot place {what!r} ({format_bytes(nbytes)}, {nbytes} bytes) on the "
                f"device: it is within the budget ({format_bytes(self.ledger.budget)}, "
                f"{self.ledger.budget_source}; {format_bytes(self.ledger.in_use)} in use by "
                f"zero-offload) but the device is out of memory ({exc}). Others took memory "
                f"since the budget was set: lower AcceleratorConfig(device_budget=...), free "
                f"device memory first, or offload more."
            ) from exc
        except BaseException:
            self.ledger.release(nbytes)
            raise
        if self.race_checker is not None:
            self.race_checker.track(tensor, f"device buffer {what!r}")
        return DeviceBuffer(tensor=tensor, nbytes=nbytes, what=what, _ledger=self.ledger)

    def read_to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor``'s values in host memory, for a decision the CPU makes now.

        Synchronisation point: a blocking device-to-host copy, after the device finished
        the work producing ``tensor``. Counted in ``blocking_reads``: gather what one
        decision needs into one tensor and read it once.
        """
        with self._reads_lock:
            self.blocking_reads += 1
        count_sync("read_to_host")  # Note [host syncs are counted where they can block]
        return tensor.detach().to("cpu")

    def memory_stats(self) -> dict[str, int]:
        """Library-owned device bytes: ``budget``, ``in_use``, ``peak``."""
        return self.ledger.stats()
