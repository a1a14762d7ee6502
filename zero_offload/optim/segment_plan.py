"""The plan both construction routes share (``construction.py``, Note [construction holds
one copy] there): one segment's buckets, the rule's state fields, which buckets are resident
on the device (``plan_placement``), which state goes to NVMe (``plan_nvme``), the device
pool, allocated whole, and the in-flight gradient staging ring. What differs between the
routes (the weights on the device, or in homes that visit a window) is the builder's."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..config import GradStaging, OffloadConfig
from ..memory.host_ram import HostShare
from ..memory.manager import Tier, TieredMemoryManager
from ..memory.pool import BlockPool
from ..memory.storage import IO_ALIGNMENT, IO_BUFFERS
from ..partition import BucketLayout, own_whole
from ..weights.nvme_home import home_ring_bytes
from ..weights.source import PeakTracker
from .grads.buffers import GradBuffers
from .grads.staging import own_staging_bytes
from .grads.staging_ring import StagingRing, ring_slot_bytes
from .rule.base import OptimizerRule, StateFields
from .state.nvme_backends import NvmeBackends
from .state.nvme_plan import RecordLayout, plan_nvme, resolve_host_budget
from .state.placement import POOL_ALIGNMENT, Placement, plan_dtype_buckets, plan_placement

__all__ = ["SegmentPlan", "open_staging_ring", "plan_layouts", "plan_segment"]


@dataclasses.dataclass
class SegmentPlan:
    """What every bucket of one segment is built from (``plan_segment``)."""

    params: list[torch.Tensor]
    layouts: list[BucketLayout]  # the segment's buckets, in index order
    name: str  # the segment's pools' name prefix
    placement: Placement
    device_pool: BlockPool  # weights_dev, gradient buffers, resident state
    grad_buffers: GradBuffers
    state: StateFields  # an offloaded bucket's (the rule's, moments in OffloadConfig's dtype)
    resident_state: StateFields  # a resident bucket's (all fp32)
    nvme: NvmeBackends
    offload: Any  # a zero_offload.params.ParamOffloader, or None
    tracker: PeakTracker
    ring: StagingRing | None = None  # Note [gradient staging for the buckets in flight]

    def itemsizes(self, layouts: list[BucketLayout]) -> list[int]:
        """The training dtype's bytes per element of each of ``layouts``."""
        return [self.params[layout.slots[0].index].dtype.itemsize for layout in layouts]


