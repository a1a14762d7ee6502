"""How a planned step reaches the weights: at once, or one step later (``overlap_step``).

``ImmediateUpdate`` runs CPU Adam bucket by bucket on the caller's thread and issues each
tile's weight copy as soon as the tile is written. ``DelayedUpdate`` queues the same update
on the host worker and publishes its weights at the next step (Note [delayed parameter
update]). The optimizer picks one at construction; nothing else asks which it has.

Note [a step is all or nothing]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Everything that can refuse (arguments, hyper-parameters, parameters replaced or unfrozen
behind the optimizer) is checked and every bucket's ``StepPlan`` made before the first
bucket changes. What can still fail after that is not the caller's data: a kernel, a copy
or a collective. Then ``StepFailed`` says which buckets were stepped, which one was
stepped in part, and that the optimizer must be reloaded from a checkpoint or rebuilt.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

import torch

from ...accelerator import Event
from ...collectives import Pending
from ...memory.manager import TieredMemoryManager
from ...memory.traffic import Category
from ...tracing import phase
from ..flat_bucket import FlatBucket, StepPlan
from ..ranks import Ranks
from ..state.store import AdamHyper

__all__ = ["DelayedUpdate", "EagerStep", "ImmediateUpdate", "StepFailed", "UpdateMode"]


class StepFailed(RuntimeError):
    """A step failed after it started changing the optimizer state; see Note [a step is
    all or nothing]."""


def _failed(what: str, stepped: list[int], failing: int | None) -> StepFailed:
    part = f"; bucket {failing} was partly stepped" if failing is not None else ""
    done = f"buckets {stepped} were stepped" if stepped else "no bucket was fully stepped"
    return StepFailed(
        f"{what}: {done}{part}. The optimizer state no longer matches one step count: "
        "reload it from a checkpoint (opt.load_state_dict) or rebuild the optimizer"
    )


class UpdateMode(ABC):
    """When an update's weights reach the device."""

    def __init__(self, manager: TieredMemoryManager, ranks: Ranks) -> None:
        self.manager = manager
        self.ranks = ranks

    @property
    def pending(self) -> bool:
        """Whether an update's weights are not on the device yet."""
        return False

    def settle(self, buckets: Sequence[FlatBucket]) -> None:
        """Put any pending update's weights on the device (weights written since win)."""
        return None

    def drain(self) -> None:
        """Make the optimizer state final for reading (``state_dict``) without publishing."""
        self.manager.synchronize()

    @abstractmethod
    def run(self, work: Sequence[tuple[StepPlan, AdamHyper]], grad_scale: float) -> None:
        """Apply the planned step to every bucket."""

    def _gather(self, bucket: FlatBucket, events: list[Event]) -> Pending | None:
        """Issue the all-gather of ``bucket``'s updated shards once this rank's shard has
        reached ``weights_dev`` (``events``); nothing with one rank."""
        if self.ranks.world_size == 1:
            return None
        # Synchronisation point (host accelerator): the collective reads weights_dev now.
        self.manager.wait_for(events, category=Category.WEIGHTS)
        return self.ranks.all_gather(
            bucket.weights_dev, what=f"bucket {bucket.layout.index} weights"
        )

    def _land(
        self, buckets: Sequence[FlatBucket], events: list[Event], gathers: list[Pending | None]
    ) -> None:
        """Make compute wait for the weight copies and all-gathers; record the versions."""
        with phase("wait_weights"):
            self.manager.wait_for(events, category=Category.WEIGHTS)
        self.ranks.wait([g for g in gathers if g is not None])
        for bucket in buckets:
            bucket.views.remember()


class ImmediateUpdate(UpdateMode):
    """CPU Adam now, tile by tile, each tile's weights copied as soon as it is written."""

    def run(self, work: Sequence[tuple[StepPlan, AdamHyper]], grad_scale: float) -> None:
        events: list[Event] = []
        gathers: list[Pending | None] = []
        stepped: list[int] = []
        with phase("cpu_adam", track="cpu_optimizer"):
            for plan, hyper in work:
                bucket = plan.bucket
                try:
                    bucket.backend.update(
                        hyper, grad_scale, plan.runs, publish=True, source=plan.source
                    )
                    published = bucket.backend.publish()
                    if self.ranks.world_size == 1:
                        events.extend(published)
                    else:  # this bucket's all-gather overlaps the next bucket's CPU Adam
                        gathers.append(self._gather(bucket, published))
                except BaseException as exc:
                    raise _failed(
                        f"{self.ranks.where()}step() failed in bucket {bucket.layout.index}",
                        stepped,
                        bucket.layout.index,
                    ) from exc
                bucket.commit(plan)
                stepped.append(bucket.layout.index)
        try:
            self._land([plan.bucket for plan, _ in work], events, gathers)
        except BaseException as exc:
            raise _failed(
                f"{self.ranks.where()}step() failed while landing the weights", stepped, None
            ) from exc


