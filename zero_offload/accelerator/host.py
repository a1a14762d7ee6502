"""HostAccelerator: a machine without a GPU, made to behave like one.

"Device" memory is ordinary memory counted against a device budget; each stream is a worker
thread that runs its queued work in order (``threads.ThreadStream``); an event completes
when the work queued before it is done; a stream can wait on another stream's event. Copies
may go over a simulated link (bandwidth, latency) so tests can prove that prefetch hides
transfer time. With ``check_races`` (or ``ZERO_OFFLOAD_CHECK_RACES=1``) a ``RaceChecker``
watches every tracked buffer and raises ``StreamRaceError`` on a missing wait. With
``strict`` (or ``ZERO_OFFLOAD_STRICT=1``) it behaves as CUDA would where CUDA differs from a
CPU: see ``strict.py``.

See Note [stream semantics] and Note [stream errors are sticky] in ``base.py``, and Note
[race checking with vector clocks] in ``race_checker.py``.
"""

from __future__ import annotations

import functools
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import psutil
import torch

from ..config import AcceleratorConfig, format_bytes
from .base import Accelerator, DeviceLedger, Event, Stream
from .capture import check_not_capturing
from .device_context import set_simulated_device
from .host_syncs import count_sync, one_sync
from .race_checker import RaceChecker, races_enabled_by_env
from .strict import (
    COMPUTE_LATENCY,
    COPY_LATENCY,
    MEMORY,
    STRICT_DEVICE_INDEX,
    ComputeEvents,
    MemoryKind,
    PendingComputeEvent,
    device_guard,
    strict_enabled_by_env,
)
from .threads import Guard, ThreadEvent, ThreadStream

__all__ = ["CallerStream", "HostAccelerator", "HostEvent", "HostStream", "StrictCallerStream"]

#: The host accelerator's events are the thread streams' events.
HostEvent = ThreadEvent


class HostStream(ThreadStream):
    """A simulated device stream: a worker thread that runs submitted work in order."""


class CallerStream(Stream):
    """The host accelerator's compute stream: the calling thread itself; work runs inline.

    For the race checker it is a stream like any other (a GPU's compute stream), distinct
    from the CPU thread that issues to it: see Note [race checking with vector clocks].
    """

    def __init__(self, name: str = "compute", *, checker: RaceChecker | None = None) -> None:
        self.name = name
        self._checker = checker

    def submit(self, fn: Callable[[], Any]) -> None:
        fn()

    def record_event(self) -> ThreadEvent:
        checker = self._checker
        stamp = checker.stamp(self) if checker is not None else None
        event = ThreadEvent(self.name, done=True, checker=checker, stamp=stamp)
        event.order = self._next_order()  # born complete: any order is true
        return event

    def wait_event(self, event: Event) -> None:
        if self._checker is not None:
            self._checker.wait(self, event.race_stamp)
        # Synchronisation point: compute runs on the caller's thread, so waiting for another
        # stream's event blocks the caller (on CUDA the GPU would wait instead). The checker
        # does not count it as the host observing the event, since on a GPU it would not.
        if isinstance(event, ThreadEvent):
            event.wait_unobserved()
        else:
            event.synchronize()

    def synchronize(self) -> None:
        # Nothing to wait for here (the work ran inline), but on a GPU this blocks: counted.
        count_sync(self.name)
        if self._checker is not None:  # the host now knows compute's work is done
            self._checker.observed(self._checker.stamp(self))


class StrictCallerStream(CallerStream):
    """The strict compute stream: work still runs inline, but its events complete late and
    only a bound thread may touch it (Notes [strict: compute completes after its event] and
    [strict: a thread's current device] in ``strict.py``)."""

    def __init__(self, name: str = "compute", *, checker: RaceChecker | None, guard: Guard) -> None:
        super().__init__(name, checker=checker)
        self._guard = guard
        self._events = ComputeEvents()

    def submit(self, fn: Callable[[], Any]) -> None:
        self._guard(f"stream {self.name!r}")
        fn()

    def record_event(self) -> PendingComputeEvent:
        self._guard(f"stream {self.name!r}")
        checker = self._checker
        stamp = checker.stamp(self) if checker is not None else None
        event = PendingComputeEvent(
            self.name,
            completer=self._events,
            latency=COMPUTE_LATENCY,
            checker=checker,
            stamp=stamp,
            guard=self._guard,
        )
        self._events.add(event, self)
        return event

    def wait_event(self, event: Event) -> None:
        self._guard(f"stream {self.name!r}")
        super().wait_event(event)

    def synchronize(self) -> None:
        self._guard(f"stream {self.name!r}")
        self._events.complete_through(None)  # the work ran inline: it is all done
        super().synchronize()


