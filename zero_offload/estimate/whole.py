"""The pools of a rule that reads whole parameters (Adafactor, Muon), planned bucket by
bucket as the optimizer plans them, on one rank or several (``own_whole``)."""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING

from .buckets import ShapeGroups
from .planners import full_offload, rule_state
from .shape import Shape

if TYPE_CHECKING:
    from ..partition import BucketLayout

__all__ = ["planned_bucket", "whole_bucket", "whole_groups_bytes"]


# Note [a whole-parameter rule's buckets are planned one by one]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A rule that reads whole parameters sizes each bucket's host pool with the shaped state
# of its slots (``placement._shaped_bytes``), and on several ranks ``own_whole`` lays the
# bucket out again: each parameter in one rank's shard, the shard the most any rank got
# (its padding), and the shaped block the most any rank keeps. The estimator plans each
# distinct bucket (its shapes) once, as the optimizer plans it (``whole_bucket``): its
# weights, gradient buffers, padding and host pool do not depend on the buckets
# before it. The greedy balance gives each parameter, largest first, to a rank least
# loaded in the bucket, and which of several such ranks takes it (the tie-break: the
# ranks' elements over the buckets before, ``total``) changes which rank holds what, not
# how much each holds. What it can change is which parameters share a rank, and so the
# largest shaped block, where tied ranks hold different shapes. So on several ranks the
# shaped blocks are replayed over the buckets in order with ``total`` carried
# (``_shaped_over_ranks``, ``partition.balance_owners`` itself). The balance reads
# ``total`` only by comparing ranks, so from one repetition of a run of repeated buckets
# to the next its state is ``total`` less its least: once that state recurs, every
# repetition after it repeats the blocks of the last period and adds the same to each
# rank, so the rest of the run is multiplied, not walked. O(1) in the layers, exact.

#: A run of repeated buckets walks at most this many repetitions looking for its period.
_PERIOD_SEARCH = 4096


def whole_groups_bytes(
    groups: ShapeGroups,
    *,
    itemsize: int,
    bucket_bytes: int,
    world_size: int,
    rule: str,
    moments_dtype: str = "float32",
) -> tuple[int, int, int]:
    """``(device weights, device gradient buffers, host per rank)`` of a rule that reads
    whole parameters over the buckets ``groups`` (bucket order), its per-element moments
    (if any) in ``moments_dtype``, exact: Note [a whole-parameter rule's buckets are
    planned one by one]."""
    weights = grad_buffers = host = 0
    for buckets, repeats in groups:
        for bucket in buckets:
            w, g, h, shaped = whole_bucket(
                bucket, itemsize, bucket_bytes, world_size, rule, moments_dtype
            )
            if world_size > 1:
                h -= shaped  # its share of the shaped state is replayed below
            weights, grad_buffers, host = (
                weights + repeats * w,
                max(grad_buffers, g),
                host + repeats * h,
            )
    if world_size > 1:
        host += _shaped_over_ranks(groups, itemsize, bucket_bytes, world_size, rule)
    return weights, grad_buffers, host


def _shaped_over_ranks(
    groups: ShapeGroups, itemsize: int, bucket_bytes: int, world_size: int, rule: str
) -> int:
    """Each bucket's shaped block (the most any rank keeps of it) over ``groups``, summed,
    with the owners ``own_whole`` gives after the buckets before: Note [a whole-parameter
    rule's buckets are planned one by one]."""
    total = [0] * world_size  # each rank's elements over the buckets so far (own_whole's)
    result = 0
    for buckets, repeats in groups:
        seen: dict[tuple[int, ...], tuple[int, int, tuple[int, ...]]] = {}
        done = 0
        while done < repeats:
            least = min(total)
            key = tuple(t - least for t in total)
            if key in seen:
                start, before, totals = seen[key]
                periods = (repeats - done) // (done - start)
                result += periods * (result - before)
                total[:] = [t + periods * (t - t0) for t, t0 in zip(total, totals, strict=True)]
                done += periods * (done - start)
                seen = {}
                if done >= repeats:
                    break
            if len(seen) < _PERIOD_SEARCH:  # beyond: walked to the end
                seen[key] = (done, result, tuple(total))
            for bucket in buckets:
                least = min(total)
                shaped, added = _shaped_block(
                    bucket,
                    tuple(t - least for t in total),
                    itemsize,
                    bucket_bytes,
                    rule,
                )
                result += shaped
                total[:] = [t + a for t, a in zip(total, added, strict=True)]
            done += 1
    return result


