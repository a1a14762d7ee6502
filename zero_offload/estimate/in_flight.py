"""Rows with gradient staging for the buckets in flight (``OffloadConfig(offload_parameters
=True, grad_staging="in_flight")``, Note [gradient staging for the buckets in flight] in
``optim/grads/staging_ring.py``): parameter offload whose host RAM holds, instead of every
bucket's gradient staging, a ring of ``grad_staging_buffers`` (K) buffers of the largest
bucket's shard.

Per rank, over the units' buckets (``Subject.unit_groups``), with ``g = a(s k)`` a bucket's
gradient staging: each placement is the one without the ring (``ParamOffloaded``,
``ParamNvme``) less every bucket's ``g``, plus the ring ``K max g``:

- state in RAM: with bf16, 14 bytes a parameter (master, two moments, the home) instead of
  16;
- state on NVMe beyond the host budget (``nvme``), the homes in RAM (``Homes.HOST``): the
  budget is the state's beside every home, the ring and the tier's I/O buffers; disk: the
  spilled state's records;
- the homes on NVMe too (``Homes.NVME``, the issue's ZeRO-Infinity configuration): the
  budget holds the homes first, those beyond it in weight files, then the state, as
  ``plan_nvme`` places them (Note [homes on NVMe] in ``optim/state/nvme_plan.py``;
  ``home_tiers``); ``"auto"`` is the RAM beside the ring, the I/O buffers, the weight tile
  ring and the bounce ring (as large as the window). Disk: the weight files and the
  spilled state's records. The step run during backward writes the weight records (Note
  [stepping during backward with parameter offload] in ``optim/update/eager.py``).

The library runs them on one rank, and only where each step runs during backward:
``CONDITIONS`` says when, and the table and the north star say it beside the row.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .buckets import BucketGroups
from .nvme import (
    Homes,
    context_tiers,
    home_tiers,
    io_bytes,
    state_tiers,
    total_bytes,
)
from .rows import (
    Configuration,
    Context,
    Limits,
    RowBytes,
    Status,
    Subject,
    nvme_refusal,
    param_offload_refusal,
)

#: Why the in-flight rows are estimates only on several ranks.
IN_FLIGHT_RANKS_NOT_YET = "in-flight gradient staging on several ranks is refused"

__all__ = ["CONDITIONS", "ParamInFlight", "param_nvme_refusal", "ring_bytes"]

#: When a row with in-flight staging runs: what lets every step run during backward.
CONDITIONS = (
    "each step announced and run during backward (opt.backward(loss, step=True)): no "
    "gradient clipping (max_grad_norm), no skip_nonfinite or fp16 loss scaling, one "
    "micro-batch per step; OffloadConfig(grad_staging='in_flight'). A fine-tune that "
    "clips gradients cannot"
)


def ring_bytes(groups: BucketGroups, ctx: Context) -> tuple[int, int]:
    """``(every bucket's own gradient staging, the ring)`` per rank: ``sum g`` and ``K max
    g`` (K: ``OffloadConfig``'s default ``grad_staging_buffers``)."""
    from ..config import OffloadConfig

    own = largest = 0
    tiers = context_tiers(ctx)
    for numels, repeats in groups:
        grads = [tiers(n).grad for n in numels]
        own += repeats * sum(grads)
        largest = max([largest, *grads])
    return own, OffloadConfig().grad_staging_buffers * largest


def param_nvme_refusal(ctx: Context, homes: Homes) -> str | None:
    """Parameter offload with NVMe state, homes ``homes``, for ``ctx``'s rule: a rule that
    reads whole parameters keeps every home in host RAM (``nvme_plan``), so homes on NVMe
    are refused; several ranks as ``param_offload_refusal``, the rest as
    ``nvme_refusal``."""
    ranks = param_offload_refusal(ctx)
    if ranks is not None:
        return ranks
    if ctx.whole and homes is Homes.NVME:
        return f"homes on NVMe: {ctx.rule} reads whole parameters, so every home stays in host RAM"
    return nvme_refusal(ctx)


@dataclass(frozen=True)
class ParamInFlight(Configuration):
    """Parameter offload with in-flight gradient staging; ``nvme``: the state beyond the host
    budget on NVMe, the homes in RAM or on NVMe as well (``homes``). Device per rank: as
    ``ParamOffloaded``."""

    nvme: bool = False
    homes: Homes = field(default=Homes.HOST)

    def bytes(self, subject: Subject, limits: Limits) -> RowBytes | None:
        ctx = subject.ctx
        pools, groups = subject.param_offload_pools(), subject.unit_groups()
        if pools is None or groups is None:
            return None
        window, grad_buffers, host = pools
        device, act_host = subject.activations(self.activations)
        rpn = ctx.ranks_per_node
        own, ring = ring_bytes(groups, ctx)
        if not self.nvme:
            return RowBytes(window, grad_buffers, device, rpn * (host - own + ring) + act_host)
        if self.homes is Homes.NVME:
            # host_budget="auto" as the optimizer resolves it (construction._nvme_config):
            # the RAM beside the ring, the I/O buffers and the two rings of homes on disk.
            from ..config import OffloadConfig
            from ..weights.nvme_home import home_ring_bytes

            homes_ring = home_ring_bytes(OffloadConfig().tile_elements, ctx.itemsize)
            fixed = ring + io_bytes(groups, ctx) + homes_ring + window
        else:
            # Every home in RAM: each one (staging as if on NVMe, less its gradient
            # staging), the ring and the I/O buffers; the state's budget is what is left.
            fixed = total_bytes(groups, ctx, "staging") - own + ring + io_bytes(groups, ctx)
        budget = limits.state_budget(fixed, act_host, rpn)
        host, disk = self.tiers(subject, budget, homes=self.homes)
        return RowBytes(window, grad_buffers, device, rpn * host + act_host, rpn * disk)

    @staticmethod
    def tiers(
        subject: Subject, budget: int | None, *, homes: Homes = Homes.HOST
    ) -> tuple[int, int]:
        """``(host, disk)`` bytes per rank with ``OffloadConfig(offload_parameters=True,
        grad_staging="in_flight", nvme_dir=..., host_budget=...)``: ``ParamNvme.tiers``
        less every bucket's gradient staging, plus the ring. ``Homes.HOST``: every home in
        RAM and ``budget`` the state's beside them; ``Homes.NVME``: ``budget`` is
        ``host_budget``, holding the homes first, then the state, as the library places
        them (``home_tiers``). Raises ``ValueError`` without units (a bare count, a
        module)."""
        groups, ctx = subject.unit_groups(), subject.ctx
        if groups is None:
            raise ValueError(
                "ParamInFlight.tiers needs a subject with units (a ShapeSubject of a "
                f"ModelShape), got {type(subject).__name__}"
            )
        own, ring = ring_bytes(groups, ctx)
        if homes is Homes.NVME:
            host, disk = home_tiers(groups, ctx, budget)
        else:
            host, disk = state_tiers(groups, ctx, budget)
        return host - own + ring, disk

    def refusal(self, ctx: Context) -> str | None:
        if self.nvme:
            return param_nvme_refusal(ctx, self.homes)
        return param_offload_refusal(ctx)

    def status(self, ctx: Context) -> tuple[Status, str]:
        if ctx.world_size > 1:
            return Status.NOT_YET, IN_FLIGHT_RANKS_NOT_YET
        return Status.RUNS, ""

    def conditions(self) -> str:
        return CONDITIONS
