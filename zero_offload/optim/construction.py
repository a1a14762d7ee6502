"""Building an optimizer's buckets: plan, place, allocate, bind, hook (one segment per
call: the constructor's param groups, or one ``add_param_group``), by one of two routes
(the weights on the device, or offloaded to homes) over the plan they share
(``segment_plan.py``). Each bucket is made in ``bucket_build.py``; parameter offload's
buckets are made unit by unit in ``unit_build.py``."""

from __future__ import annotations

import functools
import weakref
from typing import Any, NoReturn

import torch

from ..config import GradStaging, OffloadConfig
from ..errors import Attempts
from ..memory.host_ram import HostShare
from ..memory.manager import Tier, TieredMemoryManager
from ..memory.pool import BlockPool
from ..partition import BucketLayout
from ..views import ParamViews
from ..weights.source import ConstructionPeaks, DeviceOriginals, PeakTracker, tracking
from .bucket_build import build_bucket
from .checks import check_params, watch_replacement
from .flat_bucket import FlatBucket
from .lifetime import OWNERS, Resources, Segment, check_owners
from .rank_agreement import BuiltTogether, agree_on_build
from .rank_starts import start_from_rank0
from .ranks import Ranks, share_host
from .reports.live import OptimizerState
from .rule.base import OptimizerRule
from .segment_plan import SegmentPlan, open_staging_ring, plan_layouts, plan_segment
from .state.placement import POOL_ALIGNMENT
from .state.store import BucketPools
from .unit_build import build_units
from .update.policy import StepPolicy

__all__ = ["SegmentBuilder"]


