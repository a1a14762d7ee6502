"""ZeRO-3 with the shards on the device (FSDP's configuration; ``OffloadConfig(
partition_parameters=True)`` on several ranks): each rank keeps its shard of each bucket of
each unit resident in device memory, in the training dtype, and a fetch all-gathers the
unit's slot from those shards.

Note [shards on the device]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
Everything of Note [a sharded unit] (``sharded_fetch.py``) holds: the units, their slots,
the window of ``prefetch_layers``, the canonical gather order on every rank, the gathers on
a group and a stream of their own, the release after use and the gather again for backward,
the gradients' reduce-scatter to each rank's shard. What differs is where a fetch reads
this rank's shard: not the pinned host home (an H2D copy into the rank's slice of the slot,
then the all-gather), but the bucket's *device home* (``DeviceShardViews.home_dev``,
``(shard_numel,)`` training dtype, one block of the offloader's ``homes`` device pool),
which the all-gather reads directly: a fetch crosses no tier, only the wire.

The host side is ZeRO-Offload's: the shard's fp32 master and moments live where placement
puts them (host RAM), CPU Adam updates them, and writes the training-dtype shard into the
pinned staging (the fp32 master itself for an fp32 bucket), the *host home*, which stays
the optimizer's truth (its fingerprints, Note [weights written outside the optimizer]).
Each updated tile is copied H2D into ``home_dev`` as soon as it is written
(``DeviceShardViews.copy_in``, through the memory manager, after the compute issued so far:
no gather reads ``home_dev`` then, ``ParamOffloader.before_step`` waited for every fetch);
the copies' events go to compute like any published weights. A fetch's gather waits on the
``h2d`` stream's work issued so far (``DeviceShardUnit._fill_slot``): the step's copies into
``home_dev`` and any refresh are there, in stream order, together with the compute that read
the slot's previous occupant. A write to a resident unit by user code goes home as under
parameter offload (Note [a write to a resident unit reaches its home] in ``slot_writes.py``), D2H
into the host home, and then H2D into ``home_dev`` (``_home_written``), so both homes agree
before the next fetch.

Bytes per rank on the device: the shards, ``sum a(shard_numel * itemsize)`` over the buckets
(``DeviceHomes``: Ψ_bytes / world_size plus padding and alignment), the window's slots and
the gradient buffers. On the host: the master, the moments, the gradient staging and, for
bf16/fp16, the training-dtype staging, each a shard (as ZeRO-Offload's stage 2). On the
wire per step: 3Ψ, as with the host homes.

One rank: ``partition_parameters`` changes nothing there (a rank's shard is the whole
model, on the device, which is what the optimizer does without it): the optimizer is built
as without it, and ``model=``/``layers=`` are not used.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ..accelerator import Event
from ..config import format_bytes
from ..errors import DeviceBudgetExceeded
from ..memory.align import aligned
from ..memory.block import Block
from ..memory.manager import Tier, TieredMemoryManager
from ..memory.pool import BlockPool
from ..memory.traffic import Category, Direction
from ..partition import BucketLayout
from .sharded_fetch import ShardedParamOffloader
from .sharded_homes import ShardedParamUnit, ShardedWindowedViews
from .unit import ParamUnit
from .windowed_views import WindowedViews

__all__ = ["DeviceHomes", "DeviceShardOffloader", "DeviceShardUnit", "DeviceShardViews"]


class DeviceHomes:
    """The device pool of the home shards (Note [shards on the device]).

    Holds exactly one block per bucket, ``a(shard_numel * itemsize)`` bytes, allocated when
    the window is planned and freed at close; counted in the device budget all along."""

    def __init__(
        self, manager: TieredMemoryManager, nbytes: list[int], *, name: str, alignment: int
    ) -> None:
        self.manager = manager
        self.capacity = sum(aligned(n, alignment) for n in nbytes)
        try:
            self.pool: BlockPool = manager.create_pool(
                Tier.DEVICE, max(self.capacity, alignment), name=name, alignment=alignment
            )
        except DeviceBudgetExceeded as error:
            stats = manager.accelerator.memory_stats()
            raise DeviceBudgetExceeded(
                f"the parameter shards kept on the device (OffloadConfig("
                f"partition_parameters=True)) need {format_bytes(self.capacity)} "
                f"({self.capacity} bytes, this rank's shard of {len(nbytes)} buckets), but the "
                f"budget is {format_bytes(stats['budget'])} with "
                f"{format_bytes(stats['in_use'])} in use. Raise the device budget, run more "
                "ranks, or keep the shards in host RAM: OffloadConfig(offload_parameters=True)"
            ) from error
        self.blocks: list[Block] = []

    def alloc(self, numel: int, dtype: torch.dtype, *, owner: str) -> tuple[torch.Tensor, Block]:
        """A ``(numel,)`` home of ``dtype`` and its block."""
        block = self.pool.alloc(numel * dtype.itemsize, owner=owner)
        self.blocks.append(block)
        return block.view(dtype, (numel,)), block

    def close(self) -> None:
        """Free the blocks and give the pool back to the budget (after pending copies)."""
        for block in self.blocks:
            block.free()
        self.blocks = []
        self.pool.close()
        if self.pool in self.manager.pools:
            self.manager.pools.remove(self.pool)


class DeviceShardViews(ShardedWindowedViews):
    """A bucket's views whose shard also lives on the device (Note [shards on the device]).

    Fields (beyond ``ShardedWindowedViews``'):
        home_dev: ``(shard_numel,)`` training dtype, device (``DeviceHomes``): what the
            fetch's all-gather reads; ``home_dev_block`` its block.
    """

    def __init__(
        self,
        layout: BucketLayout,
        params: Sequence[nn.Parameter],
        unit: ParamUnit,
        region: torch.Tensor,
        *,
        shard: tuple[int, int],
        home_dev: tuple[torch.Tensor, Block],
    ) -> None:
        super().__init__(layout, params, unit, region, shard=shard)
        self.home_dev, self.home_dev_block = home_dev

    def gather_source(self) -> torch.Tensor:
        return self.home_dev

    def refresh_device_home(self, manager: TieredMemoryManager, *, label: str) -> Event:
        """Queue the host home's copy into ``home_dev`` (H2D, after the compute issued so
        far, which may still read the slot a fetch gathered from it)."""
        home, home_block = self.home_pair()
        return manager.copy(
            self.home_dev,
            home,
            direction=Direction.H2D,
            category=Category.WEIGHTS,
            after=[manager.compute_ready()],
            blocks=[self.home_dev_block, home_block],
            label=label,
        )

    def copy_in(
        self,
        manager: TieredMemoryManager,
        lo: int,
        hi: int,
        source: torch.Tensor,
        source_block: Block,
        *,
        after: list[Event],
        label: str,
    ) -> Event | None:
        """The step wrote ``[lo, hi)`` of the host home (bucket coordinates): its H2D copy
        into ``home_dev``; the unit's slot is stale."""
        super().copy_in(manager, lo, hi, source, source_block, after=after, label=label)
        start = self.home_span[0]
        return manager.copy(
            self.home_dev[lo - start : hi - start],
            source,
            direction=Direction.H2D,
            category=Category.WEIGHTS,
            after=after,
            blocks=[self.home_dev_block, source_block],
            label=label,
        )


