"""Strict mode of the host accelerator: behave as CUDA would where CUDA differs from a CPU.

The plain host accelerator agrees with CUDA only where that was easy: its compute events are
born complete, its device memory *is* host memory, it has no notion of a thread's current
device. Code that is wrong on a GPU passes there. ``AcceleratorConfig(strict=True)`` (or
``ZERO_OFFLOAD_STRICT=1``) closes these gaps; each is a named note below.

Note [strict: compute completes after its event]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A GPU runs compute long after the CPU queued it, so an event recorded on the compute stream
is pending for a while, and a device block freed with it stays in flight. The strict compute
stream still runs work inline (the results are there at once), but each event it records
reports ``query() == False`` (and ``completed_at() is None``) until either ``COMPUTE_LATENCY`` seconds have passed since it
was recorded or something waits for it: ``Event.synchronize``, the stream's or the
accelerator's ``synchronize``, or another stream's ``wait_event`` once that stream reaches
the wait. Completing an event completes every earlier one of the stream (stream order); its
``completed_at`` is then when it was recorded, which is when the inline work before it ended,
as a GPU timestamps an event when the stream reaches it. Code
that waits properly never blocks for long and never deadlocks; code that reads ``query()``
as "done" takes its not-done path, as it would on a GPU.

Note [strict: host memory is not device memory]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
On a GPU an op whose tensor arguments live on the device and in (pinned) host memory raises
"Expected all tensors to be on the same device". Here both are CPU memory, so the strict
accelerator registers what it hands out (``MEMORY``): ``allocate_host`` as host memory
(pinned homes, staging, activation stores), ``allocate_device`` as device memory (pool
blocks, so parameters fetched into them and everything computed from those).
``strict_device_checks()``, entered on the thread that runs compute (the test suite's
fixture enters it under ``ZERO_OFFLOAD_STRICT=1``), checks every op: one that mixes host
memory with device memory raises that ``RuntimeError``, naming the op and both tensors.
What a result is follows CUDA: a view is what its base is; anything computed from device
memory is device memory; a result computed from host memory alone is host memory; a
copy in place (``.float()``, ``.clone()``) is what its source is. ``.to(device=...)`` and
factory ops give unknown tensors: the device and "cpu" look alike here (torch passes every
factory op its device), and a state dict's ``.to("cpu")`` copy is host memory on CUDA. Exempt, as on CUDA: copies (``copy_``,
``to``), which may cross devices, and 0-dim tensors (CPU scalars mix with device tensors).
Tensors made without saying where (a test's reference, a scratch) are *unknown* and mix
with both: on a GPU machine most would be CPU tensors, and calling them device memory
would flag correct code. So a parameter left pointing at its pinned home fails as soon as
it meets an activation computed from a fetched parameter, as on a GPU; one that only
meets unknown tensors (the first layer's input) is not caught. Ops on other threads (the
simulated streams, the host worker) are not checked: they are the copies and the CPU work.
``host_memory_name(tensor)`` says whether a tensor is host memory, for tests.

Note [strict: a thread's current device]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The strict accelerator is device ``STRICT_DEVICE_INDEX`` (1) of a simulated two-device
machine. Each thread starts on device 0 (``device_context.simulated_device``); the thread
that builds the accelerator is bound, as ``CudaAccelerator`` sets the device, and so are the
simulated streams' own workers (they are the GPU). Any other thread that touches one of its
streams or events before ``accelerator.bind_thread()`` raises, as a CUDA call on the wrong
device would misbehave. See Note [every library thread binds its device].

Note [strict: a copy lands when it ends]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
On a GPU a copy queued on a stream writes its destination while the stream runs it, long
after the host queued it; a reader that did not wait for the copy's event sees bytes from
before it. A plain host copy writes at once, so such a reader is usually right by luck. The
host accelerator's copies on a simulated link therefore spend their link time first and
write at its end, and strict mode gives every copy at least ``COPY_LATENCY`` seconds of it:
a read (or a write) that skipped the wait sees the old bytes for that whole time, and the
parity tests see it. The copy still runs in its stream's order, and its end event completes
only after the bytes are written, so code that waits is never wrong, only later.

Block reuse (CUDA's caching-allocator semantics) needs no extra machinery: with compute
events pending, a block freed with one stays in flight until a stream waits for it or the
host synchronises, and the race checker (``check_races``) sees which of the two happened
(Note [block reuse waits on events] in ``memory/pending_blocks.py``).
"""

from __future__ import annotations

import collections
import enum
import os
import threading
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .base import Stream
from .device_context import simulated_device
from .threads import Guard, ThreadEvent

