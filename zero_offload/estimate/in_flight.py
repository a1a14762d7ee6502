"""Rows with gradient staging for the buckets in flight (``OffloadConfig(offload_parameters
=True, grad_staging="in_flight")``, Note [gradient staging for the buckets in flight] in
``optim/grads/staging_ring.py``): parameter offload whose host RAM holds, instead of every
bucket's gradient staging, a ring of ``grad_staging_buffers`` (K) buffers of the largest
bucket's shard.

Per rank, over the units' buckets (``Subject.unit_groups``), with ``g = a(s k)`` a bucket's
gradient staging:

- state in RAM: the parameter-offload host pool less every bucket's ``g``, plus the ring
  ``K max g``: with bf16, 14 bytes a parameter (master, two moments, the home) instead of
  16;
- state on NVMe beyond the host budget (``nvme``): every home (the weight staging), the
  ring and the tier's I/O buffers are in RAM whatever the placement, then the state that
  fits the budget; disk: the spilled state's records. Note [the host budget decides the
  split] in ``nvme.py``.

The library runs both on one rank, and only where each step runs during backward:
``CONDITIONS`` says when, and the table and the north star say it beside the row.
"""

from __future__ import annotations

from dataclasses import dataclass

from .nvme import BucketTiers, bucket_tiers, io_buffer_bytes, split_state
from .pools import BucketGroups
from .rows import ZERO3_NOT_YET, Configuration, Context, Limits, RowBytes, Status, Subject

__all__ = ["CONDITIONS", "ParamInFlight", "ring_bytes"]

#: When a row with in-flight staging runs: what lets every step run during backward.
CONDITIONS = (
    "each step announced and run during backward (opt.backward(loss, step=True)): no "
    "gradient clipping (max_grad_norm), no skip_nonfinite or fp16 loss scaling, one "
    "micro-batch per step; OffloadConfig(grad_staging='in_flight')"
)


def _tiers(ctx: Context, numel: int) -> BucketTiers:
    return bucket_tiers(
        numel, itemsize=ctx.itemsize, bucket_bytes=ctx.bucket_bytes, world_size=ctx.world_size
    )


def _sum(groups: BucketGroups, ctx: Context, attr: str) -> int:
    return sum(r * sum(getattr(_tiers(ctx, n), attr) for n in ns) for ns, r in groups)


def ring_bytes(groups: BucketGroups, ctx: Context) -> tuple[int, int]:
    """``(every bucket's own gradient staging, the ring)`` per rank: ``sum g`` and ``K max
    g`` (K: ``OffloadConfig``'s default ``grad_staging_buffers``)."""
    from ..config import OffloadConfig

    own = largest = 0
    for numels, repeats in groups:
        grads = [_tiers(ctx, n).grad for n in numels]
        own += repeats * sum(grads)
        largest = max([largest, *grads])
    return own, OffloadConfig().grad_staging_buffers * largest


@dataclass(frozen=True)
class ParamInFlight(Configuration):
    """Parameter offload with in-flight gradient staging; ``nvme``: the state beyond the host
    budget on NVMe (the homes stay in RAM). Device per rank: as ``ParamOffloaded``."""

    nvme: bool = False

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
        # In RAM whatever the placement: each home (staging as if on NVMe, less its gradient
        # staging), the ring and the I/O buffers; the budget is what is left.
        fixed = _sum(groups, ctx, "staging") - own + ring + io_buffer_bytes()
        host, disk = self.tiers(subject, limits.state_budget(fixed, act_host, rpn))
        return RowBytes(window, grad_buffers, device, rpn * host + act_host, rpn * disk)

    @staticmethod
    def tiers(subject: Subject, budget: int | None) -> tuple[int, int]:
        """``(host, disk)`` bytes per rank with ``OffloadConfig(offload_parameters=True,
        grad_staging="in_flight", nvme_dir=..., host_budget=budget)``: the host pool (every
        home, the state that fits), the ring, the I/O buffers when a bucket is on NVMe; the
        state files. Raises ``ValueError`` without units (a bare count, a module)."""
        groups, ctx = subject.unit_groups(), subject.ctx
        if groups is None:
            raise ValueError(
                "ParamInFlight.tiers needs a subject with units (a ShapeSubject of a "
                f"ModelShape), got {type(subject).__name__}"
            )
        own, ring = ring_bytes(groups, ctx)
        split = split_state(
            groups,
            lambda n: _tiers(ctx, n),
            budget,
            spilled_bytes=lambda t: t.staging - t.ram_staging,
        )
        host = _sum(groups, ctx, "ram_staging") - own + ring + split.spilled + split.host
        return host + (io_buffer_bytes() if split.disk else 0), split.disk

    def status(self, ctx: Context) -> tuple[Status, str]:
        if ctx.world_size > 1:
            return Status.NOT_YET, ZERO3_NOT_YET
        return Status.RUNS, ""

    def conditions(self) -> str:
        return CONDITIONS
