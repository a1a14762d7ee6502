"""The NVMe backends of one segment: which buckets' state (and homes) go to NVMe, the
storage tier they share, and the factory that builds each bucket's store (``NvmeState``,
``NvmeHomeState`` where its weights' home is on NVMe too, ``WholeParameterNvmeState`` for
a rule that reads whole parameters). It sits above both stores, so
neither imports the other's builder (``nvme_weights`` builds on ``nvme``).
"""

from __future__ import annotations

from ...config import OffloadConfig
from ...memory.manager import TieredMemoryManager
from ...memory.pool import BlockPool
from ...memory.state_dir import check_nvme_dir
from ...partition import BucketLayout
from ...views import ParamViews
from ...weights.nvme_home import HomeTiles
from ..grads.path import GradientPath
from ..rule.base import OptimizerRule
from .nvme import NvmeState
from .nvme_plan import NvmePlan
from .nvme_weights import NvmeHomeState
from .stream_group import StreamGroup
from .whole_nvme import WholeParameterNvmeState

__all__ = ["NvmeBackends"]


class NvmeBackends:
    """One segment's NVMe placement: which buckets, the tier, and a factory for their
    backends (what ``OffloadAdamW._build_buckets`` asks). ``tier`` is None without NVMe
    buckets; the manager owns it (closed with it)."""

    def __init__(
        self,
        manager: TieredMemoryManager,
        plan: NvmePlan,
        *,
        config: OffloadConfig,
        rank: int,
        name: str,
    ) -> None:
        self.plan = plan
        self.name = name
        self.group: StreamGroup | None = None
        self.home_tiles: HomeTiles | None = None  # built with the first NVMe home
        if config.nvme_dir is not None:
            # Checked even when every bucket fits host RAM: a wrong path fails now, not on
            # the run whose state first outgrows host_budget (Note [the directory is
            # checked and private] in memory/state_dir.py).
            check_nvme_dir(config.nvme_dir)
        if plan.nvme and config.nvme_dir is not None:
            # StorageFull here, before any pool is pinned, when the files cannot fit.
            tier = manager.open_storage(
                config.nvme_dir,
                rank=rank,
                needed_bytes=plan.disk,
                buffer_bytes=plan.record.record_bytes,
            )
            self.group = StreamGroup(tier)

    def open_home_tiles(self, pool: BlockPool) -> None:
        """The weight tile ring, in ``pool`` (else the first home on NVMe takes it)."""
        self.home_tiles = HomeTiles(pool, self.plan.home_ring, name=self.name)

    def home_on_nvme(self, index: int) -> bool:
        """Whether bucket ``index``'s home (its training-dtype weights) goes to NVMe too."""
        return index in self.plan.homes

    def holds(self, index: int) -> bool:
        """Whether bucket ``index``'s state goes to NVMe."""
        return index in self.plan.nvme

    def build(
        self,
        layout: BucketLayout,
        views: ParamViews,
        *,
        manager: TieredMemoryManager,
        host_pool: BlockPool,
        gradients: GradientPath,
        shard: tuple[int, int],
        rule: OptimizerRule,
    ) -> NvmeState:
        """The bucket's ``NvmeState``; its file is ``{name}.bucket{index}``."""
        if self.group is None:
            raise RuntimeError(f"bucket {layout.index} placed on NVMe without a tier (bug)")
        # Note [NVMe tiles follow whole parameters] in nvme_plan.py.
        kind: type[NvmeState] = NvmeState if rule.elementwise else WholeParameterNvmeState
        extra: dict[str, object] = {}
        if self.home_on_nvme(layout.index):
            if not rule.elementwise:
                raise RuntimeError(
                    f"bucket {layout.index}: the {rule.name} rule reads whole parameters and "
                    "its home would be on NVMe (a bug: refused at construction)"
                )
            if self.home_tiles is None or self.home_tiles.block is None:
                self.home_tiles = HomeTiles(host_pool, self.plan.home_ring, name=self.name)
            kind, extra = NvmeHomeState, {"home_tiles": self.home_tiles}
        return kind(
            layout,
            views,
            manager=manager,
            host_pool=host_pool,
            gradients=gradients,
            shard=shard,
            record=self.plan.record,
            group=self.group,
            name=f"{self.name}.bucket{layout.index}",
            rule=rule,
            **extra,  # type: ignore[arg-type]
        )