@functools.lru_cache(maxsize=65536)
def _shaped_block(
    shapes: tuple[Shape, ...],
    total: tuple[int, ...],
    itemsize: int,
    bucket_bytes: int,
    rule: str,
) -> tuple[int, tuple[int, ...]]:
    """``(the most shaped bytes a rank keeps of a bucket of shapes, each rank's elements
    of it)`` with ``own_whole``'s owners after buckets that left each rank ``total``
    elements (less the least: the balance only compares them)."""
    from ..optim.state.placement import POOL_ALIGNMENT
    from ..partition import SLOT_ALIGN_NUMEL, balance_owners

    layout = planned_bucket(shapes, itemsize, bucket_bytes, len(total))
    after = list(total)
    owner, _ = balance_owners(layout, after, SLOT_ALIGN_NUMEL)
    owned: dict[int, list[Shape]] = {}
    for position, slot in enumerate(layout.slots):
        owned.setdefault(owner[position], []).append(slot.shape)
    state = rule_state(rule)
    shaped = max(state.param_state_bytes(shapes, POOL_ALIGNMENT) for shapes in owned.values())
    return shaped, tuple(a - t for a, t in zip(after, total, strict=True))


@functools.lru_cache(maxsize=4096)
def planned_bucket(
    shapes: tuple[Shape, ...], itemsize: int, bucket_bytes: int, world_size: int
) -> BucketLayout:
    """The one bucket ``plan_buckets`` makes of ``shapes`` (in packing order), before
    ``own_whole``."""
    from ..optim.state.placement import POOL_ALIGNMENT
    from ..partition import plan_buckets

    layouts = plan_buckets(
        [list(enumerate(shapes[::-1]))],  # plan_buckets packs last to first
        bucket_numel=max(1, bucket_bytes // itemsize),
        world_size=world_size,
        align_numel=POOL_ALIGNMENT // 2,
    )
    if len(layouts) != 1:
        raise RuntimeError(f"a bucket of {shapes} planned as {len(layouts)} buckets (a bug)")
    return layouts[0]


@functools.lru_cache(maxsize=4096)
def whole_bucket(
    shapes: tuple[Shape, ...],
    itemsize: int,
    bucket_bytes: int,
    world_size: int,
    rule: str,
    moments_dtype: str = "float32",
) -> tuple[int, int, int, int]:
    """``(weights, gradient buffers, host per rank, shaped block)`` of one
    bucket of ``shapes`` (in packing order) for a rule that reads whole parameters, laid
    out by ``own_whole`` after no other bucket; the shaped block is in the host bytes. See
    Note [a whole-parameter rule's buckets are planned one by one]."""
    from ..optim.state.placement import POOL_ALIGNMENT, plan_placement
    from ..partition import own_whole

    layout = own_whole(
        [planned_bucket(shapes, itemsize, bucket_bytes, world_size)],
        align_numel=POOL_ALIGNMENT // 2,
    )[0]
    placement = full_offload([layout], itemsize=itemsize, rule=rule, moments_dtype=moments_dtype)
    no_shaped = plan_placement(  # the same bucket with no shaped state
        [layout],
        itemsize=itemsize,
        state=dataclasses.replace(rule_state(rule, moments_dtype), param_state=None),
        resident_state=rule_state(rule),
        offload_fraction=1.0,
        device_free=2**62,
        auto_headroom=0.0,
        alignment=POOL_ALIGNMENT,
    )
    return (
        placement.device_weights,
        placement.device_grad_buffers,
        placement.host_state,
        placement.host_state - no_shaped.host_state,
    )
