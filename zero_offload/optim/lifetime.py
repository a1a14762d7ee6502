"""What an optimizer owns, and who owns each parameter: released without close().

See Note [lifetimes without close] and Note [one optimizer per parameter] below.
"""

from __future__ import annotations

import functools
import gc
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from ..error_marks import releasing
from ..errors import Attempts
from ..memory.manager import TieredMemoryManager
from ..memory.pool import BlockPool
from ..memory.quiet_exit import passed_over
from .checks import describe_param, param_name
from .flat_bucket import FlatBucket
from .grads.buffers import GradBuffers
from .reports.live import OptimizerState
from .router import BackwardRouter
from .state.store import BucketPools

__all__ = ["OWNERS", "Resources", "Segment", "check_owners"]

# Which live optimizer trains each parameter: Note [one optimizer per parameter].
OWNERS: WeakIdKeyDictionary = WeakIdKeyDictionary()


class Segment:
    """The buckets and pools built for one call's worth of param groups.

    The constructor builds one segment for all its groups; each later ``add_param_group``
    builds another, with pools sized for that group alone.
    """

    def __init__(
        self, buckets: list[FlatBucket], pools: BucketPools, grad_buffers: GradBuffers
    ) -> None:
        self.buckets = buckets
        self.pools = pools
        self.grad_buffers = grad_buffers

    def close(self) -> None:
        """Close the buckets and gradient buffers, then the pools, each even when one before
        it failed; the first error raised at the end."""
        attempt = Attempts()
        for bucket in self.buckets:
            attempt(bucket.close)
        attempt(self.grad_buffers.close)
        for pool in (self.pools.device, *self.pools.host):
            attempt(functools.partial(_close_owned, pool))
        attempt.raise_first()


def _close_owned(pool: BlockPool) -> None:
    """Free what is still in use in a closing segment's ``pool`` and close it (Note [a block
    an interrupt orphaned])."""
    for block in pool.live_blocks():
        block.free()
    pool.close()


# Note [a block an interrupt orphaned]
# A KeyboardInterrupt (a notebook's Ctrl-C) can land between an owner letting go of a block
# and the pool taking it back (inside ``BlockPool.free``): the owner has forgotten it, the
# pool still counts it in use. Training goes on (the owner takes another block), but the
# pool's close refused for good ("cannot close pool ...: 1 blocks are still in use (owners:
# bucket2.grad); free them first", which no user can do) and the device pool stayed
# allocated. A Ctrl-C inside close() did the same from the other side: a bucket's close cut
# short left its blocks in use, and the segment's pools were never closed. When a segment
# closes, its buckets and gradient buffers have closed (or tried to) first, so a block still
# in use in the segment's own pools has no owner left: it is freed (its copies waited for by
# the pool's close) before the pool closes, and each part is attempted whatever failed
# before it.


# Note [lifetimes without close]
# HF Trainer and notebooks drop optimizers without close(). Nothing that lives on after the
# optimizer references it: the hooks hold the router weakly, the router, buckets, streams
# and threads never point back at the optimizer. So the optimizer is freed like any object,
# and a weakref.finalize releases what it owned (Resources.release): hooks removed,
# streams and the host worker stopped, pools returned (device pools: to the budget), and
# the parameters' ownership dropped. close() runs the same finalizer at once.
# Released means freed by reference counting, never by waiting for the cyclic collector: a
# closed optimizer stays referenced (an LR scheduler holds it) and a dropped one is freed
# when its last reference goes, so what the release lets go of must not sit in a cycle. The
# stores' publications hold a ``WeightsHome``, not the store (Note [a publication does not
# hold its store] in state/store.py); a store drops its pool views at close, and the manager
# joins its stream threads and releases the offloaders borrowing them (Note [a manager's
# close ends its borrowers] in memory/manager.py). What stays after close: without
# parameter offload the parameters stay views of ``weights_dev``, so they keep the device
# pool's buffer (its bytes are back in the budget) for as long as the model lives. tests/test_release_without_gc.py checks all
# this with the collector disabled.
#
# Note [one optimizer per parameter]
# A second optimizer over parameters a live one still trains would share their gradients
# with it (both sets of hooks fire) and silently never train. Construction refuses, naming
# both; an unreachable owner that the garbage collector has not reached yet is collected
# first, so building a new optimizer after dropping the old one just works.