__all__ = [
    "COMPUTE_LATENCY",
    "COPY_LATENCY",
    "MEMORY",
    "SIMULATED_DEVICE_COUNT",
    "STRICT_DEVICE_INDEX",
    "STRICT_ENV",
    "MemoryKind",
    "MemoryRegistry",
    "PendingComputeEvent",
    "StrictDeviceMode",
    "device_guard",
    "host_memory_name",
    "strict_device_checks",
    "strict_enabled_by_env",
]

#: Environment variable turning strict mode on for every host accelerator ("1" to enable).
STRICT_ENV = "ZERO_OFFLOAD_STRICT"
#: Devices on the simulated machine, and which one the strict accelerator is.
SIMULATED_DEVICE_COUNT = 2
STRICT_DEVICE_INDEX = 1
#: Seconds a compute event stays pending unless waited for: Note [strict: compute completes
#: after its event].
COMPUTE_LATENCY = 0.05
#: Seconds at least before a strict copy writes its destination: Note [strict: a copy lands
#: when it ends].
COPY_LATENCY = 0.001


def strict_enabled_by_env() -> bool:
    """Whether ``ZERO_OFFLOAD_STRICT`` asks for strict mode ("1", "true", "yes", "on")."""
    value = os.environ.get(STRICT_ENV, "").strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    raise ValueError(
        f"{STRICT_ENV}={os.environ[STRICT_ENV]!r} is not a switch; use 1 for the strict "
        "host accelerator or 0 (or unset it) for the plain one"
    )


# --------------------------------------------------------------------- current device


def device_guard(index: int) -> Guard:
    """A guard raising when the calling thread's simulated device is not ``index``.

    See Note [strict: a thread's current device].
    """

    def guard(what: str) -> None:
        current = simulated_device()
        if current != index:
            raise RuntimeError(
                f"thread {threading.current_thread().name!r} touched {what} of device "
                f"{index} while its current device is {current}: on CUDA every thread starts "
                f"on device 0, so this call would go to the wrong GPU. Bind the thread first "
                f"(accelerator.bind_thread(), or torch.cuda.set_device({index}) on CUDA); "
                f"see Note [every library thread binds its device]"
            )

    return guard


# --------------------------------------------------------------------- compute events


class PendingComputeEvent(ThreadEvent):
    """A compute-stream event that completes late: Note [strict: compute completes after
    its event]. ``completer`` completes it and every earlier event of its stream."""

    def __init__(
        self,
        stream_name: str,
        *,
        completer: ComputeEvents,
        latency: float,
        **kwargs: Any,
    ) -> None:
        super().__init__(stream_name, **kwargs)
        self._ran_at = time.perf_counter()  # the inline work before it is done by now
        self._due = self._ran_at + latency
        self._completer = completer

    def completed_at(self) -> float | None:
        # When the work before it finished (the profiler's timeline), not when someone
        # noticed: a GPU's event timestamp is taken when the stream reaches it.
        return self._ran_at if self.is_complete() else None

    def query(self) -> bool:
        if not self.is_complete() and time.perf_counter() >= self._due:
            self._completer.complete_through(self)
        return super().query()

    def wait_unobserved(self) -> None:
        self._touch()
        self._completer.complete_through(self)  # the work ran inline: waiting ends at once
        super().wait_unobserved()


class ComputeEvents:
    """The strict compute stream's pending events, oldest first; ``_lock`` guards them."""

    def __init__(self) -> None:
        self._pending: collections.deque[PendingComputeEvent] = collections.deque()
        self._lock = threading.Lock()

    def add(self, event: PendingComputeEvent, stream: Stream) -> None:
        """Queue ``event``, recorded on ``stream``; numbered in queue order."""
        with self._lock:
            event.order = stream._next_order()
            self._pending.append(event)

    def complete_through(self, event: PendingComputeEvent | None) -> None:
        """Complete ``event`` and every earlier one (all of them when ``event`` is None)."""
        with self._lock:
            if event is not None and event.is_complete():
                return
            while self._pending:
                first = self._pending.popleft()
                first._complete()
                if first is event:
                    return


# --------------------------------------------------------------------- host memory


class MemoryKind(enum.Enum):
    """Where a registered CPU storage would live on a GPU machine."""

    #: Host memory the accelerator handed out (``allocate_host``), or computed from it only.
    HOST = "host"
    #: Device memory: ``allocate_device``, or anything computed from device memory.
    DEVICE = "device"


