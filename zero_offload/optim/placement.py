"""Which buckets stay on the device, and how many bytes each tier needs: pure arithmetic.

Byte counts per bucket of ``n = padded_numel`` elements, ``s`` = training dtype bytes,
``a(x)`` = ``x`` rounded up to the pool alignment:

- device, every bucket: weights ``a(n*s)``;
- device, resident bucket: fp32 master, exp_avg, exp_avg_sq, grad accumulator ``4*a(4n)``
  (plus ``a(4n)`` with amsgrad);
- device, offloaded buckets together: ``GRAD_BUFFERS`` gradient buffers of the largest
  offloaded bucket, ``a(n_max*s)`` each (Note [a bucket's gradient lifecycle]);
- host, offloaded bucket, with ``k = n / world_size`` (this rank's shard, Note [who owns
  which shard] in partition.py): master and grad accumulator ``2*a(4k)``, moments
  ``2*a(k*m)`` (``m`` = 4 or 2 for bf16 moments; one more with amsgrad), gradient staging
  ``a(k*s)``, and weight staging ``a(k*s)`` unless the training dtype is fp32.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..config import format_bytes
from ..errors import DeviceBudgetExceeded
from ..partition import BucketLayout

__all__ = ["GRAD_BUFFERS", "POOL_ALIGNMENT", "Placement", "plan_placement"]

#: Alignment of every block in OffloadAdamW's pools, bytes; buckets are padded to multiples
#: of it too (Note [padding stays at the end] in partition.py).
POOL_ALIGNMENT = 512

#: Device gradient buffers for offloaded buckets: one filling while the previous one's
#: copy to the host is in flight.
GRAD_BUFFERS = 2


def _aligned(nbytes: int, alignment: int) -> int:
    return -(-nbytes // alignment) * alignment


@dataclass(frozen=True)
class Placement:
    """The outcome: which buckets are resident, and each pool's exact capacity in bytes."""

    resident: frozenset[int]  # bucket indices kept on the device
    device_weights: int
    device_grad_buffers: int
    device_resident_state: int
    host_state: int

    @property
    def device_total(self) -> int:
        """Bytes of the device pool."""
        return self.device_weights + self.device_grad_buffers + self.device_resident_state


def _resident_bytes(bucket: BucketLayout, *, amsgrad: bool, alignment: int) -> int:
    return (5 if amsgrad else 4) * _aligned(4 * bucket.padded_numel, alignment)


def _host_bytes(
    bucket: BucketLayout, *, itemsize: int, moment_size: int, amsgrad: bool, alignment: int
) -> int:
    n = bucket.shard_numel  # this rank's shard only, Note [who owns which shard]
    total = 2 * _aligned(4 * n, alignment)
    total += (3 if amsgrad else 2) * _aligned(moment_size * n, alignment)
    total += _aligned(itemsize * n, alignment)
    if itemsize != 4:
        total += _aligned(itemsize * n, alignment)
    return total


def plan_placement(
    buckets: Sequence[BucketLayout],
    *,
    itemsize: int,
    moment_size: int,
    amsgrad: bool,
    offload_fraction: float | str,
    device_free: int,
    auto_headroom: float,
    alignment: int,
) -> Placement:
    """Choose the resident buckets and size the pools.

    A float ``offload_fraction`` keeps the last buckets in backward order (the first
    parameters registered, whose gradients arrive last, so their copies would be the most
    exposed) on the device until ``1 - offload_fraction`` of the elements are resident.
    ``"auto"`` keeps as many as fit in ``device_free * (1 - auto_headroom)``. Raises
    ``DeviceBudgetExceeded`` when even full offload does not fit ``device_free``.
    """
    total = sum(b.numel for b in buckets) or 1
    weights = sum(_aligned(b.padded_numel * itemsize, alignment) for b in buckets)

    def grad_buffers(resident: set[int]) -> int:
        sizes = [b.padded_numel for b in buckets if b.index not in resident]
        return GRAD_BUFFERS * _aligned(max(sizes) * itemsize, alignment) if sizes else 0

    resident: set[int] = set()
    state = 0
    if offload_fraction == "auto":
        limit = int(device_free * (1 - auto_headroom))
        for bucket in reversed(buckets):
            extra = _resident_bytes(bucket, amsgrad=amsgrad, alignment=alignment)
            trial = resident | {bucket.index}
            if weights + grad_buffers(trial) + state + extra > limit:
                break
            resident, state = trial, state + extra
    else:
        want = (1.0 - float(offload_fraction)) * total
        kept = 0
        for bucket in reversed(buckets):
            if kept >= want - 1e-9 * total:
                break
            resident.add(bucket.index)
            kept += bucket.numel
            state += _resident_bytes(bucket, amsgrad=amsgrad, alignment=alignment)
    placement = Placement(
        resident=frozenset(resident),
        device_weights=weights,
        device_grad_buffers=grad_buffers(resident),
        device_resident_state=state,
        host_state=sum(
            _host_bytes(
                b, itemsize=itemsize, moment_size=moment_size, amsgrad=amsgrad, alignment=alignment
            )
            for b in buckets
            if b.index not in resident
        ),
    )
    if placement.device_total > device_free:
        raise DeviceBudgetExceeded(
            f"OffloadAdamW needs {format_bytes(placement.device_total)} "
            f"({placement.device_total} bytes) on the device but only "
            f"{format_bytes(device_free)} of the device budget is free: "
            f"weights {format_bytes(placement.device_weights)}, gradient buffers "
            f"{format_bytes(placement.device_grad_buffers)} ({GRAD_BUFFERS} x the largest "
            f"bucket), resident optimizer state {format_bytes(placement.device_resident_state)} "
            f"(offload_fraction={offload_fraction!r}). Raise the device budget, lower "
            f"OffloadConfig.bucket_bytes, or raise offload_fraction."
        )
    return placement
