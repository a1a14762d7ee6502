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
or a collective. Then ``StepFailed`` says which buckets were stepped, how far it got in the
one it stopped in (Note [what a stopped step says] in ``failures.py``), and that the
optimizer must be reloaded from a checkpoint or rebuilt: after ``zero_grad()``, by
``load_streaming`` where some state is on NVMe, else ``load_state_dict``
(``load_consolidated`` with several ranks); with several ranks its first line names the rank
whose absence failed the collective (Note [naming the absent rank] in ``collectives.py``).

Note [an interrupt is not a failure]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``KeyboardInterrupt``, ``SystemExit`` (a SIGTERM handler calling ``sys.exit``) and any other
``BaseException`` that is not an ``Exception`` leave a step as themselves, never as
``StepFailed``: ``except KeyboardInterrupt`` must catch Ctrl-C, ``except Exception`` must not
swallow it, and an exit must exit. What the step had done (the stepped buckets, the one
stepped in part, how to recover) rides on the exception as a note (``add_note``; logged
where Python has none).
"""

from __future__ import annotations

import contextlib
import functools
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np
import torch

from ...accelerator import Event, Stream, latest_per_stream
from ...accelerator.device_context import capture_thread_device
from ...collectives import Pending
from ...config import OverlapLanding, OverlapShadow
from ...memory.manager import TieredMemoryManager
from ...memory.traffic import Category
from ...tracing import phase
from ...views.in_flight import InFlight
from ..flat_bucket import FlatBucket, StepPlan
from ..publish import Publish
from ..ranks import Ranks
from ..rule.base import Hyper
from ..shadow import WeightShadows
from .failures import BucketPart, StepFailed, failed, interrupted
from .reconcile import WriteChecks
from .resume import LoadGuard, ResumedUpdate

__all__ = ["DelayedUpdate", "ImmediateUpdate", "StepFailed", "UpdateMode", "failed", "interrupted"]


def _written(bucket: FlatBucket, *, trust_weights: bool) -> list[torch.Tensor]:
    """``bucket``'s parameters written since the last step, whose weights win over a
    pending update: those with new values, and of those, with ``trust_weights`` (a loaded
    checkpoint's update), only the ones it names (``ParamViews.masters_from_weights``)."""
    views = bucket.views
    changed = views.changed_params()
    if trust_weights:
        named = {id(views.params[i]) for i in views.masters_from_weights}
        changed = [p for p in changed if id(p) in named]
    return changed


class UpdateMode(ABC):
    """When an update's weights reach the device."""

    #: Whether ``step()``'s update can be a bucket's write check (Note [the write check in
    #: the update] in reconcile.py): it runs now, on the weights as they are.
    checks_in_update: ClassVar[bool] = False

    def __init__(self, manager: TieredMemoryManager, ranks: Ranks) -> None:
        self.manager = manager
        self.ranks = ranks
        self.write_checks = WriteChecks(manager.accelerator)
        # Buckets published and not landed yet, in the order their copies went (Note
        # [weights landed at their first use] in views/in_flight.py).
        self._deferred: list[FlatBucket] = []
        # A loaded checkpoint's pending update, published from the master at the next
        # step (Note [a resumed update is published at the step, not at the load] in
        # resume.py).
        self.resumed = ResumedUpdate(ranks.where())
        # The last load's copy, and whether it stopped half-way (Note [a load cut short] in
        # resume.py): while it has, no update is pending and nothing is published.
        self.load = LoadGuard(ranks.where())

    @property
    def pending(self) -> bool:
        """Whether an update's weights are not on the device yet."""
        return self.resumed.pending and not self.load.cut

    def settle(self, buckets: Sequence[FlatBucket]) -> None:
        """Put any pending update's weights on the device (weights written since win);
        nothing after a load cut short (Note [a load cut short] in resume.py)."""
        self.land_all()
        if self.resumed.pending and not self.load.cut:
            self.resumed.refuse_overwritten_master(buckets)
            # Note [a resumed update is published at the step, not at the load] in resume.py
            for bucket in buckets:
                bucket.store.publish_all_from_master()
            self._publish_pending(buckets, trust_weights=True)
            self.resumed.pending = False

    def loaded(self, buckets: Sequence[FlatBucket], *, pending: bool) -> None:
        """A state was loaded; ``pending``: it was saved with a delayed update pending,
        whose weights the next step publishes from the master (in either update mode)."""
        self.resumed.loaded(buckets, pending=pending)
        self.load.finish()  # last: one state again (Note [a load cut short] in resume.py)

    def saved_pending(self, buckets: Sequence[FlatBucket]) -> dict[str, Any]:
        """What a checkpoint records of a pending update: ``pending_update``, and
        ``written``, the parameters (``ParamSlot.index``) written since the last step, which
        keep what was written on resume (Note [delayed parameter update])."""
        written: list[int] = []
        if self.pending:
            for bucket in buckets:
                ours = {id(p) for p in _written(bucket, trust_weights=self.resumed.pending)}
                slots = zip(bucket.layout.slots, bucket.views.params, strict=True)
                written.extend(slot.index for slot, param in slots if id(param) in ours)
        return {"pending_update": self.pending, "written": sorted(written)}

    def _publish_pending(
        self, buckets: Sequence[FlatBucket], *, trust_weights: bool, defer: bool = False
    ) -> None:
        """Publish the pending update's weights; parameters written since the last step keep
        what was written. ``trust_weights``: the update is a loaded checkpoint's, and only
        the parameters it names (``ParamViews.masters_from_weights``) count as written
        (Note [delayed parameter update]). ``defer``: compute waits for each unwritten
        bucket where its parameters are first read, not here (Note [weights landed at
        their first use] in views/in_flight.py); the copies go last bucket first, and the
        buckets left in flight join ``_deferred`` in that order."""
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
        landed: list[FlatBucket] = []
        deferred: list[tuple[FlatBucket, list[Event], Pending | None]] = []
        for bucket in reversed(buckets) if defer else buckets:
            changed = _written(bucket, trust_weights=trust_weights)
            if changed:
                written.append((bucket, [(p, p.detach().clone()) for p in changed]))
            bucket.views.masters_from_weights = frozenset()
            published = bucket.publish()
            gather = self._gather(bucket, published)[1]
            if defer and not changed:
                deferred.append((bucket, published, gather))
                continue
            landed.append(bucket)
            events.extend(published)
            gathers.append(gather)
        for bucket in buckets:
            for event in bucket.store.publication.home_readers():
                # The next update rewrites the staging these copies read.
                self.manager.host_worker.wait_event(event)
        self._land(landed, events, gathers)
        # The stream step() runs on is the forward's: it waits wherever the bucket lands.
        stream = self.manager.accelerator.current_stream()
        for bucket, published, gather in deferred:
            land = functools.partial(self._land_one, bucket, published, gather, stream)
            what = f"{self.ranks.where()}bucket {bucket.layout.index}"
            bucket.views.in_flight = InFlight(bucket.views.params, land, what=what)
            self._deferred.append(bucket)
        with torch.no_grad():
            for bucket, saved in written:
                for param, value in saved:
                    param.copy_(value)
                bucket.reconcile_master()  # Note [a master read after a load]
                bucket.views.remember()

    def _land_one(
        self, bucket: FlatBucket, events: list[Event], gather: Pending | None, stream: Stream
    ) -> None:
        """Land one deferred bucket (Note [weights landed at their first use]) on the thread
        that reads it first, with the device current there while it waits (Note [every
        library thread binds its device]): ``stream`` (``step()``'s, the forward's) waits
        for the copies and takes the fingerprints, and the reader's own stream, when it is
        another (an EMA on a side stream), waits for all of that."""
        restore = capture_thread_device()
        accelerator = self.manager.accelerator
        accelerator.bind_thread()
        try:
            with accelerator.stream_context(stream):
                self._land([bucket], events, [gather])
                landed = self.manager.compute_ready()
            self.manager.wait_for([landed], category=Category.WEIGHTS)
        finally:
            restore()

    def land_all(self) -> None:
        """Land every bucket still in flight (Note [weights landed at their first use]),
        in the order their copies went; before anything of the optimizer reads the weights."""
        while self._deferred:
            bucket = self._deferred[0]
            if bucket.views.in_flight is not None:
                bucket.views.in_flight.land()  # raises again after a failed landing
                bucket.views.in_flight = None
            self._deferred.pop(0)

    def drain(self) -> None:
        """Make the optimizer state final for reading (``state_dict``) without publishing."""
        self.land_all()
        self.manager.synchronize()

    @abstractmethod
    def eager_refusal(self) -> str | None:
        """Why an announced step cannot run during backward under this mode, or None
        (Note [stepping during backward] in ``eager.py``)."""

    @abstractmethod
    def run(self, work: Sequence[tuple[StepPlan, Hyper]], grad_scale: float) -> None:
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
        self,
        buckets: Sequence[FlatBucket],
        events: list[Event],
        gathers: list[Pending | None],
        checked: frozenset[int] = frozenset(),
    ) -> None:
        """Make compute wait for the weight copies and all-gathers; record the versions
        (fingerprints), but for the buckets whose update was their write check
        (``checked``, layout indices: Note [the write check in the update] in
        reconcile.py), which take none."""
        with phase("wait_weights"):
            # One wait per stream: its last copy's event ends after every earlier one.
            if events:
                self.manager.wait_for(latest_per_stream(events), category=Category.WEIGHTS)
        self.ranks.wait([g for g in gathers if g is not None])
        for bucket in buckets:
            if bucket.layout.index in checked:
                bucket.views.forget()
            else:
                bucket.views.remember()


