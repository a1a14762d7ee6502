"""Which parameters share a bucket, which buckets stay on the device, and how many bytes
each tier needs: pure arithmetic.

A bucket holds one param group's parameters of one training dtype (``plan_dtype_buckets``):
bf16 weights with fp32 norms, or fp32 adapters on a bf16 base, give buckets of each dtype
side by side, each with its own weights, gradient buffer, staging and copy-out.

Byte counts per bucket of ``n = padded_numel`` elements (parameters, their slot alignment
gaps, Note [slots are aligned] in partition.py, and the sharding padding), ``s`` = that
bucket's training dtype bytes, ``a(x)`` = ``x`` rounded up to the pool alignment:

- device, every bucket: weights ``a(n*s)``;
- device, resident bucket: the rule's state fields, all fp32 (``sum a(4n)`` over them: the
  master and, for Adam, two moments and a third with its max-moment option), and the fp32
  grad accumulator ``a(4n)``; for a rule that reads whole parameters, its shaped state
  too, ``a(4r)`` with ``r`` the fp32 elements of every slot's ``param_state``;
- device, offloaded buckets together: ``GRAD_BUFFERS`` gradient buffers, each of the
  largest offloaded bucket in bytes, ``max a(n*s)`` over the offloaded buckets of every
  dtype (Note [a bucket's gradient lifecycle]);
- host, offloaded bucket, with ``k = n / world_size`` (this rank's shard, Note [who owns
  which shard] in partition.py): the rule's state fields, ``sum a(k*f)`` (``f`` each
  field's bytes: the fp32 master 4, Adam's two moments 4 each or 2 in bf16), gradient staging ``a(k*s)``, and weight
  staging ``a(k*s)`` unless the bucket's training dtype is fp32; for a rule that reads
  whole parameters (Adafactor), its shaped state too, ``a(4r)`` with ``r`` the fp32
  elements of every slot's ``param_state``. The fp32 gradient
  accumulator, ``a(4k)``, is not in the pool: it is allocated in a pool of its own the first
  time a window accumulates (a second micro-batch), Note [no accumulator for one backward]
  in grads/to_host.py; ``grads.buffers.accumulator_bytes`` gives it. So does a second gradient
  staging buffer ``a(k*s)`` (``grads.buffers.spare_staging_bytes``, Note [two staging buffers
  for accumulation]). So one micro-batch of bf16 costs 4 + 8 + 2 + 2 = 16 host bytes per
  parameter, and 22 with accumulation.

Frozen parameters (``requires_grad=False``) are in no bucket, so they count nowhere.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ...config import format_bytes
from ...errors import DeviceBudgetExceeded
from ...memory.align import aligned
from ...partition import BucketLayout, plan_buckets
from ...views import Family
from ..rule.base import StateFields

__all__ = [
    "GRAD_BUFFERS",
    "POOL_ALIGNMENT",
    "Placement",
    "plan_dtype_buckets",
    "plan_placement",
]

#: Alignment of every block in OffloadAdamW's pools, bytes; buckets are padded to multiples
#: of it too (Note [padding stays at the end] in partition.py; each parameter's slot is
#: aligned as well, Note [slots are aligned]).
POOL_ALIGNMENT = 512

#: Device gradient buffers for offloaded buckets: one filling while the previous one's
#: copy to the host is in flight.
GRAD_BUFFERS = 2


@dataclass(frozen=True)
class Placement:
    """The outcome: which buckets are resident, and each pool's exact capacity in bytes."""

    resident: frozenset[int]  # bucket indices kept on the device
    device_weights: int
    device_grad_buffers: int
    device_resident_state: int
    host_state: int
    #: The largest resident step's temporaries, beside the pool (``step_temporaries``).
    device_step_temporaries: int = 0

    @property
    def device_total(self) -> int:
        """Bytes of the device pool."""
        return self.device_weights + self.device_grad_buffers + self.device_resident_state


def _resident_bytes(bucket: BucketLayout, *, state: StateFields, alignment: int) -> int:
    n = bucket.padded_numel
    total = state.bytes_for(n, alignment) + aligned(4 * n, alignment)  # + the accumulator
    # A whole-parameter rule's shaped state, every slot's (one rank: Note [whole
    # parameters stepped on the device] in whole_resident.py); 0 for an elementwise rule.
    return total + state.param_state_bytes((slot.shape for slot in bucket.slots), alignment)