def plan_layouts(
    families: list[Any],
    *,
    config: OffloadConfig,
    rule: OptimizerRule,
    world_size: int,
    first_index: int,
) -> list[BucketLayout]:
    """The segment's buckets, one training dtype each, numbered from ``first_index``; for a
    rule that reads whole parameters, each parameter in one rank's shard (Note [a whole
    parameter has one owner] in ``partition.py``)."""
    layouts = plan_dtype_buckets(
        families,
        bucket_bytes=config.bucket_bytes,
        world_size=world_size,
        align_numel=POOL_ALIGNMENT // 2,
        first_index=first_index,
    )
    if rule.elementwise:
        return layouts
    return own_whole(layouts, align_numel=POOL_ALIGNMENT // 2)


def plan_segment(
    groups: list[dict[str, Any]],
    params: list[torch.Tensor],
    layouts: list[BucketLayout],
    *,
    config: OffloadConfig,
    rule: OptimizerRule,
    manager: TieredMemoryManager,
    rank: int,
    name: str,
    tracker: PeakTracker,
    offload: Any,
    owner: str = "the optimizer",
    share: HostShare | None = None,
) -> SegmentPlan:
    """Place ``layouts``' state and allocate the device pool. ``groups``: the segment's
    param groups; ``offload``: the ``ParamOffloader`` whose window was planned (its units'
    weights live in their homes, not in ``weights_dev``), or None; ``owner``: the
    optimizer's class, as a refusal names it; ``share``: the ranks on this host's RAM,
    which split ``host_budget="auto"`` (Note [what "auto" leaves each rank] in
    ``state/nvme_plan.py``)."""
    moments_dtype = torch.bfloat16 if config.moments_dtype == "bfloat16" else torch.float32
    state = rule.state_fields(moments_dtype, groups)  # an offloaded bucket's
    resident_state = rule.state_fields(torch.float32, groups)  # a resident one's
    itemsize = [params[layout.slots[0].index].dtype.itemsize for layout in layouts]
    window_bytes = None if offload is None else offload.window_bytes
    stats = manager.accelerator.memory_stats()
    placement = plan_placement(
        layouts,
        itemsize=itemsize,
        state=state,
        resident_state=resident_state,
        offload_fraction=config.offload_fraction,
        device_free=stats["budget"] - stats["in_use"],
        auto_headroom=config.auto_headroom,
        alignment=POOL_ALIGNMENT,
        weights_elsewhere=frozenset(b.index for b in layouts if window_bytes is not None),
        step_temporaries=_step_temporaries(rule, groups, layouts),
        owner=owner,
    )
    nvme_config = _nvme_config(config, layouts, placement, params, state, window_bytes, share)
    nvme = NvmeBackends(  # OffloadConfig.nvme_dir: what does not fit host_budget
        manager,
        plan_nvme(
            layouts,
            placement,
            config=nvme_config,
            itemsize=itemsize,
            state=state,
            rank=rank,
            alignment=POOL_ALIGNMENT,
            homes_movable=window_bytes is not None,  # the staging is each unit's home
            window_bytes=window_bytes or 0,
            share=share,
        ),
        config=config,
        rank=rank,
        name=name,
    )
    device_pool = manager.create_pool(
        Tier.DEVICE, max(placement.device_total, POOL_ALIGNMENT), name=f"{name}.device"
    )
    tracker.sample()
    return SegmentPlan(
        params=params,
        layouts=layouts,
        name=name,
        placement=placement,
        device_pool=device_pool,
        grad_buffers=GradBuffers(
            manager,
            name=name,
            accumulation=config.grad_accumulation,
            step_reserve=placement.device_step_temporaries,
        ),
        state=state,
        resident_state=resident_state,
        nvme=nvme,
        offload=offload,
        tracker=tracker,
    )


def _step_temporaries(
    rule: OptimizerRule, groups: list[dict[str, Any]], layouts: list[BucketLayout]
) -> dict[int, int]:
    """Per bucket, the most device bytes its step would allocate at once if it were
    resident, for a rule that reads whole parameters (Note [whole parameters stepped on the
    device] in ``state/whole_resident.py``): its largest parameter's, with a scaled
    gradient and the hyper-parameters of any of ``groups`` that need the most. None for an
    elementwise rule: its temporaries are bounded by a tile, within ``auto_headroom``."""
    if rule.elementwise:
        return {}
    hypers = [rule.hyper(group) for group in groups]
    return {
        layout.index: max(
            rule.device_parameter_temporary_bytes(slot.shape, hyper, 0.5)
            for slot in layout.slots
            for hyper in hypers
        )
        for layout in layouts
    }


def open_staging_ring(
    plan: SegmentPlan, *, config: OffloadConfig, manager: TieredMemoryManager
) -> int:
    """With ``grad_staging="in_flight"``, ``plan.ring`` for the offloaded buckets (Note
    [gradient staging for the buckets in flight]); returns the host pool bytes it replaces:
    every offloaded bucket's own staging, ``a(k*s)`` each, which the plans count in the
    host pool."""
    offloaded = [b for b in plan.layouts if b.index not in plan.placement.resident]
    if config.grad_staging is not GradStaging.IN_FLIGHT or not offloaded:
        return 0
    sizes = plan.itemsizes(offloaded)
    plan.ring = StagingRing(
        manager,
        buffers=config.grad_staging_buffers,
        slot_bytes=ring_slot_bytes(offloaded, sizes, alignment=POOL_ALIGNMENT),
        name=f"{plan.name}.grad_staging_ring",
        alignment=POOL_ALIGNMENT,
    )
    return own_staging_bytes(offloaded, sizes, alignment=POOL_ALIGNMENT)


def _nvme_config(
    config: OffloadConfig,
    layouts: list[BucketLayout],
    placement: Placement,
    params: list[torch.Tensor],
    state: StateFields,
    window_bytes: int | None,
    share: HostShare | None,
) -> OffloadConfig:
    """The config ``plan_nvme`` places state with. With in-flight staging and
    ``host_budget="auto"`` the budget is resolved here, less what is in RAM whatever the
    placement: the ring and the I/O buffers, not every bucket's gradient staging, which
    ``plan_nvme`` would set aside (Note [gradient staging for the buckets in flight]);
    and every weight staging without parameter offload (``window_bytes`` None), or with
    it (the homes movable: Note [homes on NVMe]) the weight tile ring and the bounce
    ring, as large as the window, since the budget holds the homes first."""
    if config.grad_staging is not GradStaging.IN_FLIGHT or config.host_budget != "auto":
        return config
    offloaded = [b for b in layouts if b.index not in placement.resident]
    sizes = [params[b.slots[0].index].dtype.itemsize for b in offloaded]
    ring = ring_slot_bytes(offloaded, sizes, alignment=POOL_ALIGNMENT)
    record = RecordLayout.for_buckets(offloaded, config.tile_elements, state)
    other = config.grad_staging_buffers * ring
    other += IO_BUFFERS * record.record_bytes + IO_ALIGNMENT
    # A whole-parameter rule's shaped state is in RAM wherever the rest of its state is
    # (Note [NVMe tiles follow whole parameters] in state/nvme_plan.py).
    other += sum(
        state.param_state_bytes((slot.shape for slot in b.slots), POOL_ALIGNMENT) for b in offloaded
    )
    if window_bytes is None:  # the weight staging, as large as the gradient staging
        other += own_staging_bytes(offloaded, sizes, alignment=POOL_ALIGNMENT)
    else:
        other += home_ring_bytes(config.tile_elements, max(sizes, default=1)) + window_bytes
    budget = resolve_host_budget(config, other_host_bytes=other, share=share)
    return dataclasses.replace(config, host_budget=budget)