class MemoryRegistry:
    """Which CPU storages are host or device memory (by storage address), and what each is.

    Storages never registered are *unknown*: a CPU tensor the test or the library made
    without saying where (on a GPU machine, usually a CPU tensor too); they mix with both.
    Entries go when the storage dies, so an address the CPU allocator reuses is never
    mistaken for what it held before. ``_lock``
    guards ``_entries``.
    """

    def __init__(self) -> None:
        self._entries: dict[int, tuple[MemoryKind, str]] = {}
        self._lock = threading.Lock()

    def register(self, tensor: torch.Tensor, kind: MemoryKind, name: str) -> None:
        """Mark the storage under ``tensor`` as ``kind`` memory called ``name``."""
        address = _storage_address(tensor)
        if address is None:
            return
        entry = (kind, name)
        with self._lock:
            self._entries[address] = entry
        # The storage, not the tensor: a dtype view (``.view(torch.float32)``) does not keep
        # its base tensor alive, but every view keeps the storage.
        weakref.finalize(tensor.untyped_storage(), self._forget, address, entry)

    def _forget(self, address: int, entry: tuple[MemoryKind, str]) -> None:
        with self._lock:
            if self._entries.get(address) is entry:
                del self._entries[address]

    def lookup(self, tensor: torch.Tensor) -> tuple[MemoryKind, str] | None:
        """``(kind, name)`` of the memory ``tensor`` views, None when unknown."""
        address = _storage_address(tensor)
        return None if address is None else self._entries.get(address)


#: Every strict accelerator's memory: the dispatch mode is per thread, not per
#: accelerator, so the registry is process-wide.
MEMORY = MemoryRegistry()


def host_memory_name(tensor: torch.Tensor) -> str | None:
    """What host memory ``tensor`` views, None if it is not host memory (Note [strict: host
    memory is not device memory])."""
    entry = MEMORY.lookup(tensor)
    return entry[1] if entry is not None and entry[0] is MemoryKind.HOST else None


def _storage_address(tensor: torch.Tensor) -> int | None:
    if tensor.device.type != "cpu":
        return None
    try:
        address = tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # no storage (sparse, functional wrappers)
        return None
    return address or None


class StrictDeviceMode(TorchDispatchMode):
    """Raises when an op mixes host and device memory: Note [strict: host memory is not
    device memory]."""

    def __init__(self, registry: MemoryRegistry) -> None:
        super().__init__()
        self.registry = registry

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = _tensor_args(args, kwargs.values())
        entries = [self.registry.lookup(t) for t in tensors]
        host = [(t, e[1]) for t, e in zip(tensors, entries, strict=True) if e and e[0] is _HOST]
        device = [(t, e[1]) for t, e in zip(tensors, entries, strict=True) if e and e[0] is _DEV]
        if "copy" in func.__name__:  # copies cross devices on CUDA too
            out = func(*args, **kwargs)
            if func is torch.ops.aten.copy_.default:
                return out
            if "device" in kwargs:  # .to(device=...): "cpu" and the device look alike here
                return out
            if device or host:  # a copy in place: where its source was
                self._mark(out, *((_DEV, device[0][1]) if device else (_HOST, host[0][1])))
            return out
        if host and device:
            (h, h_name), (d, d_name) = host[0], device[0]
            raise RuntimeError(
                f"Expected all tensors to be on the same device, but found at least two "
                f"devices, cuda:{STRICT_DEVICE_INDEX} and cpu! (strict host accelerator: "
                f"{func} got host memory, a {tuple(h.shape)} {h.dtype} view of {h_name}, "
                f"with device memory, a {tuple(d.shape)} {d.dtype} view of {d_name}. On a GPU "
                f"host memory reaches compute only through a copy; see Note [strict: host "
                f"memory is not device memory])"
            )
        out = func(*args, **kwargs)
        if device:
            self._mark(out, _DEV, f"a result computed from {device[0][1]}")
        elif host and len(host) == len(tensors):  # all host memory: so is the result
            self._mark(out, _HOST, f"a result computed from {host[0][1]}")
        return out

    def _mark(self, out: Any, kind: MemoryKind, name: str) -> None:
        for tensor in _tensor_args((out,), ()):
            if self.registry.lookup(tensor) is None:
                self.registry.register(tensor, kind, name)


def _tensor_args(args: Any, kwargs: Any) -> list[torch.Tensor]:
    # The tensors with at least one dimension among an op's arguments, lists included (a
    # hand-written flatten: torch's pytree costs more than the rest of the check).
    found = []
    for group in (args, kwargs):
        for arg in group:
            if isinstance(arg, torch.Tensor):
                if arg.dim() > 0:
                    found.append(arg)
            elif isinstance(arg, (list, tuple)):
                found.extend(a for a in arg if isinstance(a, torch.Tensor) and a.dim() > 0)
    return found


_HOST, _DEV = MemoryKind.HOST, MemoryKind.DEVICE


@contextmanager
def strict_device_checks() -> Iterator[None]:
    """Check every op on this thread for mixed host and device memory while inside.

    Enter it on the thread that runs compute (forward, backward, the step); see Note
    [strict: host memory is not device memory].
    """
    with StrictDeviceMode(MEMORY):
        yield
