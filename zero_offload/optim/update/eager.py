"""A step announced before its backward, run bucket by bucket during it (``EagerStep``):
exact where nothing can change the update after backward, speculative (backed up and
restored when it must be) where ``OffloadConfig(speculative_step=True)`` allows.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence

import torch

from ...accelerator import Event
from ...memory.manager import TieredMemoryManager
from ...memory.traffic import Category
from ...tracing import phase
from ..flat_bucket import FlatBucket, StepPlan
from ..publish import Publish
from ..ranks import Ranks
from ..rule.base import Hyper
from .failures import failed, interrupted
from .modes import ImmediateUpdate

__all__ = ["EagerPhase", "EagerStep"]


class EagerPhase(enum.Enum):
    """Where an announced step is."""

    #: The announced backward has not ended: each bucket's update is queued on the host
    #: worker as the bucket completes (its state and weight staging written there).
    ANNOUNCED = "announced"
    #: The backward ended: every bucket with gradients was handed over (or, over the
    #: speculation budget, left for ``land``); updates may still be running.
    BACKWARD_ENDED = "backward_ended"
    #: ``land`` (step()) or ``abandon`` (zero_grad) took the step: weights landed, counts
    #: committed; nothing of it is pending.
    LANDED = "landed"


_P = EagerPhase
_ALLOWED = frozenset(
    {(_P.ANNOUNCED, _P.BACKWARD_ENDED), (_P.BACKWARD_ENDED, _P.LANDED), (_P.ANNOUNCED, _P.LANDED)}
)


# Note [stepping during backward]
# When a step is announced (opt.backward(loss, step=True), or opt.announce_step() before a
# plain backward) and nothing can change the update after backward (no clipping
# configured, no loss scaler that could skip the step, skip_nonfinite off, one rank, every
# bucket offloaded, no delayed update), each bucket's CPU Adam runs on the host worker as
# soon as the bucket's last flush of the backward is queued there, while backward goes on
# on the device. Its weight copies wait for the compute-stream event recorded when the
# bucket was complete (every parameter's gradient computed, so backward reads those
# weights no more), and step() makes compute wait for them, so the next forward sees the
# new weights. The plan (step counts, runs, the gradient's field) and the hyper-parameters
# are taken on the caller's thread when the bucket is handed over, so the result is
# bitwise the ordinary step's; step() then only lands the weights and commits the counts.
# The cost of a broken promise: the update has happened, so clipping or another backward
# after an announced one is refused, and what cannot be refused is said aloud: a param
# group's hyper-parameters changed between the announcement and step() (a scheduler
# stepped first, a hand-set lr) warn at step() naming the fields, and a zero_grad() in
# place of the step() (a loop skipping a step it announced) warns that the step is kept
# (StepPolicy.warn_announced_changes, StepPolicy.discard_window).

# Note [stepping during backward with parameter offload]
# With parameter offload the step writes each unit's pinned home (weights staging, or the
# fp32 master), which the window's fetches read, and publishing is a mark on the unit ("the
# slot no longer holds the home's weights", WindowedViews.copy_in) that may be made only
# while the unit is released. So a bucket's update still runs on the host worker as soon as
# its gradients are queued, but with Publish.LATER: its tiles are published in land()
# (step()), after the optimizer's step pre-hook waited for every fetch and released every
# unit (ParamOffloader.before_step). The update writes the home only after its bucket is
# complete, i.e. after every kernel of this backward that reads the unit's weights, and it
# waits for the gradient copies those kernels' compute preceded, which waited for the
# unit's fetch: no fetch of the unit is pending when the home is written, and none is
# issued later in this backward (a unit is fetched ahead of its own backward, and the
# bucket is complete only after it). A resident slot keeps the weights before the step
# until the unit is released, exactly what backward reads without a step during it.
# A home on NVMe (NvmeHomeState) is the same with the weight file for the home: the unit's
# fetch read the file into its slot's bounce and the CPU waited for those reads before the
# unit's compute was issued (ParamUnit.use), so the update's record writes follow every
# read of this backward; the slot is marked stale in land() too (HomeWritten.publish), and
# the next fetch reads the new records.
# A forward, a released parameter's read or a state dict between such a backward and step()
# would read homes being written (some units before the step, some after, some torn): each
# is refused (ParamOffloader.check_homes_settled, StepPolicy.writing_homes).
# Taken with OffloadConfig(grad_staging="in_flight") only (policy.eager_refusal), which
# needs it; per-bucket staging keeps the step in step() under parameter offload.

# Note [speculative steps]
# With OffloadConfig(speculative_step=True) an announced step runs during backward even when
# clipping is configured or an fp16 overflow could skip it (SuperOffload's bet: clipping
# rarely binds). Each bucket is stepped with the multiplier 1 / loss_scale, i.e. unclipped,
# after a copy of the state it overwrites (master, moments) was taken, within
# speculation_bytes; buckets beyond that wait for step(). In step(), once the global norm and
# the overflow flag are known: if the true multiplier is the one used and nothing is skipped,
# the speculation stands and only the waiting buckets are stepped. Otherwise every stepped
# bucket is restored from its copy; a skipped step then republishes the restored weights,
# and a clipped one steps every bucket again with the true multiplier. Bitwise the ordinary
# step in both outcomes; opt.speculation_failures counts the rollbacks (a step that stepped
# no bucket during backward has nothing to roll back and counts none).
# Not backed up, so stepped in step() too: buckets whose state is on NVMe, and those of a rule
# that reads whole parameters (Adafactor, Muon: KeepsShapedState in state/shaped.py), whose
# shaped state is not among the state_tensors() the copy takes.

# Note [the buckets left to step() land before the decision]
# A bucket handed over during backward landed its window there (StepPlan lands it), but one
# left to land() (not backed up: over speculation_bytes, NVMe, a rule that reads whole
# parameters) may still hold a window summed on the device (Note [micro-batches add up on
# the device] in grads/device_acc.py): its last flush lands it during backward only when
# the host accumulator was free by then, i.e. when the host worker had passed the previous
# step's end, which is timing. Unlanded, its statistics are the host passes of an older
# window, and decide() would clip by a stale norm. So land() lands every such bucket before
# decide(), as step() does (the optimizer's stray-gradient pass, BackwardRouter.land).


def _elements(plan: StepPlan) -> int:
    return sum(stop - start for start, stop, _ in plan.runs)


class EagerStep:
    """One announced step, run bucket by bucket during backward; see Note [stepping during
    backward] and Note [speculative steps]. Holds no reference to the optimizer (Note
    [lifetimes without close]).

    ``grad_scale``: the gradient multiplier the buckets are stepped with during backward
    (``1 / loss_scale``: no clipping). ``speculation_bytes``: None for an exact step (every
    bucket is stepped during backward); else the backup budget of a speculative one.
    """

    def __init__(
        self,
        manager: TieredMemoryManager,
        hypers: dict[int, Hyper],
        *,
        grad_scale: float = 1.0,
        speculation_bytes: int | None = None,
        publish: Publish = Publish.NOW,
    ) -> None:
        self.manager = manager
        # LATER with parameter offload: Note [stepping during backward with parameter
        # offload]; the weights are published in land().
        self.publish = publish
        self.hypers = hypers  # by param group index, read when the step was announced
        self.grad_scale = grad_scale
        self.speculation_bytes = speculation_bytes
        self.plans: dict[int, StepPlan] = {}  # by bucket index, in hand-over order
        self._done: dict[int, Event] = {}  # host-worker event after each bucket's update
        # Speculative: each stepped bucket's state before its update, by bucket index;
        # written by the host worker, read after it drained.
        self._backups: dict[int, dict[str, torch.Tensor]] = {}
        self._backup_bytes = 0
        self.phase = EagerPhase.ANNOUNCED
        #: Share of the step's elements whose CPU Adam had finished when backward returned.
        self.share_before_backward_returned: float | None = None

    def _go(self, to: EagerPhase) -> None:
        if (self.phase, to) not in _ALLOWED:
            raise RuntimeError(
                f"announced step: {self.phase.name} -> {to.name} is not a valid transition "
                "(a bug in zero-offload; please report it)"
            )
        self.phase = to

    @property
    def backward_ended(self) -> bool:
        """Whether the announced backward ended (every bucket handed over or left)."""
        return self.phase is not EagerPhase.ANNOUNCED

    @property
    def landed(self) -> bool:
        """Whether ``land`` (or ``abandon``) took the step: step() must not redo it."""
        return self.phase is EagerPhase.LANDED

    def hand_over(self, bucket: FlatBucket) -> None:
        """``bucket``'s gradients of this window are all queued: queue its update (or, over
        the speculation budget, leave it to ``land``)."""
        index = bucket.layout.index
        if index in self.plans:
            raise RuntimeError(
                f"bucket {index} got a gradient after it was stepped during backward "
                "(opt.backward(..., step=True)): a parameter's gradient arrived twice, or "
                "the announced backward raised and another began; call zero_grad() first"
            )
        store = bucket.store
        speculative = self.speculation_bytes is not None
        if speculative:
            if not store.supports_speculation:
                return  # stepped in land(), once the coefficient is known
            nbytes = sum(t.numel() * t.element_size() for t in store.state_tensors().values())
            if self._backup_bytes + nbytes > self.speculation_bytes:
                return  # stepped in land(), once the coefficient is known
            self._backup_bytes += nbytes
        arrived = bucket.grads.arrived.copy()
        plan = StepPlan(bucket, arrived)
        hyper = self.hypers[bucket.layout.group]
        store.publication.declare_weight_readers()  # the copies below wait for these readers
        ready = [self.manager.compute_ready()]
        scale = self.grad_scale
        publish = self.publish

        def update() -> None:
            if speculative:
                # Hidden cost: a copy of the bucket's state, within speculation_bytes.
                self._backups[index] = {
                    name: t.clone() for name, t in store.state_tensors().items()
                }
            with phase("cpu_adam", track="cpu_optimizer", owner=self.manager):
                store.update(
                    hyper, scale, plan.runs, publish=publish, source=plan.source, after=ready
                )

        worker = self.manager.host_worker
        worker.submit(update)
        self._done[index] = worker.record_event()
        self.plans[index] = plan
        # On the thread running backward, before it goes on: Note [a step moves the
        # version counters] in views/param_views.py.
        bucket.views.stepped(arrived)
        # Its staging may take the next bucket's gradient once this update is done: Note
        # [gradient staging for the buckets in flight] in grads/staging_ring.py.
        bucket.gradients.update_queued(self._done[index])

    def hand_over_rest(self, buckets: Sequence[FlatBucket]) -> None:
        """Hand over each of ``buckets`` with gradients not handed over yet."""
        for bucket in buckets:
            if bucket.layout.index not in self.plans and bucket.has_gradients:
                self.hand_over(bucket)

    def end_backward(self, buckets: Sequence[FlatBucket]) -> None:
        """Backward ended: hand over the rest, and measure how much was already done."""
        self.hand_over_rest(buckets)
        total = sum(_elements(p) for p in self.plans.values())
        done = sum(_elements(p) for i, p in self.plans.items() if self._done[i].query())
        self.share_before_backward_returned = done / total if total else 1.0
        self._go(EagerPhase.BACKWARD_ENDED)

    def land(
        self,
        buckets: Sequence[FlatBucket],
        ranks: Ranks,
        decide: Callable[[], tuple[bool, float]],
    ) -> bool:
        """step(): wait for the updates, check the speculation (``decide`` returns whether
        the step is skipped and its true gradient multiplier), make compute wait for the
        weights, commit. Returns whether the speculation was rolled back (a bucket stepped
        during backward restored, then the step skipped or redone)."""
        self._drain(ranks)
        self._go(EagerPhase.LANDED)
        # Note [the buckets left to step() land before the decision]
        for bucket in buckets:
            if bucket.layout.index not in self.plans:
                bucket.gradients.land()
        skip, grad_scale = decide()
        events: list[Event] = []
        for bucket in buckets:
            events.extend(bucket.publish())
        if not skip and grad_scale == self.grad_scale:
            with phase("wait_weights"):
                self.manager.wait_for(events, category=Category.WEIGHTS)
            rest = []
            for bucket in buckets:
                plan = self.plans.get(bucket.layout.index)
                if plan is not None:
                    bucket.commit(plan)
                    bucket.views.remember()
                else:
                    rest.append((StepPlan(bucket, bucket.grads.arrived), self._hyper(bucket)))
            ImmediateUpdate(self.manager, ranks).run(rest, grad_scale)
            for plan, _ in rest:  # Note [a step moves the version counters]
                plan.bucket.views.stepped(plan.bucket.grads.arrived)
            return False
        if self.speculation_bytes is None:
            raise RuntimeError(
                "an exact step run during backward needed another coefficient (bug: "
                "Note [stepping during backward] lists what refuses it)"
            )
        # Note [speculative steps]: restore, then skip or step again.
        for event in events:
            event.synchronize()  # the redo rewrites the staging these copies read
        rolled_back = bool(self._backups)  # else no bucket was stepped during backward
        for index, backup in self._backups.items():
            bucket = next(b for b in buckets if b.layout.index == index)
            for name, tensor in bucket.store.state_tensors().items():
                tensor.copy_(backup[name])
        self._backups.clear()
        if skip:
            restored: list[Event] = []
            for bucket in buckets:
                if bucket.layout.index in self.plans:
                    bucket.store.publish_all_from_master()  # the weights from before
                    restored.extend(bucket.publish())
                bucket.grads.consume()
            with phase("wait_weights"):
                self.manager.wait_for(restored, category=Category.WEIGHTS)
            for bucket in buckets:
                bucket.views.remember()
            return rolled_back
        work = [
            (self.plans.get(b.layout.index) or StepPlan(b, b.grads.arrived), self._hyper(b))
            for b in buckets
        ]
        ImmediateUpdate(self.manager, ranks).run(work, grad_scale)
        for bucket in buckets:  # again where stepped during backward: no harm
            bucket.views.stepped(bucket.grads.arrived)
        return rolled_back

    def _drain(self, ranks: Ranks) -> None:
        stepped = [i for i, e in self._done.items() if e.query()]
        try:
            self.manager.host_worker.synchronize()
        except BaseException as exc:
            what = f"{ranks.where()}the step run during backward"
            if interrupted(exc, what, stepped, None, buckets=(), ranks=ranks):
                raise  # Note [an interrupt is not a failure] in modes.py
            raise failed(f"{what} failed", stepped, None, ranks=ranks, cause=exc) from exc

    def abandon(self, buckets: Sequence[FlatBucket], ranks: Ranks) -> list[int]:
        """The announced backward raised and the window is being discarded (zero_grad):
        the buckets already stepped cannot be unstepped (an exact step keeps no backup;
        a speculative one is restored instead), so they are taken as stepped: their
        weights land and their counts move. Returns their indices."""
        self._drain(ranks)
        self._go(EagerPhase.LANDED)
        events: list[Event] = []
        for bucket in buckets:
            events.extend(bucket.publish())
        for event in events:
            event.synchronize()  # the restored state below must not race the copies
        for index, backup in self._backups.items():
            bucket = next(b for b in buckets if b.layout.index == index)
            for name, tensor in bucket.store.state_tensors().items():
                tensor.copy_(backup[name])
            bucket.store.publish_all_from_master()
            events.extend(bucket.publish())
            self.plans.pop(index)
        with phase("wait_weights"):
            self.manager.wait_for(events, category=Category.WEIGHTS)
        for bucket in buckets:
            plan = self.plans.get(bucket.layout.index)
            if plan is not None:
                bucket.commit(plan)
            bucket.views.remember()
        return sorted(self.plans)

    def _hyper(self, bucket: FlatBucket) -> Hyper:
        return self.hypers[bucket.layout.group]
