"""The exact pool sizes of an offloading optimizer of a given rule for given parameter
shapes, planned as the optimizer plans them (``partition.plan_buckets``, ``optim.state.placement.plan_placement``,
``params.window.plan_slots``). The planners live in packages that import torch, so they are
imported when first called, never when the estimator is imported."""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Sequence

from .buckets import (
    BucketGroups,
    BucketKey,
    bucket_numel_of,
    shape_bucket_numels,
    shape_bucket_shapes,
)
from .planners import full_offload, plan_layouts, reads_whole, rule_state
from .shape import ModelShape, Shape, Unit
from .whole import whole_groups_bytes

__all__ = [
    "device_shard_bytes",
    "mixed_offload_bytes",
    "module_bucket_numels",
    "module_bucket_shapes",
    "offload_adamw_bytes",
    "offload_bytes",
    "offload_bytes_of_count",
    "param_offload_bytes",
    "rule_state",
    "rule_state_bytes",
    "shape_bucket_groups",
    "shape_offload_bytes",
]


def offload_bytes(
    shapes: Sequence[Shape],
    *,
    itemsize: int,
    bucket_bytes: int,
    world_size: int = 1,
    rule: str = "adamw",
    moments_dtype: str = "float32",
) -> tuple[int, int, int]:
    """``(device weights, device gradient buffers, host per rank)`` of a fully offloaded
    optimizer of ``rule`` over parameters of ``shapes``: its exact pool sizes, in bytes,
    the buckets laid out as the optimizer lays them out (``plan_layouts``: for a rule that
    reads whole parameters, ``own_whole``), the moments in ``moments_dtype``
    (``OffloadConfig.moments_dtype``)."""
    layouts = plan_layouts(list(enumerate(shapes)), itemsize, bucket_bytes, world_size, rule)
    placement = full_offload(layouts, itemsize=itemsize, rule=rule, moments_dtype=moments_dtype)
    # plan_placement sizes the host pool for this rank's shards already.
    return placement.device_weights, placement.device_grad_buffers, placement.host_state


def mixed_offload_bytes(
    shapes: Sequence[Shape],
    itemsizes: Sequence[int],
    *,
    bucket_bytes: int,
    world_size: int = 1,
    rule: str = "adamw",
    moments_dtype: str = "float32",
) -> tuple[int, int, int]:
    """``offload_bytes`` of parameters of ``shapes`` in training dtypes of ``itemsizes``
    bytes (one per parameter: a bf16 model with fp32 norms), as ``plan_dtype_buckets``
    plans them: each dtype's parameters in buckets of that dtype alone, the buckets in
    backward order (descending highest parameter index), each sized by its own dtype."""
    import dataclasses

    planned = []
    for itemsize in dict.fromkeys(itemsizes):
        members = [
            (i, s) for i, (s, k) in enumerate(zip(shapes, itemsizes, strict=True)) if k == itemsize
        ]
        layouts = plan_layouts(members, itemsize, bucket_bytes, world_size, rule)
        planned += [(layout, itemsize) for layout in layouts]
    planned.sort(key=lambda pair: -pair[0].slots[0].index)  # stable, as plan_dtype_buckets
    layouts = [dataclasses.replace(layout, index=i) for i, (layout, _) in enumerate(planned)]
    placement = full_offload(
        layouts, itemsize=[k for _, k in planned], rule=rule, moments_dtype=moments_dtype
    )
    return placement.device_weights, placement.device_grad_buffers, placement.host_state


def offload_adamw_bytes(
    shapes: Sequence[Shape], *, itemsize: int, bucket_bytes: int, world_size: int = 1
) -> tuple[int, int, int]:
    """``offload_bytes`` of ``OffloadAdamW``."""
    return offload_bytes(
        shapes, itemsize=itemsize, bucket_bytes=bucket_bytes, world_size=world_size
    )


