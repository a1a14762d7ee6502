"""With parameter offload, which order a segment's units are built in and how many host
bytes each unit's pool takes: pure arithmetic, before anything is pinned.

Note [homes are pinned unit by unit]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
With parameter offload an offloaded bucket keeps its home (its training-dtype weights: the
weight staging, or the fp32 master), its master, moments and gradient staging in host
memory (or, past ``host_budget``, part of them on NVMe: Note [homes on NVMe] in
``state/nvme_plan.py``). One host pool for the segment, pinned whole before the weights
move, would sit beside every original not yet moved: host peak = final + the model. So the
segment pins one host pool per unit instead, each of exactly its offloaded buckets' bytes
(``NvmePlan.bucket_host``, less their own gradient staging where the in-flight ring
replaces it; with a rule that reads whole parameters, its shaped state too: Note [rules
that read a whole parameter] in ``rule/base.py``), allocated once and never resized. A
unit that needs no host bytes pins no pool: a unit of resident buckets, or one whose homes
are all on NVMe with in-flight staging (its gradient paths then take their name and
alignment from the weight tile ring's pool, which exists exactly then; nothing of theirs
is allocated there). Segment-wide buffers come first: the NVMe tier's I/O buffers, the
in-flight staging ring and the weight tile ring of the homes on NVMe (``F0`` below).

A unit is built in three moves (``unit_build.build_units``): its buckets' originals
are copied into its window slot on the device and released (``ParamOffloader.views_for``),
then its pool is pinned, then its stores take their homes from the slot and the slot is
free again. A unit's pool and its own originals never coexist. Host bytes after unit ``u``
is built: ``F0 + M + sum_{j <= u} d_j`` with ``M`` the originals in host memory at the call
(CPU weights, pinned or not, and device weights after Note [originals on the device leave
first] in ``weights/source.py``) and ``d_j`` = unit ``j``'s pool less its originals. Units
with ``d <= 0`` (homes on NVMe with in-flight staging, resident buckets, a shard of the
homes on many ranks) are built first, then the others, each group in bucket order: the
running sum falls, then rises to the final footprint ``F``. So

    host peak = max(F0 + M, F)   (plus the one checkpoint tensor being read, from meta)

and when every unit's pool holds at least its originals (one rank, every bucket offloaded
and its home in RAM: the home alone is the original's size) the peak is ``F`` itself,
within the "final footprint plus one unit" the design asks. Where the final footprint is
smaller than the model (homes on NVMe) it is the model the caller had plus ``F0``: the
library adds nothing but its segment-wide buffers. Measured by the ledger: Note
[construction peaks] in ``weights/source.py``. The stores are built in this order, then
listed in bucket order (and an NVMe stream group keeps bucket order as they join it).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

from ..memory.align import aligned
from ..partition import BucketLayout

__all__ = ["UnitBuild", "plan_units"]


class UnitBuild(NamedTuple):
    """One unit's step of a segment's construction (Note [homes are pinned unit by unit])."""

    unit: int  # its index in ParamOffloader.units
    layouts: tuple[BucketLayout, ...]  # its buckets, in bucket order
    capacity: int  # bytes of its host pool, pinned when it is built; 0: no pool of its own
    freed: int  # host bytes of its originals that its build releases


def plan_units(
    layouts: Sequence[BucketLayout],
    *,
    unit_of: Callable[[BucketLayout], int],
    host_bytes: Mapping[int, int],
    freed: Callable[[BucketLayout], int],
    alignment: int,
) -> list[UnitBuild]:
    """The units of ``layouts`` in build order: those whose pool is no larger than their
    originals first, then the rest, each group in bucket order.

    ``unit_of``: a bucket's unit; ``host_bytes``: per offloaded bucket index, its bytes in
    its unit's pool (a resident bucket is absent: it has none); ``freed``: host bytes of a
    bucket's originals not yet released; ``alignment``: the pools' (each bucket's bytes
    are multiples of it already)."""
    by_unit: dict[int, list[BucketLayout]] = {}
    for layout in layouts:
        by_unit.setdefault(unit_of(layout), []).append(layout)
    builds = []
    for unit, members in by_unit.items():
        capacity = aligned(sum(host_bytes.get(b.index, 0) for b in members), alignment)
        builds.append(UnitBuild(unit, tuple(members), capacity, sum(map(freed, members))))
    return sorted(builds, key=lambda build: build.capacity > build.freed)  # stable
