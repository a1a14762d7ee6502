"""The exact pool sizes of ``OffloadAdamW`` for given parameter shapes, planned as the
optimizer plans them (``partition.plan_buckets``, ``optim.state.placement.plan_placement``,
``params.window.plan_slots``). The planners live in packages that import torch, so they are
imported when first called, never when the estimator is imported."""

from __future__ import annotations

import functools
import math
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING

from .shape import ModelShape, Shape, Unit

if TYPE_CHECKING:
    from ..optim.rule.base import StateFields
    from ..optim.state.placement import Placement
    from ..partition import BucketLayout

__all__ = [
    "BucketGroups",
    "device_shard_bytes",
    "module_bucket_numels",
    "offload_adamw_bytes",
    "offload_bytes_of_count",
    "param_offload_bytes",
    "rule_state_bytes",
    "shape_bucket_groups",
    "shape_bucket_numels",
    "shape_offload_bytes",
    "unit_bucket_groups",
]


def offload_adamw_bytes(
    shapes: Sequence[Shape], *, itemsize: int, bucket_bytes: int, world_size: int = 1
) -> tuple[int, int, int]:
    """``(device weights, device gradient buffers, host per rank)`` of a fully offloaded
    ``OffloadAdamW`` over parameters of ``shapes``: its exact pool sizes, in bytes."""
    from ..optim.state.placement import POOL_ALIGNMENT
    from ..partition import plan_buckets

    layouts = plan_buckets(
        [[(i, shape) for i, shape in enumerate(shapes)]],
        bucket_numel=max(1, bucket_bytes // itemsize),
        world_size=world_size,
        align_numel=POOL_ALIGNMENT // 2,
    )
    placement = _full_offload(layouts, itemsize=itemsize)
    # plan_placement sizes the host pool for this rank's shards already.
    return placement.device_weights, placement.device_grad_buffers, placement.host_state


@functools.lru_cache(maxsize=8)
def rule_state(rule: str = "adamw") -> StateFields:
    """The state fields of optimizer ``rule`` with its default options, fp32 (the
    optimizer's default ``moments_dtype``): what every offloaded row sizes, as the optimizer
    asks its rule (Note [the rule is the only place that knows the optimizer])."""
    import torch

    from ..optim.rule import by_name

    return by_name(rule).state_fields(torch.float32, ())


def rule_state_bytes(rule: str, shapes: Sequence[Shape]) -> int:
    """Host state bytes of optimizer ``rule`` (default options, fp32) over parameters of
    ``shapes``, alignment aside: every element's fields, and the shaped state of a rule
    that reads whole parameters (Adafactor's factors: ``4 (m + n)`` bytes per ``(m, n)``
    matrix, 4 per element below two dims; Muon's momentum buffer, 4 per matrix element, and
    AdamW's moments beside it, 8 per other element; Note [rules that read a whole
    parameter]). The rows by parameter count (``Context.state_bytes``) size the per-element
    part only."""
    fields = rule_state(rule)
    numel = sum(math.prod(shape) for shape in shapes)
    return fields.bytes_per_element * numel + 4 * fields.param_state_numel(
        tuple(shape) for shape in shapes
    )


def _full_offload(
    layouts: Sequence[BucketLayout],
    *,
    itemsize: int,
    weights_elsewhere: frozenset[int] = frozenset(),
) -> Placement:
    """``plan_placement`` of ``layouts`` with everything offloaded, AdamW's state in fp32
    (``rule_state``), no budget."""
    from ..optim.state.placement import POOL_ALIGNMENT, plan_placement

    return plan_placement(
        layouts,
        itemsize=itemsize,
        state=rule_state(),
        resident_state=rule_state(),
        offload_fraction=1.0,
        device_free=2**62,
        auto_headroom=0.0,
        alignment=POOL_ALIGNMENT,
        weights_elsewhere=weights_elsewhere,
    )


@functools.lru_cache(maxsize=1024)
def _unit_pools(
    shapes: tuple[Shape, ...], *, itemsize: int, bucket_bytes: int, world_size: int = 1
) -> tuple[int, int, int]:
    """``(window bytes, gradient buffers, host per rank)`` of one unit under parameter
    offload: its own buckets (a unit never shares one), planned as the optimizer plans them.
    With ``world_size`` ranks (ZeRO-3 with offload) the slot still holds the whole unit,
    gathered, and the host holds this rank's shard."""
    from ..memory.align import aligned
    from ..optim.state.placement import POOL_ALIGNMENT
    from ..partition import plan_buckets

    layouts = plan_buckets(
        [list(enumerate(shapes))],
        bucket_numel=max(1, bucket_bytes // itemsize),
        world_size=world_size,
        align_numel=POOL_ALIGNMENT // 2,
    )
    nbytes = sum(aligned(layout.padded_numel * itemsize, POOL_ALIGNMENT) for layout in layouts)
    placement = _full_offload(
        layouts, itemsize=itemsize, weights_elsewhere=frozenset(b.index for b in layouts)
    )
    return nbytes, placement.device_grad_buffers, placement.host_state


def param_offload_bytes(
    shape: ModelShape,
    *,
    itemsize: int,
    bucket_bytes: int,
    prefetch_layers: int = 1,
    world_size: int = 1,
) -> tuple[int, int, int]:
    """``(device window, device gradient buffers, host per rank)`` of ``OffloadAdamW`` with
    ``OffloadConfig(offload_parameters=True)`` over a model of ``shape`` (its units,
    ``ModelShape.parameter_units``): the exact pool sizes, with one rank or several (ZeRO-3
    with offload, ``_unit_pools``).

    Each unit's buckets are its own, so each distinct unit is planned once (the blocks are
    alike): the host pool and the gradient buffers are a sum and a maximum over buckets
    (``plan_placement``). The window's ring gives unit ``j`` slot ``j mod ring``, so the
    blocks beyond one ring's worth, in whole rings, change no slot: they are left out of
    ``plan_slots``, which then takes O(1) in the layers.
    """
    from ..params.window import plan_slots

    ring = prefetch_layers + 2
    before, after = shape.outer_units()
    block: Unit = (shape.block_shapes(), False)
    planned = {
        tuple(shapes): _unit_pools(
            tuple(shapes), itemsize=itemsize, bucket_bytes=bucket_bytes, world_size=world_size
        )
        for shapes, _ in [*before, block, *after]
    }
    grad_buffers = max(pools[1] for pools in planned.values())
    host = sum(planned[tuple(shapes)][2] for shapes, _ in before + after)
    host += shape.layers * planned[tuple(block[0])][2]
    kept_layers = shape.layers
    if shape.layers > ring:
        kept_layers = ring + (shape.layers - ring) % ring
    window = [*before, *[block] * kept_layers, *after]
    _, slot_bytes = plan_slots(
        [planned[tuple(shapes)][0] for shapes, _ in window],
        [tied for _, tied in window],
        prefetch_layers=prefetch_layers,
    )
    return sum(slot_bytes), grad_buffers, host


def device_shard_bytes(
    shape: ModelShape, *, itemsize: int, bucket_bytes: int, world_size: int
) -> int:
    """Device bytes per rank of the home shards of ``OffloadConfig(partition_parameters=True)``
    on ``world_size`` ranks (``params/device_shards.py``'s ``DeviceHomes``): each unit's own
    buckets planned as the optimizer plans them, ``a(shard_numel * itemsize)`` per bucket."""
    from ..memory.align import aligned
    from ..optim.state.placement import POOL_ALIGNMENT
    from ..partition import plan_buckets

    def unit_bytes(shapes: tuple[Shape, ...]) -> int:
        layouts = plan_buckets(
            [list(enumerate(shapes))],
            bucket_numel=max(1, bucket_bytes // itemsize),
            world_size=world_size,
            align_numel=POOL_ALIGNMENT // 2,
        )
        return sum(aligned(b.shard_numel * itemsize, POOL_ALIGNMENT) for b in layouts)

    before, after = shape.outer_units()
    outer = sum(unit_bytes(tuple(shapes)) for shapes, _ in [*before, *after])
    return outer + shape.layers * unit_bytes(tuple(shape.block_shapes()))


def _pack(sizes: Sequence[int], fill: int, limit: int) -> tuple[list[int], int]:
    """``partition.plan_buckets``' packing loop over parameters of ``sizes`` elements (in
    the order it packs them), from an open bucket of ``fill`` elements (0: none): the
    elements of each bucket it closes, and the open bucket's after. Note [slots are
    aligned]: each slot starts at a multiple of ``SLOT_ALIGN_NUMEL``."""
    from ..partition import SLOT_ALIGN_NUMEL

    closed = []
    for size in sizes:
        offset = -(-fill // SLOT_ALIGN_NUMEL) * SLOT_ALIGN_NUMEL
        if fill and offset + size > limit:
            closed.append(fill)
            offset = 0
        fill = offset + size
    return closed, fill


def _sizes_last_first(units: Sequence[Unit]) -> list[int]:
    return [math.prod(shape) for shapes, _ in units[::-1] for shape in shapes[::-1]]


#: Buckets in bucket order (backward order) as runs: ``(numels, repeats)`` is the buckets
#: of ``numels`` (elements, alignment gaps included), that sequence ``repeats`` times over.
BucketGroups = list[tuple[tuple[int, ...], int]]


def shape_bucket_groups(shape: ModelShape, *, bucket_numel: int) -> BucketGroups:
    """The buckets ``plan_buckets`` makes of ``shape``'s parameters, in bucket order, in
    O(1) in the layers.

    The packer walks the parameters last to first, and at a block's edge its only state is
    how full the open bucket is. The blocks are alike, so once that fill repeats, the
    buckets repeat with it: the cycle is one group, repeated, not walked.
    """
    before, after = shape.outer_units()
    block = [math.prod(s) for s in shape.block_shapes()][::-1]
    groups: BucketGroups = []
    closed, fill = _pack(_sizes_last_first(after), 0, bucket_numel)
    groups.append((tuple(closed), 1))
    seen: dict[int, int] = {}  # fill at a block's edge -> the block
    fills: list[int] = []  # fills[k]: the fill before block k (walked blocks only)
    history: list[list[int]] = []  # history[k]: the buckets block k closed
    done = 0
    while done < shape.layers:
        if fill in seen:  # blocks seen[fill] .. done - 1 repeat from here on
            start = seen[fill]
            whole, rest = divmod(shape.layers - done, done - start)
            cycle = tuple(numel for closed in history[start:done] for numel in closed)
            groups.append((cycle, whole))
            groups.append((tuple(n for closed in history[start : start + rest] for n in closed), 1))
            fill = fills[start + rest]
            break
        seen[fill] = done
        fills.append(fill)
        closed, fill = _pack(block, fill, bucket_numel)
        history.append(closed)
        groups.append((tuple(closed), 1))
        done += 1
    closed, fill = _pack(_sizes_last_first(before), fill, bucket_numel)
    groups.append((tuple(closed) + ((fill,) if fill else ()), 1))
    return [(numels, repeats) for numels, repeats in groups if numels and repeats]


def shape_bucket_numels(shape: ModelShape, *, bucket_numel: int) -> Counter[int]:
    """How many buckets of each size (elements, alignment gaps included) ``plan_buckets``
    makes of ``shape``'s parameters (``shape_bucket_groups``, counted)."""
    counts: Counter[int] = Counter()
    for numels, repeats in shape_bucket_groups(shape, bucket_numel=bucket_numel):
        for numel in numels:
            counts[numel] += repeats
    return counts


@functools.lru_cache(maxsize=64)
def module_bucket_numels(
    shapes: tuple[Shape, ...], itemsize: int, bucket_bytes: int
) -> tuple[int, ...]:
    """Elements (gaps included) of each bucket ``plan_buckets`` makes of ``shapes``, in
    bucket order."""
    from ..optim.state.placement import POOL_ALIGNMENT
    from ..partition import plan_buckets

    layouts = plan_buckets(
        [list(enumerate(shapes))],
        bucket_numel=max(1, bucket_bytes // itemsize),
        align_numel=POOL_ALIGNMENT // 2,
    )
    return tuple(layout.numel for layout in layouts)


def unit_bucket_groups(shape: ModelShape, *, itemsize: int, bucket_bytes: int) -> BucketGroups:
    """The buckets of ``shape`` under parameter offload, in bucket order (the units last
    to first, each unit's own buckets as ``plan_buckets`` orders them)."""

    def numels(shapes: list[Shape]) -> tuple[int, ...]:
        return module_bucket_numels(tuple(shapes), itemsize, bucket_bytes)

    before, after = shape.outer_units()
    groups: BucketGroups = [(numels(shapes), 1) for shapes, _ in after[::-1]]
    groups.append((numels(shape.block_shapes()), shape.layers))
    groups += [(numels(shapes), 1) for shapes, _ in before[::-1]]
    return groups


def shape_offload_bytes(
    shape: ModelShape, *, itemsize: int, bucket_bytes: int, world_size: int = 1
) -> tuple[int, int, int]:
    """``offload_adamw_bytes`` of ``shape``'s parameters, exact, in O(1) in the layers:
    each distinct bucket size planned once (``shape_bucket_numels``); ``plan_placement``'s
    weights and host pool are sums over buckets, its gradient buffers a maximum."""
    weights = grad_buffers = host = 0
    counts = shape_bucket_numels(shape, bucket_numel=max(1, bucket_bytes // itemsize))
    for numel, count in counts.items():
        w, g, h = _one_bucket(numel, itemsize, bucket_bytes, world_size)
        weights, grad_buffers, host = weights + count * w, max(grad_buffers, g), host + count * h
    return weights, grad_buffers, host


@functools.lru_cache(maxsize=4096)
def _one_bucket(
    numel: int, itemsize: int, bucket_bytes: int, world_size: int
) -> tuple[int, int, int]:
    """``offload_adamw_bytes`` of one bucket of ``numel`` elements."""
    return offload_adamw_bytes(
        [(numel,)], itemsize=itemsize, bucket_bytes=bucket_bytes, world_size=world_size
    )


def offload_bytes_of_count(
    params: int, *, itemsize: int, bucket_bytes: int, world_size: int
) -> tuple[int, int, int]:
    """``offload_adamw_bytes`` of ``params`` elements in full buckets plus one partial bucket.

    Full buckets are identical, so one is planned and multiplied: exact, and O(1) in
    ``params`` (the search for the largest model calls this dozens of times).
    """
    bucket_numel = max(1, bucket_bytes // itemsize)
    full, rest = divmod(params, bucket_numel)
    weights = grad_buffers = host = 0
    for count, numel in ((full, bucket_numel), (1, rest)):
        if count and numel:
            w, g, h = _one_bucket(numel, itemsize, bucket_bytes, world_size)
            weights, grad_buffers, host = (
                weights + count * w,
                max(grad_buffers, g),
                host + count * h,
            )
    return weights, grad_buffers, host