def rule_state_bytes(rule: str, shapes: Sequence[Shape], moments_dtype: str = "float32") -> int:
    """Host state bytes of optimizer ``rule`` (default options, its moments in
    ``moments_dtype``; the shaped state fp32) over parameters of
    ``shapes``, alignment aside: every element's fields, and the shaped state of a rule
    that reads whole parameters (Adafactor's factors: ``4 (m + n)`` bytes per ``(m, n)``
    matrix, 4 per element below two dims; Muon's momentum buffer, 4 per matrix element, and
    AdamW's moments beside it, 8 per other element; Note [rules that read a whole
    parameter]). The rows by parameter count (``Context.state_bytes``) size the per-element
    part only."""
    fields = rule_state(rule, moments_dtype)
    numel = sum(math.prod(shape) for shape in shapes)
    return fields.bytes_per_element * numel + 4 * fields.param_state_numel(
        tuple(shape) for shape in shapes
    )


@functools.lru_cache(maxsize=1024)
def _unit_pools(
    shapes: tuple[Shape, ...],
    *,
    itemsize: int,
    bucket_bytes: int,
    world_size: int = 1,
    rule: str = "adamw",
    moments_dtype: str = "float32",
) -> tuple[int, int, int]:
    """``(window bytes, gradient buffers, host per rank)`` of one unit under parameter
    offload: its own buckets (a unit never shares one), planned as the optimizer plans them.
    With ``world_size`` ranks (ZeRO-3 with offload) the slot still holds the whole unit,
    gathered, and the host holds this rank's shard (a rule that reads whole parameters is
    refused there: ``Configuration.refusal``)."""
    from ..memory.align import aligned
    from ..optim.state.placement import POOL_ALIGNMENT

    layouts = plan_layouts(list(enumerate(shapes)), itemsize, bucket_bytes, world_size, rule)
    nbytes = sum(aligned(layout.padded_numel * itemsize, POOL_ALIGNMENT) for layout in layouts)
    placement = full_offload(
        layouts,
        itemsize=itemsize,
        rule=rule,
        moments_dtype=moments_dtype,
        weights_elsewhere=frozenset(b.index for b in layouts),
    )
    return nbytes, placement.device_grad_buffers, placement.host_state


