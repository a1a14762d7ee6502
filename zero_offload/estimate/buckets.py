"""The buckets ``partition.plan_buckets`` makes of a model's parameters, as the optimizer
plans them, in O(1) in the layers: pure arithmetic over shapes, no torch."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

from .shape import ModelShape, Shape, Unit

__all__ = [
    "BucketGroups",
    "BucketKey",
    "ShapeGroups",
    "bucket_numel_of",
    "shape_bucket_numels",
    "shape_bucket_shapes",
]


def _pack(
    shapes: Sequence[Shape], bucket: tuple[Shape, ...], fill: int, limit: int
) -> tuple[list[tuple[Shape, ...]], tuple[Shape, ...], int]:
    """``partition.plan_buckets``' packing loop over parameters of ``shapes`` (in the order
    it packs them), from an open bucket holding ``bucket`` (``fill`` elements; empty:
    none): the parameters of each bucket it closes, and the open bucket's after, with its
    elements. Note [slots are aligned]: each slot starts at a multiple of
    ``SLOT_ALIGN_NUMEL``."""
    from ..partition import SLOT_ALIGN_NUMEL

    closed = []
    for shape in shapes:
        size = math.prod(shape)
        offset = -(-fill // SLOT_ALIGN_NUMEL) * SLOT_ALIGN_NUMEL
        if bucket and offset + size > limit:
            closed.append(bucket)
            offset, bucket = 0, ()
        fill, bucket = offset + size, (*bucket, shape)
    return closed, bucket, fill


def _shapes_last_first(units: Sequence[Unit]) -> list[Shape]:
    return [shape for shapes, _ in units[::-1] for shape in shapes[::-1]]


#: Buckets in bucket order (backward order) as runs: ``(buckets, repeats)`` is the
#: ``buckets``, each its parameters' shapes in the order ``plan_buckets`` packs them, that
#: sequence ``repeats`` times over.
ShapeGroups = list[tuple[tuple[tuple[Shape, ...], ...], int]]

#: A bucket as the tiers of ``nvme.py`` plan it: for an elementwise rule its length
#: (elements, alignment gaps included), all its state is per element; for a rule that reads
#: whole parameters its parameters' shapes in packing order (``ShapeGroups``' buckets).
BucketKey = int | tuple[Shape, ...]

#: Buckets in bucket order (backward order) as runs: ``(keys, repeats)`` is the buckets
#: ``keys`` (``BucketKey``), that sequence ``repeats`` times over.
BucketGroups = list[tuple[tuple[BucketKey, ...], int]]


def shape_bucket_shapes(shape: ModelShape, *, bucket_numel: int) -> ShapeGroups:
    """The buckets ``plan_buckets`` makes of ``shape``'s parameters, in bucket order, in
    O(1) in the layers.

    The packer walks the parameters last to first, and at a block's edge its only state is
    the open bucket (its parameters, and so how full it is). The blocks are alike, so once
    that state repeats, the buckets repeat with it: the cycle is one group, repeated, not
    walked.
    """
    before, after = shape.outer_units()
    block = shape.block_shapes()[::-1]
    groups: ShapeGroups = []
    closed, bucket, fill = _pack(_shapes_last_first(after), (), 0, bucket_numel)
    groups.append((tuple(closed), 1))
    seen: dict[tuple[Shape, ...], int] = {}  # the open bucket at a block's edge -> the block
    edges: list[tuple[tuple[Shape, ...], int]] = []  # edges[k]: the open bucket before block k
    history: list[list[tuple[Shape, ...]]] = []  # history[k]: the buckets block k closed
    done = 0
    while done < shape.layers:
        if bucket in seen:  # blocks seen[bucket] .. done - 1 repeat from here on
            start = seen[bucket]
            whole, rest = divmod(shape.layers - done, done - start)
            groups.append((tuple(b for closed in history[start:done] for b in closed), whole))
            groups.append((tuple(b for closed in history[start : start + rest] for b in closed), 1))
            bucket, fill = edges[start + rest]
            break
        seen[bucket] = done
        edges.append((bucket, fill))
        closed, bucket, fill = _pack(block, bucket, fill, bucket_numel)
        history.append(closed)
        groups.append((tuple(closed), 1))
        done += 1
    closed, bucket, _ = _pack(_shapes_last_first(before), bucket, fill, bucket_numel)
    groups.append((tuple(closed) + ((bucket,) if bucket else ()), 1))
    return [(buckets, repeats) for buckets, repeats in groups if buckets and repeats]


def bucket_numel_of(shapes: tuple[Shape, ...]) -> int:
    """Elements of a bucket of ``shapes`` in packing order, alignment gaps included."""
    from ..partition import SLOT_ALIGN_NUMEL

    fill = 0
    for shape in shapes:
        fill = -(-fill // SLOT_ALIGN_NUMEL) * SLOT_ALIGN_NUMEL + math.prod(shape)
    return fill


def shape_bucket_numels(shape: ModelShape, *, bucket_numel: int) -> Counter[int]:
    """How many buckets of each size (elements, alignment gaps included) ``plan_buckets``
    makes of ``shape``'s parameters (``shape_bucket_shapes``, counted)."""
    counts: Counter[int] = Counter()
    for buckets, repeats in shape_bucket_shapes(shape, bucket_numel=bucket_numel):
        for bucket in buckets:
            counts[bucket_numel_of(bucket)] += repeats
    return counts
