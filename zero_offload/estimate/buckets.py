"""The buckets ``partition.plan_buckets`` makes of a model's parameters, as the optimizer
plans them, in O(1) in the layers: pure arithmetic over shapes, no torch."""

from __future__ import annotations

import functools
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
    shapes: Sequence[Shape], bucket: list[Shape], fill: int, limit: int
) -> tuple[list[tuple[Shape, ...]], int, int]:
    """``partition.plan_buckets``' packing loop over parameters of ``shapes`` (in the order
    it packs them), from an open bucket holding ``bucket`` (``fill`` elements; empty:
    none), which it extends in place: the parameters of each bucket it closes, the open
    bucket's elements after, and the index in ``shapes`` where the open bucket after began
    (-1: before ``shapes``). Note [slots are aligned]: each slot starts at a multiple of
    ``SLOT_ALIGN_NUMEL``."""
    from ..partition import SLOT_ALIGN_NUMEL

    closed = []
    opened = -1
    for index, shape in enumerate(shapes):
        size = math.prod(shape)
        offset = -(-fill // SLOT_ALIGN_NUMEL) * SLOT_ALIGN_NUMEL
        if bucket and offset + size > limit:
            closed.append(tuple(bucket))
            bucket.clear()
            offset, opened = 0, index
        bucket.append(shape)
        fill = offset + size
    return closed, fill, opened


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
    walked. The open bucket at an edge is named by where it began (Note [the open bucket
    by where it began]), so comparing two edges costs O(1), not the bucket's length: with
    small blocks and large buckets a bucket spans thousands of blocks, and comparing and
    copying its shapes at every edge made one estimate take 38 s.
    """
    return list(_shape_bucket_shapes(shape, bucket_numel))


# Note [the open bucket by where it began]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# At the edge before block k, a bucket that began at shape i of block j (j < k) holds that
# block's shapes from i on, then the k - j - 1 blocks after it, whole: (i, k - j) names its
# contents, and so every bucket the packer closes from there on. A bucket that began before
# the blocks (in the units after them, packed first) never recurs: its name holds k itself.


@functools.lru_cache(maxsize=256)
def _shape_bucket_shapes(shape: ModelShape, bucket_numel: int) -> ShapeGroups:
    before, after = shape.outer_units()
    block = shape.block_shapes()[::-1]
    outer = _shapes_last_first(after)
    groups: ShapeGroups = []
    bucket: list[Shape] = []
    closed, fill, opened = _pack(outer, bucket, 0, bucket_numel)
    groups.append((tuple(closed), 1))
    began = ("outer", opened)  # where the open bucket began: ("outer", i) or ("block", i, j)

    def name(began: tuple, k: int) -> tuple:  # Note [the open bucket by where it began]
        return (began[1], k - began[2]) if began[0] == "block" else (began, k)

    def contents(began: tuple, k: int) -> list[Shape]:
        if began[0] == "block":
            return block[began[1] :] + block * (k - began[2] - 1)
        return outer[max(began[1], 0) :] + block * k

    seen: dict[tuple, int] = {}  # the open bucket's name at a block's edge -> the block
    edges: list[tuple[tuple, int]] = []  # edges[k]: where the open bucket began, its fill
    history: list[list[tuple[Shape, ...]]] = []  # history[k]: the buckets block k closed
    done = 0
    while done < shape.layers:
        key = name(began, done)
        if key in seen:  # blocks seen[key] .. done - 1 repeat from here on
            start = seen[key]
            whole, rest = divmod(shape.layers - done, done - start)
            groups.append((tuple(b for closed in history[start:done] for b in closed), whole))
            groups.append((tuple(b for closed in history[start : start + rest] for b in closed), 1))
            began, fill = edges[start + rest]
            bucket[:] = contents(began, start + rest)
            break
        seen[key] = done
        edges.append((began, fill))
        closed, fill, opened = _pack(block, bucket, fill, bucket_numel)
        if opened >= 0:
            began = ("block", opened, done)
        history.append(closed)
        groups.append((tuple(closed), 1))
        done += 1
    closed, _, _ = _pack(_shapes_last_first(before), bucket, fill, bucket_numel)
    groups.append((tuple(closed) + ((tuple(bucket),) if bucket else ()), 1))
    return [(buckets, repeats) for buckets, repeats in groups if buckets and repeats]


@functools.lru_cache(maxsize=256)  # a key holds a bucket's shapes: thousands, for small blocks
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
