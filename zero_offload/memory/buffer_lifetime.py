"""InFlight: a buffer and the events of the copies that may still touch it, in one object.

Note [a buffer travels with its events]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A copy queued on a stream reads or writes its buffers until its end event completes. Code
that keeps the buffer in one field and the event in another can free, reuse or read the
buffer without the event, and nothing stops it. ``InFlight`` makes the pair one value: the
buffer is handed out only through a method that orders the caller after the events first
(``wait()`` on the host, ``use_on(stream)`` on a stream, without blocking the CPU), and
events are added to it, never kept beside it. ``BlockPool`` keeps its buffer in one until
its last copy is done (Note [a pool outlives its copies], below); the optimizer's
staging buffers and the activation records are the other such pairs.

Note [a pool outlives its copies]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A pinned buffer must not be unpinned and freed while a DMA into or out of it is queued,
and a device buffer must not return to the budget while a copy still touches it. ``close()``
waits for pending events; a pool dropped without ``close()`` (an optimizer a Trainer lets go
of) is finalised by ``BufferLifetime.drain``, which holds the buffer, waits for every
event ever recorded on a block that has not yet completed, and only then releases the
buffer. That
wait runs in a finalizer, i.e. in whichever thread dropped the last reference: a hidden
host synchronisation, paid only by code that forgot ``close()``.

Not thread-safe by itself: the owner serialises ``add`` and the hand-outs (the pool does it
under its lock).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Generic, TypeVar

import torch

from ..accelerator import Event, Stream
from ..errors import StreamError

__all__ = ["BufferLifetime", "InFlight", "pruned"]

T = TypeVar("T")


def pruned(events: list[Event]) -> list[Event]:
    """``events`` with the completed ones dropped, at lengths 8, 16, 32, ... only: a
    record per tile of a large copy keeps many pending at once, and filtering them all at
    every record made recording quadratic. Completed events left in meanwhile are harmless
    (everything that reads such a list queries them)."""
    n = len(events)
    if n >= 8 and n & (n - 1) == 0:
        return [event for event in events if not event.query()]
    return events


class InFlight(Generic[T]):
    """``buffer`` and the events after which no queued copy touches it any more."""

    __slots__ = ("_buffer", "_events")

    def __init__(self, buffer: T, events: Iterable[Event] = ()) -> None:
        self._buffer = buffer
        self._events: list[Event] = []
        for event in events:
            self.add(event)

    def __repr__(self) -> str:
        return f"InFlight({type(self._buffer).__name__}, {len(self.pending())} pending)"

    def add(self, event: Event) -> None:
        """One more copy touches the buffer until ``event``."""
        if not isinstance(event, Event):
            raise TypeError(f"InFlight.add takes an accelerator Event, got {event!r}")
        self._events = [*pruned(self._events), event]

    def pending(self) -> list[Event]:
        """The events not yet complete (``query``; never blocks)."""
        return [event for event in self._events if not event.query()]

    def done(self) -> bool:
        """Whether no copy touches the buffer any more."""
        return not self.pending()

    def wait(self) -> T:
        """The buffer, once every event is complete.

        Synchronisation point: blocks the calling thread on the pending events.
        """
        for event in self._events:
            event.synchronize()
        self._events = []
        return self._buffer

    def use_on(self, stream: Stream) -> T:
        """The buffer for work issued on ``stream`` next: the stream waits, the CPU does not."""
        for event in self.pending():
            stream.wait_event(event)
        return self._buffer


class BufferLifetime:
    """Holds a pool's buffer until its copies are done; see Note [a pool outlives its copies].

    ``held`` pairs the buffer with every block event not yet seen complete (Note [a buffer
    travels with its events]); it is guarded by the pool's lock while the
    pool lives. ``drain`` runs once, when the pool is closed or collected.
    """

    def __init__(self, buffer: torch.Tensor, release: Callable[[], None]) -> None:
        self.held: InFlight[torch.Tensor] | None = InFlight(buffer)  # (capacity,) uint8
        self._release = release

    def add(self, event: Event) -> None:
        """One more copy may touch the buffer until ``event``."""
        if self.held is not None:
            self.held.add(event)

    def drain(self) -> None:
        """Wait for every copy, then release the buffer (once; later calls do nothing)."""
        # Synchronisation point (hidden when run as a finalizer): see the Note above.
        if self.held is not None:
            for event in self.held.pending():
                try:
                    event.synchronize()
                except StreamError:
                    # Its stream failed, so its work is over and the buffer free to go; the
                    # error reached the stream's user already (Note [stream errors are
                    # sticky]). Raising it again here would print it once more per pool
                    # from the finalizers at exit, burying the one error that matters.
                    continue
            self.held = None
        release, self._release = self._release, _noop
        release()


def _noop() -> None:
    return None