def _host_bytes(bucket: BucketLayout, *, itemsize: int, state: StateFields, alignment: int) -> int:
    n = bucket.shard_numel  # this rank's shard only, Note [who owns which shard]
    total = state.bytes_for(n, alignment)  # no accumulator (accumulator_bytes)
    total += _shaped_bytes(bucket, state=state, alignment=alignment)
    total += aligned(itemsize * n, alignment)  # gradient staging
    if itemsize != 4:
        total += aligned(itemsize * n, alignment)
    return total


def _shaped_bytes(bucket: BucketLayout, *, state: StateFields, alignment: int) -> int:
    """The block of a whole-parameter rule's shaped state (Note [rules that read a whole
    parameter] in rule/base.py) on the rank that keeps the most of it: each rank keeps its
    own parameters' (Note [a whole parameter has one owner] in partition.py), and every
    rank's pool is sized alike, as the shards are. 0 for an elementwise rule."""
    owned: dict[int, list[tuple[int, ...]]] = {}
    for slot in bucket.slots:
        owned.setdefault(bucket.owner(slot) or 0, []).append(slot.shape)
    return max(state.param_state_bytes(shapes, alignment) for shapes in owned.values())


def plan_dtype_buckets(
    families: Sequence[Family],
    *,
    bucket_bytes: int,
    world_size: int,
    align_numel: int,
    first_index: int = 0,
) -> list[BucketLayout]:
    """Pack each training dtype's parameters into buckets of that dtype alone.

    Each dtype gets ``partition.plan_buckets`` with ``bucket_bytes // itemsize`` elements
    per bucket, over its families in group order. The dtypes' buckets are then interleaved
    in the order backward is expected to fill them (descending highest parameter index:
    groups last to first, parameters last to first, as ``plan_buckets`` orders one dtype),
    so an fp32 norm's bucket sits among the bf16 buckets of its layers. Returned layouts
    are numbered ``first_index, first_index + 1, ...`` in that order and carry their real
    param group index.
    """
    planned: list[BucketLayout] = []
    for dtype in dict.fromkeys(family.dtype for family in families):
        same = [family for family in families if family.dtype == dtype]
        for layout in plan_buckets(
            [family.members for family in same],
            bucket_numel=max(1, bucket_bytes // dtype.itemsize),
            world_size=world_size,
            align_numel=align_numel,
        ):
            planned.append(dataclasses.replace(layout, group=same[layout.group].group))
    # Stable: within one dtype the highest indices already decrease bucket by bucket.
    planned.sort(key=lambda layout: -layout.slots[0].index)
    return [
        dataclasses.replace(layout, index=first_index + position)
        for position, layout in enumerate(planned)
    ]


def plan_placement(
    buckets: Sequence[BucketLayout],
    *,
    itemsize: int | Sequence[int],
    state: StateFields,
    resident_state: StateFields,
    offload_fraction: float | str,
    device_free: int,
    auto_headroom: float,
    alignment: int,
    weights_elsewhere: frozenset[int] = frozenset(),
    step_temporaries: Mapping[int, int] | None = None,
    owner: str = "the optimizer",
) -> Placement:
    """Choose the resident buckets and size the pools.

    A float ``offload_fraction`` keeps the last buckets in backward order (the first
    parameters registered, whose gradients arrive last, so their copies would be the most
    exposed) on the device until ``1 - offload_fraction`` of the elements are resident.
    ``"auto"`` keeps as many as fit in ``device_free * (1 - auto_headroom)``. Raises
    ``DeviceBudgetExceeded`` when even full offload does not fit ``device_free``.

    ``itemsize``: training dtype bytes, one for every bucket or one per bucket of
    ``buckets`` (mixed training dtypes, ``plan_dtype_buckets``). ``weights_elsewhere``:
    indices of buckets whose weights are not in the device pool (parameter offload keeps
    them in a window of its own, ``zero_offload.params``). ``state``: the rule's fields of an
    offloaded bucket (its moments in ``OffloadConfig.moments_dtype``); ``resident_state``:
    of a resident one (all fp32). ``step_temporaries``: by bucket index, the device bytes a
    resident bucket's step allocates beyond the pool at once, where they grow with a
    parameter rather than a tile (a rule that reads whole parameters: Note [whole
    parameters stepped on the device] in ``whole_resident.py``); the largest over the
    resident buckets must fit beside the pool, within ``"auto"``'s limit too. ``owner``:
    who needs the bytes, as the refusal names it (the optimizer's class).
    """
    temporaries = step_temporaries or {}

    def largest_step(resident: set[int]) -> int:
        return max((temporaries.get(index, 0) for index in resident), default=0)

    if isinstance(itemsize, int):
        sizes_of = {b.index: itemsize for b in buckets}
    else:
        if len(itemsize) != len(buckets):
            raise ValueError(
                f"itemsize must be one int or one per bucket ({len(buckets)}), got "
                f"{len(itemsize)} values"
            )
        sizes_of = {b.index: size for b, size in zip(buckets, itemsize, strict=True)}
    total = sum(b.param_numel for b in buckets) or 1  # parameter elements, no gaps
    weights = sum(
        aligned(b.padded_numel * sizes_of[b.index], alignment)
        for b in buckets
        if b.index not in weights_elsewhere
    )

    def grad_buffers(resident: set[int]) -> int:
        # Each buffer must hold the largest offloaded bucket of any dtype, in bytes.
        sizes = [b.padded_numel * sizes_of[b.index] for b in buckets if b.index not in resident]
        return GRAD_BUFFERS * aligned(max(sizes), alignment) if sizes else 0

    resident: set[int] = set()
    on_device = 0  # the resident buckets' state and accumulators
    if offload_fraction == "auto":
        limit = int(device_free * (1 - auto_headroom))
        for bucket in reversed(buckets):
            extra = _resident_bytes(bucket, state=resident_state, alignment=alignment)
            trial = resident | {bucket.index}
            if weights + grad_buffers(trial) + on_device + extra + largest_step(trial) > limit:
                break
            resident, on_device = trial, on_device + extra
    else:
        want = (1.0 - float(offload_fraction)) * total
        kept = 0
        for bucket in reversed(buckets):
            if kept >= want - 1e-9 * total:
                break
            resident.add(bucket.index)
            kept += bucket.param_numel
            on_device += _resident_bytes(bucket, state=resident_state, alignment=alignment)
    placement = Placement(
        resident=frozenset(resident),
        device_weights=weights,
        device_grad_buffers=grad_buffers(resident),
        device_resident_state=on_device,
        host_state=sum(
            _host_bytes(b, itemsize=sizes_of[b.index], state=state, alignment=alignment)
            for b in buckets
            if b.index not in resident
        ),
        device_step_temporaries=largest_step(resident),
    )
    step = placement.device_step_temporaries
    if placement.device_total + step > device_free:
        steps = f", and {format_bytes(step)} of step temporaries beside them" if step else ""
        raise DeviceBudgetExceeded(
            f"{owner} needs {format_bytes(placement.device_total)} "
            f"({placement.device_total} bytes) on the device{steps} but only "
            f"{format_bytes(device_free)} of the device budget is free: "
            f"weights {format_bytes(placement.device_weights)}, gradient buffers "
            f"{format_bytes(placement.device_grad_buffers)} ({GRAD_BUFFERS} x the largest "
            f"bucket), resident optimizer state {format_bytes(placement.device_resident_state)} "
            f"(offload_fraction={offload_fraction!r}). {_budget_advice(placement, offload_fraction)}"
        )
    return placement


def _budget_advice(placement: Placement, offload_fraction: float | str) -> str:
    """What would make ``placement`` fit, by what it holds: a setting already at its limit
    (``offload_fraction=1.0`` keeps no optimizer state on the device) is not offered."""
    fixes = ["raise the device budget (AcceleratorConfig(device_budget=...))"]
    if placement.device_resident_state:
        fixes.append(
            f"raise OffloadConfig.offload_fraction (now {offload_fraction!r}; 1.0 keeps no "
            f"optimizer state on the device, freeing "
            f"{format_bytes(placement.device_resident_state)})"
        )
    if placement.device_grad_buffers:
        fixes.append(
            f"lower OffloadConfig.bucket_bytes (the gradient buffers are {GRAD_BUFFERS} x "
            "the largest bucket)"
        )
    if placement.device_weights:
        full = "" if offload_fraction == 1.0 else ", offload_fraction=1.0"
        fixes.append(
            f"offload the weights too (OffloadConfig(offload_parameters=True{full}) with "
            "model= on the optimizer: a window of layers on the device instead of all "
            f"{format_bytes(placement.device_weights)})"
        )
    return "To fit: " + "; ".join(fixes[:-1]) + "; or " + fixes[-1] + "."