class ImmediateUpdate(UpdateMode):
    """CPU Adam now, tile by tile, each tile's weights copied as soon as it is written."""

    checks_in_update = True

    def eager_refusal(self) -> str | None:
        if self.load.cut:  # Note [a load cut short] in resume.py
            return "the last load was interrupted, and step() refuses until it is redone"
        if self.resumed.pending:
            return "the loaded checkpoint's pending update is published by step() first"
        return None

    def _settle_issued(self) -> None:
        """Wait for the weight copies the step issued before it stopped: Note [an
        interrupted step's copies land before it leaves]."""
        with contextlib.suppress(Exception):  # a failed stream: the step's own error is told
            self.manager.h2d.synchronize()

    def run(self, work: Sequence[tuple[StepPlan, Hyper]], grad_scale: float) -> None:
        events: list[Event] = []
        gathers: list[Pending | None] = []
        stepped: list[int] = []
        checked: set[int] = set()
        buckets = [plan.bucket for plan, _ in work]
        # How far the step got, for what it says if it stops: Note [what a stopped step
        # says] in failures.py
        current: StepPlan | None = None  # the plan of the bucket being stepped
        part = BucketPart.UNTOUCHED
        try:
            with phase("cpu_adam", track="cpu_optimizer", owner=self.manager):
                for plan, hyper in work:
                    current, part = plan, BucketPart.UNTOUCHED
                    bucket = plan.bucket
                    take = self.write_checks.takes(bucket)
                    if take and not plan.every_slot:  # not what the check saw: by value
                        bucket.store.reconcile_master()
                        take = False
                    part = BucketPart.UPDATING
                    bucket.store.update(
                        hyper,
                        grad_scale,
                        plan.runs,
                        publish=Publish.NOW,
                        source=plan.source,
                        take_written=take,
                    )
                    part = BucketPart.UPDATED
                    if take:
                        checked.add(bucket.layout.index)
                    published = bucket.publish()
                    # this bucket's all-gather overlaps the next bucket's CPU Adam
                    wait, gather = self._gather(bucket, published)
                    events.extend(wait)
                    gathers.append(gather)
                    bucket.commit(plan)
                    stepped.append(bucket.layout.index)
                    current = None
            self._land(buckets, events, gathers, frozenset(checked))
        except BaseException as exc:
            self._settle_issued()  # Note [an interrupted step's copies land before it leaves]
            stopped = self._stopped(exc, buckets, stepped, current, part)
            if stopped is exc:  # an interrupt leaves as itself, with a note
                raise
            raise stopped from exc

    def _stopped(
        self,
        exc: BaseException,
        buckets: list[FlatBucket],
        stepped: list[int],
        current: StepPlan | None,
        part: BucketPart,
    ) -> BaseException:
        """What ``run`` raises when ``exc`` stopped it in ``current`` (None: between
        buckets, or after the last) as far as ``part``: ``exc`` itself, with a note, for an
        interrupt (Note [an interrupt is not a failure]), else ``StepFailed``; either says
        exactly what was stepped (Note [what a stopped step says] in failures.py)."""
        if current is not None and part is BucketPart.UPDATED:
            bucket = current.bucket
            if bucket.layout.index in stepped or np.array_equal(bucket.steps, current.steps):
                # its commit took the counts before the stop: stepped and counted
                stepped = sorted({*stepped, bucket.layout.index})
                current = None
        applied = current is None and len(stepped) == len(buckets)
        if applied:
            failing, part = None, BucketPart.UNTOUCHED
            where = "while landing the weights"
        else:
            bucket = current.bucket if current is not None else buckets[len(stepped)]
            failing = bucket.layout.index
            part = part if current is not None else BucketPart.UNTOUCHED
            where = f"in bucket {failing}"
        what = f"{self.ranks.where()}step() {where}"
        if interrupted(
            exc,
            what,
            stepped,
            failing,
            buckets=buckets,
            ranks=self.ranks,
            part=part,
            applied=applied,
        ):
            return exc
        return failed(
            f"{self.ranks.where()}step() failed {where}",
            stepped,
            failing,
            buckets=buckets,
            ranks=self.ranks,
            cause=exc,
            part=part,
        )


