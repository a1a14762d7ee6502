"""Which device a thread has current: CUDA's per-thread current device, and its simulation.

Note [every library thread binds its device]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
On CUDA the current device belongs to the calling *thread*, and every new thread starts on
device 0. A thread that the library starts (a ``ThreadStream`` worker, the host worker) and
then uses for CUDA calls that take no device (``cudaHostRegister``, ``torch.cuda.current_stream()``,
event records and waits) works on device 0, whatever the rank's GPU: on rank 1 of a node it
creates a second CUDA context on GPU 0 (hundreds of MiB) and orders the wrong streams. So
every library thread binds a device before its first call: ``Accelerator.bind_thread()``
when it knows the accelerator, else the device its creator had current when it was made
(``capture_thread_device``), and raw driver calls run under ``on_cuda_device``.

The host accelerator's strict mode (``strict.py``) simulates this: a thread-local simulated
device index that starts at 0 in every thread, the strict accelerator being device 1, and
every stream or event call from a thread whose simulated device is not the accelerator's
raises as a mismatched CUDA call would.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

__all__ = [
    "capture_thread_device",
    "on_cuda_device",
    "set_simulated_device",
    "simulated_device",
]

_local = threading.local()


def simulated_device() -> int:
    """The calling thread's simulated current device (0 until the thread binds another)."""
    return getattr(_local, "index", 0)


def set_simulated_device(index: int) -> None:
    """Make ``index`` the calling thread's simulated current device."""
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise ValueError(f"a device index must be an int >= 0, got {index!r}")
    _local.index = index


def _cuda_current() -> int | None:
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return None  # nothing bound yet: the new thread will start where this one would
    return torch.cuda.current_device()


def capture_thread_device() -> Callable[[], None]:
    """A callable that gives the thread running it the caller's current device(s).

    For a thread started without an accelerator to bind: call this where the thread is
    created, run the result first thing in the thread. See Note [every library thread binds
    its device].
    """
    simulated = getattr(_local, "index", None)
    cuda = _cuda_current()

    def bind() -> None:
        if simulated is not None:
            _local.index = simulated
        if cuda is not None and torch.cuda.current_device() != cuda:
            torch.cuda.set_device(cuda)

    return bind


@contextmanager
def on_cuda_device(index: int) -> Iterator[None]:
    """Run the body with CUDA device ``index`` current on this thread, then restore it.

    For driver calls that take no device (``cudaHostRegister``/``Unregister``), which may
    run on any thread, a finalizer's included. See Note [every library thread binds its
    device].
    """
    previous = torch.cuda.current_device()
    if previous != index:
        torch.cuda.set_device(index)
    try:
        yield
    finally:
        if previous != index:
            torch.cuda.set_device(previous)
