"""In what order a backward's buckets go to the host: any order with one rank, one fixed
order on every rank with several (``Ranks.bucket_order`` picks).

Note [ranks in lockstep]
~~~~~~~~~~~~~~~~~~~~~~~~
With several ranks, buckets are reduce-scattered in one fixed order (bucket index), each
exactly once per backward, whichever gradients a rank produced: collectives match by order,
so a rank that left a branch unused must not skip or reorder a bucket. A bucket complete
early goes early only when every bucket before it has gone; at the end of backward the rest
go, in order, including buckets that got no gradient on this rank (a zero buffer: they
contribute zeros). The per-parameter "got a gradient" flags are OR-reduced at the step, so
uneven gradients give exactly the single-process result on the global batch, like DDP with
``find_unused_parameters=True``. The cost: a complete bucket may wait, holding its device
gradient buffer, behind an earlier one that a rank does not complete (those waiting
buffers come from extra device pools, ``grads.buffers.GradBuffers``), and its copy to the host
overlaps less of backward. With one rank order does not matter: a bucket goes as soon as it
is complete, and any bucket may go early when the device pool needs its buffer.

Note [a parameter's gradient may arrive several times]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Reentrant activation checkpointing (``use_reentrant=True``) runs each segment's backward as
a graph task of its own, and each task accumulates into ``.grad`` and calls the
post-accumulate-grad hook: a weight used in several segments (an ALBERT-style shared block,
a tied embedding used inside a checkpointed block and by the head) reports once per use, at
points of backward nothing announces. One rank adds the pieces (a bucket may go several
times). Several ranks reduce-scatter each bucket at one point of the fixed order, so a
bucket must not go before its parameters' last report, and DDP's static-graph answer is
ours: the first backward learns how many reports each parameter gives (``uses``), and later
backwards count a bucket complete when each parameter has given as many
(``BucketGrads.expected``, the maximum seen in any backward). In the learning backward a
bucket may go early as usual; a report for a bucket that already went opens its device
buffer again, and at the end of that backward the ranks OR their "late" flags (one small
all-reduce on the comm stream, after the reduce-scatters, read on the host) and every rank
reduce-scatters each flagged bucket a second time, in order, zeros where it has nothing: the
host accumulator adds the two flushes, as it adds micro-batches. Memory stays that of any
backward (no bucket is held back in the first one) and only the first backward pays the
round trip. A later backward that gives a parameter more reports than any before (control
flow that changed) cannot be repaired without a collective every backward, so it raises,
naming the parameter, and the next backward (after ``zero_grad()``, on every rank: a
failed backward is retried by all ranks or by none) learns again.
Adding a param group starts learning again (every rank adds it, so every rank agrees).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch

from ...errors import PoolExhausted
from ...partition import BucketLayout
from .lifecycle import BucketGrads, GradState

if TYPE_CHECKING:
    from ..ranks import Ranks


# What an order asks of the buckets and the router it serves (``flat_bucket.FlatBucket``
# and ``router.BackwardRouter``), written as protocols so this module stays below both: the
# ranks, which sit below the buckets, choose the order.
class OrderedBucket(Protocol):
    layout: BucketLayout
    grads: BucketGrads

    def receive_grad(self, slot_index: int, grad: torch.Tensor, *, grow: bool = False) -> bool:
        """Add one parameter's gradient; True when the bucket is complete."""

    def flush(self, ranks: Any) -> None:
        """Hand this backward's device gradients on."""

    def open_empty(self, *, grow: bool) -> None:
        """Open a zero device buffer unless one is open."""


class AnnouncedStep(Protocol):
    @property
    def backward_ended(self) -> bool:
        """Whether the announced step saw its backward end."""

    def hand_over(self, bucket: Any) -> None:
        """A bucket's gradients are on their way: step it when they land."""

    def hand_over_rest(self, buckets: Sequence[Any]) -> None:
        """Hand over each of ``buckets`` with gradients not handed over yet."""

    def end_backward(self, buckets: Sequence[Any]) -> None:
        """The backward ended: step what is left."""


