"""Parameter offload's buckets, built unit by unit (``build_units``): the moves of Note
[homes are pinned unit by unit] in ``unit_pools.py``, in the order ``plan_units`` gives.
The route that calls it (``SegmentBuilder._build_weights_offloaded`` in ``construction.py``)
has planned the window and the segment first, and undoes what was made on a failure."""

from __future__ import annotations

from collections.abc import Callable

from ..memory.align import aligned
from ..memory.manager import Tier, TieredMemoryManager
from ..memory.pool import BlockPool
from ..partition import BucketLayout
from ..views import ParamViews
from .flat_bucket import FlatBucket
from .segment_plan import SegmentPlan
from .state.placement import POOL_ALIGNMENT
from .unit_pools import plan_units

__all__ = ["BucketMaker", "build_units"]

#: Makes one bucket: ``(parts, layout, views, host_pool) -> FlatBucket`` (the builder's
#: ``_bucket``, over ``build_bucket`` in bucket_build.py).
BucketMaker = Callable[[SegmentPlan, BucketLayout, ParamViews, BlockPool | None], FlatBucket]


def build_units(
    parts: SegmentPlan,
    host_pools: list[BlockPool],
    out: list[FlatBucket],
    *,
    manager: TieredMemoryManager,
    bucket: BucketMaker,
) -> None:
    """Parameter offload: unit by unit, its buckets' views (the originals go to the
    unit's window slot and are released), its host pool, its buckets' stores; see Note
    [homes are pinned unit by unit] in ``unit_pools.py``. Pools are appended to
    ``host_pools`` and buckets to ``out`` as they are made (a failure undoes them)."""
    offload, tracker, plan = parts.offload, parts.tracker, parts.nvme.plan
    layouts, name = parts.layouts, parts.name
    bytes_of = dict(plan.bucket_host)
    if parts.ring is not None:  # the ring replaces each bucket's own gradient staging
        for layout in layouts:
            if layout.index in bytes_of:
                itemsize = parts.params[layout.slots[0].index].dtype.itemsize
                bytes_of[layout.index] -= aligned(itemsize * layout.shard_numel, POOL_ALIGNMENT)
    shared = None  # the segment-wide pool of the units that pin none (see the Note)
    if plan.home_ring:  # segment-wide, before any unit
        shared = manager.create_pool(Tier.HOST, plan.home_ring, name=f"{name}.home_tiles.host")
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
                pool = manager.create_pool(
                    Tier.HOST, build.capacity, name=f"{name}.unit{build.unit}.host"
                )
                host_pools.append(pool)
                tracker.sample()
            while waiting:
                out.append(bucket(parts, waiting[0].layout, waiting[0], pool))
                waiting.pop(0)
        except BaseException:
            for views in waiting:  # those with a store are undone by build()
                views.unbind()
                views.close()
            raise
