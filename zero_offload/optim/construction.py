"""Building an OffloadAdamW's buckets: plan, place, allocate, bind, hook (one segment per
call: the constructor's param groups, or one ``add_param_group``)."""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

import torch

from ..config import GradStaging, OffloadConfig
from ..memory.align import aligned
from ..memory.manager import Tier, TieredMemoryManager
from ..memory.pool import BlockPool
from ..memory.storage import IO_ALIGNMENT, IO_BUFFERS
from ..partition import BucketLayout
from ..views import ParamViews
from ..weights.nvme_home import home_ring_bytes
from ..weights.source import ConstructionPeaks, DeviceOriginals, PeakTracker, tracking
from .checks import check_params, watch_replacement
from .flat_bucket import FlatBucket
from .grads.buffers import GradBuffers
from .grads.on_device import DeviceGradients
from .grads.path import GradientPath
from .grads.staging_ring import StagingRing, own_staging_bytes, ring_slot_bytes
from .grads.to_host import HostGradients
from .lifetime import OWNERS, Resources, Segment, check_owners
from .ranks import Ranks
from .reports.live import OptimizerState
from .rule.base import OptimizerRule, StateFields
from .state.host import HostState
from .state.nvme_backends import NvmeBackends
from .state.nvme_plan import RecordLayout, plan_nvme, resolve_host_budget
from .state.placement import POOL_ALIGNMENT, Placement, plan_dtype_buckets, plan_placement
from .state.resident import ResidentState
from .state.store import BucketPools, StateStore
from .unit_pools import plan_units
from .update.policy import StepPolicy

__all__ = ["SegmentBuilder", "check_param_offload", "windows_parameters"]


def windows_parameters(config: OffloadConfig, comm: Any) -> bool:
    """Whether the optimizer keeps a window of units' weights on the device (Note [the
    parameter window] in ``params/offloader.py``): with ``offload_parameters``, and with
    ``partition_parameters`` on several ranks (ZeRO-3, Note [shards on the device] in
    ``params/device_shards.py``); one rank's shard is the whole model, kept on the device
    as without partitioning."""
    return config.offload_parameters or (config.partition_parameters and comm is not None)


