"""The row for ``overlap_step`` with its device weight shadows (Note [the delayed update
lands in a shadow] in ``optim/shadow.py``).

The delayed update keeps, where the device budget has room, one shadow per bucket: the
shard of ``s`` elements in the ``k``-byte training dtype, ``a(ks)`` device bytes in a pool of
its own (the same bytes as the bucket's host home, ``BucketTiers.home``). So ``k`` more
device bytes a parameter than the ``Offloaded`` row of the same activations, and the same
host bytes; a bucket without room publishes from the host and costs nothing more.
"""

from __future__ import annotations

from dataclasses import dataclass

from .nvme import total_bytes
from .rows import Configuration, Limits, RowBytes, Subject

__all__ = ["Shadowed"]


@dataclass(frozen=True)
class Shadowed(Configuration):
    """``Offloaded`` with ``overlap_step`` and every bucket's weight shadow on the device."""

    def bytes(self, subject: Subject, limits: Limits) -> RowBytes | None:
        weights, grad_buffers, host = subject.offload_pools()
        device, act_host = subject.activations(self.activations)
        shadows = total_bytes(subject.bucket_groups(), subject.ctx, "home")
        rpn = subject.ctx.ranks_per_node
        return RowBytes(weights, grad_buffers + shadows, device, rpn * host + act_host)

    def conditions(self) -> str:
        return (
            "OffloadConfig(overlap_step=True), each bucket's weight shadow on the device "
            "(overlap_shadow='auto', the default, where the device budget has room: else "
            "the ZeRO-Offload row of the same activations)"
        )
