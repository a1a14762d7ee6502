"""CudaAccelerator: CUDA streams and events, exact-size pinned host memory, device budget.

See Note [stream semantics] and Note [stream errors are sticky] in ``base.py``. On CUDA,
``submit(fn)`` runs ``fn`` on the calling thread with the stream current, so its kernels and
copies are queued on that stream; Python exceptions raised while *issuing* work surface
immediately, and asynchronous CUDA errors surface at the next synchronisation, as CUDA does.

Note [the default device budget]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The budget is what the library may add on top of what already lives on the GPU. By default
it is the device's *free* memory when the accelerator is built (``torch.cuda.mem_get_info``:
the weights, the CUDA context and other processes are already counted out), less a headroom
of ``max(DEVICE_HEADROOM_FRACTION`` of total memory, ``DEVICE_HEADROOM_MIN)`` for what
comes later and is not the library's: activations, the caching allocator's fragmentation,
cuBLAS workspaces, NCCL buffers. Memory the caching allocator holds cached but unused
(``memory_reserved - memory_allocated``) is free to torch, so it counts as free.
``AcceleratorConfig.device_budget`` (or ``ZERO_OFFLOAD_DEVICE_BUDGET``) still wins.

Events and streams: ``cuda_events.py`` (Note [cuda events: blocking, timed only when asked]).
"""

from __future__ import annotations

import ctypes
import os
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch

from ..config import AcceleratorConfig, format_bytes
from ..errors import DeviceBudgetExceeded
from .base import Accelerator, DeviceLedger, Stream
from .capture import check_not_capturing
from .cuda_events import Clock, CudaStream
from .device_context import on_cuda_device
from .host_syncs import one_sync
from .pinned import memlock_limit, page_aligned_buffer

__all__ = [
    "DEVICE_HEADROOM_FRACTION",
    "DEVICE_HEADROOM_MIN",
    "CudaAccelerator",
    "HostRegistration",
    "LibraryRanges",
    "check_device_free",
    "default_device_budget",
    "foreign_device_tensors",
    "resolve_device_index",
]

#: Headroom left out of the default budget: this share of the GPU's total memory...
DEVICE_HEADROOM_FRACTION = 0.05
#: ...or at least this many bytes. See Note [the default device budget].
DEVICE_HEADROOM_MIN = 1 << 30


def default_device_budget(free: int, total: int, cached_unused: int = 0) -> tuple[int, str]:
    """The default budget from ``mem_get_info``'s ``free`` and ``total`` bytes, and why.

    ``cached_unused``: bytes the caching allocator holds but has not handed out. See Note
    [the default device budget].
    """
    headroom = max(int(total * DEVICE_HEADROOM_FRACTION), DEVICE_HEADROOM_MIN)
    available = free + cached_unused
    budget = max(available - headroom, 0)
    return budget, (
        f"default: {format_bytes(available)} free on the device at construction "
        f"(torch.cuda.mem_get_info, plus torch's unused cache) less a headroom of "
        f"{format_bytes(headroom)}"
    )


def resolve_device_index(
    index: int | None, *, env: Mapping[str, str], device_count: int, current: int
) -> int:
    """Which CUDA device this process uses: ``index``, else the current device when the
    user chose one, else ``LOCAL_RANK``, else the current (device 0).

    A current device other than 0 was set by the user (``torch.cuda.set_device``): it wins
    over ``LOCAL_RANK``, which is only torchrun's default mapping. ``LOCAL_RANK`` is used
    only when it names a visible device: with one GPU visible per process
    (``CUDA_VISIBLE_DEVICES``) the rank's GPU is device 0, the current one.
    """
    if index is not None:
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < device_count:
            raise ValueError(
                f"CUDA device index must be an int in [0, {device_count}), got {index!r}; "
                f"this process sees {device_count} GPU(s)"
            )
        return index
    if current != 0:
        return current  # an explicit set_device: not ours to override
    local = env.get("LOCAL_RANK", "").strip()
    if local:
        if not local.isdigit():
            raise ValueError(f"LOCAL_RANK={local!r} is not a device index; torchrun sets 0, 1, ...")
        if int(local) < device_count:
            return int(local)
    return current


def check_device_free(nbytes: int, *, free: int, cached_unused: int, what: str) -> None:
    """Raise ``DeviceBudgetExceeded`` if ``nbytes`` cannot fit in what the device has now.

    The budget is a snapshot taken at construction (Note [the default device budget]);
    others (activations, another process) may have taken memory since, so a large request
    is checked against ``mem_get_info`` again before it is made.
    """
    available = free + cached_unused
    if nbytes > available:
        raise DeviceBudgetExceeded(
            f"cannot place {what!r} ({format_bytes(nbytes)}, {nbytes} bytes) on the device: "
            f"only {format_bytes(available)} is free there now (torch.cuda.mem_get_info plus "
            f"torch's unused cache), less than when the budget was set. Free device memory "
            f"first (smaller batch, fewer cached tensors), lower AcceleratorConfig("
            f"device_budget=...), or offload more (smaller buckets, higher offload_fraction)."
        )