class DeviceShardUnit(ShardedParamUnit):
    """A unit whose shards are gathered from the device homes (Note [shards on the device])."""

    def _fill_slot(self, manager: TieredMemoryManager) -> Event:
        """Nothing is copied: the gather reads ``home_dev``. Its start event: the ``h2d``
        stream's work so far (every copy into the device homes), after the compute issued
        so far (the readers of the slot's previous occupant)."""
        manager.h2d.wait_event(manager.compute_ready())
        return manager.h2d.record_event()

    def _home_written(self, views: WindowedViews) -> None:
        if not isinstance(views, DeviceShardViews):
            raise RuntimeError(f"{self!r}: bucket {views.layout.index} has no device home (bug)")
        label = f"param {self.spec.name} bucket{views.layout.index} device home"
        views.refresh_device_home(self.manager, label=label)


class DeviceShardOffloader(ShardedParamOffloader):
    """``ShardedParamOffloader`` whose homes' shards are kept on the device; see Note
    [shards on the device].

    Fields (beyond ``ShardedParamOffloader``'s): ``homes``: the ``DeviceHomes`` pool (None
    before ``plan`` and after ``close``)."""

    unit_class = DeviceShardUnit

    def __init__(self, model: nn.Module, **kwargs: Any) -> None:
        super().__init__(model, **kwargs)
        self.homes: DeviceHomes | None = None

    def plan(
        self, layouts: Sequence[BucketLayout], params: Sequence[Any], *, alignment: int
    ) -> None:
        """The window, then the device homes (one shard per bucket)."""
        super().plan(layouts, params, alignment=alignment)
        nbytes = [
            layout.shard_numel * params[layout.slots[0].index].element_size() for layout in layouts
        ]
        try:
            self.homes = DeviceHomes(
                self.manager, nbytes, name=f"{self.name}.homes", alignment=alignment
            )
        except BaseException:
            super().close()
            raise

    def _new_views(
        self,
        layout: BucketLayout,
        params: Sequence[nn.Parameter],
        unit: ParamUnit,
        region: torch.Tensor,
    ) -> WindowedViews:
        if self.homes is None:
            raise RuntimeError("device homes used before plan() (bug)")
        shard = layout.shard_range(self.comm.rank)
        home_dev = self.homes.alloc(
            layout.shard_numel, params[0].dtype, owner=f"bucket{layout.index}.home_dev"
        )
        return DeviceShardViews(layout, params, unit, region, shard=shard, home_dev=home_dev)

    def adopt(self, views: WindowedViews, backend: Any) -> None:
        """The host home holds the shard's initial weights: copy them to the device home
        (waited: construction)."""
        super().adopt(views, backend)
        if not isinstance(views, DeviceShardViews):
            raise RuntimeError(f"bucket {views.layout.index}: no device home (bug)")
        label = f"bucket{views.layout.index} device home"
        # Synchronisation point (construction): the host home is rewritten by the next step.
        views.refresh_device_home(self.manager, label=label).synchronize()

    @property
    def home_bytes(self) -> int:
        """Device bytes of the home shards' pool."""
        return 0 if self.homes is None else self.homes.capacity

    def close(self) -> None:
        """Close as ``ShardedParamOffloader`` (the last gathers read the device homes), then
        free the device homes."""
        try:
            super().close()
        finally:
            if self.homes is not None:
                self.homes.close()
                self.homes = None