# Note [an interrupted step's copies land before it leaves]
# A step stopped by a Ctrl-C (or a failure) after a bucket's weights were published has
# that bucket's H2D copies queued. The recovery it names (zero_grad, then the model's and
# the optimizer's checkpoints loaded) ran at once, and the copies landed after it, over the
# checkpoint's weights in the device parameters: the run went on 1e-3 off torch's with no
# error (the model loaded before the optimizer; after it, the load's own copies queued
# behind them and won). So before the interrupt or the failure leaves ``step()``, the h2d
# stream is drained (Synchronisation point, only on that path): what the step issued has
# landed, and nothing it did is still moving when the caller's recovery runs.


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
# the next step publish from the master, in either update mode, except for the parameters
# the dict had no master for and those written between the last step and the save (it
# records them: ``UpdateMode.saved_pending``). Together they are
# ``ParamViews.masters_from_weights``: the weights loaded into those before that step win,
# so both load orders resume as the uninterrupted run goes on. "Written" means new values,
# not a moved version counter (Note [weights written outside the optimizer] in
# views/param_views.py). Where the device budget has room, the update's tiles cross the link
# as they are written, into a device shadow, and step() k+1 copies them on the device
# instead (Note [the delayed update lands in a shadow] in optim/shadow.py).


class DelayedUpdate(UpdateMode):
    """``overlap_step``: the update runs on the host worker, published at the next step."""

    def __init__(
        self,
        manager: TieredMemoryManager,
        ranks: Ranks,
        *,
        shadow: OverlapShadow = OverlapShadow.AUTO,
        landing: OverlapLanding = OverlapLanding.AT_STEP,
        name: str = "delayed_update",
    ) -> None:
        super().__init__(manager, ranks)
        self.landing = landing
        self._pending = False  # an update of our own is queued or done, not yet published
        self._steps_queued = 0  # for errors: which step's update is pending
        self.shadows = WeightShadows(manager, setting=shadow, name=name)

    @property
    def pending(self) -> bool:
        return (self._pending or self.resumed.pending) and not self.load.cut

    def eager_refusal(self) -> str | None:
        return "overlap_step delays the update instead"

    def loaded(self, buckets: Sequence[FlatBucket], *, pending: bool) -> None:
        self._pending = False  # ours was drained; the checkpoint's, if any, is resumed
        super().loaded(buckets, pending=pending)

    def run(self, work: Sequence[tuple[StepPlan, Hyper]], grad_scale: float) -> None:
        plans = [
            (plan.bucket, hyper, plan.runs, plan.source, self._publish(plan.bucket))
            for plan, hyper in work
        ]

        def update() -> None:
            with phase("cpu_adam", track="cpu_optimizer", owner=self.manager):
                for bucket, hyper, runs, source, publish in plans:
                    bucket.store.update(hyper, grad_scale, runs, publish=publish, source=source)

        self.manager.host_worker.submit(update)
        for plan, _ in work:  # the counts are the snapshot the queued update works from
            plan.bucket.commit(plan)
        self._pending = True
        self._steps_queued += 1

    def _publish(self, bucket: FlatBucket) -> Publish:
        """Into the bucket's shadow where it has one (taken at its first update), else
        later from the home: Note [the delayed update lands in a shadow]."""
        buffer_bytes = bucket.layout.padded_numel * bucket.dtype.itemsize
        if bucket.store.publication.shadowed(self.shadows, buffer_bytes=buffer_bytes):
            return Publish.SHADOW
        return Publish.LATER

    def settle(self, buckets: Sequence[FlatBucket]) -> None:
        self.land_all()
        if self.resumed.pending:
            super().settle(buckets)
            return
        if not self._pending or self.load.cut:  # Note [a load cut short] in resume.py
            return
        # Synchronisation point: the delayed update must be finished before its weights go.
        try:
            self.manager.host_worker.synchronize()
        except BaseException as exc:
            if not isinstance(exc, Exception):  # Note [an interrupt is not a failure]
                raise
            raise failed(
                f"{self.ranks.where()}the delayed update of step {self._steps_queued} failed",
                [],
                None,
            ) from exc
        defer = self.landing is OverlapLanding.AT_FIRST_USE
        self._publish_pending(buckets, trust_weights=False, defer=defer)
        self._pending = False