# Note [library storages by address range]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The caching allocator must be told (``record_stream``) about a device tensor that a copy
# on a side stream uses only when the allocator owns it and may hand it out early: a saved
# activation autograd drops after packing. Library buffers (pool buffers, and every tensor
# viewing them, such as a reloaded activation over its own storage slice of a pool buffer,
# whose storage pointer is *inside* the buffer) stay allocated until their own events
# complete (Note [block reuse waits on events] in memory/pending_blocks.py). So they are
# recognised by address range, not by the storage's start: ``record_stream`` on a pointer
# inside an allocation asserts under ``backend:cudaMallocAsync`` ("ptr not found"), and
# with the native allocator would only delay the whole pool buffer's eventual free.


class LibraryRanges:
    """The address ranges of library-allocated device buffers; ``_lock`` guards them
    (finalizers drop ranges on any thread)."""

    def __init__(self) -> None:
        self._ranges: dict[int, int] = {}  # start -> end (exclusive), bytes
        self._lock = threading.Lock()

    def add(self, start: int, nbytes: int) -> None:
        """Track ``[start, start + nbytes)``."""
        with self._lock:
            self._ranges[start] = start + nbytes

    def discard(self, start: int) -> None:
        """Stop tracking the range starting at ``start`` (its buffer died)."""
        with self._lock:
            self._ranges.pop(start, None)

    def owns(self, ptr: int) -> bool:
        """Whether ``ptr`` lies inside a library buffer. O(buffers): a few pools."""
        with self._lock:
            return any(start <= ptr < end for start, end in self._ranges.items())


def foreign_device_tensors(
    tensors: tuple[torch.Tensor, ...], ranges: LibraryRanges
) -> list[torch.Tensor]:
    """The device tensors of ``tensors`` the caching allocator owns (not library buffers):
    those a copy on a side stream must ``record_stream``, Note [library storages by
    address range]."""
    return [t for t in tensors if t.is_cuda and not ranges.owns(t.untyped_storage().data_ptr())]


def _clear_last_error() -> None:
    # The runtime keeps a failed call's error as the thread's "last error" until someone
    # reads it; torch's next kernel-launch check would report it as its own failure. torch
    # binds no cudaGetLastError, so call the runtime torch loaded (same soname, same copy).
    for name in (None, f"libcudart.so.{(torch.version.cuda or '12').split('.')[0]}"):
        try:
            ctypes.CDLL(name).cudaGetLastError()
            return
        except (OSError, AttributeError):
            continue


class HostRegistration:
    """``cudaHostRegister``/``Unregister`` for device ``index``, from any thread.

    Each call runs with the device current (``on_cuda_device``; a finalizer may unregister
    on any thread): Note [every library thread binds its device] in device_context.py. A
    failed registration clears the runtime's last error, so it is reported once, by us.
    ``cudart``/``clear_error`` are for tests with a fake runtime.
    """

    def __init__(
        self,
        index: int,
        *,
        cudart: Any = None,
        clear_error: Callable[[], None] = _clear_last_error,
    ) -> None:
        self.index = index
        self._cudart = cudart
        self._clear_error = clear_error

    def _runtime(self) -> Any:
        return self._cudart if self._cudart is not None else torch.cuda.cudart()

    def register(self, ptr: int, nbytes: int) -> int:
        """Pin ``nbytes`` at ``ptr``; the CUDA status (0 on success)."""
        with on_cuda_device(self.index):
            status = int(self._runtime().cudaHostRegister(ptr, nbytes, 0))
            if status != 0:
                self._clear_error()
        return status

    def unregister(self, ptr: int) -> None:
        """Unpin the registration at ``ptr`` (at the last view's death, any thread)."""
        with on_cuda_device(self.index):
            status = int(self._runtime().cudaHostUnregister(ptr))
            if status != 0:
                self._clear_error()  # nothing to raise to in a finalizer; keep torch clean


