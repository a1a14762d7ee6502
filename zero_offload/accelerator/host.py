"""HostAccelerator: a machine without a GPU, made to behave like one.

"Device" memory is ordinary memory counted against a device budget; each stream is a worker
thread that runs its queued work in order; an event completes when the work queued before it
is done; a stream can wait on another stream's event. Copies may go over a simulated link
(bandwidth, latency) so tests can prove that prefetch hides transfer time.

See Note [stream semantics] and Note [stream errors are sticky] in ``base.py``.
"""

from __future__ import annotations

import queue
import threading
import time
import traceback
import weakref
from collections.abc import Callable
from typing import Any

import psutil
import torch

from ..config import AcceleratorConfig, format_bytes
from ..errors import StreamError
from .base import Accelerator, DeviceLedger, Event, Stream

__all__ = ["HostAccelerator", "HostEvent", "HostStream"]

_STOP = object()


class HostEvent(Event):
    """Completes when a worker reaches it in its queue; carries the stream's error if any."""

    def __init__(self, stream_name: str, *, done: bool = False) -> None:
        self.stream_name = stream_name
        self._done = threading.Event()
        self._error: StreamError | None = None
        self._completed_at: float | None = None
        if done:
            self._complete()

    def _complete(self, error: StreamError | None = None) -> None:
        self._error = error
        self._completed_at = time.perf_counter()
        self._done.set()

    def completed_at(self) -> float | None:
        return self._completed_at if self._done.is_set() else None

    def query(self) -> bool:
        return self._done.is_set()

    def synchronize(self) -> None:
        self._done.wait()
        if self._error is not None:
            raise self._error


class _Worker:
    """The thread behind a ``HostStream``; holds no reference to the stream itself.

    ``_lock`` guards ``error`` and the hand-over of events to a failed queue.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.tasks: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.error: StreamError | None = None
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, name=f"zero_offload:{name}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            item = self.tasks.get()
            if item is _STOP:
                return
            if isinstance(item, HostEvent):
                item._complete(self.error)
                continue
            if self.error is not None:
                continue  # drained: the stream failed, see Note [stream errors are sticky]
            try:
                item()
            except BaseException as exc:
                error = StreamError(
                    f"work on stream {self.name!r} failed with {type(exc).__name__}: {exc}\n"
                    f"(original traceback below, as the cause)\n"
                    + "".join(traceback.format_exception(exc))
                )
                error.__cause__ = exc
                with self.lock:
                    self.error = error


class HostStream(Stream):
    """A worker thread that runs submitted work in order."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._worker = _Worker(name)
        self._closed = False
        weakref.finalize(self, self._worker.tasks.put, _STOP)

    def _check(self) -> None:
        if self._worker.error is not None:
            raise self._worker.error
        if self._closed:
            raise RuntimeError(
                f"stream {self.name!r} is closed: its worker thread has stopped, so it "
                "cannot run or wait for more work (its owner was closed)"
            )

    def submit(self, fn: Callable[[], Any]) -> None:
        self._check()
        self._worker.tasks.put(fn)

    def record_event(self) -> HostEvent:
        self._check()
        event = HostEvent(self.name)
        self._worker.tasks.put(event)
        return event

    def wait_event(self, event: Event) -> None:
        self.submit(event.synchronize)

    def synchronize(self) -> None:
        self.record_event().synchronize()
        self._check()

    @property
    def closed(self) -> bool:
        """Whether ``close()`` has stopped this stream's worker."""
        return self._closed

    def close(self) -> None:
        """Finish the work already queued, then stop the worker; later calls are no-ops.

        Synchronisation point: waits for the queued work, and raises its error if it failed.
        """
        if self._closed:
            return
        try:
            self.synchronize()
        finally:
            self._closed = True
            self._worker.tasks.put(_STOP)


class CallerStream(Stream):
    """The host accelerator's compute stream: the calling thread itself; work runs inline."""

    def __init__(self, name: str = "compute") -> None:
        self.name = name

    def submit(self, fn: Callable[[], Any]) -> None:
        fn()

    def record_event(self) -> HostEvent:
        return HostEvent(self.name, done=True)

    def wait_event(self, event: Event) -> None:
        # Synchronisation point: compute runs on the caller's thread, so waiting for another
        # stream's event blocks the caller (on CUDA the GPU would wait instead).
        event.synchronize()

    def synchronize(self) -> None:
        return None


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
        self._streams: weakref.WeakSet[HostStream] = weakref.WeakSet()
        self._compute = CallerStream()

    @property
    def pinned_memory_available(self) -> bool:
        return False

    def new_stream(self, name: str) -> HostStream:
        stream = HostStream(name)
        self._streams.add(stream)
        return stream

    def current_stream(self) -> CallerStream:
        return self._compute

    def synchronize(self) -> None:
        for stream in list(self._streams):
            if not stream.closed:
                stream.synchronize()

    def allocate_host(self, nbytes: int, *, pinned: bool = True) -> torch.Tensor:
        # Ordinary pageable memory: there is no device to pin for.
        return torch.empty(nbytes, dtype=torch.uint8)

    def _device_empty(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def link_seconds(self, nbytes: int) -> float:
        """Time the simulated link takes for ``nbytes`` (0 without a simulated link)."""
        seconds = self.config.link_latency
        if self.config.link_bandwidth is not None:
            seconds += nbytes / self.config.link_bandwidth
        return seconds

    def copy_(self, dst: torch.Tensor, src: torch.Tensor, *, stream: Stream) -> None:
        nbytes = src.numel() * src.element_size()
        delay = self.link_seconds(nbytes)

        def run() -> None:
            start = time.perf_counter()
            dst.copy_(src)
            remaining = delay - (time.perf_counter() - start)
            if remaining > 0:
                time.sleep(remaining)  # the simulated link: the copy finishes no sooner

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
        }
