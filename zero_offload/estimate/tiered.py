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
  budget holds every home (``tiers``: the budget given is the state's, beside them).
  Gradient staging is for the whole model in both; ``ParamInFlight`` (``in_flight.py``)
  is each of them with staging only for the buckets in flight.

With several ranks ``ParamNvme`` is ZeRO-3 with offload and NVMe (ZeRO-Infinity, Note
[sharded homes on NVMe] in ``params/sharded_fetch.py``), which runs: each rank places its
shard of every bucket by its own budget, under ``nvme_dir/rank{r}``. Its bytes are per rank
(``tiers``) and per node (the row: ``ranks_per_node`` of them); a rank's are rank 0's, whose
shards hold the most real elements (the last ranks' hold the padding), so another rank's
disk is at most that.

Each holds one micro-batch a step (``window`` ``Window.ONE``); with ``Window.DEVICE`` or
``Window.HOST``, the row for several, summed on the device or on the host: the fp32
accumulators (and the spare staging) in RAM beside the host budget, which shrinks by as much
(Note [the accumulators sit beside the host budget] in ``accumulation.py``).

See Note [the host budget decides the split] in ``nvme.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .accumulation import Accumulating, Window
from .delayed import Shadowed
from .in_flight import ParamInFlight, param_nvme_refusal
from .nvme import Homes, home_tiers, io_bytes, state_tiers, total_bytes
from .rows import (
    ActivationMode,
    Configuration,
    Context,
    DeviceShards,
    Limits,
    Offloaded,
    ParamOffloaded,
    Replicated,
    RowBytes,
    Subject,
    nvme_refusal,
)

__all__ = ["CONFIGURATIONS", "Homes", "NvmeState", "ParamNvme", "home_tiers"]


@dataclass(frozen=True)
class NvmeState(Configuration):
    """ZeRO-Offload with the optimizer state on NVMe beyond the host budget (runs today).

    Host per rank: every bucket's gradient and weight staging, the state that fits the
    budget, the I/O buffers when a bucket is on NVMe; disk per rank: the other buckets'
    state records. Device: as ``Offloaded``."""

    #: Micro-batches a step: with several, their accumulators join (``accumulation.py``).
    window: Window = field(default=Window.ONE)

    def refusal(self, ctx: Context) -> str | None:
        return nvme_refusal(ctx)

    def conditions(self) -> str:
        return self.window.nvme_conditions()

    def bytes(self, subject: Subject, limits: Limits) -> RowBytes | None:
        ctx = subject.ctx
        weights, grad_buffers, _ = subject.offload_pools()
        device, act_host = subject.activations(self.activations)
        acc_device, acc_host = self.window.pools(subject.bucket_groups(), ctx)
        host, disk = self.tiers(subject, self.state_budget(subject, limits))
        rpn = ctx.ranks_per_node
        host_bytes = rpn * (host + acc_host) + act_host
        return RowBytes(weights, grad_buffers + acc_device, device, host_bytes, rpn * disk)

    def state_budget(self, subject: Subject, limits: Limits) -> int | None:
        """The row's ``host_budget`` per rank (``None``: the host unknown, unbounded)."""
        ctx, groups = subject.ctx, subject.bucket_groups()
        _, act_host = subject.activations(self.activations)
        # plan_nvme's budget leaves room for every bucket's staging as if on NVMe, and for
        # the window's accumulators (Note [the accumulators sit beside the host budget]).
        fixed = total_bytes(groups, ctx, "staging") + io_bytes(groups, ctx)
        fixed += self.window.pools(groups, ctx)[1]
        return limits.state_budget(fixed, act_host, ctx.ranks_per_node)

    @staticmethod
    def tiers(subject: Subject, budget: int | None) -> tuple[int, int]:
        """``(host, disk)`` bytes per rank with ``OffloadConfig(host_budget=budget)``: the
        host pool (staging, the state that fits), the I/O buffers when a bucket is on NVMe;
        the state files."""
        return state_tiers(subject.bucket_groups(), subject.ctx, budget)


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
    #: Micro-batches a step: with several, their accumulators join (``accumulation.py``).
    window: Window = field(default=Window.ONE)

    def refusal(self, ctx: Context) -> str | None:
        return param_nvme_refusal(ctx, self.homes)

    def conditions(self) -> str:
        return self.window.nvme_conditions()

    def bytes(self, subject: Subject, limits: Limits) -> RowBytes | None:
        ctx = subject.ctx
        pools, groups = subject.param_offload_pools(), subject.unit_groups()
        if pools is None or groups is None:
            return None
        slots, grad_buffers, _ = pools  # the device window's slots, the gradient buffers
        device, act_host = subject.activations(self.activations)
        acc_device, acc_host = self.window.pools(groups, ctx)
        budget = self.state_budget(subject, limits)
        host, disk = self.tiers(subject, budget, homes=self.homes)
        rpn = ctx.ranks_per_node
        host_bytes = rpn * (host + acc_host) + act_host
        return RowBytes(slots, grad_buffers + acc_device, device, host_bytes, rpn * disk)

    def state_budget(self, subject: Subject, limits: Limits) -> int | None:
        """The row's budget per rank for what ``tiers`` places (``None``: the host unknown,
        unbounded; the subject without units: no row): with the homes on NVMe the
        optimizer's ``host_budget``; with them in RAM the state's beside every home, so the
        ``host_budget`` that builds the row is it plus the homes (Note [homes on NVMe])."""
        ctx = subject.ctx
        pools, groups = subject.param_offload_pools(), subject.unit_groups()
        if pools is None or groups is None:
            return None
        _, act_host = subject.activations(self.activations)
        # The window's accumulators are in RAM beside the budget whatever the placement
        # (Note [the accumulators sit beside the host budget]).
        accumulators = self.window.pools(groups, ctx)[1]
        if self.homes is Homes.NVME:
            # Room for the gradient staging and the rings (Note [homes on NVMe]).
            from ..config import OffloadConfig
            from ..weights.nvme_home import home_ring_bytes

            ring = home_ring_bytes(OffloadConfig().tile_elements, ctx.itemsize)
            fixed = total_bytes(groups, ctx, "grad") + io_bytes(groups, ctx) + ring + pools[0]
        else:
            # plan_nvme's budget leaves room for every bucket's staging as if on NVMe.
            fixed = total_bytes(groups, ctx, "staging") + io_bytes(groups, ctx)
        return limits.state_budget(fixed + accumulators, act_host, ctx.ranks_per_node)

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
        return state_tiers(groups, subject.ctx, budget)


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
    Accumulating("ZeRO-Offload + ckpt, micro-batches summed on the device", _CKPT),
    Accumulating("ZeRO-Offload + ckpt, micro-batches summed on the host", _CKPT, False),
    Shadowed("ZeRO-Offload + ckpt + overlap_step, weight shadow on the device", _CKPT),
    DeviceShards("ZeRO-Offload + ZeRO-3 (shards on the device)"),
    DeviceShards("ZeRO-Offload + ZeRO-3 + checkpointing", _CKPT),
    DeviceShards("ZeRO-Offload + ZeRO-3 + activation offload", _ACT),
    NvmeState("ZeRO-Offload + NVMe state + checkpointing", _CKPT),
    NvmeState("ZeRO-Offload + NVMe state + activation offload", _ACT),
    NvmeState(
        "ZeRO-Offload + NVMe state + ckpt, micro-batches summed on the device", _CKPT, Window.DEVICE
    ),
    NvmeState(
        "ZeRO-Offload + NVMe state + ckpt, micro-batches summed on the host", _CKPT, Window.HOST
    ),
    ParamOffloaded("ZeRO-Offload + parameter offload"),
    ParamOffloaded("ZeRO-Offload + param offload + checkpointing", _CKPT),
    ParamOffloaded("ZeRO-Offload + param offload + activation offload", _ACT),
    Accumulating("param offload + ckpt, micro-batches summed on the device", _CKPT, params=True),
    Accumulating("param offload + ckpt, micro-batches summed on the host", _CKPT, False, True),
    ParamInFlight("param offload + in-flight staging + checkpointing", _CKPT),
    ParamInFlight("param offload + in-flight staging + activation offload", _ACT),
    ParamNvme("param offload + NVMe state + checkpointing", _CKPT),
    ParamNvme("param offload + NVMe state + activation offload", _ACT),
    ParamNvme(
        "param offload + NVMe state + ckpt, micro-batches summed on the device",
        _CKPT,
        Homes.HOST,
        Window.DEVICE,
    ),
    ParamNvme(
        "param offload + NVMe state + ckpt, micro-batches summed on the host",
        _CKPT,
        Homes.HOST,
        Window.HOST,
    ),
    ParamInFlight("param offload + NVMe state + in-flight staging + ckpt", _CKPT, nvme=True),
    ParamInFlight("param offload + NVMe state + in-flight staging + act. offload", _ACT, nvme=True),
    ParamNvme("params and state on NVMe + checkpointing", _CKPT, Homes.NVME),
    ParamNvme("params and state on NVMe + activation offload", _ACT, Homes.NVME),
    ParamNvme(
        "params and state on NVMe + ckpt, micro-batches summed on the device",
        _CKPT,
        Homes.NVME,
        Window.DEVICE,
    ),
    ParamNvme(
        "params and state on NVMe + ckpt, micro-batches summed on the host",
        _CKPT,
        Homes.NVME,
        Window.HOST,
    ),
    ParamInFlight("params and state on NVMe + in-flight staging + ckpt", _CKPT, True, Homes.NVME),
    ParamInFlight(
        "params and state on NVMe + in-flight staging + act. offload", _ACT, True, Homes.NVME
    ),
)
