"""Rows whose state spans host RAM and NVMe, and the table's rows in order
(``CONFIGURATIONS``).

- ``NvmeState``: ZeRO-Offload with ``OffloadConfig(nvme_dir=...)``, which the library runs:
  weights on the device, every bucket's gradient and weight staging in RAM, the master and
  moments in RAM up to the host budget and on NVMe beyond it.
- ``ParamNvme``: parameter offload with optimizer state on NVMe, homes in RAM (``homes``
  ``HOST``) or on NVMe as well (``NVME``, ZeRO-Infinity's ``offload_param: nvme``). The
  library runs the first on one rank, as ``NvmeState`` places state: every bucket's home
  (the weight staging) and gradient staging in RAM, the master and moments in RAM up to the
  host budget and on NVMe beyond it. It does not run the second yet; that estimate follows
  the design of the big-models issue: host RAM holds bounce buffers for the window's units,
  gradient staging only for the buckets in flight (each bucket's update runs as its gradient
  arrives, so its staging is released at once), the tier's I/O buffers, and whatever state
  fits the host budget.

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

__all__ = ["CONFIGURATIONS", "Homes", "NvmeState", "ParamNvme"]

#: Why the rows with the weights themselves on NVMe are estimates only.
PARAMS_NVME_NOT_YET = "parameter offload with the weights on NVMe is not implemented"


def _tiers(ctx: Context) -> Callable[[int], BucketTiers]:
    def tiers(numel: int) -> BucketTiers:
        return bucket_tiers(
            numel, itemsize=ctx.itemsize, bucket_bytes=ctx.bucket_bytes, world_size=ctx.world_size
        )

    return tiers


def _total(groups: BucketGroups, ctx: Context, attr: str) -> int:
    tiers = _tiers(ctx)
    return sum(repeats * sum(getattr(tiers(n), attr) for n in numels) for numels, repeats in groups)


def _largest(groups: BucketGroups, ctx: Context, attr: str) -> int:
    tiers = _tiers(ctx)
    return max((getattr(tiers(n), attr) for numels, _ in groups for n in numels), default=0)


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


class Homes(enum.Enum):
    """Where the training-dtype weights (each unit's home) live under parameter offload."""

    HOST = "host RAM: pinned, the H2D copies' source"
    NVME = "NVMe: read ahead into host bounce buffers, then copied to the device"


@dataclass(frozen=True)
class ParamNvme(Configuration):
    """Parameter offload with optimizer state on NVMe beyond the host budget, the homes in
    RAM or on NVMe (``homes``). Device per rank: as ``ParamOffloaded``.

    ``homes`` ``HOST`` (what the library runs, one rank): host and disk as ``NvmeState``
    places state, over the units' buckets (``tiers``): each bucket's weight staging is its
    unit's home, so every home and every bucket's gradient staging are in RAM, then the
    state that fits the budget, the I/O buffers when a bucket spills; disk: the spilled
    state's records. ``NVME`` (an estimate of what the library does not run yet): host per
    rank holds ``GRAD_BUFFERS`` buckets' gradient staging (the buckets in flight), the I/O
    buffers, bounce buffers as large as the device window (``prefetch_layers + 2`` units
    read ahead), then the state that fits the budget; disk: every home, 4 KiB-aligned, and
    the spilled state's records."""

    homes: Homes = field(default=Homes.HOST)

    def bytes(self, subject: Subject, limits: Limits) -> RowBytes | None:
        from ..optim.state.placement import GRAD_BUFFERS

        ctx = subject.ctx
        pools, groups = subject.param_offload_pools(), subject.unit_groups()
        if pools is None or groups is None:
            return None
        window, grad_buffers, _ = pools
        device, act_host = subject.activations(self.activations)
        rpn = ctx.ranks_per_node
        if self.homes is Homes.HOST:
            # plan_nvme's budget leaves room for every bucket's staging as if on NVMe.
            fixed = _total(groups, ctx, "staging") + io_buffer_bytes()
            budget = limits.state_budget(fixed, act_host, rpn)
            host, disk = self.tiers(subject, budget)
            return RowBytes(window, grad_buffers, device, rpn * host + act_host, rpn * disk)
        fixed = GRAD_BUFFERS * _largest(groups, ctx, "grad") + io_buffer_bytes() + window
        disk = _total(groups, ctx, "home_file")
        budget = limits.state_budget(fixed, act_host, ctx.ranks_per_node)
        split = split_state(groups, _tiers(ctx), budget)
        disk += split.disk
        host = fixed - (0 if disk else io_buffer_bytes()) + split.host
        return RowBytes(window, grad_buffers, device, rpn * host + act_host, rpn * disk)

    @staticmethod
    def tiers(subject: Subject, budget: int | None) -> tuple[int, int]:
        """``(host, disk)`` bytes per rank with homes in RAM and ``OffloadConfig(
        offload_parameters=True, nvme_dir=..., host_budget=budget)``: ``NvmeState.tiers``
        over the units' buckets (``Subject.unit_groups``). Raises ``ValueError`` where
        parameter offload is not estimated (a bare count, a module without a shape)."""
        groups = subject.unit_groups()
        if groups is None:
            raise ValueError(
                f"ParamNvme.tiers needs a subject with units (a ShapeSubject of a ModelShape), got "
                f"{type(subject).__name__}"
            )
        return _state_tiers(groups, subject.ctx, budget)

    def status(self, ctx: Context) -> tuple[Status, str]:
        reasons = [PARAMS_NVME_NOT_YET] if self.homes is Homes.NVME else []
        if ctx.world_size > 1:
            reasons.append(ZERO3_NOT_YET)
        if not reasons:
            return Status.RUNS, ""
        return Status.NOT_YET, "; ".join(reasons)


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
