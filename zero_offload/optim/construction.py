"""Building an OffloadAdamW's buckets: plan, place, allocate, bind, hook (one segment per
call: the constructor's param groups, or one ``add_param_group``)."""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import torch

from ..config import OffloadConfig
from ..memory.manager import Tier
from ..partition import BucketLayout
from ..views import ParamViews
from .checks import check_params
from .flat_bucket import FlatBucket
from .grads.buffers import GradBuffers
from .grads.on_device import DeviceGradients
from .grads.path import GradientPath
from .grads.to_host import HostGradients
from .lifetime import OWNERS, Segment, check_owners
from .state.host import HostState
from .state.nvme import NvmeBackends
from .state.nvme_plan import plan_nvme
from .state.placement import POOL_ALIGNMENT, Placement, plan_dtype_buckets, plan_placement
from .state.resident import ResidentState
from .state.store import BucketPools, StateStore
from .update.loss_scaler import DynamicLossScaler, NoLossScaler

if TYPE_CHECKING:
    from .offload_adamw import OffloadAdamW

__all__ = ["build_group", "check_param_offload"]


def check_param_offload(config: OffloadConfig, comm: Any, model: Any, layers: Any) -> None:
    """Refuse model=/layers= without parameter offload, and parameter offload without a
    model or with several ranks."""
    if config.offload_parameters:
        if model is None:
            raise ValueError(
                "OffloadConfig(offload_parameters=True) needs the model whose blocks it "
                "fetches: pass model=<the nn.Module> (and layers=<its blocks>, by default "
                "the nn.ModuleList holding the most parameters)"
            )
        if comm is not None:
            raise ValueError(
                f"{comm.where()}: OffloadConfig.offload_parameters=True runs on one rank "
                "only for now (ZeRO-3 sharding of the weights is not implemented); set "
                "offload_parameters=False or run one process"
            )
    elif model is not None or layers is not None:
        raise ValueError(
            "model= and layers= are for parameter offload; set "
            "OffloadConfig(offload_parameters=True), or leave them None"
        )


def _param_offloader(opt: OffloadAdamW, params: list[torch.Tensor], families: list[Any]) -> Any:
    """The ``ParamOffloader`` for this segment, or None without parameter offload."""
    if opt._param_offload_of is None:
        return None
    if opt._resources.param_offload is not None:
        raise ValueError(
            "add_param_group with OffloadConfig(offload_parameters=True): the window is "
            "planned once for the model; pass every param group to the constructor"
        )
    from ..params import ParamOffloader  # params sits beside optim (DESIGN.md)

    model, layers = opt._param_offload_of
    return ParamOffloader(
        model,
        layers=layers,
        manager=opt.manager,
        prefetch_layers=opt.config.prefetch_layers,
        trainable=[params[i] for family in families for i, _ in family.members],
        name=f"offload_adamw{opt.serial}",
    )


