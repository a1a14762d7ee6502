"""The exact pool sizes of ``OffloadAdamW`` for given parameter shapes, planned as the
optimizer plans them (``partition.plan_buckets``, ``optim.placement.plan_placement``,
``params.window.plan_slots``). The planners live in packages that import torch, so they are
imported when first called, never when the estimator is imported."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

from .shape import ModelShape, Shape

if TYPE_CHECKING:
    from ..optim.placement import Placement
    from ..partition import BucketLayout

__all__ = ["offload_adamw_bytes", "offload_bytes_of_count", "param_offload_bytes"]


def offload_adamw_bytes(
    shapes: Sequence[Shape], *, itemsize: int, bucket_bytes: int, world_size: int = 1
) -> tuple[int, int, int]:
    """``(device weights, device gradient buffers, host per rank)`` of a fully offloaded
    ``OffloadAdamW`` over parameters of ``shapes``: its exact pool sizes, in bytes."""
    from ..optim.placement import POOL_ALIGNMENT
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


def _full_offload(
    layouts: Sequence[BucketLayout],
    *,
    itemsize: int,
    weights_elsewhere: frozenset[int] = frozenset(),
) -> Placement:
    """``plan_placement`` of ``layouts`` with everything offloaded, fp32 moments, no
    budget."""
    from ..optim.placement import POOL_ALIGNMENT, plan_placement

    return plan_placement(
        layouts,
        itemsize=itemsize,
        moment_size=4,
        amsgrad=False,
        offload_fraction=1.0,
        device_free=2**62,
        auto_headroom=0.0,
        alignment=POOL_ALIGNMENT,
        weights_elsewhere=weights_elsewhere,
    )


def param_offload_bytes(
    shape: ModelShape, *, itemsize: int, bucket_bytes: int, prefetch_layers: int = 1
) -> tuple[int, int, int]:
    """``(device window, device gradient buffers, host)`` of ``OffloadAdamW`` with
    ``OffloadConfig(offload_parameters=True)`` over a model of ``shape`` (its units,
    ``ModelShape.parameter_units``), one rank: the exact pool sizes, from buckets planned per
    unit as the optimizer plans them."""
    from ..optim.placement import POOL_ALIGNMENT
    from ..params.window import aligned, plan_slots  # params sits above the estimator's inputs
    from ..partition import plan_buckets

    layouts: list[BucketLayout] = []
    unit_bytes, tied = [], []
    first = 0
    for shapes, is_tied in shape.parameter_units():
        nbytes = 0
        for layout in plan_buckets(
            [[(first + i, s) for i, s in enumerate(shapes)]],
            bucket_numel=max(1, bucket_bytes // itemsize),
            align_numel=POOL_ALIGNMENT // 2,
        ):
            layouts.append(dataclasses.replace(layout, index=len(layouts)))
            nbytes += aligned(layout.padded_numel * itemsize, POOL_ALIGNMENT)
        first += len(shapes)
        unit_bytes.append(nbytes)
        tied.append(is_tied)
    _, slot_bytes = plan_slots(unit_bytes, tied, prefetch_layers=prefetch_layers)
    placement = _full_offload(
        layouts, itemsize=itemsize, weights_elsewhere=frozenset(b.index for b in layouts)
    )
    return sum(slot_bytes), placement.device_grad_buffers, placement.host_state


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
            w, g, h = offload_adamw_bytes(
                [(numel,)], itemsize=itemsize, bucket_bytes=bucket_bytes, world_size=world_size
            )
            weights, grad_buffers, host = (
                weights + count * w,
                max(grad_buffers, g),
                host + count * h,
            )
    return weights, grad_buffers, host
