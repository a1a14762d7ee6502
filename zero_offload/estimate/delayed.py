"""The row for ``overlap_step``: the second gradient staging buffer its delayed update
needs, and the device weight shadows (Note [the delayed update lands in a shadow] in
``optim/shadow.py``).

Note [overlap_step's device extras follow the budget]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
One micro-batch a step. Update k reads window k's gradient while backward k+1's lands, so
the windows take turns between a bucket's two staging buffers (Note [the delayed update
reads one buffer, the next backward fills the other] in ``optim/grads/staging.py``): every
bucket of shard ``s`` elements in a ``k``-byte training dtype pins its spare staging,
``a(ks)`` host bytes, beside the ``Offloaded`` row's own staging. No fp32 accumulator, on
either side: per parameter, the row's gradient bytes beyond ``Offloaded`` are

- host: ``k`` (the spare; bf16 2, fp32 4), where ``overlap_step`` used to accumulate every
  window into an fp32 host accumulator, 4;
- device: 0, where it used to take an fp32 device accumulator, 4, where the budget had room.

On the device it may take one more pool per bucket, asked once and only where the device
budget has its bytes plus a reserve left (``pool_if_room``: a tenth of the budget, or two
of the bucket's gradient buffers if more; Note [micro-batches add up on the device]): at
the first delayed update, bucket by bucket in bucket order, the weight shadow, ``a(ks)``
(``WeightShadows.take``). A bucket refused one publishes from the home, and a later,
smaller bucket may still fit. ``Shadowed`` replays those choices bucket by bucket against
the device memory (the library's ledger starting at the weights and gradient buffers: the
activations are not in it), so its device bytes are what the optimizer takes with
``AcceleratorConfig(device_budget=device_memory)``, and with the device memory unknown,
every bucket's. The host bytes do not depend on it. With several micro-batches a window
accumulates as without ``overlap_step`` (``estimate/accumulation.py``: an fp32 host
accumulator, and from the second window a device one where the budget has room after the
shadows), which the row's ``conditions`` say and do not count.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

from .buckets import BucketGroups
from .nvme import BucketTiers, context_tiers, total_bytes
from .rows import Configuration, Context, Limits, RowBytes, Subject

__all__ = ["Shadowed", "device_extras"]


#: A pool ``pool_if_room`` is asked for: ``(bytes asked, bytes the pool takes)`` of a bucket.
_Ask = Callable[[BucketTiers], tuple[int, int]]


def _shadow(t: BucketTiers, itemsize: int) -> tuple[int, int]:
    return itemsize * t.shard, t.home


def device_extras(groups: BucketGroups, ctx: Context, *, in_use: int, budget: int | None) -> int:
    """Replay Note [overlap_step's device extras follow the budget] over ``groups`` (bucket
    order), the ledger at ``in_use`` bytes, under ``budget`` (``None``: every bucket's):
    the bytes of the weight shadows taken, per rank. O(groups) but where a group's repeats
    straddle the budget's edge."""
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

    return replay(functools.partial(_shadow, itemsize=ctx.itemsize))


@dataclass(frozen=True)
class Shadowed(Configuration):
    """``Offloaded`` with ``overlap_step``: every bucket's spare gradient staging on the
    host, and on the device each bucket's weight shadow where the budget has room (Note
    [overlap_step's device extras follow the budget])."""

    def bytes(self, subject: Subject, limits: Limits) -> RowBytes | None:
        ctx = subject.ctx
        weights, grad_buffers, host = subject.offload_pools()
        device, act_host = subject.activations(self.activations)
        groups = subject.bucket_groups()
        shadows = device_extras(groups, ctx, in_use=weights + grad_buffers, budget=limits.device)
        spare = total_bytes(groups, ctx, "grad")  # each bucket's spare staging, a(ks)
        rpn = ctx.ranks_per_node
        host_bytes = rpn * (host + spare) + act_host
        return RowBytes(weights, grad_buffers + shadows, device, host_bytes)

    def conditions(self) -> str:
        return (
            "OffloadConfig(overlap_step=True): every bucket's second gradient staging buffer "
            "on the host (the delayed update reads one while the next backward fills the "
            "other: 2 bytes a bf16 parameter, 4 an fp32 one; no fp32 accumulator), and on "
            "the device, bucket by bucket, its weight shadow where the device budget (taken "
            "as the device memory) has room for it and a reserve of max(10% of the budget, "
            "two gradient buffers), the device bytes those taken; one micro-batch a step "
            "(with several, the micro-batches add up as in the accumulating rows: an fp32 "
            "accumulator on the host, and one on the device where the budget has room after the shadows)"
        )
