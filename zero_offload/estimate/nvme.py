"""Optimizer state and weights in host RAM or on NVMe: each bucket's bytes per tier, and
which buckets a host budget keeps in RAM. Pure arithmetic over the library's own planners
(``optim.state.nvme_plan.plan_nvme``), imported when first called.

Note [the host budget decides the split]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``OffloadConfig(nvme_dir=..., host_budget="auto")`` places offloaded buckets whole, in
bucket order: in host RAM while their fp32 master and moments fit the budget; that bucket
and every later one on NVMe (``plan_nvme``). The budget is the RAM left once everything
that is in RAM whatever the placement is counted: the reserve of ``host_reserve``, the
gradient and weight staging, the tier's I/O buffers, offloaded activations. The estimator
sets it the same way from the given host memory, per rank (the node's ranks share the
RAM evenly), so a row's host bytes are those fixed bytes plus the state that fits, and its
disk bytes the state that does not. A row with NVMe fits when the fixed bytes fit the host
and the spilled state fits the disk.

Per bucket of this rank's shard ``k`` elements, training dtype ``s`` bytes, ``a(x)`` the
pool alignment (512 B), records 4 KiB-aligned per tile:

- state ``a(4k) + 2 a(4k)``: the master and AdamW's two moments in fp32, or the fields of
  the rule the estimate names (``rule_state``: Lion's and Adagrad's ``a(4k) + a(4k)``),
  each moment ``a(2k)`` with ``moments_dtype="bfloat16"``;
- staging ``2 a(sk)``: gradient staging and weight staging (the H2D copies' source); with
  the state in RAM and fp32 training the master is the source, so ``a(sk)`` only;
- record: the bucket's state file records, the state's bytes rounded up per tile;
- home ``a(sk)``: the training-dtype weights (parameter offload makes the weight staging
  the home); on NVMe, ``home_file``: its weight file, one 4 KiB-aligned record per tile
  (Note [a weight file's records] in ``weights/nvme_home.py``).

With parameter offload the budget holds the homes first (Note [homes on NVMe] in
``optim/state/nvme_plan.py``), the state in what is left: homes kept in RAM in bucket
order while they fit the budget, the rest in weight files (their state on NVMe too), with the step's weight
tile ring and the window's bounce ring (one buffer per window slot, as large as the NVMe
records of the largest unit in it) in RAM.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .buckets import BucketGroups, BucketKey
from .shape import Shape

if TYPE_CHECKING:
    from ..partition import BucketLayout
    from .rows import Context

__all__ = [
    "BucketTiers",
    "Homes",
    "StateSplit",
    "bucket_tiers",
    "context_tiers",
    "home_tiers",
    "io_buffer_bytes",
    "io_bytes",
    "split_state",
    "state_tiers",
    "total_bytes",
    "whole_bucket_tiers",
]

#: ``plan_nvme`` reads ``nvme_dir`` only to name files it does not create here.
_PLANNING_DIR = "/nonexistent/zero-offload-estimate"


@dataclass(frozen=True)
class BucketTiers:
    """One bucket's bytes (this rank's shard) in each place it may live."""

    state: int  # master and moments, in host RAM or (as ``record``) on NVMe
    staging: int  # gradient + weight staging in host RAM with the state on NVMe
    ram_staging: int  # the same with the state in RAM (fp32: no weight staging, the master is)
    grad: int  # gradient staging alone, a(s k)
    home: int  # training-dtype weights in host RAM, a(s k)
    record: int  # the state on NVMe: its records, 4 KiB-aligned per tile
    home_file: int  # the training-dtype weights on NVMe, 4 KiB-aligned
    accumulator: int  # an fp32 gradient accumulator of the shard, a(4s), host or device
    shard: int = 0  # elements of this rank's shard, s
    buffer: int = 0  # one device gradient buffer of the whole bucket (padding included)


@functools.lru_cache(maxsize=4096)
def bucket_tiers(
    numel: int,
    *,
    itemsize: int,
    bucket_bytes: int,
    world_size: int,
    rule: str = "adamw",
    moments_dtype: str = "float32",
) -> BucketTiers:
    """``BucketTiers`` of a bucket of ``numel`` elements (gaps included), planned by
    ``plan_buckets`` and ``plan_nvme`` as the optimizer plans it, at the default
    ``tile_elements``: once with an unbounded host budget (the state in RAM), once with none
    (on NVMe). ``rule``: an elementwise one (its state is per element), its moments in
    ``moments_dtype`` in RAM and in the records alike; a rule that reads whole parameters
    has ``whole_bucket_tiers``."""
    from ..optim.state.placement import POOL_ALIGNMENT
    from ..partition import plan_buckets

    layouts = plan_buckets(
        [[(0, (numel,))]],
        bucket_numel=max(1, bucket_bytes // itemsize),
        world_size=world_size,
        align_numel=POOL_ALIGNMENT // 2,
    )
    return _tiers(layouts[0], itemsize, rule, moments_dtype)


@functools.lru_cache(maxsize=4096)
def whole_bucket_tiers(
    shapes: tuple[Shape, ...],
    *,
    itemsize: int,
    bucket_bytes: int,
    world_size: int,
    rule: str,
    moments_dtype: str = "float32",
) -> BucketTiers:
    """``BucketTiers`` of a bucket of parameters of ``shapes`` (in packing order) for a rule
    that reads whole parameters: laid out by ``own_whole`` (each rank's shard the bucket's
    largest rank share), its shaped state in RAM with the staging wherever the rest of its
    state is, its records following whole parameters (Note [NVMe tiles follow whole
    parameters]; NVMe on one rank only, as the library runs it)."""
    from ..optim.state.placement import POOL_ALIGNMENT
    from ..partition import own_whole
    from .whole import planned_bucket

    planned = planned_bucket(shapes, itemsize, bucket_bytes, world_size)
    layout = own_whole([planned], align_numel=POOL_ALIGNMENT // 2)[0]
    return _tiers(layout, itemsize, rule, moments_dtype)


def _tiers(layout: BucketLayout, itemsize: int, rule: str, moments_dtype: str) -> BucketTiers:
    """``BucketTiers`` of the bucket ``layout`` (see ``bucket_tiers``)."""
    from ..config import OffloadConfig
    from ..memory.align import aligned
    from ..optim.state.nvme_plan import plan_nvme
    from ..optim.state.placement import POOL_ALIGNMENT
    from ..weights.nvme_home import weight_file_bytes
    from .planners import full_offload, rule_state

    placement = full_offload([layout], itemsize=itemsize, rule=rule, moments_dtype=moments_dtype)

    def plan(budget: int) -> tuple[int, int, int]:
        config = OffloadConfig(nvme_dir=_PLANNING_DIR, host_budget=budget)
        nvme = plan_nvme(
            [layout],
            placement,
            config=config,
            itemsize=itemsize,
            state=rule_state(rule, moments_dtype),
            rank=0,
            alignment=POOL_ALIGNMENT,
        )
        return nvme.host_pool, nvme.host_state, nvme.disk

    in_ram, state, _ = plan(2**62)
    staging, _, record = plan(0)
    shard = layout.shard_numel
    return BucketTiers(
        state=state,
        staging=staging,
        ram_staging=in_ram - state,
        grad=aligned(itemsize * shard, POOL_ALIGNMENT),
        home=aligned(itemsize * shard, POOL_ALIGNMENT),
        record=record,
        home_file=weight_file_bytes(
            layout.real_in(*layout.shard_range(0)), OffloadConfig().tile_elements, itemsize
        ),
        accumulator=aligned(4 * shard, POOL_ALIGNMENT),
        shard=shard,
        buffer=layout.padded_numel * itemsize,
    )


@functools.lru_cache(maxsize=64)
def io_buffer_bytes(rule: str = "adamw", capacity: int = 0, moments_dtype: str = "float32") -> int:
    """Host bytes of the NVMe tier's I/O buffers (one segment): ``IO_BUFFERS`` records of a
    whole tile of ``rule``'s fields, its moments in ``moments_dtype`` (of ``capacity``
    elements where a rule that reads whole parameters has a larger one: ``io_bytes``), and
    one alignment page (``nvme_plan``)."""

    from ..config import OffloadConfig
    from ..memory.storage import IO_ALIGNMENT, IO_BUFFERS
    from ..optim.state.nvme_plan import RecordLayout
    from .planners import rule_state

    fields = rule_state(rule, moments_dtype)
    record = RecordLayout.make(OffloadConfig().tile_elements, fields, capacity=capacity)
    return IO_BUFFERS * record.record_bytes + IO_ALIGNMENT


def io_bytes(groups: BucketGroups, ctx: Context) -> int:
    """``io_buffer_bytes`` of the buckets ``groups``: for a rule that reads whole parameters
    each record holds the largest tile of their whole-parameter tiles
    (``RecordLayout.for_buckets``)."""
    if not ctx.whole:
        return io_buffer_bytes(ctx.rule, moments_dtype=ctx.moments_dtype)
    from ..config import OffloadConfig
    from ..optim.state.nvme_plan import whole_parameter_tiles
    from .whole import planned_bucket

    tile = OffloadConfig().tile_elements
    largest = max(
        (
            n
            for keys, _ in groups
            for key in keys
            if not isinstance(key, int)
            for n in whole_parameter_tiles(
                planned_bucket(key, ctx.itemsize, ctx.bucket_bytes, ctx.world_size), tile
            )
        ),
        default=0,
    )
    return io_buffer_bytes(ctx.rule, largest, ctx.moments_dtype)


@dataclass(frozen=True)
class StateSplit:
    """Where a host budget puts the state (per rank); see Note [the host budget decides
    the split]."""

    host: int  # state kept in host RAM (within the budget)
    disk: int  # records of the buckets on NVMe
    spilled: int  # bytes of ``per_bucket`` (the caller's) of the buckets on NVMe


def split_state(
    groups: BucketGroups,
    tiers: Callable[[BucketKey], BucketTiers],
    budget: int | None,
    *,
    spilled_bytes: Callable[[BucketTiers], int] = lambda t: 0,
) -> StateSplit:
    """Buckets in bucket order stay in RAM while their state fits ``budget`` (``None``:
    unbounded); that bucket and every later one go to NVMe, as ``plan_nvme`` places them.
    ``spilled_bytes`` sums a further quantity over the buckets on NVMe. O(1) in a group's
    repeats."""
    host = disk = spilled = 0
    spilling = False
    for numels, repeats in groups:
        each = [tiers(numel) for numel in numels]
        if not spilling:
            state = sum(t.state for t in each)
            whole = repeats
            if budget is not None and state:
                whole = min(repeats, max(0, budget - host) // state)
            host += whole * state
            repeats -= whole
            if not repeats:
                continue
            spilling = True  # this repeat's first buckets may still fit; the rest spill
            first = 0
            while budget is not None and host + each[first].state <= budget:
                host += each[first].state
                first += 1
            disk += sum(t.record for t in each[first:])
            spilled += sum(spilled_bytes(t) for t in each[first:])
            repeats -= 1
        disk += repeats * sum(t.record for t in each)
        spilled += repeats * sum(spilled_bytes(t) for t in each)
    return StateSplit(host, disk, spilled)


def context_tiers(ctx: Context) -> Callable[[BucketKey], BucketTiers]:
    """``bucket_tiers`` (a bucket's length) or ``whole_bucket_tiers`` (its shapes) at
    ``ctx``'s training dtype, bucket size, world size, rule and moments' dtype."""

    def tiers(key: BucketKey) -> BucketTiers:
        kwargs = {
            "itemsize": ctx.itemsize,
            "bucket_bytes": ctx.bucket_bytes,
            "world_size": ctx.world_size,
            "rule": ctx.rule,
            "moments_dtype": ctx.moments_dtype,
        }
        if isinstance(key, int):
            return bucket_tiers(key, **kwargs)  # type: ignore[arg-type]
        return whole_bucket_tiers(key, **kwargs)  # type: ignore[arg-type]

    return tiers


def total_bytes(groups: BucketGroups, ctx: Context, attr: str) -> int:
    """Field ``attr`` of ``BucketTiers`` summed over the buckets ``groups``, per rank."""
    tiers = context_tiers(ctx)
    return sum(repeats * sum(getattr(tiers(n), attr) for n in numels) for numels, repeats in groups)


def state_tiers(groups: BucketGroups, ctx: Context, budget: int | None) -> tuple[int, int]:
    """``(host, disk)`` per rank of buckets ``groups`` placed as ``plan_nvme`` places them:
    every bucket's staging in RAM, the state up to ``budget`` too, the rest on NVMe with the
    I/O buffers in RAM."""
    split = split_state(
        groups, context_tiers(ctx), budget, spilled_bytes=lambda t: t.staging - t.ram_staging
    )
    host = total_bytes(groups, ctx, "ram_staging") + split.spilled + split.host
    return host + (io_bytes(groups, ctx) if split.disk else 0), split.disk


def home_tiers(
    groups: BucketGroups, ctx: Context, budget: int | None, *, prefetch_layers: int = 1
) -> tuple[int, int]:
    """``(host, disk)`` per rank of the units' buckets ``groups`` (bucket order) placed as
    ``plan_nvme`` places them with the homes movable (Note [homes on NVMe]): ``budget``
    holds the homes first, in bucket order, the rest going to their weight files; the
    state takes what is left (``state_tiers``). With a home on disk the weight tile ring
    and the bounce ring (per window slot, the largest unit's NVMe records + 4 KiB) join the
    host. O(buckets per unit x groups)."""
    from ..config import OffloadConfig
    from ..memory.storage import IO_ALIGNMENT
    from ..params.window import plan_slots
    from ..weights.nvme_home import home_ring_bytes

    if budget is None:
        return state_tiers(groups, ctx, None)
    tiers = context_tiers(ctx)
    kept, moved, home_disk = 0, 0, 0
    runs: list[tuple[int, int]] = []  # (a unit's weight files' bytes, units), bucket order
    for numels, repeats in groups:
        each = [tiers(n) for n in numels]
        home, files = sum(t.home for t in each), sum(t.home_file for t in each)
        if not moved:  # the repeats that fit whole, then one unit bucket by bucket
            whole = repeats if home == 0 else min(repeats, max(0, budget - kept) // home)
            kept += whole * home
            runs.append((0, whole))
            repeats -= whole
            if repeats:
                unit = 0
                for t in each:
                    if not moved and kept + t.home <= budget:
                        kept += t.home
                        continue
                    moved += t.home
                    unit += t.home_file
                home_disk += unit
                runs.append((unit, 1))
                repeats -= 1
        moved += repeats * home
        home_disk += repeats * files
        runs.append((files, repeats))
    host, disk = state_tiers(groups, ctx, budget - kept)
    if not moved:
        return host, disk
    _, slots = plan_slots(
        *_ring_units(runs[::-1], prefetch_layers), prefetch_layers=prefetch_layers
    )
    host += home_ring_bytes(OffloadConfig().tile_elements, ctx.itemsize) - moved
    host += sum(n + IO_ALIGNMENT for n in slots if n)
    return host, disk + home_disk


def _ring_units(runs: list[tuple[int, int]], prefetch_layers: int) -> tuple[list[int], list[bool]]:
    """``plan_slots``' arguments for the units ``runs`` (``(bytes, count)``, forward order),
    each run cut to a count it plans alike: a ring of ``r`` slots gives the units of a run
    every slot once the run has ``r`` of them, so ``r`` plus the count's remainder mod ``r``
    (which keeps the next run's slots) stand for any longer run. O(runs x ring), not O(units):
    a search over the layers plans models of a million units."""
    ring = prefetch_layers + 2
    units = []
    for nbytes, count in runs:
        units += [nbytes] * (count if count < 2 * ring else ring + count % ring)
    return units, [False] * len(units)


class Homes(enum.Enum):
    """Where the training-dtype weights (each unit's home) live under parameter offload."""

    HOST = "host RAM: pinned, the H2D copies' source"
    NVME = "NVMe beyond the host budget: read into host bounce buffers, then to the device"
