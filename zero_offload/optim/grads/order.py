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
buffers come from extra device pools, ``offloaded.GradBuffers``), and its copy to the host
overlaps less of backward. With one rank order does not matter: a bucket goes as soon as it
is complete, and any bucket may go early when the device pool needs its buffer.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from ...errors import PoolExhausted
from ...partition import BucketLayout
from .lifecycle import BucketGrads, GradState


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


class AnnouncedStep(Protocol):
    @property
    def backward_ended(self) -> bool:
        """Whether the announced step saw its backward end."""

    def hand_over(self, bucket: Any) -> None:
        """A bucket's gradients are on their way: step it when they land."""

    def end_backward(self, buckets: Sequence[Any]) -> None:
        """The backward ended: step what is left."""


class Routing(Protocol):
    buckets: Sequence[OrderedBucket]
    ranks: Any  # optim.ranks.Ranks: where() names this rank in errors
    eager: AnnouncedStep | None


__all__ = ["BucketOrder", "FreeOrder", "LockstepOrder"]


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
        for bucket in router.buckets:
            if bucket.grads.holds_device_buffer:
                bucket.flush(router.ranks)
        if router.eager is not None and not router.eager.backward_ended:
            router.eager.end_backward(router.buckets)

    def reset(self) -> None:
        """Any order: no position to rewind."""


class LockstepOrder(BucketOrder):
    """Several ranks: Note [ranks in lockstep].

    Fields:
        next: the index (in the router's order) of the next bucket to go.
    """

    def __init__(self) -> None:
        self.next = 0

    @property
    def in_progress(self) -> bool:
        return self.next > 0

    def receive(
        self, router: Routing, bucket: OrderedBucket, slot_index: int, grad: torch.Tensor
    ) -> None:
        if bucket.grads.state is GradState.COMPLETE:
            bucket.receive_grad(slot_index, grad)  # a second gradient before its turn
            return
        # layout.index is the bucket's position in the order (plan_dtype_buckets numbers
        # each segment's buckets from len(buckets)).
        if bucket.layout.index < self.next:
            raise RuntimeError(
                f"{router.ranks.where()}bucket {bucket.layout.index} got a gradient after it "
                "was reduce-scattered in this backward (a parameter's gradient arrived "
                "twice); every rank must reduce each bucket once per backward"
            )
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

    def end_backward(self, router: Routing) -> None:
        for bucket in router.buckets[self.next :]:
            bucket.open_empty(grow=True)
            bucket.flush(router.ranks)

    def reset(self) -> None:
        self.next = 0
