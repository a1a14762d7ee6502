"""Flat buckets and who owns which slice: pure arithmetic, no tensors.

Parameters are packed, group by group and in reverse registration order (which approximates
the order backward produces their gradients), into buckets of at most ``bucket_numel``
elements (a parameter larger than that gets a bucket of its own). Each parameter's slot
starts at a multiple of ``slot_align_numel`` elements (Note [slots are aligned]), and each
bucket's flat length is padded up to a multiple of ``world_size * align_numel`` so that
every rank owns an equal, aligned, contiguous shard.

Note [padding stays at the end]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A bucket's parameters occupy ``[0, numel)`` of its flat buffer, with only the alignment gaps
of Note [slots are aligned] between them; the sharding padding is ``[numel, padded_numel)``.
Gap and padding elements start at zero, receive zero gradients and therefore stay zero
through Adam (zero gradient, zero weight, zero moments stay zero), and no parameter view
ever covers them, so they never reach the user's tensors. ``numel`` counts the gaps (it is
where the last slot ends); ``param_numel`` counts parameter elements only.

Note [slots are aligned]
~~~~~~~~~~~~~~~~~~~~~~~~
Every slot's offset is a multiple of ``slot_align_numel`` elements (default
``SLOT_ALIGN_NUMEL`` = 16: 64 bytes of fp32, a cache line and a full AVX-512 vector). A
parameter view that starts mid-vector makes every vectorised kernel over it (the CPU Adam's
numba loops, cuBLASLt's and Inductor's kernels, which want 16-byte-aligned operands) take
its slow unaligned path; FSDP pads each parameter the same way. The cost is fewer than
``slot_align_numel`` elements per parameter, which the memory formula counts through
``padded_numel`` (``optim/state/placement.py``, and so ``estimate.py``).

Note [who owns which shard]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
With ``world_size`` ranks, rank ``r`` owns ``[r * shard_numel, (r + 1) * shard_numel)`` of
every bucket (``shard_range``): the fp32 master weights, moments and gradient accumulator
of those elements live only on rank ``r`` (in its host pool), and only rank ``r`` runs Adam
on them. Shards tile the padded bucket exactly once, in rank order, so the padding (at the
end, Note [padding stays at the end]) falls in the last ranks' shards, and a parameter may
straddle two or more shards; each rank then holds a contiguous piece of it
(``owned_piece``). Every rank keeps the whole bucket's training-dtype weights on its device.
A rule that reads whole parameters gets another layout of the same shape, where no
parameter straddles two shards: Note [a whole parameter has one owner].

Note [a whole parameter has one owner]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Adafactor and Muon read a whole parameter per update (Note [rules that read a whole
parameter] in ``optim/rule/base.py``), so on several ranks each parameter is stepped whole,
by one rank, its owner. ``own_whole`` lays each planned bucket out again so that the flat
range shards of Note [who owns which shard] fall on parameter boundaries: rank ``r``'s
parameters sit at the start of ``[r * shard_numel, (r + 1) * shard_numel)``, in the order
the bucket had them, and the rest of that shard is a gap of zeros (as between slots, Note
[padding stays at the end]: no view covers it, its gradient is zeroed with the other gaps).
So every rank-level path stays as it is and is exact: the reduce-scatter leaves each
parameter's averaged gradient with its owner, the owner steps it with the host kernel, and
the all-gather of the shards hands every rank the owner's weights.

Balance: within a bucket the parameters go, largest first, each to the rank with the least
of that bucket so far (ties: the least over every bucket so far, then the lowest rank), and
the shard is the most any rank got, rounded up to ``align_numel``. Largest-first keeps the
bucket's padding, and so every rank's device and host bytes for it (``shard_numel`` each,
as for any layout), near the bucket's ``1 / world_size``; the tie-break moves a bucket
that holds one parameter (one larger than ``bucket_numel``) to the rank with the least
work so far, so the owners rotate. The cost is the padding: a bucket of one parameter
holds ``world_size`` times its elements on each device and every rank keeps host state for
a shard of that size, of which one rank uses any. Smaller ``bucket_bytes`` than the largest
parameters mean more such buckets. The pools are sized from these shards (the estimator's
rows plan the same shards: Note [a whole-parameter rule's buckets are planned one by one]
in ``estimate/pools.py``). The map is a pure function of the layouts, so every rank
computes the same one and none is sent. Work is
balanced by elements: Adafactor's step is linear in them; Newton-Schulz on an ``m x n``
matrix costs ``m n min(m, n)``, so a model whose matrices differ widely in shape balances
Muon's time less evenly than its memory.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "SLOT_ALIGN_NUMEL",
    "BucketLayout",
    "ParamSlot",
    "balance_owners",
    "clip_runs",
    "own_whole",
    "plan_buckets",
]

#: Default alignment of each parameter's slot in its bucket, elements; Note [slots are aligned].
SLOT_ALIGN_NUMEL = 16


@dataclass(frozen=True)
class ParamSlot:
    """Where one parameter lives in its bucket's flat buffer (elements, not bytes)."""

    index: int  # position of the parameter in the optimizer's flat parameter list
    shape: tuple[int, ...]
    offset: int  # first element in the bucket
    numel: int

    @property
    def end(self) -> int:
        """One past the last element."""
        return self.offset + self.numel


