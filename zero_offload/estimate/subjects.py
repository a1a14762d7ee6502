"""The subjects of an estimate (``rows.Subject``): a ``ModelShape``, a module's parameter
shapes, or a bare count, each with its family for the largest-model search (Note [largest
that fits grows the row's own family] in ``rows.py``) and its pools planned once, for the
rule the estimate names."""

from __future__ import annotations

from collections.abc import Sequence

from .buckets import BucketGroups, BucketKey, shape_bucket_shapes
from .pools import (
    device_shard_bytes,
    mixed_offload_bytes,
    module_bucket_numels,
    module_bucket_shapes,
    offload_bytes,
    offload_bytes_of_count,
    param_offload_bytes,
    shape_bucket_groups,
    shape_offload_bytes,
    unit_bucket_groups,
)
from .rows import Context, Subject
from .shape import ModelShape, Shape, shapes_numel
from .whole import whole_groups_bytes

__all__ = ["CountSubject", "ModuleSubject", "ShapeSubject"]


class ShapeSubject(Subject):
    """A ``ModelShape``; its family: the same widths, any number of layers."""

    def __init__(self, shape: ModelShape, ctx: Context) -> None:
        super().__init__(ctx)
        self._shape = shape
        self._members: dict[int, ShapeSubject] = {shape.layers: self}
        self._param_pools: tuple[int, int, int] | None = None
        self._shards: int | None = None  # device_shards(), planned once

    @property
    def params(self) -> int:
        return self._shape.params

    @property
    def shape(self) -> ModelShape:
        return self._shape

    def _plan_offload(self) -> tuple[int, int, int]:
        ctx = self.ctx
        return shape_offload_bytes(
            self._shape,
            itemsize=ctx.itemsize,
            bucket_bytes=ctx.bucket_bytes,
            world_size=ctx.world_size,
            rule=ctx.rule,
            moments_dtype=ctx.moments_dtype,
        )

    def param_offload_pools(self) -> tuple[int, int, int] | None:
        if self._param_pools is None:  # several ranks: ZeRO-3 with offload
            self._param_pools = param_offload_bytes(
                self._shape,
                itemsize=self.ctx.itemsize,
                bucket_bytes=self.ctx.bucket_bytes,
                world_size=self.ctx.world_size,
                rule=self.ctx.rule,
                moments_dtype=self.ctx.moments_dtype,
            )
        return self._param_pools

    def device_shards(self) -> int | None:
        if self._shards is None:
            ctx = self.ctx
            self._shards = device_shard_bytes(
                self._shape,
                itemsize=ctx.itemsize,
                bucket_bytes=ctx.bucket_bytes,
                world_size=ctx.world_size,
            )
        return self._shards

    def _shape_counts(self) -> list[tuple[Shape, int]]:
        before, after = self._shape.outer_units()
        counts = [(shape, 1) for shapes, _ in [*before, *after] for shape in shapes]
        return counts + [(shape, self._shape.layers) for shape in self._shape.block_shapes()]

    def _plan_groups(self) -> BucketGroups:
        ctx = self.ctx
        bucket_numel = max(1, ctx.bucket_bytes // ctx.itemsize)
        if ctx.whole:  # buckets by their shapes (``buckets.BucketKey``)
            return list(shape_bucket_shapes(self._shape, bucket_numel=bucket_numel))
        return shape_bucket_groups(self._shape, bucket_numel=bucket_numel)

    def unit_groups(self) -> BucketGroups | None:
        ctx = self.ctx
        return unit_bucket_groups(
            self._shape, itemsize=ctx.itemsize, bucket_bytes=ctx.bucket_bytes, by_shape=ctx.whole
        )

    @property
    def size(self) -> int:
        return self._shape.layers

    def member(self, size: int) -> ShapeSubject:
        """The same widths with ``size`` layers (members are shared: each planned once)."""
        if size not in self._members:
            member = ShapeSubject(self._shape.with_layers(size), self.ctx)
            member._members = self._members
            self._members[size] = member
        return self._members[size]


class CountSubject(Subject):
    """A bare parameter count, in full buckets; its family: every count."""

    def __init__(self, params: int, ctx: Context) -> None:
        super().__init__(ctx)
        self._params = params

    @property
    def params(self) -> int:
        return self._params

    def _plan_offload(self) -> tuple[int, int, int]:
        ctx = self.ctx
        return offload_bytes_of_count(
            self._params,
            itemsize=ctx.itemsize,
            bucket_bytes=ctx.bucket_bytes,
            world_size=ctx.world_size,
            rule=ctx.rule,
            moments_dtype=ctx.moments_dtype,
        )

    def _plan_groups(self) -> BucketGroups:
        bucket_numel = max(1, self.ctx.bucket_bytes // self.ctx.itemsize)
        full, rest = divmod(self._params, bucket_numel)
        groups = [((_one_param(bucket_numel, self.ctx),), full)]
        if rest:
            groups.append(((_one_param(rest, self.ctx),), 1))
        return [(keys, repeats) for keys, repeats in groups if repeats]

    @property
    def size(self) -> int:
        return self._params

    def member(self, size: int) -> CountSubject:
        return CountSubject(size, self.ctx)


class ModuleSubject(Subject):
    """A module's trainable parameters by shape; its family: the module plus whole buckets
    of extra parameters, and below it, bare counts."""

    def __init__(
        self,
        shapes: Sequence[Shape],
        ctx: Context,
        *,
        base: ModuleSubject | None = None,
        extra_buckets: int = 0,
        itemsizes: Sequence[int] | None = None,
    ) -> None:
        super().__init__(ctx)
        self._shapes = list(shapes)
        # Each parameter's training dtype bytes where they differ (a bf16 model with fp32
        # norms: its own buckets per dtype, ``mixed_offload_bytes``); None: all ctx.itemsize.
        self._itemsizes = None if itemsizes is None or len(set(itemsizes)) < 2 else list(itemsizes)
        self._base = base  # the module itself, when this is it plus extra buckets
        self._extra = extra_buckets  # whole buckets of parameters added after the module
        self._bucket_numel = max(1, ctx.bucket_bytes // ctx.itemsize)

    @property
    def params(self) -> int:
        return shapes_numel(self._shapes) + self._extra * self._bucket_numel

    def _plan_offload(self) -> tuple[int, int, int]:
        # The extra parameters, registered last, are packed first, a full bucket each, and
        # leave the module's own buckets as they were: the pools add up.
        ctx, extra = self.ctx, self._extra
        if self._base is not None and ctx.whole and ctx.world_size > 1:
            # The extra buckets come first and move own_whole's owners of the module's
            # (Note [a whole-parameter rule's buckets are planned one by one]).
            own = module_bucket_shapes(tuple(self._base._shapes), ctx.itemsize, ctx.bucket_bytes)
            return whole_groups_bytes(
                [((((self._bucket_numel,),),), extra), (own, 1)],
                itemsize=ctx.itemsize,
                bucket_bytes=ctx.bucket_bytes,
                world_size=ctx.world_size,
                rule=ctx.rule,
                moments_dtype=ctx.moments_dtype,
            )
        if self._itemsizes is not None and self._base is None:
            return mixed_offload_bytes(
                self._shapes,
                self._itemsizes,
                bucket_bytes=ctx.bucket_bytes,
                world_size=ctx.world_size,
                rule=ctx.rule,
                moments_dtype=ctx.moments_dtype,
            )
        if self._base is not None:
            weights, grad_buffers, host = self._base.offload_pools()
            full = offload_bytes_of_count(
                self._bucket_numel,
                itemsize=ctx.itemsize,
                bucket_bytes=ctx.bucket_bytes,
                world_size=ctx.world_size,
                rule=ctx.rule,
                moments_dtype=ctx.moments_dtype,
            )
            return weights + extra * full[0], max(grad_buffers, full[1]), host + extra * full[2]
        return offload_bytes(
            self._shapes,
            itemsize=ctx.itemsize,
            bucket_bytes=ctx.bucket_bytes,
            world_size=ctx.world_size,
            rule=ctx.rule,
            moments_dtype=ctx.moments_dtype,
        )

    def _shape_counts(self) -> list[tuple[Shape, int]]:
        return [(shape, 1) for shape in self._shapes] + [((self._bucket_numel,), self._extra)]

    def _plan_groups(self) -> BucketGroups:
        # The extra parameters, registered last, fill the first buckets.
        ctx = self.ctx
        shapes = tuple(self._shapes)
        own: tuple[BucketKey, ...] = (
            module_bucket_shapes(shapes, ctx.itemsize, ctx.bucket_bytes)
            if ctx.whole
            else module_bucket_numels(shapes, ctx.itemsize, ctx.bucket_bytes)
        )
        extra = _one_param(self._bucket_numel, ctx)
        return [((extra,), self._extra)] * bool(self._extra) + [(own, 1)]

    @property
    def size(self) -> int:
        return self.params

    def member(self, size: int) -> Subject:
        """Below the module: a bare count; from it up: the module plus whole buckets (a
        size between two of those is the smaller)."""
        module = self if self._base is None else self._base
        if size < module.params:
            return CountSubject(size, self.ctx)
        extra = (size - module.params) // self._bucket_numel
        if not extra:
            return module
        return ModuleSubject(
            module._shapes,
            self.ctx,
            base=module,
            extra_buckets=extra,
            itemsizes=module._itemsizes,
        )


def _one_param(numel: int, ctx: Context) -> BucketKey:
    """A bucket of one 1-D parameter of ``numel`` elements as ``BucketGroups`` holds it:
    its length, or for a rule that reads whole parameters its shape."""
    return ((numel,),) if ctx.whole else numel
