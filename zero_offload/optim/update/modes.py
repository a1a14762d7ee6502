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
from collections.abc import Sequence

import torch

from ...accelerator import Event
from ...collectives import Pending
from ...memory.manager import TieredMemoryManager
from ...memory.traffic import Category
from ...tracing import phase
from ..flat_bucket import FlatBucket, StepPlan
from ..ranks import Ranks
from .tiles import AdamHyper

__all__ = ["DelayedUpdate", "ImmediateUpdate", "StepFailed", "UpdateMode", "failed"]


class StepFailed(RuntimeError):
    """A step failed after it started changing the optimizer state; see Note [a step is
    all or nothing]."""


def failed(what: str, stepped: list[int], failing: int | None) -> StepFailed:
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
    def eager_refusal(self) -> str | None:
        """Why an announced step cannot run during backward under this mode, or None
        (Note [stepping during backward] in ``eager.py``)."""

    @abstractmethod
    def loaded(self, buckets: Sequence[FlatBucket], *, pending: bool) -> None:
        """A state was loaded; ``pending``: it was saved with a delayed update pending."""

    @abstractmethod
    def run(self, work: Sequence[tuple[StepPlan, AdamHyper]], grad_scale: float) -> None:
        """Apply the planned step to every bucket."""

    def _gather(
        self, bucket: FlatBucket, published: list[Event]
    ) -> tuple[list[Event], Pending | None]:
        """``Ranks.gather_weights`` of ``bucket``'s updated shard."""
        return self.ranks.gather_weights(
            self.manager,
            bucket.weights_dev,
            published,
            what=f"bucket {bucket.layout.index} weights",
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

    def eager_refusal(self) -> str | None:
        return None

    def loaded(self, buckets: Sequence[FlatBucket], *, pending: bool) -> None:
        """Every update is on the device when step() returns: a pending one of the
        checkpoint's is in its master and weights already."""

    def run(self, work: Sequence[tuple[StepPlan, AdamHyper]], grad_scale: float) -> None:
        events: list[Event] = []
        gathers: list[Pending | None] = []
        stepped: list[int] = []
        with phase("cpu_adam", track="cpu_optimizer"):
            for plan, hyper in work:
                bucket = plan.bucket
                try:
                    bucket.store.update(
                        hyper, grad_scale, plan.runs, publish=True, source=plan.source
                    )
                    published = bucket.publish()
                    # this bucket's all-gather overlaps the next bucket's CPU Adam
                    wait, gather = self._gather(bucket, published)
                    events.extend(wait)
                    gathers.append(gather)
                except BaseException as exc:
                    raise failed(
                        f"{self.ranks.where()}step() failed in bucket {bucket.layout.index}",
                        stepped,
                        bucket.layout.index,
                    ) from exc
                bucket.commit(plan)
                stepped.append(bucket.layout.index)
        try:
            self._land([plan.bucket for plan, _ in work], events, gathers)
        except BaseException as exc:
            raise failed(
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
# the next step publish from the master, except for the parameters the dict had no master
# for (``ParamViews.masters_from_weights``): weights loaded into those before that step win,
# so both load orders resume alike. "Written" means new values, not a moved version counter
# (Note [weights written outside the optimizer] in views/param_views.py).


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

    def eager_refusal(self) -> str | None:
        return "overlap_step delays the update instead"

    def loaded(self, buckets: Sequence[FlatBucket], *, pending: bool) -> None:
        if pending:
            self.resume_pending(buckets)
        else:
            self.forget_pending()

    def resume_pending(self, buckets: Sequence[FlatBucket]) -> None:
        """A checkpoint had an update pending: publish it from the master at the next step."""
        for bucket in buckets:
            bucket.store.publish_all_from_master()
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
                    bucket.store.update(hyper, grad_scale, runs, publish=False, source=source)

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
            raise failed(
                f"{self.ranks.where()}the delayed update of step {self._steps_queued} failed",
                [],
                None,
            ) from exc
        events: list[Event] = []
        gathers: list[Pending | None] = []
        # Parameters written since the last step keep what was written, the others of
        # their bucket take the pending update: saved before the publication, put back
        # after it, then the master reconciled element-wise (Note [weights written outside
        # the optimizer] in views/param_views.py).
        # Written means new values (a reload of the same weights writes nothing). Resumed
        # from a checkpoint, the weights loaded since are the checkpoint's own and the
        # publication wins, except where the checkpoint had no master: there the weights
        # loaded are the truth, whichever of the model and the optimizer loaded first.
        written: list[tuple[FlatBucket, list[tuple[torch.Tensor, torch.Tensor]]]] = []
        for bucket in buckets:
            views = bucket.views
            changed = views.changed_params()
            if self._trust_weights:
                ours = {id(views.params[i]) for i in views.masters_from_weights}
                changed = [p for p in changed if id(p) in ours]
            if changed:
                written.append((bucket, [(p, p.detach().clone()) for p in changed]))
            views.masters_from_weights = frozenset()
            published = bucket.publish()
            events.extend(published)
            gathers.append(self._gather(bucket, published)[1])
        for event in events:
            # The next update rewrites the staging these copies read.
            self.manager.host_worker.wait_event(event)
        self._land(buckets, events, gathers)
        with torch.no_grad():
            for bucket, saved in written:
                for param, value in saved:
                    param.copy_(value)
                bucket.store.reconcile_master()
                bucket.views.remember()
        self._pending = False
        self._trust_weights = False