@dataclass(frozen=True)
class BucketLayout:
    """One bucket: its parameters' slots, its padded length, and the shards of each rank."""

    index: int  # position in the optimizer's bucket list
    group: int  # param group the bucket's parameters belong to
    slots: tuple[ParamSlot, ...]
    numel: int  # where the last slot ends: parameters and their alignment gaps, [0, numel)
    padded_numel: int  # multiple of world_size * align_numel; padding is [numel, padded_numel)
    world_size: int

    @property
    def param_numel(self) -> int:
        """Elements of parameters, without alignment gaps or padding."""
        return sum(slot.numel for slot in self.slots)

    @property
    def shard_numel(self) -> int:
        """Elements each rank owns."""
        return self.padded_numel // self.world_size

    def shard_range(self, rank: int) -> tuple[int, int]:
        """``[start, stop)`` of the flat buffer that ``rank`` owns."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {rank}")
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    def real_in(self, start: int, stop: int) -> int:
        """Elements of ``[start, stop)`` before the sharding padding: parameters and their
        (zero) alignment gaps, Note [padding stays at the end]."""
        return max(0, min(stop, self.numel) - start)

    def owned_piece(self, slot: ParamSlot, start: int, stop: int) -> tuple[int, int]:
        """The piece ``[lo, hi)`` of ``slot``'s flattened parameter inside ``[start, stop)``
        of the bucket (``lo == hi`` when none); see Note [who owns which shard]."""
        lo, hi = max(slot.offset, start), min(slot.end, stop)
        if lo >= hi:
            return 0, 0
        return lo - slot.offset, hi - slot.offset

    def owner(self, slot: ParamSlot) -> int | None:
        """The rank whose shard holds all of ``slot``, or None when it straddles shards
        (Note [a whole parameter has one owner])."""
        first, last = slot.offset // self.shard_numel, (slot.end - 1) // self.shard_numel
        return first if first == last else None

    def slots_in(self, start: int, stop: int) -> list[tuple[ParamSlot, int, int]]:
        """The parameter pieces inside ``[start, stop)``: ``(slot, lo, hi)`` in bucket elements."""
        pieces = []
        for slot in self.slots:
            lo, hi = max(slot.offset, start), min(slot.end, stop)
            if lo < hi:
                pieces.append((slot, lo, hi))
        return pieces


def clip_runs(
    runs: Sequence[tuple[int, int, int]], start: int, stop: int
) -> list[tuple[int, int, int]]:
    """``(lo, hi, step)`` bucket ranges cut to ``[start, stop)`` and shifted to start there
    (shard-local element numbers); empty pieces are dropped."""
    pieces = []
    for lo, hi, step in runs:
        lo, hi = max(lo, start), min(hi, stop)
        if lo < hi:
            pieces.append((lo - start, hi - start, step))
    return pieces


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def plan_buckets(
    groups: Sequence[Sequence[tuple[int, tuple[int, ...]]]],
    *,
    bucket_numel: int,
    world_size: int = 1,
    align_numel: int = 128,
    slot_align_numel: int = SLOT_ALIGN_NUMEL,
) -> list[BucketLayout]:
    """Pack parameters into buckets.

    ``groups[g]`` lists ``(index, shape)`` of group ``g``'s parameters in registration order.
    Returns the buckets in the order backward is expected to fill them: groups last to first,
    and within a group parameters last to first. See Note [padding stays at the end] and
    Note [slots are aligned]. A bucket holds at most ``bucket_numel`` elements counting the
    alignment gaps (or one parameter, if that alone is larger).
    """
    for name, value in (
        ("bucket_numel", bucket_numel),
        ("world_size", world_size),
        ("align_numel", align_numel),
        ("slot_align_numel", slot_align_numel),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    buckets: list[BucketLayout] = []
    multiple = world_size * align_numel

    def close(group: int, slots: list[ParamSlot], numel: int) -> None:
        if slots:
            buckets.append(
                BucketLayout(
                    index=len(buckets),
                    group=group,
                    slots=tuple(slots),
                    numel=numel,
                    padded_numel=_round_up(numel, multiple),
                    world_size=world_size,
                )
            )

    for group in reversed(range(len(groups))):
        slots: list[ParamSlot] = []
        numel = 0
        for index, shape in reversed(groups[group]):
            size = 1
            for dim in shape:
                size *= dim
            if size == 0:
                continue
            offset = _round_up(numel, slot_align_numel)  # Note [slots are aligned]
            if slots and offset + size > bucket_numel:
                close(group, slots, numel)
                slots, offset = [], 0
            slots.append(ParamSlot(index=index, shape=tuple(shape), offset=offset, numel=size))
            numel = offset + size
        close(group, slots, numel)
    return buckets


def own_whole(
    layouts: Sequence[BucketLayout],
    *,
    align_numel: int,
    slot_align_numel: int = SLOT_ALIGN_NUMEL,
) -> list[BucketLayout]:
    """``layouts`` laid out again so that each parameter lies whole in one rank's shard,
    the ranks' loads balanced; index, group and parameters unchanged. See Note [a whole
    parameter has one owner]. One rank: the layouts as they were."""
    if not layouts or layouts[0].world_size == 1:
        return list(layouts)
    world = layouts[0].world_size
    total = [0] * world  # elements each rank owns over the buckets so far
    result = []
    for layout in layouts:
        owner, load = balance_owners(layout, total, slot_align_numel)
        shard = _round_up(max(load), align_numel)
        slots: list[ParamSlot] = []
        for rank in range(world):
            offset = rank * shard
            for position, slot in enumerate(layout.slots):
                if owner[position] == rank:
                    slots.append(dataclasses.replace(slot, offset=offset))
                    offset = _round_up(offset + slot.numel, slot_align_numel)
        result.append(
            dataclasses.replace(
                layout, slots=tuple(slots), numel=slots[-1].end, padded_numel=world * shard
            )
        )
    return result


def balance_owners(
    layout: BucketLayout, total: list[int], slot_align_numel: int
) -> tuple[list[int], list[int]]:
    """The owner of each of ``layout``'s slots (by position) and each rank's aligned
    elements in it; ``total`` (each rank's elements over the buckets so far) is updated.
    Largest first, to the least loaded: Note [a whole parameter has one owner]."""
    world = len(total)
    load = [0] * world
    owner = [0] * len(layout.slots)
    order = sorted(range(len(layout.slots)), key=lambda i: (-layout.slots[i].numel, i))
    for position in order:
        rank = min(range(world), key=lambda r: (load[r], total[r], r))
        owner[position] = rank
        load[rank] += _round_up(layout.slots[position].numel, slot_align_numel)
        total[rank] += layout.slots[position].numel
    return owner, load
