"""Rows whose state spans host RAM and NVMe, and the table's rows in order
(``CONFIGURATIONS``).

- ``NvmeState``: ZeRO-Offload with ``OffloadConfig(nvme_dir=...)``, which the library runs:
  weights on the device, every bucket's gradient and weight staging in RAM, the master and
  moments in RAM up to the host budget and on NVMe beyond it.
- ``ParamNvme``: parameter offload with optimizer state on NVMe, homes in RAM (``homes``
  ``HOST``) or on NVMe as well when they do not fit (``NVME``, ZeRO-Infinity's
  ``offload_param: nvme``). The library places them as ``plan_nvme`` does (Note [homes
  on NVMe] in ``optim/state/nvme_plan.py``), on one rank: every bucket's gradient staging
  in RAM; the host budget holds the homes first (``NVME``: those beyond it in weight
  files, with the step's weight tile ring and the window's bounce ring in RAM), then the
  master and moments, the rest of the state on NVMe. ``HOST`` is that placement where the
  budget holds every home (``tiers``: the budget given is the state's, beside them). Gradient staging is for the whole model in both (staging only for the
  buckets in flight is a separate item of the big-models issue).

See Note [the host budget decides the split] in ``nvme.py``.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field

from .in_flight import ParamInFlight
from .nvme import BucketTiers, bucket_tiers, io_buffer_bytes, split_state
from .pools import BucketGroups
from .rows import (
    ZERO3_NOT_YET,
    ActivationMode,
    Configuration,
    Context,
    Limits,
    Offloaded,
    ParamOffloaded,
    Replicated,
    RowBytes,
    Status,
    Subject,
)

__all__ = ["CONFIGURATIONS", "Homes", "NvmeState", "ParamNvme", "home_tiers"]


def _tiers(ctx: Context) -> Callable[[int], BucketTiers]:
    def tiers(numel: int) -> BucketTiers:
        return bucket_tiers(
            numel, itemsize=ctx.itemsize, bucket_bytes=ctx.bucket_bytes, world_size=ctx.world_size
        )

    return tiers


def _total(groups: BucketGroups, ctx: Context, attr: str) -> int:
    tiers = _tiers(ctx)
    return sum(repeats * sum(getattr(tiers(n), attr) for n in numels) for numels, repeats in groups)


@dataclass(frozen=True)
class NvmeState(Configuration):
    """ZeRO-Offload with the optimizer state on NVMe beyond the host budget (runs today).

    Host per rank: every bucket's gradient and weight staging, the state that fits the
    budget, the I/O buffers when a bucket is on NVMe; disk per rank: the other buckets'
    state records. Device: as ``Offloaded``."""

    def bytes(self, subject: Subject, limits: Limits) -> RowBytes | None:
        ctx = subject.ctx
        weights, grad_buffers, _ = subject.offload_pools()
        device, act_host = subject.activations(self.activations)
        # plan_nvme's budget leaves room for every bucket's staging as if on NVMe.
        fixed = _total(subject.bucket_groups(), ctx, "staging") + io_buffer_bytes()
        budget = limits.state_budget(fixed, act_host, ctx.ranks_per_node)
        host, disk = self.tiers(subject, budget)
        rpn = ctx.ranks_per_node
        return RowBytes(weights, grad_buffers, device, rpn * host + act_host, rpn * disk)

    @staticmethod
    def tiers(subject: Subject, budget: int | None) -> tuple[int, int]:
        """``(host, disk)`` bytes per rank with ``OffloadConfig(host_budget=budget)``: the
        host pool (staging, the state that fits), the I/O buffers when a bucket is on NVMe;
        the state files."""
        return _state_tiers(subject.bucket_groups(), subject.ctx, budget)


def _state_tiers(groups: BucketGroups, ctx: Context, budget: int | None) -> tuple[int, int]:
    """``(host, disk)`` per rank of buckets ``groups`` placed as ``plan_nvme`` places them:
    every bucket's staging in RAM, the state up to ``budget`` too, the rest on NVMe with the
    I/O buffers in RAM."""
    split = split_state(
        groups, _tiers(ctx), budget, spilled_bytes=lambda t: t.staging - t.ram_staging
    )
    host = _total(groups, ctx, "ram_staging") + split.spilled + split.host
    return host + (io_buffer_bytes() if split.disk else 0), split.disk


def home_tiers(
    groups: BucketGroups, ctx: Context, budget: int | None, *, prefetch_layers: int = 1
) -> tuple[int, int]:
    """``(host, disk)`` per rank of the units' buckets ``groups`` (bucket order) placed as
    ``plan_nvme`` places them with the homes movable (Note [homes on NVMe]): ``budget``
    holds the homes first, in bucket order, the rest going to their weight files; the
    state takes what is left (``_state_tiers``). With a home on disk the weight tile ring
    and the bounce ring (per window slot, the largest unit's NVMe records + 4 KiB) join the
    host. O(units)."""
    from ..config import OffloadConfig
    from ..memory.storage import IO_ALIGNMENT
    from ..params.window import plan_slots
    from ..weights.nvme_home import home_ring_bytes

    if budget is None:
        return _state_tiers(groups, ctx, None)
    tiers = _tiers(ctx)
    kept, moved, home_disk = 0, 0, 0
    records: list[int] = []  # per unit in bucket order: its weight files' bytes
    for numels, repeats in groups:
        each = [tiers(n) for n in numels]
        for _ in range(repeats):
            unit = 0
            for t in each:
                if not moved and kept + t.home <= budget:
                    kept += t.home
                    continue
                moved += t.home
                unit += t.home_file
            home_disk += unit
            records.append(unit)
    host, disk = _state_tiers(groups, ctx, budget - kept)
    if not moved:
        return host, disk
    _, slots = plan_slots(records[::-1], [False] * len(records), prefetch_layers=prefetch_layers)
    host += home_ring_bytes(OffloadConfig().tile_elements, ctx.itemsize) - moved
    host += sum(n + IO_ALIGNMENT for n in slots if n)
    return host, disk + home_disk


class Homes(enum.Enum):
    """Where the training-dtype weights (each unit's home) live under parameter offload."""

    HOST = "host RAM: pinned, the H2D copies' source"
    NVME = "NVMe beyond the host budget: read into host bounce buffers, then to the device"


@dataclass(frozen=True)
class ParamNvme(Configuration):
    """Parameter offload with optimizer state on NVMe beyond the host budget, the homes in
    RAM or on NVMe (``homes``). Device per rank: as ``ParamOffloaded``.

    ``homes`` ``HOST``: host and disk as ``NvmeState`` places state, over the units'
    buckets (``tiers``): each bucket's weight staging is its unit's home, so every home
    and every bucket's gradient staging are in RAM, then the state that fits the budget,
    the I/O buffers when a bucket spills; disk: the spilled state's records. ``NVME``:
    the budget holds the homes first, those beyond it in weight files with the weight
    tile ring and the bounce ring in RAM, then the state (``home_tiers``)."""

    homes: Homes = field(default=Homes.HOST)

    def bytes(self, subject: Subject, limits: Limits) -> RowBytes | None:
        ctx = subject.ctx
        pools, groups = subject.param_offload_pools(), subject.unit_groups()
        if pools is None or groups is None:
            return None
        window, grad_buffers, _ = pools
        device, act_host = subject.activations(self.activations)
        rpn = ctx.ranks_per_node
        # plan_nvme's budget leaves room for every bucket's staging as if on NVMe; with the
        # homes movable, for the gradient staging and the rings (Note [homes on NVMe]).
        fixed = _total(groups, ctx, "staging") + io_buffer_bytes()
        budget = limits.state_budget(fixed, act_host, rpn)
        if self.homes is Homes.NVME:
            from ..config import OffloadConfig
            from ..weights.nvme_home import home_ring_bytes

            ring = home_ring_bytes(OffloadConfig().tile_elements, ctx.itemsize)
            grads = _total(groups, ctx, "grad") + io_buffer_bytes() + ring + window
            host, disk = home_tiers(groups, ctx, limits.state_budget(grads, act_host, rpn))
        else:
            host, disk = self.tiers(subject, budget)
        return RowBytes(window, grad_buffers, device, rpn * host + act_host, rpn * disk)

    @staticmethod
    def tiers(
        subject: Subject, budget: int | None, *, homes: Homes = Homes.HOST
    ) -> tuple[int, int]:
        """``(host, disk)`` bytes per rank with ``OffloadConfig(offload_parameters=True,
        nvme_dir=..., host_budget=budget)``: ``NvmeState.tiers`` over the units' buckets
        (``Subject.unit_groups``), homes in RAM and ``budget`` the state's beside them;
        with ``homes=Homes.NVME`` ``budget`` holds the homes first and the state in what
        is left, as the library places them (``home_tiers``). Raises ``ValueError`` where parameter
        offload is not estimated (a bare count, a module without a shape)."""
        groups = subject.unit_groups()
        if groups is None:
            raise ValueError(
                f"ParamNvme.tiers needs a subject with units (a ShapeSubject of a ModelShape), got "
                f"{type(subject).__name__}"
            )
        if homes is Homes.NVME:
            return home_tiers(groups, subject.ctx, budget)
        return _state_tiers(groups, subject.ctx, budget)

    def status(self, ctx: Context) -> tuple[Status, str]:
        if ctx.world_size > 1:
            return Status.NOT_YET, ZERO3_NOT_YET
        return Status.RUNS, ""


_CKPT, _ACT = ActivationMode.CHECKPOINTED, ActivationMode.OFFLOADED

#: The table's rows, in order: the paper's accounting, then this library's configurations
#: from the least offloaded (fastest) to the most. A new kind of row is one more
#: ``Configuration``.
CONFIGURATIONS: tuple[Configuration, ...] = (
    Replicated("no offload (DDP)", stage=0),
    Replicated("ZeRO-1", stage=1),
    Replicated("ZeRO-2", stage=2),
    Replicated("ZeRO-3", stage=3),
    Offloaded("ZeRO-Offload"),
    Offloaded("ZeRO-Offload + checkpointing", _CKPT),
    Offloaded("ZeRO-Offload + activation offload", _ACT),
    NvmeState("ZeRO-Offload + NVMe state + checkpointing", _CKPT),
    NvmeState("ZeRO-Offload + NVMe state + activation offload", _ACT),
    ParamOffloaded("ZeRO-Offload + parameter offload"),
    ParamOffloaded("ZeRO-Offload + param offload + checkpointing", _CKPT),
    ParamOffloaded("ZeRO-Offload + param offload + activation offload", _ACT),
    ParamInFlight("param offload + in-flight staging + checkpointing", _CKPT),
    ParamInFlight("param offload + in-flight staging + activation offload", _ACT),
    ParamNvme("param offload + NVMe state + checkpointing", _CKPT),
    ParamNvme("param offload + NVMe state + activation offload", _ACT),
    ParamInFlight("param offload + NVMe state + in-flight staging + ckpt", _CKPT, nvme=True),
    ParamInFlight("param offload + NVMe state + in-flight staging + act. offload", _ACT, nvme=True),
    ParamNvme("params and state on NVMe + checkpointing", _CKPT, Homes.NVME),
    ParamNvme("params and state on NVMe + activation offload", _ACT, Homes.NVME),
)
