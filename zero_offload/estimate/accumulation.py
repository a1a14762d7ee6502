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
"""

from __future__ import annotations

from dataclasses import dataclass

from .nvme import total_bytes
from .rows import Configuration, Context, Limits, RowBytes, Subject, param_offload_refusal

__all__ = ["Accumulating"]


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
        acc = total_bytes(groups, ctx, "accumulator")
        rpn = ctx.ranks_per_node
        if self.on_device:
            return RowBytes(weights, grad_buffers + acc, device, rpn * (host + acc) + act_host)
        spare = total_bytes(groups, ctx, "grad")
        return RowBytes(weights, grad_buffers, device, rpn * (host + acc + spare) + act_host)

    def conditions(self) -> str:
        if self.on_device:
            return (
                "several micro-batches a step, summed on the device "
                "(OffloadConfig(grad_accumulation='auto'), the default, where the device "
                "budget has room: else the host row)"
            )
        return (
            "several micro-batches a step, summed on the host "
            "(OffloadConfig(grad_accumulation='host'))"
        )