def param_offload_bytes(
    shape: ModelShape,
    *,
    itemsize: int,
    bucket_bytes: int,
    prefetch_layers: int = 1,
    world_size: int = 1,
    rule: str = "adamw",
    moments_dtype: str = "float32",
) -> tuple[int, int, int]:
    """``(device window, device gradient buffers, host per rank)`` of an optimizer of
    ``rule``, its moments in ``moments_dtype``, with
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
            tuple(shapes),
            itemsize=itemsize,
            bucket_bytes=bucket_bytes,
            world_size=world_size,
            rule=rule,
            moments_dtype=moments_dtype,
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


def shape_bucket_groups(shape: ModelShape, *, bucket_numel: int) -> BucketGroups:
    """``shape_bucket_shapes`` by bucket length (``BucketGroups`` of an elementwise rule)."""
    return [
        (tuple(bucket_numel_of(b) for b in buckets), repeats)
        for buckets, repeats in shape_bucket_shapes(shape, bucket_numel=bucket_numel)
    ]


@functools.lru_cache(maxsize=64)
def module_bucket_numels(
    shapes: tuple[Shape, ...], itemsize: int, bucket_bytes: int
) -> tuple[int, ...]:
    """Elements (gaps included) of each bucket ``plan_buckets`` makes of ``shapes``, in
    bucket order."""
    return tuple(bucket_numel_of(b) for b in module_bucket_shapes(shapes, itemsize, bucket_bytes))


@functools.lru_cache(maxsize=64)
def module_bucket_shapes(
    shapes: tuple[Shape, ...], itemsize: int, bucket_bytes: int
) -> tuple[tuple[Shape, ...], ...]:
    """Each bucket ``plan_buckets`` makes of ``shapes``, its parameters' shapes in packing
    order (``ShapeGroups``' buckets), in bucket order."""
    layouts = plan_layouts(list(enumerate(shapes)), itemsize, bucket_bytes, 1, "adamw")
    return tuple(tuple(slot.shape for slot in layout.slots) for layout in layouts)


def unit_bucket_groups(
    shape: ModelShape, *, itemsize: int, bucket_bytes: int, by_shape: bool = False
) -> BucketGroups:
    """The buckets of ``shape`` under parameter offload, in bucket order (the units last
    to first, each unit's own buckets as ``plan_buckets`` orders them); ``by_shape``: each
    bucket its shapes, as a rule that reads whole parameters plans it (``BucketKey``)."""

    def keys(shapes: list[Shape]) -> tuple[BucketKey, ...]:
        if by_shape:
            return module_bucket_shapes(tuple(shapes), itemsize, bucket_bytes)
        return module_bucket_numels(tuple(shapes), itemsize, bucket_bytes)

    before, after = shape.outer_units()
    groups: BucketGroups = [(keys(shapes), 1) for shapes, _ in after[::-1]]
    groups.append((keys(shape.block_shapes()), shape.layers))
    groups += [(keys(shapes), 1) for shapes, _ in before[::-1]]
    return groups


def shape_offload_bytes(
    shape: ModelShape,
    *,
    itemsize: int,
    bucket_bytes: int,
    world_size: int = 1,
    rule: str = "adamw",
    moments_dtype: str = "float32",
) -> tuple[int, int, int]:
    """``offload_bytes`` of ``shape``'s parameters, exact, in O(1) in the layers: each
    distinct bucket planned once; ``plan_placement``'s weights and host pool are sums over
    buckets, its gradient buffers a maximum. An elementwise rule's bucket is its length
    (``shape_bucket_numels``); a rule that reads whole parameters keeps shaped state by
    shape, so its bucket is its shapes (``shape_bucket_shapes``): Note [a whole-parameter
    rule's buckets are planned one by one]."""
    bucket_numel = max(1, bucket_bytes // itemsize)
    if not reads_whole(rule):
        counts = shape_bucket_numels(shape, bucket_numel=bucket_numel)
        return _counted_buckets(
            counts.items(), itemsize, bucket_bytes, world_size, rule, moments_dtype
        )
    groups = shape_bucket_shapes(shape, bucket_numel=bucket_numel)
    return whole_groups_bytes(
        groups,
        itemsize=itemsize,
        bucket_bytes=bucket_bytes,
        world_size=world_size,
        rule=rule,
        moments_dtype=moments_dtype,
    )


@functools.lru_cache(maxsize=4096)
def _one_bucket(
    numel: int,
    itemsize: int,
    bucket_bytes: int,
    world_size: int,
    rule: str = "adamw",
    moments_dtype: str = "float32",
) -> tuple[int, int, int]:
    """``offload_bytes`` of one bucket of one parameter of ``numel`` elements."""
    return offload_bytes(
        [(numel,)],
        itemsize=itemsize,
        bucket_bytes=bucket_bytes,
        world_size=world_size,
        rule=rule,
        moments_dtype=moments_dtype,
    )


def offload_bytes_of_count(
    params: int,
    *,
    itemsize: int,
    bucket_bytes: int,
    world_size: int,
    rule: str = "adamw",
    moments_dtype: str = "float32",
) -> tuple[int, int, int]:
    """``offload_bytes`` of ``params`` elements in full buckets plus one partial bucket,
    each one 1-D parameter (a count has no shapes).

    Full buckets are identical, so one is planned and multiplied: exact, and O(1) in
    ``params`` (the search for the largest model calls this dozens of times).
    """
    bucket_numel = max(1, bucket_bytes // itemsize)
    full, rest = divmod(params, bucket_numel)
    counted = [
        (numel, count) for numel, count in ((bucket_numel, full), (rest, 1)) if count and numel
    ]
    return _counted_buckets(counted, itemsize, bucket_bytes, world_size, rule, moments_dtype)


def _counted_buckets(
    counted: Iterable[tuple[int, int]],
    itemsize: int,
    bucket_bytes: int,
    world_size: int,
    rule: str,
    moments_dtype: str,
) -> tuple[int, int, int]:
    """``offload_bytes`` of ``count`` one-parameter buckets of ``numel`` elements, for each
    ``(numel, count)``: each planned once (``_one_bucket``); the weights and host pool are
    sums over buckets, the gradient buffers a maximum, as in ``plan_placement``."""
    weights = grad_buffers = host = 0
    for numel, count in counted:
        w, g, h = _one_bucket(numel, itemsize, bucket_bytes, world_size, rule, moments_dtype)
        weights, grad_buffers, host = weights + count * w, max(grad_buffers, g), host + count * h
    return weights, grad_buffers, host
