"""The gradient lifecycle of one bucket: one enum, checked transitions.

Note [a bucket's gradient lifecycle]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The gradients a ``step()`` uses are exactly those of the backward passes since the previous
``step()`` or ``zero_grad()`` (the *window*), whatever the loop calls to clear gradients:
``param.grad`` is never where they live, so ``model.zero_grad()`` cannot reach them and the
optimizer owns the window instead (DeepSpeed's engine semantics). During backward each
parameter's gradient is added into its slot of the bucket's device gradient buffer (taken
from the device pool and zeroed when the bucket's first gradient of a backward arrives, so
slots without a gradient and padding add nothing), and ``param.grad`` is released at once.
When the bucket is complete for this backward (every parameter reported), or the backward
ends, or (one rank) the device pool needs the space, the bucket is *flushed*: the buffer is
reduce-scattered over the ranks, copied into host staging and released (its reuse waits on
the copy's event, Note [block reuse waits on events]); the host worker then adds staging
into the fp32 accumulator, or overwrites it for the window's first flush. A bucket may be
flushed several times per window (micro-batches, early flushes): the accumulator sums the
pieces exactly, in fp32.

``step()`` consumes the window; the accumulator still holds its gradients (a second
``step()`` with no backward between reuses them, like torch without ``zero_grad``), and the
next backward opens a fresh window. ``zero_grad()`` discards everything in flight, device
buffers included. A backward that raised half-way leaves FILLING buckets and a partial
``uses`` count behind: the next ``zero_grad()`` discards them, and the next completed
backward or ``step()`` flushes them into the window (as torch's ``param.grad`` would keep
them), so nothing of it outlives that step.

The rejected alternative: flags spread over the bucket (``fresh``, ``pending``, a
device-gradient enum, a "backward pending" flag on the optimizer). Each loop style that
cleared gradients another way left one of them stale.
"""

from __future__ import annotations

import enum

import numpy as np

__all__ = ["PENDING", "BucketGrads", "GradState"]


class GradState(enum.Enum):
    """Where a bucket's gradients of the current window are, and the memory they hold."""

    #: No gradient in this window. No device gradient memory; the host accumulator's
    #: content is stale and the next flush overwrites it.
    EMPTY = "empty"
    #: A device gradient buffer (``padded_numel`` elements of the training dtype; the fp32
    #: accumulator itself for a resident bucket) is receiving this backward's gradients.
    FILLING = "filling"
    #: Several ranks only: every parameter of the bucket reported in this backward, and
    #: the bucket keeps its device buffer until every bucket before it in the fixed order
    #: has gone (Note [ranks in lockstep] in ``order.py``).
    COMPLETE = "complete"
    #: Flushed: the device buffer is released (its reuse waits on the copy's event); the
    #: reduce-scatter, the copy into host staging and the host worker's accumulation are
    #: queued or running.
    IN_FLIGHT = "in_flight"
    #: The host accumulator holds the window's gradients (the host worker has drained).
    ACCUMULATED = "accumulated"
    #: A step used the window. The accumulator still holds its gradients (a second step
    #: reuses them); the next backward opens a new window and overwrites it.
    CONSUMED = "consumed"


#: A bucket holding gradients of a backward that no step has used yet.
PENDING = frozenset(
    {GradState.FILLING, GradState.COMPLETE, GradState.IN_FLIGHT, GradState.ACCUMULATED}
)

_S = GradState
# Allowed transitions; anything else is a bug in the optimizer, never a user error.
_ALLOWED: frozenset[tuple[GradState, GradState]] = frozenset(
    {
        (_S.EMPTY, _S.FILLING),
        (_S.CONSUMED, _S.FILLING),
        (_S.IN_FLIGHT, _S.FILLING),
        (_S.ACCUMULATED, _S.FILLING),
        (_S.FILLING, _S.COMPLETE),
        (_S.FILLING, _S.IN_FLIGHT),
        (_S.COMPLETE, _S.IN_FLIGHT),
        (_S.IN_FLIGHT, _S.ACCUMULATED),
        (_S.IN_FLIGHT, _S.CONSUMED),
        (_S.ACCUMULATED, _S.CONSUMED),
        (_S.CONSUMED, _S.CONSUMED),
        (_S.EMPTY, _S.EMPTY),
    }
    | {(state, _S.EMPTY) for state in GradState}
)

