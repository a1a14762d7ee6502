"""Host synchronisations, counted by the thread that makes them and the stream it waits for.

Note [host syncs are counted where they can block]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A host synchronisation is a call that blocks a CPU thread until queued work is done:
``Event.synchronize``, ``Stream.synchronize``, ``Accelerator.synchronize`` and
``Accelerator.read_to_host``. On a GPU, one made by a thread of the training loop (the
caller's, or autograd's while it runs backward hooks) stops that thread from queuing the
kernels that follow: the GPU drains its queue and idles until Python catches up. On the
host accelerator the "device" is never far behind, so time cannot show such a wait; it is
counted instead, at the accelerator, where it is made. The counts are structural: the same
code makes the same calls on every accelerator.

Each call is counted as one of three kinds (``SyncKind``):
- ``WAIT``: the thread may block. These are what the step keeps few (issue 39: at most one
  per step on the training loop's threads, outside the CPU optimizer's inputs).
- ``COMPLETED``: a ``query()`` found the work done first, so the call returns at once. It
  is still made, so that CUDA's sanitizer and the race checker see the host-side order
  (Note [a completed event is synchronized] in ``memory/pending_blocks.py``), and counted
  apart, since it costs nothing: ``synchronize_completed``.
- ``INPUT``: host compute waiting for the tile it reads next (CPU Adam following the
  gradient in): a data dependency that pipelines, one per launch at most: ``wait_input``.

A whole-device synchronisation (``Accelerator.synchronize``) is one count, whatever it waits
for inside. Thread names tell the library's own threads (``zero_offload:<stream>``, the
simulated streams' and the host worker's) from the training loop's (``training_thread``).
Counting costs one lock and one dict update per call: tens of calls a step.
"""

from __future__ import annotations

import enum
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NamedTuple, Protocol

__all__ = [
    "LIBRARY_THREAD_PREFIX",
    "SyncKey",
    "SyncKind",
    "count_sync",
    "host_syncs",
    "one_sync",
    "synchronize",
    "synchronize_completed",
    "training_thread",
    "wait_input",
]

#: Every thread the library starts is named ``zero_offload:<what>``.
LIBRARY_THREAD_PREFIX = "zero_offload:"


class SyncKind(enum.Enum):
    """How a counted synchronisation could block; Note [host syncs are counted where ...]."""

    WAIT = "wait"
    COMPLETED = "completed"
    INPUT = "input"


class SyncKey(NamedTuple):
    thread: str  # the calling thread's name
    stream: str  # the stream waited for ("device" for a whole-device synchronisation)
    kind: SyncKind


class Event(Protocol):
    """What is waited for: ``base.Event`` (which this module may not import: ``base``
    counts its own waits here)."""

    def query(self) -> bool: ...
    def synchronize(self) -> None: ...


_lock = threading.Lock()
_counts: Counter[SyncKey] = Counter()
_local = threading.local()  # .kind: the kind the current call counts as; None: not counted


def count_sync(stream: str) -> None:
    """Count one synchronisation of the calling thread on ``stream``, of the kind its
    context says (``WAIT`` unless inside ``synchronize_completed``/``wait_input``)."""
    kind = getattr(_local, "kind", SyncKind.WAIT)
    if kind is None:  # inside a whole-device synchronisation, counted once already
        return
    key = SyncKey(threading.current_thread().name, stream, kind)
    with _lock:
        _counts[key] += 1


@contextmanager
def _counted_as(kind: SyncKind | None) -> Iterator[None]:
    previous = getattr(_local, "kind", SyncKind.WAIT)
    _local.kind = kind
    try:
        yield
    finally:
        _local.kind = previous


@contextmanager
def one_sync() -> Iterator[None]:
    """Count the synchronisation inside as one ``WAIT`` on "device" (a whole-device one)."""
    count_sync("device")
    with _counted_as(None):
        yield


def synchronize_completed(event: Event, *, quiet: bool = False) -> None:
    """Synchronize ``event``, which ``query()`` found complete: free, and a host wait that
    CSAN and the race checker see (Note [a completed event is synchronized] in
    ``memory/pending_blocks.py``), counted as ``COMPLETED``. ``quiet``: leave a failed
    copy's error to its stream's own synchronisation points (Note [stream errors are
    sticky]) instead of raising it here."""
    with _counted_as(SyncKind.COMPLETED):
        try:
            event.synchronize()
        except Exception:
            if not quiet:
                raise


def synchronize(event: Event) -> None:
    """``event.synchronize()``: counted as ``COMPLETED`` (free) when a ``query()`` finds it
    done first, else as a ``WAIT``."""
    if event.query():
        synchronize_completed(event)
    else:
        event.synchronize()


def wait_input(event: Event) -> None:
    """Block until ``event``, the arrival of the tile host compute reads next, which a
    ``query()`` found pending: counted as ``INPUT``, not ``WAIT``."""
    with _counted_as(SyncKind.INPUT):
        event.synchronize()


def host_syncs() -> Counter[SyncKey]:
    """Every synchronisation counted so far in this process, by thread, stream and kind.
    Take two and subtract them for a window."""
    with _lock:
        return Counter(_counts)


def training_thread(name: str) -> bool:
    """Whether a thread of this name is the training loop's (not one the library started)."""
    return not name.startswith(LIBRARY_THREAD_PREFIX)