class CudaAccelerator(Accelerator):
    """See the module docstring."""

    name = "cuda"
    computes_on_host = False  # the GPU computes: CPU Adam may take every core

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
        index = resolve_device_index(
            index,
            env=os.environ,
            device_count=torch.cuda.device_count(),
            current=torch.cuda.current_device(),
        )
        self.device = torch.device("cuda", index)
        self.bind_thread()  # the building thread works on this device from now on
        self._registration = HostRegistration(index)
        free, total = torch.cuda.mem_get_info(self.device)
        cached = torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
        budget, source = self.config.resolved_device_budget(
            *default_device_budget(free, total, cached)
        )
        self.ledger = DeviceLedger(budget, source)
        self._clock = Clock(self.device)
        self._streams: weakref.WeakSet[CudaStream] = weakref.WeakSet()
        self._library = LibraryRanges()  # Note [library storages by address range]
        self._compute = self._wrap(torch.cuda.current_stream(self.device), "compute")
        # Per thread: the stream made current by ``stream_context``, if any (``stream``).
        self._current = threading.local()

    @property
    def pinned_memory_available(self) -> bool:
        return True

    def bind_thread(self) -> None:
        # Only when it differs: set_device on the current device still costs a driver call.
        if torch.cuda.current_device() != self.device.index:
            torch.cuda.set_device(self.device)

    def _wrap(self, stream: torch.cuda.Stream, name: str) -> CudaStream:
        return CudaStream(stream, name, timing=lambda: self.timing, clock=self._clock)

    def new_stream(self, name: str) -> CudaStream:
        stream = self._wrap(torch.cuda.Stream(self.device), name)
        self._streams.add(stream)
        return stream

    def current_stream(self) -> CudaStream:
        chosen = getattr(self._current, "stream", None)
        if chosen is not None:  # inside stream_context: that stream, by its own name
            return chosen
        current = torch.cuda.current_stream(self.device)
        if current != self._compute.stream:
            self._compute = self._wrap(current, "compute")
        return self._compute

    @contextmanager
    def stream_context(self, stream: Stream) -> Iterator[None]:
        # Note [metadata ops are recorded on the current stream] in base.py
        if not isinstance(stream, CudaStream):
            raise TypeError(f"stream must be a CUDA stream of this accelerator, got {stream!r}")
        previous = getattr(self._current, "stream", None)
        self._current.stream = stream
        try:
            with torch.cuda.stream(stream.stream):
                yield
        finally:
            self._current.stream = previous

    def synchronize(self) -> None:
        with one_sync():  # Note [host syncs are counted where they can block]
            for stream in list(self._streams):
                stream.synchronize()
            torch.cuda.synchronize(self.device)

    def allocate_host(self, nbytes: int, *, pinned: bool = True) -> torch.Tensor:
        if not pinned or nbytes == 0:
            return torch.empty(nbytes, dtype=torch.uint8)
        # Hidden cost: faults in and page-locks every page; done once per pool. See Note
        # [pinned buffers are page-aligned mmaps] in pinned.py for why not np.empty or
        # torch's pinned allocator.
        registration = self._registration
        return page_aligned_buffer(
            nbytes, register=registration.register, unregister=registration.unregister
        )

    def _device_empty(self, nbytes: int, *, what: str) -> torch.Tensor:
        # The budget is a snapshot from construction: check what the device has now.
        free, _ = torch.cuda.mem_get_info(self.device)
        cached = torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
        check_device_free(nbytes, free=free, cached_unused=cached, what=what)
        tensor = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        ptr = tensor.untyped_storage().data_ptr()
        self._library.add(ptr, nbytes)
        weakref.finalize(tensor, self._library.discard, ptr)
        return tensor

    def copy_(
        self,
        dst: torch.Tensor,
        src: torch.Tensor,
        *,
        stream: Stream,
        label: str = "",
        held: bool = False,
    ) -> None:
        if not isinstance(stream, CudaStream):
            raise TypeError(f"stream must be a CUDA stream of this accelerator, got {stream!r}")
        check_not_capturing("the copy" if label else "a copy", label=label)
        # Which device tensors the caching allocator must keep from other streams until this
        # copy is done: none when the caller holds them (Note [holding, not record_stream] in
        # activations/offloader.py), else those it owns (Note [library storages by address
        # range]).
        foreign = [] if held else foreign_device_tensors((dst, src), self._library)

        def run() -> None:
            dst.copy_(src, non_blocking=True)
            for tensor in foreign:
                tensor.record_stream(stream.stream)

        stream.submit(run)

    def describe(self) -> dict[str, Any]:
        props = torch.cuda.get_device_properties(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        limit = memlock_limit()
        return {
            "device": f"{self.device} ({props.name})",
            "device_memory_total": total,
            "device_memory_free": free,
            "device_budget": self.ledger.budget,
            "device_budget_source": self.ledger.budget_source,
            "simulated_link": "none (real PCIe/NVLink)",
            "memlock_limit": "unlimited" if limit is None else limit,
        }
