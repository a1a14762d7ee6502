"""Which saved device tensors are still held for their copy out to the host, and when a
record is ON_HOST.

A copy out reads the tensor autograd saved; the offloader keeps that tensor referenced in
``OutgoingCopies`` until the copy's end event completes, or until compute waited for it, and
only then drops it (Note [holding, not record_stream] in ``offloader.py``). The ``d2h``
stream runs copies in issue order, so they are released oldest first. A record whose copy
out ended on the stream is LANDING until the host sees the event complete, then ON_HOST
(``record.py``; Note [a completed event is synchronized] in ``memory/pending_blocks.py``).

Not thread-safe by itself: every method runs under the offloader's lock, which also guards
the records' fields.
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple

import torch

from ..accelerator import Event
from ..accelerator.host_syncs import synchronize_completed
from .record import ActivationState, OffloadedActivation

__all__ = ["OutgoingCopies"]


class _Outgoing(NamedTuple):
    record: OffloadedActivation
    source: torch.Tensor  # the device tensor autograd saved, held until `event` completes
    event: Event  # end of the copy to the host


class OutgoingCopies:
    """The pending copies out, in issue order, with the device tensors they read, and the
    LANDING records.

    Each ``release_*`` method returns the released records: their device tensors are no
    longer held here, and the caller drops its last references outside the lock (the
    memory returns to the allocator then) and counts their bytes off.
    """

    def __init__(self) -> None:
        self._pending: deque[_Outgoing] = deque()  # pending copies out, in issue order
        self._landing: list[OffloadedActivation] = []  # LANDING records, oldest first

    def __len__(self) -> int:
        return len(self._pending)

    def add(self, record: OffloadedActivation, source: torch.Tensor, event: Event) -> None:
        """Hold ``source`` until ``event``, the end of ``record``'s copy out, completes."""
        self._pending.append(_Outgoing(record, source, event))

    def oldest(self) -> tuple[OffloadedActivation, Event]:
        """The oldest pending copy out's record and end event."""
        item = self._pending[0]
        return item.record, item.event

    def release_completed(self) -> list[OffloadedActivation]:
        """Release the copies out that completed (never blocks), and settle the LANDING
        records the host now sees done."""
        released = []
        while self._pending and self._pending[0].event.query():
            released.append(self._release_oldest())
        landing, self._landing = self._landing, []
        for record in landing:
            if record.state is ActivationState.LANDING:
                self.settle(record)
        return released

    def release_through(self, record: OffloadedActivation) -> list[OffloadedActivation]:
        """Release the copies out up to ``record``'s, after compute waited for its copy (the
        earlier ones are done too); nothing when it is not pending."""
        released: list[OffloadedActivation] = []
        if not any(item.record is record for item in self._pending):
            return released
        while self._pending:
            item = self._release_oldest()
            released.append(item)
            if item is record:
                break
        return released

    def settle(self, record: OffloadedActivation) -> None:
        """ON_HOST if the copy out is done, the host seeing it so (Note [a completed event
        is synchronized] in memory/pending_blocks.py); LANDING until then. Never blocks."""
        if record.out_event.query():
            synchronize_completed(record.out_event, quiet=True)
            record.state = ActivationState.ON_HOST
        else:
            record.state = ActivationState.LANDING
            self._landing.append(record)

    def abandon(self) -> None:
        """Drop every held tensor and LANDING record, for an offloader released (Note [an
        offloader released without close] in ``release.py``): the caller waited for the
        copies out already. Runs without the offloader's lock, which nobody holds then."""
        self._pending.clear()
        self._landing.clear()

    def _release_oldest(self) -> OffloadedActivation:
        item = self._pending.popleft()
        if item.record.state is ActivationState.MOVING_OUT:
            self.settle(item.record)
        return item.record