class Resources:
    """What an optimizer owns and must release, without a reference back to it."""

    def __init__(self, manager: TieredMemoryManager, router: BackwardRouter) -> None:
        self.manager = manager
        self.router = router
        self.segments: list[Segment] = []
        self.state: OptimizerState | None = None
        self.extra_streams: list[Any] = []
        self.param_offload: Any = None  # a zero_offload.params.ParamOffloader, or None
        self.released = False  # every part of release() ran: Note [a release cut short]
        # The optimizer, weakly (set by its first segment): dead when ``release`` runs as
        # the finalizer of a dropped optimizer, not from close(). Note [a release after a
        # collective failure the caller saw].
        self.owner: weakref.ref | None = None

    def release(self) -> None:
        # What fails here reaches no caller: Note [an error reaches the caller once] in
        # error_marks.py.
        with releasing():
            attempt = self._release()
        self.released = True
        # Note [a quiet exit after a failed stream] in memory/quiet_exit.py; Note [a release
        # after a collective failure the caller saw].
        attempt.raise_first(unless=self._passed_over)

    def _passed_over(self, error: BaseException) -> bool:
        return passed_over(error, dropped=self.owner is not None and self.owner() is None)

    def _release(self) -> Attempts:
        # Release everything even when a part fails (a stream's sticky error, a pool still
        # owning a block after a failure, a weight record that cannot be read back): the
        # first error is raised at the end, after the NVMe files and pools are gone.
        attempt = Attempts()
        self.router.remove_hooks()
        if self.param_offload is not None:
            # Before the pools go: the parameters take private copies of their weights.
            attempt(self.param_offload.close)
            self.param_offload = None
        for segment in self.segments:
            for bucket in segment.buckets:
                for param in bucket.params:
                    OWNERS.pop(param, None)

        # Buckets still in flight land first, their all-gathers included, while the pools
        # and the process group exist; a bucket that cannot land gets its parameters' class
        # back all the same (Note [weights landed at their first use] in views/in_flight.py).
        for segment in self.segments:
            for bucket in segment.buckets:
                in_flight, bucket.views.in_flight = bucket.views.in_flight, None
                if in_flight is not None:
                    attempt(in_flight.land)
                    in_flight.abandon()
        attempt(self.manager.synchronize)
        for segment in self.segments:
            attempt(segment.close)
        self.segments.clear()
        self.router.buckets.clear()
        if self.state is not None:
            self.state.clear_slots()
        attempt(self.manager.close)
        for stream in self.extra_streams:
            close = getattr(stream, "close", None)
            if close is not None:
                attempt(close)
        attempt(self.router.ranks.close)  # after the comm stream: its collectives are done
        return attempt


# Note [a release cut short]
# Each part of ``release`` is attempted (a KeyboardInterrupt inside one is kept like any
# error and raised at the end), but a Ctrl-C can also land between two parts, in release's
# own code. The optimizer's finalizer had been called, so the next close() returned at
# once, and what the parts after it release (the pools: on the device, the weights and
# gradient buffers) stayed allocated while anything (an LR scheduler) held the optimizer.
# ``released`` is set only when every part ran; close() runs ``release`` again until it
# is, each part being a no-op once done (a closed pool, a closed manager, cleared lists).


# Note [a release after a collective failure the caller saw]
# A collective that fails on the comm stream fails every stream that waits on it (Note
# [stream errors are sticky]), and the caller's next step, backward or zero_grad raises its
# CollectiveError (``surface_collective_errors``). A loop's ``finally: opt.close()`` then
# met the same failed streams while releasing and raised them again, wrapped in a
# StreamError, on top of the error being handled: the user saw one failure twice, the
# second hiding the first. Under ZeRO-3 the close gathers each unit once more over the
# broken process group and failed with a CollectiveError of its own. So a release whose
# first error is a collective failure after one that reached the caller passes over it
# and releases the rest (Note [an error reaches the caller once] in ``error_marks.py``). A
# failure no call has raised yet (close() is the first call to meet it) is still raised by
# close(), as is a failed stream's error without a collective behind it: close() was asked.
# A dropped optimizer's finalizer asks nobody: it passes over any error a caller met, and
# prints one nobody met, once (Note [a quiet exit after a failed stream] in
# ``memory/quiet_exit.py``); ``owner`` tells it from close(). Whether an error reached the
# caller is marked on its chain when it did; the CollectiveError's traceback cannot tell: a
# stream that fails later stores the same chain without frames (Note [a sticky error holds
# no frames]), and a ZeRO-3 close re-raises it inside the release.


def check_owners(
    opt: torch.optim.Optimizer, params: Sequence[torch.Tensor], indices: Sequence[int]
) -> None:
    """Refuse parameters a live optimizer other than ``opt`` trains; Note [one optimizer
    per parameter]."""
    collected = False
    for index in indices:
        param = params[index]
        while True:
            owner = OWNERS.get(param)
            live = owner() if owner is not None else None
            if live is None or live is opt:
                break
            if not collected:  # an unreachable owner not collected yet: collect it
                del live
                gc.collect()
                collected = True
                continue
            raise ValueError(
                f"{describe_param(index, param, param_name(opt.param_groups, index))} is "
                f"already trained by {live!r}, which "
                f"is still alive; {opt!r} would share its gradients and never train. "
                f"Call close() on {live!r} (or drop every reference to it) first, or "
                "add the parameter to that optimizer instead"
            )
