"""Rows for several micro-batches a step: where they add up (``OffloadConfig.
grad_accumulation``, Note [micro-batches add up on the device] in
``optim/grads/device_acc.py``).

The ``Offloaded`` rows hold one micro-batch per step: a bucket's gradient stays in its
staging (Note [no accumulator for one backward] in ``optim/grads/to_host.py``). A window of
several takes, per bucket of shard ``s`` elements in a ``k``-byte training dtype:

- on the device (``"auto"``, when the device budget has room): ``a(4s)`` device bytes, the
  fp32 sum, and ``a(4s)`` host bytes, the host accumulator it lands in once a step;
- on the host (``"host"``, or no room): ``a(4s)`` host bytes, the accumulator, and
  ``a(ks)``, the second staging buffer (Note [two staging buffers for accumulation] in
  ``optim/grads/staging.py``).

So on the device: ``4`` more device bytes a parameter, and ``k`` fewer host bytes than on
the host. With parameter offload (``params``) the same, over the units' buckets (each unit's
own), beside the window: the ``ParamOffloaded`` rows hold one micro-batch per step too. "auto" takes the device row where it fits, else the host row; the rows say
which, and ``zero-offload estimate`` prints both.

With NVMe state (``tiered.py``: ``NvmeState`` and ``ParamNvme`` with a ``window`` other than
``Window.ONE``) the same pools join, in RAM whatever the placement: the host budget places
the state exactly as with one micro-batch, and the accumulators are pools of their own
beside it (Note [the accumulators sit beside the host budget]).

Note [the accumulators sit beside the host budget]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``plan_nvme`` splits the state by ``host_budget`` at construction, before any window
accumulates; the accumulators and the spare staging are pinned later, at the first window
of several micro-batches (``optim/state/nvme_plan.py``'s docstring), outside the budget.
``host_budget="auto"`` leaves them no room (it counts one micro-batch's pools), so a loop
that accumulates with NVMe state needs a ``host_budget`` in bytes that leaves it. The rows
with a window of several take that budget: the host less the reserve less their fixed
bytes, the accumulators' included (the row's condition says so), so a row that fits is one
whose pools all fit; given that budget the optimizer builds the row's bytes exactly
(tests/test_estimate_nvme_micro_batches.py).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from .buckets import BucketGroups
from .nvme import total_bytes
from .rows import Configuration, Context, Limits, RowBytes, Subject, param_offload_refusal

__all__ = ["Accumulating", "Window"]


class Window(enum.Enum):
    """How many micro-batches a step, and where several add up (``OffloadConfig.
    grad_accumulation``): the rows with NVMe state take one as a field."""

    ONE = "one micro-batch a step: the gradient stays in its staging, no accumulator"
    DEVICE = "several, summed in an fp32 accumulator on the device, landing once on the host"
    HOST = "several, summed in an fp32 accumulator on the host, through two staging buffers"

    def pools(self, groups: BucketGroups, ctx: Context) -> tuple[int, int]:
        """``(device, host)`` bytes per rank this window adds to one micro-batch's pools,
        over the buckets ``groups`` (see the module's docstring)."""
        if self is Window.ONE:
            return 0, 0  # Note [no accumulator for one backward]
        acc = total_bytes(groups, ctx, "accumulator")  # each bucket's a(4s): the fp32 sum
        if self is Window.DEVICE:
            # The sum on the device, and the host accumulator it lands in once a step; the
            # spare staging goes once the device sums (Note [the spare goes when the device
            # sums] in optim/grads/staging.py).
            return acc, acc
        # The host accumulator, and each bucket's spare staging a(ks) (Note [two staging
        # buffers for accumulation]).
        return 0, acc + total_bytes(groups, ctx, "grad")

    def nvme_conditions(self) -> str:
        """The condition of a row with NVMe state and this window (empty: none)."""
        if self is Window.ONE:
            return ""
        where = _WHERE[self is Window.DEVICE]
        return (
            f"{where}, with OffloadConfig(host_budget=...) in bytes leaving room for the "
            "accumulators: host_budget='auto' sizes the state beside one micro-batch's pools"
        )


@dataclass(frozen=True)
class Accumulating(Configuration):
    """``Offloaded`` (``ParamOffloaded`` with ``params``) with several micro-batches a
    step, summed on the device (``on_device``) or on the host."""

    on_device: bool = True
    params: bool = False  # parameter offload: the window, and the units' buckets

    def refusal(self, ctx: Context) -> str | None:
        return param_offload_refusal(ctx) if self.params else None

    def bytes(self, subject: Subject, limits: Limits) -> RowBytes | None:
        ctx = subject.ctx
        if self.params:
            pools, unit_groups = subject.param_offload_pools(), subject.unit_groups()
            if pools is None or unit_groups is None:
                return None  # no shape: no parameter offload rows
            (weights, grad_buffers, host), groups = pools, unit_groups
        else:
            weights, grad_buffers, host = subject.offload_pools()
            groups = subject.bucket_groups()
        device, act_host = subject.activations(self.activations)
        window = Window.DEVICE if self.on_device else Window.HOST
        extra_device, extra_host = window.pools(groups, ctx)
        host_bytes = ctx.ranks_per_node * (host + extra_host) + act_host
        return RowBytes(weights, grad_buffers + extra_device, device, host_bytes)

    def conditions(self) -> str:
        return _WHERE[self.on_device]


#: Where several micro-batches add up, as a row's condition says it, by "on the device".
_WHERE = {
    True: (
        "several micro-batches a step, summed on the device "
        "(OffloadConfig(grad_accumulation='auto'), the default, where the device budget has "
        "room: else the host row)"
    ),
    False: (
        "several micro-batches a step, summed on the host (OffloadConfig(grad_accumulation='host'))"
    ),
}