def check_param_offload(config: OffloadConfig, comm: Any, model: Any, layers: Any) -> None:
    """Refuse model=/layers= without parameter offload or partitioning, and a window
    without a model. Parameter offload with several ranks is ZeRO-3 with offload (Note [a
    sharded unit] in ``params/sharded_fetch.py``); with ``nvme_dir`` too, each rank's home
    shards beyond ``host_budget`` live in its own weight files (ZeRO-Infinity, Note [sharded
    homes on NVMe] there); partitioning alone there is ZeRO-3 with the shards on the device."""
    if windows_parameters(config, comm):
        if model is None:
            switch = "offload_parameters" if config.offload_parameters else "partition_parameters"
            raise ValueError(
                f"OffloadConfig({switch}=True) needs the model whose blocks it "
                "fetches: pass model=<the nn.Module> (and layers=<its blocks>, by default "
                "the nn.ModuleList holding the most parameters)"
            )
    elif (model is not None or layers is not None) and not config.partition_parameters:
        raise ValueError(
            "model= and layers= are for parameter offload or partitioning; set "
            "OffloadConfig(offload_parameters=True) or partition_parameters=True, or leave "
            "them None"
        )


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
        params = self._all_params(owner)
        first_index = sum(len(owner.param_groups[g]["params"]) for g in range(group_indices[0]))
        families = check_params(
            owner.param_groups,
            group_indices,
            first_index=first_index,
            device=self.manager.accelerator.device,
        )
        if not families:
            return
        check_owners(owner, params, [i for family in families for i, _ in family.members])
        self._check_in_flight([params[i] for family in families for i, _ in family.members])
        trainable = [params[i] for family in families for i, _ in family.members]
        tracker = PeakTracker(self.manager, trainable)
        with tracking(tracker):
            # See Note [originals on the device leave first] in weights/source.py.
            originals = DeviceOriginals(trainable, tracker)
            try:
                self._build(owner, params, families, tracker)
            except BaseException as exc:
                originals.restore(exc)
                raise
        self.peaks = tracker.peaks()

    def _check_in_flight(self, params: list[torch.Tensor]) -> None:
        """Refuse ``grad_staging="in_flight"`` where no step could run during backward
        whatever the loop does (Note [gradient staging for the buckets in flight])."""
        if self.config.grad_staging is not GradStaging.IN_FLIGHT:
            return
        reason = self.ranks.eager_refusal()
        if reason is None and any(p.dtype == torch.float16 for p in params):
            reason = "fp16 parameters bring a loss scaler that may skip a step"
        if reason is not None:
            raise ValueError(
                f"OffloadConfig(grad_staging='in_flight') needs each step to run during "
                f"backward, which cannot happen here: {reason}. Use "
                "grad_staging='per_bucket' (the default)"
            )

    def _staging_ring(
        self, layouts: list[BucketLayout], itemsize: list[int], name: str
    ) -> tuple[StagingRing | None, int]:
        """With ``grad_staging="in_flight"``, the segment's ring (Note [gradient staging
        for the buckets in flight]) and the host pool bytes it replaces: every offloaded
        bucket's own staging, ``a(k*s)`` each, which the plans count in the host pool."""
        if self.config.grad_staging is not GradStaging.IN_FLIGHT or not layouts:
            return None, 0
        own = own_staging_bytes(layouts, itemsize, alignment=POOL_ALIGNMENT)
        ring = StagingRing(
            self.manager,
            buffers=self.config.grad_staging_buffers,
            slot_bytes=ring_slot_bytes(layouts, itemsize, alignment=POOL_ALIGNMENT),
            name=f"{name}.grad_staging_ring",
            alignment=POOL_ALIGNMENT,
        )
        return ring, own

    def _nvme_config(
        self,
        layouts: list[BucketLayout],
        placement: Placement,
        params: list[torch.Tensor],
        state: StateFields,
        window_bytes: int | None,
    ) -> OffloadConfig:
        """The config ``plan_nvme`` places state with. With in-flight staging and
        ``host_budget="auto"`` the budget is resolved here, less what is in RAM whatever the
        placement: the ring and the I/O buffers, not every bucket's gradient staging, which
        ``plan_nvme`` would set aside (Note [gradient staging for the buckets in flight]);
        and every weight staging without parameter offload (``window_bytes`` None), or with
        it (the homes movable: Note [homes on NVMe]) the weight tile ring and the bounce
        ring, as large as the window, since the budget holds the homes first."""
        config = self.config
        if config.grad_staging is not GradStaging.IN_FLIGHT or config.host_budget != "auto":
            return config
        offloaded = [b for b in layouts if b.index not in placement.resident]
        sizes = [params[b.slots[0].index].dtype.itemsize for b in offloaded]
        ring = ring_slot_bytes(offloaded, sizes, alignment=POOL_ALIGNMENT)
        record = RecordLayout.make(config.tile_elements, state)
        other = config.grad_staging_buffers * ring
        other += IO_BUFFERS * record.record_bytes + IO_ALIGNMENT
        if window_bytes is None:  # the weight staging, as large as the gradient staging
            other += own_staging_bytes(offloaded, sizes, alignment=POOL_ALIGNMENT)
        else:
            other += home_ring_bytes(config.tile_elements, max(sizes, default=1)) + window_bytes
        budget = resolve_host_budget(config, other_host_bytes=other)
        return dataclasses.replace(config, host_budget=budget)

    def _build(
        self,
        owner: torch.optim.Optimizer,
        params: list[torch.Tensor],
        families: list[Any],
        tracker: PeakTracker,
    ) -> None:
        offload = self._param_offloader(params, families)
        if offload is not None:  # no bucket spans two units (zero_offload.params)
            families = offload.split_families(families, params)
        layouts = plan_dtype_buckets(
            families,
            bucket_bytes=self.config.bucket_bytes,
            world_size=self.ranks.world_size,
            align_numel=POOL_ALIGNMENT // 2,
            first_index=len(self.resources.router.buckets),
        )
        groups = [owner.param_groups[g] for g in sorted({family.group for family in families})]
        moments_dtype = torch.bfloat16 if self.config.moments_dtype == "bfloat16" else torch.float32
        state = self.rule.state_fields(moments_dtype, groups)  # an offloaded bucket's
        resident_state = self.rule.state_fields(torch.float32, groups)  # a resident one's
        if offload is not None:
            offload.plan(layouts, params, alignment=POOL_ALIGNMENT)  # the window (device)
            tracker.sample()
        stats = self.manager.accelerator.memory_stats()
        try:
            placement = plan_placement(
                layouts,
                itemsize=[params[layout.slots[0].index].dtype.itemsize for layout in layouts],
                state=state,
                resident_state=resident_state,
                offload_fraction=self.config.offload_fraction,
                device_free=stats["budget"] - stats["in_use"],
                auto_headroom=self.config.auto_headroom,
                alignment=POOL_ALIGNMENT,
                weights_elsewhere=frozenset(b.index for b in layouts if offload is not None),
            )
        except BaseException:
            if offload is not None:
                offload.close()
            raise
        name = f"{self.name}.{len(self.resources.segments)}"
        try:  # a refusal here (StorageFull) gives the window back too
            nvme = NvmeBackends(  # OffloadConfig.nvme_dir: what does not fit host_budget
                self.manager,
                plan_nvme(
                    layouts,
                    placement,
                    config=self._nvme_config(
                        layouts,
                        placement,
                        params,
                        state,
                        None if offload is None else offload.window_bytes,
                    ),
                    itemsize=[params[layout.slots[0].index].dtype.itemsize for layout in layouts],
                    state=state,
                    rank=self.ranks.rank,
                    alignment=POOL_ALIGNMENT,
                    homes_movable=offload is not None,  # the staging is each unit's home
                    window_bytes=0 if offload is None else offload.window_bytes,
                ),
                config=self.config,
                rank=self.ranks.rank,
                name=name,
            )
            device_pool = self.manager.create_pool(
                Tier.DEVICE, max(placement.device_total, POOL_ALIGNMENT), name=f"{name}.device"
            )
        except BaseException:
            if offload is not None:
                offload.close()
            raise
        tracker.sample()
        parts = _Parts(
            params=params,
            placement=placement,
            device_pool=device_pool,
            grad_buffers=GradBuffers(self.manager, name=name),
            state=state,
            resident_state=resident_state,
            nvme=nvme,
            offload=offload,
            tracker=tracker,
        )
        buckets: list[FlatBucket] = []
        moved: list[ParamViews] = []  # views built before the host pool (no param offload)
        host_pools: list[BlockPool] = []  # one; or, with parameter offload, one per unit
        try:
            if offload is None:  # see Note [construction holds one copy]
                for layout in layouts:
                    members = [params[slot.index] for slot in layout.slots]
                    moved.append(ParamViews(layout, members, device_pool))
                    tracker.released(members)
            offloaded = [b for b in layouts if b.index not in placement.resident]
            parts.ring, own_staging = self._staging_ring(
                offloaded, [params[b.slots[0].index].dtype.itemsize for b in offloaded], name
            )
            tracker.sample()
            if offload is None:
                host_pools.append(
                    self.manager.create_pool(
                        Tier.HOST,
                        max(nvme.plan.host_pool - own_staging, POOL_ALIGNMENT),
                        name=f"{name}.host",
                    )
                )
                tracker.sample()
                for layout, views in zip(layouts, moved, strict=True):
                    buckets.append(self._bucket(parts, layout, views, host_pools[0]))
            else:
                self._build_units(parts, layouts, name, host_pools, buckets)
                buckets.sort(key=lambda bucket: bucket.layout.index)
        except BaseException:
            # The parameters take private copies of their weights back before the pools go.
            bound = {id(v): v for v in [*moved, *(bucket.views for bucket in buckets)]}
            for views in bound.values():
                views.unbind()
            if offload is not None:
                offload.close()
            self.manager.discard_pool(device_pool)
            for pool in host_pools:
                self.manager.discard_pool(pool)
            if parts.ring is not None:
                parts.ring.close()
            raise
        pools = BucketPools(device=device_pool, host=tuple(host_pools))
        if offload is not None:
            offload.install(owner)  # the bounce ring, with homes on NVMe
            # A forward must not fetch homes a step during backward is writing: Note
            # [stepping during backward with parameter offload] in update/eager.py.
            offload.homes_in_update = owner._policy.writing_homes
            self.resources.param_offload = offload
        tracker.sample()  # the final footprint (gradient staging pools, bounce ring included)
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

    def _build_units(
        self,
        parts: _Parts,
        layouts: list[BucketLayout],
        name: str,
        host_pools: list[BlockPool],
        out: list[FlatBucket],
    ) -> None:
        """Parameter offload: unit by unit, its buckets' views (the originals go to the
        unit's window slot and are released), its host pool, its buckets' stores; see Note
        [homes are pinned unit by unit] in ``unit_pools.py``. Pools are appended to
        ``host_pools`` and buckets to ``out`` as they are made (a failure undoes them)."""
        offload, tracker, plan = parts.offload, parts.tracker, parts.nvme.plan
        bytes_of = dict(plan.bucket_host)
        if parts.ring is not None:  # the ring replaces each bucket's own gradient staging
            for layout in layouts:
                if layout.index in bytes_of:
                    itemsize = parts.params[layout.slots[0].index].dtype.itemsize
                    bytes_of[layout.index] -= aligned(itemsize * layout.shard_numel, POOL_ALIGNMENT)
        shared = None  # the segment-wide pool of the units that pin none (see the Note)
        if plan.home_ring:  # segment-wide, before any unit
            shared = self.manager.create_pool(
                Tier.HOST, plan.home_ring, name=f"{name}.home_tiles.host"
            )
            host_pools.append(shared)
            parts.nvme.open_home_tiles(shared)
            tracker.sample()
        builds = plan_units(
            layouts,
            unit_of=offload.unit_index,
            host_bytes=bytes_of,
            freed=lambda b: tracker.pending_host([parts.params[s.index] for s in b.slots]),
            alignment=POOL_ALIGNMENT,
        )
        for build in builds:
            waiting: list[ParamViews] = []  # views of this unit without a store yet
            try:
                for layout in build.layouts:
                    members = [parts.params[slot.index] for slot in layout.slots]
                    waiting.append(offload.views_for(layout, members))
                    tracker.released(members)
                pool = shared
                if build.capacity:  # pinned now: the unit's originals are released
                    pool = self.manager.create_pool(
                        Tier.HOST, build.capacity, name=f"{name}.unit{build.unit}.host"
                    )
                    host_pools.append(pool)
                    tracker.sample()
                while waiting:
                    out.append(self._bucket(parts, waiting[0].layout, waiting[0], pool))
                    waiting.pop(0)
            except BaseException:
                for views in waiting:  # those with a store are undone by build()
                    views.unbind()
                    views.close()
                raise

    def _bucket(
        self, parts: _Parts, layout: BucketLayout, views: ParamViews, host_pool: BlockPool | None
    ) -> FlatBucket:
        """The bucket of ``layout`` over ``views``, resident or offloaded as the placement
        says (offloaded: its host fields from ``host_pool``); with parameter offload its
        weights live in the store's home (``offload.adopt``)."""
        shard = layout.shard_range(self.ranks.rank)
        gradients: GradientPath | None = None
        try:
            store: StateStore
            if layout.index in parts.placement.resident:
                gradients = DeviceGradients(layout, device_pool=parts.device_pool)
                store = ResidentState(
                    layout,
                    views,
                    device_pool=parts.device_pool,
                    gradients=gradients,
                    rule=self.rule,
                    fields=parts.resident_state,
                    tile_elements=self.config.tile_elements,
                )
            else:
                if host_pool is None:
                    raise RuntimeError(f"offloaded bucket {layout.index} without a host pool (bug)")
                gradients = host_gradients = HostGradients(
                    layout,
                    manager=self.manager,
                    device_pool=parts.device_pool,
                    host_pool=host_pool,
                    grad_buffers=parts.grad_buffers,
                    shard=shard,
                    dtype=views.dtype,
                    tile_elements=self.config.tile_elements,
                    # Note [no accumulator for one backward] in grads/to_host.py
                    always_accumulate=self.config.overlap_step,
                    ring=parts.ring,  # Note [gradient staging for the buckets in flight]
                )
                if parts.nvme.holds(layout.index):
                    store = parts.nvme.build(
                        layout,
                        views,
                        manager=self.manager,
                        host_pool=host_pool,
                        gradients=host_gradients,
                        shard=shard,
                        rule=self.rule,
                    )
                else:
                    store = HostState(
                        layout,
                        views,
                        manager=self.manager,
                        host_pool=host_pool,
                        gradients=host_gradients,
                        shard=shard,
                        rule=self.rule,
                        fields=parts.state,
                        tile_elements=self.config.tile_elements,
                    )
            if parts.offload is not None:
                parts.offload.adopt(views, store)
        except BaseException:
            if gradients is not None:
                gradients.close()
            raise
        views.remember()
        return FlatBucket(layout, views, gradients, store, shard=shard)


@dataclasses.dataclass
class _Parts:
    """What every bucket of one segment is built from (``SegmentBuilder._build``)."""

    params: list[torch.Tensor]
    placement: Placement
    device_pool: BlockPool  # weights_dev, gradient buffers, resident state
    grad_buffers: GradBuffers
    state: StateFields  # an offloaded bucket's (the rule's, moments in OffloadConfig's dtype)
    resident_state: StateFields  # a resident bucket's (all fp32)
    nvme: NvmeBackends
    offload: Any  # a zero_offload.params.ParamOffloader, or None
    tracker: PeakTracker
    ring: StagingRing | None = None  # Note [gradient staging for the buckets in flight]
