"""One bucket built: the gradient path and the state store its placement gives it, over its
views (``build_bucket``). Both construction routes (``construction.py``) make every bucket
here, once its parameters are re-pointed at their slots (``ParamViews``) and, when offloaded,
its host pool exists; which route ran is invisible from here but for the window that adopts
the weights with parameter offload."""

from __future__ import annotations

from ..config import OffloadConfig
from ..memory.manager import TieredMemoryManager
from ..memory.pool import BlockPool
from ..partition import BucketLayout
from ..views import ParamViews
from .flat_bucket import FlatBucket
from .grads.on_device import DeviceGradients
from .grads.path import GradientPath
from .grads.to_host import HostGradients
from .rule.base import OptimizerRule
from .segment_plan import SegmentPlan
from .state.host import HostState
from .state.resident import ResidentState
from .state.store import StateStore
from .state.whole import WholeParameterHostState
from .state.whole_resident import WholeParameterResidentState

__all__ = ["build_bucket"]


def build_bucket(
    parts: SegmentPlan,
    layout: BucketLayout,
    views: ParamViews,
    host_pool: BlockPool | None,
    *,
    rank: int,
    rule: OptimizerRule,
    config: OffloadConfig,
    manager: TieredMemoryManager,
) -> FlatBucket:
    """The bucket of ``layout`` over ``views``, resident or offloaded as ``parts.placement``
    says (offloaded: its host fields from ``host_pool``); with parameter offload its
    weights live in the store's home (``offload.adopt``). ``rank`` owns the bucket's shard.
    A failure closes the gradient path made so far; the views are the caller's to undo."""
    shard = layout.shard_range(rank)
    gradients: GradientPath | None = None
    try:
        store: StateStore
        if layout.index in parts.placement.resident:
            gradients = DeviceGradients(layout, device_pool=parts.device_pool)
            # Note [whole parameters stepped on the device] in state/whole_resident.py.
            resident = ResidentState if rule.elementwise else WholeParameterResidentState
            store = resident(
                layout,
                views,
                device_pool=parts.device_pool,
                gradients=gradients,
                rule=rule,
                fields=parts.resident_state,
                tile_elements=config.tile_elements,
            )
        else:
            if host_pool is None:
                raise RuntimeError(f"offloaded bucket {layout.index} without a host pool (bug)")
            gradients = host_gradients = HostGradients(
                layout,
                manager=manager,
                device_pool=parts.device_pool,
                host_pool=host_pool,
                grad_buffers=parts.grad_buffers,
                shard=shard,
                dtype=views.dtype,
                tile_elements=config.tile_elements,
                # Note [no accumulator for one backward] in grads/to_host.py
                delayed_update=config.overlap_step,
                ring=parts.ring,  # Note [gradient staging for the buckets in flight]
            )
            if parts.nvme.holds(layout.index):
                store = parts.nvme.build(
                    layout,
                    views,
                    manager=manager,
                    host_pool=host_pool,
                    gradients=host_gradients,
                    shard=shard,
                    rule=rule,
                )
            else:
                # Note [rules that read a whole parameter] in rule/base.py.
                host = HostState if rule.elementwise else WholeParameterHostState
                store = host(
                    layout,
                    views,
                    manager=manager,
                    host_pool=host_pool,
                    gradients=host_gradients,
                    shard=shard,
                    rule=rule,
                    fields=parts.state,
                    tile_elements=config.tile_elements,
                )
        if parts.offload is not None:
            parts.offload.adopt(views, store)
    except BaseException:
        if gradients is not None:
            gradients.close()
        raise
    views.remember()
    return FlatBucket(layout, views, gradients, store, shard=shard)