class SegmentBuilder:
    """Builds an optimizer's segments: plan, place, allocate, bind, hook (one segment per
    call: the constructor's param groups, or one ``add_param_group``). Holds what every
    segment is built into; the optimizer is passed to each call (it owns the builder, so
    the builder does not hold it: Note [lifetimes without close] in ``lifetime.py``)."""

    def __init__(
        self,
        *,
        config: OffloadConfig,
        manager: TieredMemoryManager,
        ranks: Ranks,
        resources: Resources,
        state_view: OptimizerState,
        policy: StepPolicy,
        rule: OptimizerRule,
        name: str,
        param_offload_of: tuple[Any, Any] | None,
    ) -> None:
        self.config = config
        self.rule = rule  # what the state is and how it steps (optim/rule/)
        self.manager = manager
        self.ranks = ranks
        self.resources = resources
        self.state_view = state_view
        self.policy = policy
        self.name = name  # the pools' name prefix
        # Parameter offload (zero_offload.params): the model and its blocks, or None.
        self.param_offload_of = param_offload_of
        #: What the last ``build`` held at its worst (Note [construction peaks] in
        #: ``weights/source.py``); None before the first.
        self.peaks: ConstructionPeaks | None = None
        #: The ranks on this host's RAM at the last build (None with one rank).
        self._share: HostShare | None = None

    @staticmethod
    def _all_params(owner: torch.optim.Optimizer) -> list[torch.Tensor]:
        return [p for group in owner.param_groups for p in group["params"]]

    def _param_offloader(self, params: list[torch.Tensor], families: list[Any]) -> Any:
        """The ``ParamOffloader`` for this segment, or None without parameter offload."""
        if self.param_offload_of is None:
            return None
        if self.resources.param_offload is not None:
            raise ValueError(
                "add_param_group with OffloadConfig(offload_parameters=True): the window is "
                "planned once for the model; pass every param group to the constructor"
            )
        from ..params import (  # beside optim (docs/design.md, "The layers")
            DeviceShardOffloader,
            ParamOffloader,
            ShardedParamOffloader,
        )

        model, layers = self.param_offload_of
        options: dict[str, Any] = {
            "layers": layers,
            "manager": self.manager,
            "prefetch_layers": self.config.prefetch_layers,
            "trainable": [params[i] for family in families for i, _ in family.members],
            "name": f"{self.name}",
        }
        gathers = self.ranks.param_gathers()
        if gathers is None:
            return ParamOffloader(model, **options)
        # Several ranks: ZeRO-3 with offload (Note [a sharded unit]), or with the shards on
        # the device (Note [shards on the device]).
        sharded = ShardedParamOffloader if self.config.offload_parameters else DeviceShardOffloader
        return sharded(
            model,
            comm=gathers[0],
            stream=gathers[1],
            finished=self.resources.router.finished,
            **options,
        )

    def build(self, owner: torch.optim.Optimizer, group_indices: list[int]) -> None:
        """Bucket, place and allocate the trainable parameters of ``group_indices``: buckets
        of one training dtype each (``plan_dtype_buckets``), one device and one host pool
        sized for them all (``plan_placement``, per-bucket itemsize); with parameter offload
        one host pool per unit (Note [homes are pinned unit by unit] in unit_pools.py)."""
        # Tells close() from a dropped optimizer's finalizer: Note [a release after a
        # collective failure the caller saw] in lifetime.py.
        self.resources.owner = weakref.ref(owner)
        params = self._all_params(owner)
        first_index = sum(len(owner.param_groups[g]["params"]) for g in range(group_indices[0]))
        refused: Exception | None = None
        try:
            families = check_params(
                owner.param_groups,
                group_indices,
                first_index=first_index,
                device=self.manager.accelerator.device,
            )
            trainable = [params[i] for family in families for i, _ in family.members]
            if families:
                check_owners(owner, params, [i for family in families for i, _ in family.members])
                self._check_in_flight(trainable)
        except Exception as exc:
            refused = exc  # raised by agree_on_build, after the other ranks heard of it
        # After this rank's own checks, before anything is allocated (a segment with nothing
        # to train too: every rank calls it at every build): Note [the ranks build alike].
        self._agree(owner, group_indices, refused)
        if not families:
            return
        # Every rank, before anything is allocated: Note [ranks that share a host's RAM].
        self._share = share_host(self.ranks.comm)
        together = BuiltTogether(self.ranks.comm, owner=type(owner).__name__)
        try:
            tracker = PeakTracker(self.manager, trainable)
        except BaseException as exc:
            together.failed(exc)
            raise
        with tracking(tracker):
            originals: DeviceOriginals | None = None
            try:
                # See Note [originals on the device leave first] in weights/source.py.
                originals = DeviceOriginals(trainable, tracker)
                # Note [every rank starts from rank 0's weights] in rank_starts.py: every
                # rank got here (Note [a rank that fails alone]), then the broadcast.
                together.so_far()
                start_from_rank0(
                    trainable,
                    comm=self.ranks.comm,
                    chunk_bytes=self.config.bucket_bytes,
                    owner=type(owner).__name__,
                )
                self._build(owner, params, families, tracker, together)
            except BaseException as exc:
                together.failed(exc)  # first: restoring may raise (Note [a rank that fails alone])
                if originals is not None:
                    originals.restore(exc)
                raise
        self.peaks = tracker.peaks()

    def refuse(self, owner: torch.optim.Optimizer, refused: Exception) -> NoReturn:
        """Raise ``refused``, this rank's refusal of a build's arguments (a group, the
        parameters), once every rank has heard of it; they raise naming this rank (Note [a
        rank that fails alone] in ``rank_agreement.py``)."""
        self._agree(owner, [], refused)
        raise refused  # agree_on_build raised it already; for the type checker

    def _agree(
        self, owner: torch.optim.Optimizer, group_indices: list[int], refused: Exception | None
    ) -> None:
        """``agree_on_build`` for this builder's rule, config, windows and ranks, issued
        after the reduce-scatters a backward left on the comm stream (Note [caller
        collectives follow the reduce-scatters] in ``ranks.py``)."""
        self.ranks.after_scatters()
        agree_on_build(
            owner,
            group_indices,
            rule=self.rule,
            config=self.config,
            windows=self.param_offload_of,
            comm=self.ranks.comm,
            refused=refused,
        )

    def _check_in_flight(self, params: list[torch.Tensor]) -> None:
        """Refuse ``grad_staging="in_flight"`` where no step could run during backward
        whatever the loop does (Note [gradient staging for the buckets in flight])."""
        if self.config.grad_staging is not GradStaging.IN_FLIGHT:
            return
        reason = self.ranks.eager_refusal()
        if reason is None and any(p.dtype == torch.float16 for p in params):
            reason = "fp16 parameters bring a loss scaler that may skip a step"
        if reason is None and self.config.loss_scaler.autocast_fp16:
            reason = (
                "LossScalerConfig(autocast_fp16=True) brings a loss scaler that may skip a step"
            )
        if reason is not None:
            raise ValueError(
                f"OffloadConfig(grad_staging='in_flight') needs each step to run during "
                f"backward, which cannot happen here: {reason}. Use "
                "grad_staging='per_bucket' (the default)"
            )

    def _build(
        self,
        owner: torch.optim.Optimizer,
        params: list[torch.Tensor],
        families: list[Any],
        tracker: PeakTracker,
        together: BuiltTogether,
    ) -> None:
        """One segment, by one of two routes over one shared plan (``_plan``): the
        weights stay on the device, in the device pool (``_build_weights_on_device``), or
        with parameter offload live in homes and visit a window (``_build_weights_offloaded``).
        Each route's last move before the segment joins the optimizer is ``together.built``
        (Note [a rank that fails alone]). See Note [construction holds one copy]."""
        offload = self._param_offloader(params, families)
        if offload is None:
            self._build_weights_on_device(owner, params, families, tracker, together)
        else:
            self._build_weights_offloaded(owner, params, families, tracker, together, offload)

    def _build_weights_on_device(
        self,
        owner: torch.optim.Optimizer,
        params: list[torch.Tensor],
        families: list[Any],
        tracker: PeakTracker,
        together: BuiltTogether,
    ) -> None:
        """Without parameter offload: every bucket's views over the device pool first (the
        originals released), then the one host pool, then the stores."""
        parts = self._plan(owner, params, families, self._layouts(families), tracker, None)
        moved: list[ParamViews] = []  # the views, built before the host pool
        host_pools: list[BlockPool] = []
        buckets: list[FlatBucket] = []
        try:
            for layout in parts.layouts:  # see Note [construction holds one copy]
                members = [params[slot.index] for slot in layout.slots]
                moved.append(ParamViews(layout, members, parts.device_pool))
                tracker.released(members)
            own_staging = open_staging_ring(parts, config=self.config, manager=self.manager)
            tracker.sample()
            host_pools.append(
                self.manager.create_pool(
                    Tier.HOST,
                    max(parts.nvme.plan.host_pool - own_staging, POOL_ALIGNMENT),
                    name=f"{parts.name}.host",
                )
            )
            tracker.sample()
            for layout, views in zip(parts.layouts, moved, strict=True):
                buckets.append(self._bucket(parts, layout, views, host_pools[0]))
            together.built()
        except BaseException as exc:
            self._undo(parts, [*moved, *(bucket.views for bucket in buckets)], host_pools, exc)
            raise
        self._register(owner, parts, buckets, host_pools)

    def _build_weights_offloaded(
        self,
        owner: torch.optim.Optimizer,
        params: list[torch.Tensor],
        families: list[Any],
        tracker: PeakTracker,
        together: BuiltTogether,
        offload: Any,
    ) -> None:
        """With parameter offload (``offload``, a ``ParamOffloader``): no bucket spans two
        units; the window is planned on the device before the state is placed, and the
        buckets are built unit by unit (``build_units`` in unit_build.py)."""
        families = offload.split_families(families, params)
        layouts = self._layouts(families)
        offload.plan(layouts, params, alignment=POOL_ALIGNMENT)  # the window (device)
        tracker.sample()
        try:
            parts = self._plan(owner, params, families, layouts, tracker, offload)
        except BaseException:
            offload.close()
            raise
        host_pools: list[BlockPool] = []  # one per unit that pins (and the shared one)
        buckets: list[FlatBucket] = []
        try:
            # build_units takes the ring's bytes off each unit's host pool
            open_staging_ring(parts, config=self.config, manager=self.manager)
            tracker.sample()
            build_units(parts, host_pools, buckets, manager=self.manager, bucket=self._bucket)
            buckets.sort(key=lambda bucket: bucket.layout.index)
            offload.open_bounce()  # with homes on NVMe: pinned, so before built()
            together.built()
        except BaseException as exc:
            self._undo(parts, [bucket.views for bucket in buckets], host_pools, exc)
            raise
        offload.install(owner)  # hooks only
        # A forward must not fetch homes a step during backward is writing: Note
        # [stepping during backward with parameter offload] in update/eager.py.
        offload.homes_in_update = self.policy.writing_homes
        self.resources.param_offload = offload
        self._register(owner, parts, buckets, host_pools)

    def _layouts(self, families: list[Any]) -> list[BucketLayout]:
        """``plan_layouts`` for this optimizer's next segment (numbered after its buckets)."""
        return plan_layouts(
            families,
            config=self.config,
            rule=self.rule,
            world_size=self.ranks.world_size,
            first_index=len(self.resources.router.buckets),
        )

    def _plan(
        self,
        owner: torch.optim.Optimizer,
        params: list[torch.Tensor],
        families: list[Any],
        layouts: list[BucketLayout],
        tracker: PeakTracker,
        offload: Any,
    ) -> SegmentPlan:
        """``plan_segment`` for this optimizer's next segment (its groups, its name)."""
        groups = [owner.param_groups[g] for g in sorted({family.group for family in families})]
        return plan_segment(
            groups,
            params,
            layouts,
            config=self.config,
            rule=self.rule,
            manager=self.manager,
            rank=self.ranks.rank,
            name=f"{self.name}.{len(self.resources.segments)}",
            tracker=tracker,
            offload=offload,
            owner=type(owner).__name__,
            share=self._share,
        )

    def _undo(
        self,
        parts: SegmentPlan,
        views: list[ParamViews],
        host_pools: list[BlockPool],
        cause: BaseException,
    ) -> None:
        """A build failed half-way (``cause``, which the caller raises): the parameters
        take private copies of their weights back before the pools go (Note [construction
        holds one copy]). Under ZeRO-3 a copy is gathered from every rank's shard, which
        needs every rank: where that fails (a rank that failed alone is gone, Note [a rank
        that fails alone]), ``cause`` says so and keeps its type; the pools go either way."""
        attempt = Attempts()
        for each in {id(v): v for v in views}.values():
            attempt(each.unbind)
        if parts.offload is not None:
            attempt(parts.offload.close)
        attempt(functools.partial(self.manager.discard_pool, parts.device_pool))
        for pool in host_pools:
            attempt(functools.partial(self.manager.discard_pool, pool))
        if parts.ring is not None:
            attempt(parts.ring.close)
        interrupts = [e for e in [cause, *attempt.errors] if not isinstance(e, Exception)]
        if interrupts and attempt.errors:
            attempt.raise_first()  # an interrupt: what failed here is not a note
        if attempt.errors:
            cause.add_note(
                f"(the parameters could not take their weights back: {attempt.errors[0]}; "
                "under ZeRO-3 a rank holds only its shards, so rebuild the model before "
                "another try)"
            )

    def _register(
        self,
        owner: torch.optim.Optimizer,
        parts: SegmentPlan,
        buckets: list[FlatBucket],
        host_pools: list[BlockPool],
    ) -> None:
        """The built segment joins the optimizer: its pools, the router, ``opt.state``, the
        owners of its parameters, the loss scaler."""
        pools = BucketPools(device=parts.device_pool, host=tuple(host_pools))
        parts.tracker.sample()  # the final footprint (gradient staging pools, bounce ring included)
        segment = Segment(buckets, pools, parts.grad_buffers)
        self.resources.segments.append(segment)
        self.resources.router.add(buckets)
        self.state_view.add(buckets)
        for bucket in buckets:
            for param in bucket.params:
                OWNERS[param] = weakref.ref(owner)
            watch_replacement(bucket.params)  # Note [parameters replaced in their module]
        self.policy.use_scaler_for(buckets)  # Note [one loss scale]

    # Note [construction holds one copy]
    # The device pool is allocated whole first (the final device footprint). Then each
    # bucket copies its parameters' initial weights into its slots, from wherever they are
    # (the device, the host, or a checkpoint for meta parameters: Note [construction reads
    # each weight from its source] in weights/source.py) and re-points the parameters there
    # (ParamViews), which releases the originals bucket by bucket. Without parameter offload
    # every bucket moves before the host pool is pinned, so host originals and the host pool
    # never coexist: host peak = max(the host originals, the final host footprint), plus one
    # checkpoint tensor. With parameter offload the homes live in the host pools, one per
    # unit, each pinned once that unit's originals are in its window slot and released:
    # host peak = max(the host originals + the segment-wide buffers, the final footprint)
    # (Note [homes are pinned unit by unit] in unit_pools.py).
    # Originals on the device leave it for the host before anything is allocated, and the
    # build proceeds as from CPU weights: device peak = max(the model as the caller had it,
    # the final footprint) (Note [originals on the device leave first] in weights/source.py).
    # Both peaks are measured: Note [construction peaks]. A failure half-way gives the
    # parameters built so far private copies again (ParamViews.unbind) before the pools are
    # discarded, and the originals that had left the device go back to it
    # (DeviceOriginals.restore), so the model keeps its values where they were.

    def _bucket(
        self,
        parts: SegmentPlan,
        layout: BucketLayout,
        views: ParamViews,
        host_pool: BlockPool | None,
    ) -> FlatBucket:
        """``build_bucket`` (bucket_build.py) with this builder's rank, rule, config and
        manager: the one call both routes make a bucket through."""
        return build_bucket(
            parts,
            layout,
            views,
            host_pool,
            rank=self.ranks.rank,
            rule=self.rule,
            config=self.config,
            manager=self.manager,
        )