class HostAccelerator(Accelerator):
    """See the module docstring."""

    name = "host"

    def __init__(self, config: AcceleratorConfig | None = None) -> None:
        self.config = config if config is not None else AcceleratorConfig()
        self.device = torch.device("cpu")
        budget, source = self.config.resolved_device_budget(
            psutil.virtual_memory().total // 2, "default: half of host RAM"
        )
        self.ledger = DeviceLedger(budget, source)
        check = self.config.check_races
        enabled = races_enabled_by_env() if check is None else check
        self.race_checker = RaceChecker() if enabled else None
        self.strict = strict_enabled_by_env() if self.config.strict is None else self.config.strict
        #: The device index, of the simulated machine in strict mode (Note [strict: a thread's
        #: current device] in strict.py); 0 otherwise, where no thread's device is checked.
        self.index = STRICT_DEVICE_INDEX if self.strict else 0
        self._guard: Guard | None = device_guard(self.index) if self.strict else None
        self._streams: weakref.WeakSet[HostStream] = weakref.WeakSet()
        # Per thread: the stream made current by ``stream_context``, if any (attribute
        # ``stream``); compute otherwise.
        self._current = threading.local()
        self._compute: CallerStream
        if self._guard is not None:
            self._compute = StrictCallerStream(checker=self.race_checker, guard=self._guard)
            self.bind_thread()  # the building thread, as CudaAccelerator sets the device
        else:
            self._compute = CallerStream(checker=self.race_checker)

    @property
    def pinned_memory_available(self) -> bool:
        return False

    @property
    def timing(self) -> bool:
        return True  # every event knows its completion time; it costs nothing here

    def bind_thread(self) -> None:
        set_simulated_device(self.index)

    def new_stream(self, name: str) -> HostStream:
        # The worker is the simulated GPU running the stream: it is on the device.
        stream = HostStream(
            name, checker=self.race_checker, bind=self.bind_thread, guard=self._guard
        )
        self._streams.add(stream)
        return stream

    def current_stream(self) -> Stream:
        return getattr(self._current, "stream", None) or self._compute

    @contextmanager
    def stream_context(self, stream: Stream) -> Iterator[None]:
        # Note [metadata ops are recorded on the current stream] in base.py: the ops in the
        # block run inline here; only the stream that declared accesses are recorded on moves.
        if self._guard is not None:
            self._guard(f"stream {stream.name!r}")
        previous = getattr(self._current, "stream", None)
        self._current.stream = stream
        try:
            yield
        finally:
            self._current.stream = previous

    def synchronize(self) -> None:
        with one_sync():  # Note [host syncs are counted where they can block]
            for stream in list(self._streams):
                if not stream.closed:
                    stream.synchronize()
            self._compute.synchronize()

    def allocate_host(self, nbytes: int, *, pinned: bool = True) -> torch.Tensor:
        # Ordinary pageable memory: there is no device to pin for.
        tensor = torch.empty(nbytes, dtype=torch.uint8)
        name = f"host buffer of {nbytes} bytes"
        if self.race_checker is not None:
            self.race_checker.track(tensor, name)
        if self.strict:  # Note [strict: host memory is not device memory] in strict.py
            MEMORY.register(tensor, MemoryKind.HOST, f"the {'pinned ' if pinned else ''}{name}")
        return tensor

    def _device_empty(self, nbytes: int, *, what: str) -> torch.Tensor:
        tensor = torch.empty(nbytes, dtype=torch.uint8)
        if self.strict:  # Note [strict: host memory is not device memory] in strict.py
            MEMORY.register(tensor, MemoryKind.DEVICE, f"device buffer {what!r}")
        return tensor

    def link_seconds(self, nbytes: int) -> float:
        """Time the simulated link takes for ``nbytes`` (0 without a simulated link)."""
        seconds = self.config.link_latency
        if self.config.link_bandwidth is not None:
            seconds += nbytes / self.config.link_bandwidth
        return seconds

    def copy_(
        self,
        dst: torch.Tensor,
        src: torch.Tensor,
        *,
        stream: Stream,
        label: str = "",
        held: bool = False,
    ) -> None:
        # ``held`` changes nothing here: there is no caching allocator to tell.
        check_not_capturing("the copy" if label else "a copy", label=label)
        self._check_copy(dst, src, stream=stream, label=label)
        delay = self.link_seconds(src.nbytes)
        if self.strict:  # Note [strict: a copy lands when it ends] in strict.py
            delay = max(delay, COPY_LATENCY)
        if delay <= 0:  # no simulated link: the copy alone (no clock read on the worker)
            stream.submit(functools.partial(dst.copy_, src))
            return

        def run() -> None:
            time.sleep(delay)  # the link's time first: a reader that did not wait sees
            dst.copy_(src)  # the old bytes all along (Note [strict: a copy lands when ...])

        stream.submit(run)

    def describe(self) -> dict[str, Any]:
        link = (
            "none (copies at memory speed)"
            if not self.config.simulates_link
            else f"{format_bytes(self.config.link_bandwidth or 0)}/s, "
            f"{self.config.link_latency * 1e6:.0f} us latency"
        )
        return {
            "device": "cpu (host accelerator)",
            "device_memory_total": psutil.virtual_memory().total,
            "device_budget": self.ledger.budget,
            "device_budget_source": self.ledger.budget_source,
            "simulated_link": link,
            "race_checker": "on" if self.race_checker is not None else "off",
            "strict": f"on (device {self.index} of 2)" if self.strict else "off",
        }