def build_group(opt: OffloadAdamW, group_indices: list[int]) -> None:
    """Bucket, place and allocate the trainable parameters of ``group_indices``: buckets
    of one training dtype each (``plan_dtype_buckets``), one device and one host pool
    sized for them all (``plan_placement``, per-bucket itemsize)."""
    params = opt._all_params()
    first_index = sum(len(opt.param_groups[g]["params"]) for g in range(group_indices[0]))
    families = check_params(
        opt.param_groups,
        group_indices,
        first_index=first_index,
        device=opt.accelerator.device,
    )
    if not families:
        return
    check_owners(opt, params, [i for family in families for i, _ in family.members])
    offload = _param_offloader(opt, params, families)
    if offload is not None:  # no bucket spans two units (zero_offload.params)
        families = offload.split_families(families, params)
    layouts = plan_dtype_buckets(
        families,
        bucket_bytes=opt.config.bucket_bytes,
        world_size=opt._ranks.world_size,
        align_numel=POOL_ALIGNMENT // 2,
        first_index=len(opt.buckets),
    )
    amsgrad = any(opt.param_groups[family.group]["amsgrad"] for family in families)
    moments_dtype = torch.bfloat16 if opt.config.moments_dtype == "bfloat16" else torch.float32
    if offload is not None:
        offload.plan(layouts, params, alignment=POOL_ALIGNMENT)  # the window (device)
    stats = opt.accelerator.memory_stats()
    try:
        placement = plan_placement(
            layouts,
            itemsize=[params[layout.slots[0].index].dtype.itemsize for layout in layouts],
            moment_size=moments_dtype.itemsize,
            amsgrad=amsgrad,
            offload_fraction=opt.config.offload_fraction,
            device_free=stats["budget"] - stats["in_use"],
            auto_headroom=opt.config.auto_headroom,
            alignment=POOL_ALIGNMENT,
            weights_elsewhere=frozenset(b.index for b in layouts if offload is not None),
        )
    except BaseException:
        if offload is not None:
            offload.close()
        raise
    name = f"offload_adamw{opt.serial}.{len(opt._resources.segments)}"
    nvme = NvmeBackends(  # OffloadConfig.nvme_dir: what does not fit host_budget
        opt.manager,
        plan_nvme(
            layouts,
            placement,
            config=opt.config,
            itemsize=[params[layout.slots[0].index].dtype.itemsize for layout in layouts],
            moments_dtype=moments_dtype,
            amsgrad=amsgrad,
            rank=opt._ranks.rank,
            alignment=POOL_ALIGNMENT,
        ),
        config=opt.config,
        rank=opt._ranks.rank,
        name=name,
    )
    try:
        device_pool = opt.manager.create_pool(
            Tier.DEVICE, max(placement.device_total, POOL_ALIGNMENT), name=f"{name}.device"
        )
    except BaseException:
        if offload is not None:
            offload.close()
        raise
    try:
        host_pool = opt.manager.create_pool(
            Tier.HOST, max(nvme.plan.host_pool, POOL_ALIGNMENT), name=f"{name}.host"
        )
    except BaseException:
        opt.manager.discard_pool(device_pool)
        if offload is not None:
            offload.close()
        raise
    pools = BucketPools(device=device_pool, host=host_pool)
    grad_buffers = GradBuffers(opt.manager, name=name)
    buckets: list[FlatBucket] = []
    try:
        _build_buckets(
            opt,
            layouts,
            placement,
            pools,
            grad_buffers,
            amsgrad,
            moments_dtype,
            buckets,
            nvme,
            offload,
        )
    except BaseException:
        # The parameters take private copies of their weights back before the pools go.
        for bucket in buckets:
            bucket.views.unbind()
        if offload is not None:
            offload.close()
        opt.manager.discard_pool(device_pool)
        opt.manager.discard_pool(host_pool)
        raise
    if offload is not None:
        offload.install(opt)
        opt._resources.param_offload = offload
    segment = Segment(buckets, pools, grad_buffers)
    opt._resources.segments.append(segment)
    opt._router.add(buckets)
    opt._state_view.add(buckets)
    for bucket in buckets:
        for param in bucket.params:
            OWNERS[param] = weakref.ref(opt)
    if isinstance(opt.scaler, NoLossScaler) and any(
        bucket.dtype == torch.float16 for bucket in buckets
    ):
        # The first fp16 parameters bring the dynamic scaler: Note [one loss scale].
        opt.scaler = DynamicLossScaler(opt.config.loss_scaler)


# Note [construction holds one copy]
# Each bucket copies its parameters into the device pool and re-points them there
# (ParamViews), which releases the original storage bucket by bucket: the peak is one
# bucket above the final footprint, never two copies of the model. A failure half-way
# gives the parameters built so far private copies again (ParamViews.unbind) before the
# pools are discarded, so the model keeps its values.


def _build_buckets(
    opt: OffloadAdamW,
    layouts: list[BucketLayout],
    placement: Placement,
    pools: BucketPools,
    grad_buffers: GradBuffers,
    amsgrad: bool,
    moments_dtype: torch.dtype,
    out: list[FlatBucket],
    nvme: NvmeBackends,
    offload: Any = None,
) -> None:
    """One bucket per layout, resident or offloaded as ``placement`` says, appended to
    ``out`` as each is built (so a failure can undo the ones before it). With parameter
    offload (``offload``) the weights live in its window and the store's home."""
    params = opt._all_params()
    for layout in layouts:
        members = [params[slot.index] for slot in layout.slots]
        views = (
            ParamViews(layout, members, pools.device)
            if offload is None
            else offload.views_for(layout, members)
        )
        shard = layout.shard_range(opt._ranks.rank)
        gradients: GradientPath | None = None
        try:
            store: StateStore
            if layout.index in placement.resident:
                gradients = DeviceGradients(layout, device_pool=pools.device)
                store = ResidentState(
                    layout,
                    views,
                    device_pool=pools.device,
                    gradients=gradients,
                    amsgrad=amsgrad,
                    tile_elements=opt.config.tile_elements,
                )
            else:
                gradients = host_gradients = HostGradients(
                    layout,
                    manager=opt.manager,
                    device_pool=pools.device,
                    host_pool=pools.host,
                    grad_buffers=grad_buffers,
                    shard=shard,
                    dtype=views.dtype,
                    tile_elements=opt.config.tile_elements,
                    # Note [no accumulator for one backward] in grads/to_host.py
                    always_accumulate=opt.config.overlap_step,
                )
                if nvme.holds(layout.index):
                    store = nvme.build(
                        layout,
                        views,
                        manager=opt.manager,
                        host_pool=pools.host,
                        gradients=host_gradients,
                        shard=shard,
                    )
                else:
                    store = HostState(
                        layout,
                        views,
                        manager=opt.manager,
                        host_pool=pools.host,
                        gradients=host_gradients,
                        shard=shard,
                        moments_dtype=moments_dtype,
                        amsgrad=amsgrad,
                        tile_elements=opt.config.tile_elements,
                    )
            if offload is not None:
                offload.adopt(views, store)
        except BaseException:
            if gradients is not None:
                gradients.close()
            views.unbind()
            views.close()
            raise
        views.remember()
        out.append(FlatBucket(layout, views, gradients, store, shard=shard))
