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
the host. "auto" takes the device row where it fits, else the host row; the rows say
which, and ``zero-offload estimate`` prints both.
"""

from __future__ import annotations

from dataclasses import dataclass

from .nvme import total_bytes
from .rows import Configuration, Limits, RowBytes, Subject

__all__ = ["Accumulating"]


@dataclass(frozen=True)
class Accumulating(Configuration):
    """``Offloaded`` with several micro-batches a step, summed on the device
    (``on_device``) or on the host."""

    on_device: bool = True

    def bytes(self, subject: Subject, limits: Limits) -> RowBytes | None:
        ctx = subject.ctx
        weights, grad_buffers, host = subject.offload_pools()
        device, act_host = subject.activations(self.activations)
        groups = subject.bucket_groups()
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
