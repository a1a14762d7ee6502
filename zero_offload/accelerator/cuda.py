"""CudaAccelerator: CUDA streams and events, exact-size pinned host memory, device budget.

See Note [stream semantics] and Note [stream errors are sticky] in ``base.py``. On CUDA,
``submit(fn)`` runs ``fn`` on the calling thread with the stream current, so its kernels and
copies are queued on that stream; Python exceptions raised while *issuing* work surface
immediately, and asynchronous CUDA errors surface at the next synchronisation, as CUDA does.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ..config import AcceleratorConfig
from ..errors import StreamError
from .base import Accelerator, DeviceLedger, Event, Stream

__all__ = ["CudaAccelerator"]


class _Clock:
    """Maps CUDA event times onto ``time.perf_counter()``: a reference event and its time."""

    def __init__(self, device: torch.device) -> None:
        torch.cuda.synchronize(device)
        self.event = torch.cuda.Event(enable_timing=True)
        self.event.record(torch.cuda.current_stream(device))
        self.event.synchronize()  # one sync at construction, so the two clocks agree
        self.time = time.perf_counter()


class CudaEvent(Event):
    """A timing ``torch.cuda.Event`` recorded on a stream."""

    def __init__(self, event: torch.cuda.Event, stream_name: str, clock: _Clock) -> None:
        self.event = event
        self.stream_name = stream_name
        self._clock = clock

    def query(self) -> bool:
        return bool(self.event.query())

    def synchronize(self) -> None:
        self.event.synchronize()

    def completed_at(self) -> float | None:
        if not self.event.query():
            return None
        return self._clock.time + self._clock.event.elapsed_time(self.event) / 1e3


class CudaStream(Stream):
    """A ``torch.cuda.Stream`` with a name, wrapping errors raised while issuing work."""

    def __init__(self, stream: torch.cuda.Stream, name: str, clock: _Clock) -> None:
        self.stream = stream
        self.name = name
        self._clock = clock
        self._error: StreamError | None = None

    def submit(self, fn: Callable[[], Any]) -> None:
        if self._error is not None:
            raise self._error
        try:
            with torch.cuda.stream(self.stream):
                fn()
        except BaseException as exc:
            error = StreamError(f"work on stream {self.name!r} failed: {exc!r}")
            error.__cause__ = exc
            self._error = error
            raise error from exc

    def record_event(self) -> CudaEvent:
        if self._error is not None:
            raise self._error
        event = torch.cuda.Event(enable_timing=True)
        event.record(self.stream)
        return CudaEvent(event, self.name, self._clock)

    def wait_event(self, event: Event) -> None:
        if not isinstance(event, CudaEvent):
            raise TypeError(f"a CUDA stream can only wait on a CUDA event, got {type(event)}")
        self.stream.wait_event(event.event)

    def synchronize(self) -> None:
        if self._error is not None:
            raise self._error
        self.stream.synchronize()


def _unregister(ptr: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(ptr)


class CudaAccelerator(Accelerator):
    """See the module docstring."""

    name = "cuda"

    def __init__(
        self, config: AcceleratorConfig | None = None, *, index: int | None = None
    ) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError(
                "CudaAccelerator needs a CUDA GPU and a CUDA build of torch; "
                f"torch {torch.__version__} reports none. Use the host accelerator "
                "(ZERO_OFFLOAD_ACCELERATOR=host) on this machine."
            )
        self.config = config if config is not None else AcceleratorConfig()
        if self.config.simulates_link:
            raise ValueError(
                "AcceleratorConfig.link_bandwidth/link_latency simulate a link on the host "
                "accelerator only; a CUDA GPU has a real one. Leave them unset on CUDA."
            )
        index = torch.cuda.current_device() if index is None else index
        self.device = torch.device("cuda", index)
        total = torch.cuda.get_device_properties(self.device).total_memory
        budget, source = self.config.resolved_device_budget(total, "default: total GPU memory")
        self.ledger = DeviceLedger(budget, source)
        self._clock = _Clock(self.device)
        self._streams: weakref.WeakSet[CudaStream] = weakref.WeakSet()
        self._compute = CudaStream(torch.cuda.current_stream(self.device), "compute", self._clock)

    @property
    def pinned_memory_available(self) -> bool:
        return True

    def new_stream(self, name: str) -> CudaStream:
        stream = CudaStream(torch.cuda.Stream(self.device), name, self._clock)
        self._streams.add(stream)
        return stream

    def current_stream(self) -> CudaStream:
        current = torch.cuda.current_stream(self.device)
        if current != self._compute.stream:
            self._compute = CudaStream(current, "compute", self._clock)
        return self._compute

    def synchronize(self) -> None:
        for stream in list(self._streams):
            stream.synchronize()
        torch.cuda.synchronize(self.device)

    def allocate_host(self, nbytes: int, *, pinned: bool = True) -> torch.Tensor:
        if not pinned or nbytes == 0:
            return torch.empty(nbytes, dtype=torch.uint8)
        # Pin exactly nbytes: register an ordinary allocation with the CUDA runtime instead
        # of torch's pinned caching allocator, which rounds up to a power of two (up to 2x
        # host RAM). Hidden cost: page-locking touches every page; done once per pool.
        array = np.empty(nbytes, dtype=np.uint8)
        ptr = array.ctypes.data
        status = torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0)
        if int(status) != 0:
            raise MemoryError(
                f"cudaHostRegister of {nbytes} bytes failed with CUDA error {int(status)}; "
                "lower the host pool size or the locked-memory limit (ulimit -l)"
            )
        weakref.finalize(array, _unregister, ptr)
        return torch.from_numpy(array)

    def _device_empty(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def copy_(
        self, dst: torch.Tensor, src: torch.Tensor, *, stream: Stream, label: str = ""
    ) -> None:
        if not isinstance(stream, CudaStream):
            raise TypeError(f"stream must be a CUDA stream of this accelerator, got {stream!r}")

        def run() -> None:
            dst.copy_(src, non_blocking=True)
            # The caching allocator must not hand these bytes to other work on another
            # stream until this copy has finished.
            for tensor in (dst, src):
                if tensor.is_cuda:
                    tensor.record_stream(stream.stream)

        stream.submit(run)

    def describe(self) -> dict[str, Any]:
        props = torch.cuda.get_device_properties(self.device)
        return {
            "device": f"{self.device} ({props.name})",
            "device_memory_total": props.total_memory,
            "device_budget": self.ledger.budget,
            "device_budget_source": self.ledger.budget_source,
            "simulated_link": "none (real PCIe/NVLink)",
        }