#: States in which the bucket holds a device gradient buffer.
HOLDS_DEVICE_BUFFER = frozenset({_S.FILLING, _S.COMPLETE})


class BucketGrads:
    """One bucket's gradient state; see Note [a bucket's gradient lifecycle].

    Fields:
        state: the ``GradState``.
        uses: (n_slots,) int64, host; how many times each parameter reported in the current
            backward (more than once under reentrant checkpointing, Note [a parameter's
            gradient may arrive several times] in ``order.py``).
        expected: (n_slots,) int64, host; how many reports make a parameter complete: 1, or
            what the ranks' order learned (``learn_uses``). The bucket is complete when
            every parameter has ``uses >= expected``.
        arrived: (n_slots,) bool, host; which parameters got a gradient in this window
            (those are the ones a step updates, as torch skips parameters without .grad).
        flushes: flushes in this window (the first one overwrites the accumulator).
    """

    def __init__(self, index: int, n_slots: int) -> None:
        self.index = index
        self.state = GradState.EMPTY
        self.uses = np.zeros(n_slots, dtype=np.int64)
        self.expected = np.ones(n_slots, dtype=np.int64)
        self.arrived = np.zeros(n_slots, dtype=bool)
        self.flushes = 0

    def _go(self, to: GradState) -> None:
        if (self.state, to) not in _ALLOWED:
            raise RuntimeError(
                f"bucket {self.index}: gradient state {self.state.name} -> {to.name} is not a "
                "valid transition (a bug in zero-offload; please report it)"
            )
        self.state = to

    @property
    def holds_device_buffer(self) -> bool:
        """Whether a device gradient buffer is live (FILLING or COMPLETE)."""
        return self.state in HOLDS_DEVICE_BUFFER

    @property
    def opens_window(self) -> bool:
        """Whether the next gradient starts a new window (EMPTY or CONSUMED)."""
        return self.state in (GradState.EMPTY, GradState.CONSUMED)

    def start_filling(self) -> None:
        """A gradient arrived and the bucket has no device buffer: one was just opened."""
        if self.opens_window:
            self.arrived[:] = False
            self.flushes = 0
        self._go(GradState.FILLING)

    def receive(self, slot_index: int) -> bool:
        """Record one parameter's gradient; True when every parameter has reported as
        often as expected."""
        if not self.holds_device_buffer:
            raise RuntimeError(
                f"bucket {self.index}: gradient received in state {self.state.name} (bug)"
            )
        self.uses[slot_index] += 1
        self.arrived[slot_index] = True
        return bool((self.uses >= self.expected).all())

    def learn_uses(self) -> None:
        """Expect, from the next backward on, at least as many reports per parameter as
        this backward gave (Note [a parameter's gradient may arrive several times])."""
        np.maximum(self.expected, self.uses, out=self.expected)

    def complete(self) -> None:
        """FILLING -> COMPLETE: waiting for its turn in the fixed order."""
        self._go(GradState.COMPLETE)

    def flushed(self) -> bool:
        """FILLING/COMPLETE -> IN_FLIGHT; returns whether this flush overwrites the
        accumulator (the window's first)."""
        overwrite = self.flushes == 0
        self._go(GradState.IN_FLIGHT)
        self.flushes += 1
        return overwrite

    def end_backward(self) -> None:
        """Expect every parameter again in the next backward."""
        self.uses[:] = 0

    def settled(self) -> None:
        """The host worker drained: IN_FLIGHT -> ACCUMULATED (other states stay)."""
        if self.state is GradState.IN_FLIGHT:
            self._go(GradState.ACCUMULATED)

    def consume(self) -> None:
        """A step used the window (EMPTY stays EMPTY: nothing to use)."""
        if self.state is not GradState.EMPTY:
            self._go(GradState.CONSUMED)

    def discard(self) -> None:
        """``zero_grad``: forget the window (the caller released any device buffer)."""
        self._go(GradState.EMPTY)
        self.uses[:] = 0
        self.arrived[:] = False
        self.flushes = 0
