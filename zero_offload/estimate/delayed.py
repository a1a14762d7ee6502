"""The row for ``overlap_step``: the fp32 gradient accumulators it always keeps, and the
device weight shadows (Note [the delayed update lands in a shadow] in ``optim/shadow.py``).

Note [overlap_step's device extras follow the budget]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``overlap_step`` always accumulates, even one micro-batch a step (Note [no accumulator for
one backward] in ``optim/grads/to_host.py``): every bucket of shard ``s`` elements in a
``k``-byte training dtype pins its fp32 host accumulator, ``a(4s)`` host bytes. On the
device it may take two more pools, each asked once and each only where the device budget
has its bytes plus a reserve left (``pool_if_room``: a tenth of the budget, or two of the
bucket's gradient buffers if more; Note [micro-batches add up on the device]):

1. at the first backward, bucket by bucket in bucket order, the fp32 device accumulator,
   ``a(4s)`` (``DeviceAccumulators.take``);
2. at the first delayed update, bucket by bucket in bucket order, the weight shadow,
   ``a(ks)`` (``WeightShadows.take``), with the accumulators already taken.

A bucket refused one keeps going without it (on the host, or publishing from the home), and
a later, smaller bucket may still fit. So the accumulators take the room first, and under a
budget that barely holds the row few buckets get a shadow. ``Shadowed`` replays those
choices bucket by bucket against the device memory (the library's ledger starting at the
weights and gradient buffers: the activations are not in it), so its device bytes are what
the optimizer takes with ``AcceleratorConfig(device_budget=device_memory)``, and with the
device memory unknown, every bucket's. The host bytes do not depend on it. One micro-batch a
step: with several, a bucket that accumulates on the host also pins its spare staging
(Note [two staging buffers for accumulation]), ``a(ks)``, which the row's ``conditions``
say and do not count.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

from .buckets import BucketGroups
from .nvme import BucketTiers, context_tiers, total_bytes
from .rows import Configuration, Context, Limits, RowBytes, Subject

__all__ = ["Shadowed", "device_extras"]


@dataclass(frozen=True)
class DeviceExtras:
    """What ``overlap_step`` takes on the device beyond the ``Offloaded`` row, per rank."""

    accumulators: int  # fp32 device accumulators taken, bytes
    shadows: int  # weight shadows taken, bytes


#: A pool ``pool_if_room`` is asked for: ``(bytes asked, bytes the pool takes)`` of a bucket.
_Ask = Callable[[BucketTiers], tuple[int, int]]


def _accumulator(t: BucketTiers) -> tuple[int, int]:
    return 4 * t.shard, t.accumulator


def _shadow(t: BucketTiers, itemsize: int) -> tuple[int, int]:
    return itemsize * t.shard, t.home


def device_extras(
    groups: BucketGroups, ctx: Context, *, in_use: int, budget: int | None
) -> DeviceExtras:
    """Replay Note [overlap_step's device extras follow the budget] over ``groups`` (bucket
    order), the ledger at ``in_use`` bytes, under ``budget`` (``None``: every bucket's).
    O(groups) but where a group's repeats straddle the budget's edge."""
    from ..optim.grads.device_acc import RESERVE_FRACTION

    tiers = context_tiers(ctx)
    used = in_use
    share = 0 if budget is None else int(budget * RESERVE_FRACTION)

    def replay(ask: _Ask) -> int:
        """Bytes of the pools ``ask`` describes that the budget gives, bucket by bucket."""
        nonlocal used
        start = used
        for keys, repeats in groups:
            asks = [(ask(t), max(share, 2 * t.buffer)) for t in (tiers(key) for key in keys)]
            cycle = sum(pool for (_, pool), _ in asks)
            if (
                budget is None
                or used + repeats * cycle + max(need + reserve for (need, _), reserve in asks)
                <= budget
            ):
                used += repeats * cycle  # every repeat's every bucket has room
                continue
            for _ in range(repeats):
                before = used
                for (need, pool), reserve in asks:
                    if need + reserve <= budget - used:
                        used += pool
                if used == before:  # the ledger stands still: the later repeats are refused
                    break
        return used - start

    accumulators = replay(_accumulator)
    shadows = replay(functools.partial(_shadow, itemsize=ctx.itemsize))
    return DeviceExtras(accumulators, shadows)


@dataclass(frozen=True)
class Shadowed(Configuration):
    """``Offloaded`` with ``overlap_step``: every bucket's fp32 accumulator on the host, and
    on the device each bucket's accumulator and weight shadow where the budget has room
    (Note [overlap_step's device extras follow the budget])."""

    def bytes(self, subject: Subject, limits: Limits) -> RowBytes | None:
        ctx = subject.ctx
        weights, grad_buffers, host = subject.offload_pools()
        device, act_host = subject.activations(self.activations)
        groups = subject.bucket_groups()
        extras = device_extras(groups, ctx, in_use=weights + grad_buffers, budget=limits.device)
        acc = total_bytes(groups, ctx, "accumulator")
        rpn = ctx.ranks_per_node
        host_bytes = rpn * (host + acc) + act_host
        buffers = grad_buffers + extras.accumulators + extras.shadows
        return RowBytes(weights, buffers, device, host_bytes)

    def conditions(self) -> str:
        return (
            "OffloadConfig(overlap_step=True): every bucket's fp32 gradient accumulator on "
            "the host (overlap_step always accumulates), and on the device, bucket by "
            "bucket, its fp32 accumulator and then its weight shadow where the device budget "
            "(taken as the device memory) has room for it and a reserve of max(10% of the "
            "budget, two gradient buffers), the device bytes those taken; one micro-batch a "
            "step (with several, each bucket refused a device accumulator also pins a spare "
            "gradient staging buffer: 2 bytes a bf16 parameter)"
        )