class Routing(Protocol):
    buckets: Sequence[OrderedBucket]
    ranks: Any  # optim.ranks.Ranks: where() names this rank in errors
    eager: AnnouncedStep | None


__all__ = ["BucketOrder", "FreeOrder", "LockstepOrder", "bucket_order"]


class BucketOrder(ABC):
    """When a bucket that received a gradient is flushed."""

    @property
    def in_progress(self) -> bool:
        """Whether some buckets of this backward went and others must follow."""
        return False

    @abstractmethod
    def receive(
        self, router: Routing, bucket: OrderedBucket, slot_index: int, grad: torch.Tensor
    ) -> None:
        """Add one gradient to ``bucket`` and flush what may go now."""

    @abstractmethod
    def end_backward(self, router: Routing) -> None:
        """The backward ended: flush what must go."""

    @abstractmethod
    def reset(self) -> None:
        """A new backward (or a discarded window) starts from the first bucket."""

    def finished(self, router: Routing, indices: Sequence[int]) -> None:  # noqa: B027
        """The buckets ``indices`` get no more gradients in this backward (one rank: they
        went when complete already)."""

    def buckets_added(self) -> None:  # noqa: B027 (most orders have nothing to learn)
        """``add_param_group`` appended buckets to the order."""


class FreeOrder(BucketOrder):
    """One rank: a bucket goes as soon as it is complete, and any bucket may go early when
    the device pool needs its buffer."""

    def receive(
        self, router: Routing, bucket: OrderedBucket, slot_index: int, grad: torch.Tensor
    ) -> None:
        try:
            complete = bucket.receive_grad(slot_index, grad)
        except PoolExhausted:
            # More buckets are half-filled than the gradient buffers hold (backward order
            # differs from bucket order): hand the others on early and retry.
            for other in router.buckets:
                if other is not bucket and other.grads.holds_device_buffer:
                    other.flush(router.ranks)
            complete = bucket.receive_grad(slot_index, grad)
        if not complete:
            return
        bucket.flush(router.ranks)
        if router.eager is not None:
            router.eager.hand_over(bucket)

    def end_backward(self, router: Routing) -> None:
        eager = router.eager
        if eager is not None and eager.backward_ended:
            eager = None
        if eager is not None:
            # Each is stepped before the next flush, as a complete bucket is, so its ring
            # slot goes to that flush (Note [gradient staging for the buckets in flight]):
            # the buckets flushed early first, then each flushed now as it goes.
            eager.hand_over_rest([b for b in router.buckets if not b.grads.holds_device_buffer])
        for bucket in router.buckets:
            if bucket.grads.holds_device_buffer:
                bucket.flush(router.ranks)
                if eager is not None:
                    eager.hand_over(bucket)
        if eager is not None:
            eager.end_backward(router.buckets)

    def reset(self) -> None:
        """Any order: no position to rewind."""