# Note [delayed parameter update]
# step() k computes the statistics and the skip/clip decision on the caller's thread, then
# queues the CPU update with gradients g_k on the host worker and returns. The forward and
# backward of step k+1 run meanwhile on the weights published by step k, which hold the
# updates g_1..g_{k-1}: one step of staleness. step() k+1 first waits for the update g_k,
# copies its weights to the device (the next forward waits on those copies) and only then
# queues update g_{k+1}, which waits for those copies because it rewrites the staging they
# read. Backward k+1's gradient accumulation is queued on the same host worker behind update
# g_k, so it never overwrites gradients in use. Weights written between the steps (a
# ``model.load_state_dict``, an EMA swap) win over the pending update, as they would in
# torch: the bucket's publication is dropped and its master re-derived from them. Reading
# the state (``state_dict``) waits for the update but publishes nothing, so checkpointing
# never changes training; the dict records that an update was pending, and loading it makes
# the next step publish from the master.


class DelayedUpdate(UpdateMode):
    """``overlap_step``: the update runs on the host worker, published at the next step."""

    def __init__(self, manager: TieredMemoryManager, ranks: Ranks) -> None:
        super().__init__(manager, ranks)
        self._pending = False
        # Loaded from a checkpoint taken with an update pending: the weights written until
        # the next step are the checkpoint's own, not an outside write.
        self._trust_weights = False
        self._steps_queued = 0  # for errors: which step's update is pending

    @property
    def pending(self) -> bool:
        return self._pending

    def resume_pending(self, buckets: Sequence[FlatBucket]) -> None:
        """A checkpoint had an update pending: publish it from the master at the next step."""
        for bucket in buckets:
            bucket.backend.publish_all_from_master()
        self._pending = True
        self._trust_weights = True

    def forget_pending(self) -> None:
        """Loaded a checkpoint without a pending update: nothing to publish."""
        self._pending = False
        self._trust_weights = False

    def run(self, work: Sequence[tuple[StepPlan, AdamHyper]], grad_scale: float) -> None:
        plans = [(plan.bucket, hyper, plan.runs, plan.source) for plan, hyper in work]

        def update() -> None:
            with phase("cpu_adam", track="cpu_optimizer"):
                for bucket, hyper, runs, source in plans:
                    bucket.backend.update(hyper, grad_scale, runs, publish=False, source=source)

        self.manager.host_worker.submit(update)
        for plan, _ in work:  # the counts are the snapshot the queued update works from
            plan.bucket.commit(plan)
        self._pending = True
        self._steps_queued += 1

    def settle(self, buckets: Sequence[FlatBucket]) -> None:
        if not self._pending:
            return
        # Synchronisation point: the delayed update must be finished before its weights go.
        try:
            self.manager.host_worker.synchronize()
        except BaseException as exc:
            raise _failed(
                f"{self.ranks.where()}the delayed update of step {self._steps_queued} failed",
                [],
                None,
            ) from exc
        events: list[Event] = []
        gathers: list[Pending | None] = []
        # Parameters written since the last step keep what was written, the others of
        # their bucket take the pending update: saved before the publication, put back
        # after it, then the master reconciled element-wise (Note [weights written outside
        # the optimizer] in param_views.py).
        written: list[tuple[FlatBucket, list[tuple[torch.Tensor, torch.Tensor]]]] = []
        for bucket in buckets:
            if not self._trust_weights:
                changed = bucket.views.changed_params()
                if changed:
                    written.append((bucket, [(p, p.detach().clone()) for p in changed]))
            published = bucket.backend.publish()
            events.extend(published)
            gathers.append(self._gather(bucket, published))
        for event in events:
            # The next update rewrites the staging these copies read.
            self.manager.host_worker.wait_event(event)
        self._land(buckets, events, gathers)
        with torch.no_grad():
            for bucket, saved in written:
                for param, value in saved:
                    param.copy_(value)
                bucket.backend.reconcile_master()
                bucket.views.remember()
        self._pending = False
        self._trust_weights = False


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
# after an announced one is refused.

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
# step in both outcomes; opt.speculation_failures counts the rollbacks.


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
        hypers: dict[int, AdamHyper],
        *,
        grad_scale: float = 1.0,
        speculation_bytes: int | None = None,
    ) -> None:
        self.manager = manager
        self.hypers = hypers  # by param group index, read when the step was announced
        self.grad_scale = grad_scale
        self.speculation_bytes = speculation_bytes
        self.plans: dict[int, StepPlan] = {}  # by bucket index, in hand-over order
        self._done: dict[int, Event] = {}  # host-worker event after each bucket's update
        # Speculative: each stepped bucket's state before its update, by bucket index;
        # written by the host worker, read after it drained.
        self._backups: dict[int, dict[str, torch.Tensor]] = {}
        self._backup_bytes = 0
        self.backward_ended = False
        #: Share of the step's elements whose CPU Adam had finished when backward returned.
        self.share_before_backward_returned: float | None = None
        #: Speculative: whether the step had to be restored and redone (or skipped).
        self.rolled_back = False
        #: Whether ``land`` (or ``abandon``) took the step: the next step() must not redo it.
        self.landed = False

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
        backend = bucket.backend
        speculative = self.speculation_bytes is not None
        if speculative:
            if not backend.supports_speculation:
                return  # stepped in land(), once the coefficient is known
            nbytes = sum(t.numel() * t.element_size() for t in backend.state_tensors().values())
            if self._backup_bytes + nbytes > self.speculation_bytes:
                return  # stepped in land(), once the coefficient is known
            self._backup_bytes += nbytes
        plan = StepPlan(bucket, bucket.grads.arrived.copy())
        hyper = self.hypers[bucket.layout.group]
        declare = getattr(backend, "declare_weight_readers", None)
        if declare is not None:
            declare()  # the copies below wait for these readers
        ready = [self.manager.compute_ready()]
        scale = self.grad_scale

        def update() -> None:
            if speculative:
                # Hidden cost: a copy of the bucket's state, within speculation_bytes.
                self._backups[index] = {
                    name: t.clone() for name, t in backend.state_tensors().items()
                }
            with phase("cpu_adam", track="cpu_optimizer"):
                backend.update(
                    hyper, scale, plan.runs, publish=True, source=plan.source, after=ready
                )

        worker = self.manager.host_worker
        worker.submit(update)
        self._done[index] = worker.record_event()
        self.plans[index] = plan

    def end_backward(self, buckets: Sequence[FlatBucket]) -> None:
        """Backward ended: hand over the rest, and measure how much was already done."""
        for bucket in buckets:
            if bucket.layout.index not in self.plans and bucket.has_gradients:
                self.hand_over(bucket)
        total = sum(_elements(p) for p in self.plans.values())
        done = sum(_elements(p) for i, p in self.plans.items() if self._done[i].query())
        self.share_before_backward_returned = done / total if total else 1.0
        self.backward_ended = True

    def land(
        self,
        buckets: Sequence[FlatBucket],
        ranks: Ranks,
        decide: Callable[[], tuple[bool, float]],
    ) -> None:
        """step(): wait for the updates, check the speculation (``decide`` returns whether
        the step is skipped and its true gradient multiplier), make compute wait for the
        weights, commit."""
        self._drain(ranks)
        self.landed = True
        skip, grad_scale = decide()
        events: list[Event] = []
        for bucket in buckets:
            events.extend(bucket.backend.publish())
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
            return
        if self.speculation_bytes is None:
            raise RuntimeError(
                "an exact step run during backward needed another coefficient (bug: "
                "Note [stepping during backward] lists what refuses it)"
            )
        # Note [speculative steps]: restore, then skip or step again.
        self.rolled_back = True
        for event in events:
            event.synchronize()  # the redo rewrites the staging these copies read
        for index, backup in self._backups.items():
            bucket = next(b for b in buckets if b.layout.index == index)
            for name, tensor in bucket.backend.state_tensors().items():
                tensor.copy_(backup[name])
        self._backups.clear()
        if skip:
            restored: list[Event] = []
            for bucket in buckets:
                if bucket.layout.index in self.plans:
                    bucket.backend.publish_all_from_master()  # the weights from before
                    restored.extend(bucket.backend.publish())
                bucket.grads.consume()
            with phase("wait_weights"):
                self.manager.wait_for(restored, category=Category.WEIGHTS)
            for bucket in buckets:
                bucket.views.remember()
            return
        work = [
            (self.plans.get(b.layout.index) or StepPlan(b, b.grads.arrived), self._hyper(b))
            for b in buckets
        ]
        ImmediateUpdate(self.manager, ranks).run(work, grad_scale)

    def _drain(self, ranks: Ranks) -> None:
        stepped = [i for i, e in self._done.items() if e.query()]
        try:
            self.manager.host_worker.synchronize()
        except BaseException as exc:
            raise _failed(
                f"{ranks.where()}the step run during backward failed", stepped, None
            ) from exc

    def abandon(self, buckets: Sequence[FlatBucket], ranks: Ranks) -> list[int]:
        """The announced backward raised and the window is being discarded (zero_grad):
        the buckets already stepped cannot be unstepped (an exact step keeps no backup;
        a speculative one is restored instead), so they are taken as stepped: their
        weights land and their counts move. Returns their indices."""
        self._drain(ranks)
        self.landed = True
        events: list[Event] = []
        for bucket in buckets:
            events.extend(bucket.backend.publish())
        for event in events:
            event.synchronize()  # the restored state below must not race the copies
        for index, backup in self._backups.items():
            bucket = next(b for b in buckets if b.layout.index == index)
            for name, tensor in bucket.backend.state_tensors().items():
                tensor.copy_(backup[name])
            bucket.backend.publish_all_from_master()
            events.extend(bucket.backend.publish())
            self.plans.pop(index)
        with phase("wait_weights"):
            self.manager.wait_for(events, category=Category.WEIGHTS)
        for bucket in buckets:
            plan = self.plans.get(bucket.layout.index)
            if plan is not None:
                bucket.commit(plan)
            bucket.views.remember()
        return sorted(self.plans)

    def _hyper(self, bucket: FlatBucket) -> AdamHyper:
        return self.hypers[bucket.layout.group]