class LockstepOrder(BucketOrder):
    """Several ranks: Note [ranks in lockstep], Note [a parameter's gradient may arrive
    several times].

    Fields:
        next: the index (in the router's order) of the next bucket to go.
        learning: whether this backward learns the reports per parameter and repairs late
            ones at its end (the first backward, and the first after ``add_param_group``).
        late: indices of buckets that got a gradient after they went in this backward
            (learning backward only).
        agree: ORs a (n_buckets,) float64 host vector of flags over the ranks, ordered
            after the reduce-scatters issued so far (``ShardedRanks.agree_late``).
    """

    def __init__(self, agree: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.next = 0
        self.learning = True
        self.late: set[int] = set()
        self.agree = agree

    @property
    def in_progress(self) -> bool:
        return self.next > 0

    def receive(
        self, router: Routing, bucket: OrderedBucket, slot_index: int, grad: torch.Tensor
    ) -> None:
        if bucket.grads.state is GradState.COMPLETE:
            bucket.receive_grad(slot_index, grad)  # a further gradient before its turn
            return
        # layout.index is the bucket's position in the order (plan_dtype_buckets numbers
        # each segment's buckets from len(buckets)).
        if bucket.layout.index < self.next:
            self._late(router, bucket, slot_index, grad)
            return
        try:
            complete = bucket.receive_grad(slot_index, grad)
        except PoolExhausted:
            # Buckets wait their turn: grow instead.
            complete = bucket.receive_grad(slot_index, grad, grow=True)
        if not complete:
            return
        bucket.grads.complete()
        buckets = router.buckets
        while self.next < len(buckets) and buckets[self.next].grads.state is GradState.COMPLETE:
            buckets[self.next].flush(router.ranks)
            self.next += 1

    def _late(
        self, router: Routing, bucket: OrderedBucket, slot_index: int, grad: torch.Tensor
    ) -> None:
        """A gradient for a bucket that already went in this backward; see Note [a
        parameter's gradient may arrive several times]."""
        if self.learning:
            bucket.receive_grad(slot_index, grad, grow=True)  # flushed again at the end
            self.late.add(bucket.layout.index)
            return
        uses = int(bucket.grads.uses[slot_index]) + 1
        self.learning = True  # the retried backward learns the counts again
        raise RuntimeError(
            f"{router.ranks.where()}parameter {bucket.layout.slots[slot_index].index} (shape "
            f"{tuple(grad.shape)}) got its gradient {uses} times in this backward, more than "
            "in any backward before, after its bucket "
            f"{bucket.layout.index} was reduce-scattered. A weight used several times under "
            "reentrant activation checkpointing (use_reentrant=True) reports once per use; "
            "with several ranks each bucket goes once per backward, after as many reports "
            "as the first backward gave, so the number of uses must not grow after the "
            "first backward. Call zero_grad() and run the backward again on every rank (it "
            "learns the counts again), or use use_reentrant=False, whose backward reports "
            "each weight once"
        )

    def end_backward(self, router: Routing) -> None:
        buckets = router.buckets
        for bucket in buckets[self.next :]:
            bucket.open_empty(grow=True)
            bucket.flush(router.ranks)
        self.next = len(buckets)
        if self.learning:
            # Synchronisation point (the learning backward only): the flags are read on
            # the host to decide which buckets go again; every rank takes part.
            flags = torch.zeros(len(buckets), dtype=torch.float64)
            flags[sorted(self.late)] = 1.0
            agreed = self.agree(flags)
            for index in torch.nonzero(agreed).flatten().tolist():
                buckets[index].open_empty(grow=True)
                buckets[index].flush(router.ranks)
            self.learning = False
            self.late.clear()
        for bucket in buckets:
            bucket.grads.learn_uses()

    def finished(self, router: Routing, indices: Sequence[int]) -> None:
        """Complete the buckets ``indices`` now, zeros where nothing came, and send what
        is ready in order. Under ZeRO-3 a rank's backward waits for gathers the other ranks
        issue from their backward; a bucket this rank completes only at the end of its
        backward would hold back its reduce-scatters, the others' would wait for it, and
        their gradient buffers with them, until they can issue no gather: a deadlock."""
        buckets = router.buckets
        for index in indices:
            bucket = buckets[index]
            if index < self.next or bucket.grads.state in (GradState.COMPLETE, GradState.IN_FLIGHT):
                continue  # gone already, or complete and waiting its turn
            bucket.open_empty(grow=True)
            bucket.grads.complete()
        while self.next < len(buckets) and buckets[self.next].grads.state is GradState.COMPLETE:
            buckets[self.next].flush(router.ranks)
            self.next += 1

    def reset(self) -> None:
        self.next = 0
        self.late.clear()

    def buckets_added(self) -> None:
        self.learning = True


def bucket_order(ranks: Ranks) -> BucketOrder:
    """In what order buckets go to the host during backward: ``LockstepOrder`` where the
    ranks' collectives must match (Note [ranks in lockstep]), else ``FreeOrder``."""
    return LockstepOrder(ranks.agree_late) if ranks.lockstep else FreeOrder()
