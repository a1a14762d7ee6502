"""The optimizer's planners asked for a rule, as the estimator asks them: the rule's state
fields (``rule_state``), its buckets (``plan_layouts``, ``own_whole`` for a rule that reads
whole parameters) and their pools with everything offloaded (``full_offload``). The
planners live in packages that import torch, so they are imported when first called, never
when the estimator is imported."""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from .shape import Shape

if TYPE_CHECKING:
    from ..optim.rule.base import StateFields
    from ..optim.state.placement import Placement
    from ..partition import BucketLayout

__all__ = ["full_offload", "plan_layouts", "reads_whole", "rule_state", "shaped_state_bytes"]


@functools.lru_cache(maxsize=8)
def rule_state(rule: str = "adamw") -> StateFields:
    """The state fields of optimizer ``rule`` with its default options, fp32 (the
    optimizer's default ``moments_dtype``): what every offloaded row sizes, as the optimizer
    asks its rule (Note [the rule is the only place that knows the optimizer])."""
    import torch

    from ..optim.rule import by_name

    return by_name(rule).state_fields(torch.float32, ())


def reads_whole(rule: str) -> bool:
    """Whether optimizer ``rule`` reads whole parameters (Note [rules that read a whole
    parameter]): its shaped state depends on the shapes, and on several ranks its buckets
    are laid out by ``own_whole``."""
    from ..optim.rule import by_name

    return not by_name(rule).elementwise


def plan_layouts(
    members: list[tuple[int, Shape]],
    itemsize: int,
    bucket_bytes: int,
    world_size: int,
    rule: str,
) -> list[BucketLayout]:
    """The buckets of one group of ``members`` as ``segment_plan.plan_layouts`` makes
    them for ``rule``."""
    from ..optim.state.placement import POOL_ALIGNMENT
    from ..partition import own_whole, plan_buckets

    layouts = plan_buckets(
        [members],
        bucket_numel=max(1, bucket_bytes // itemsize),
        world_size=world_size,
        align_numel=POOL_ALIGNMENT // 2,
    )
    if not reads_whole(rule):
        return layouts
    return own_whole(layouts, align_numel=POOL_ALIGNMENT // 2)


def shaped_state_bytes(rule: str, shapes: Iterable[tuple[Shape, int]]) -> int:
    """fp32 bytes of ``rule``'s shaped state (Note [rules that read a whole parameter])
    over ``(shape, count)`` pairs: ``count`` parameters of each shape, alignment aside; 0
    for an elementwise rule."""
    fields = rule_state(rule)
    return 4 * sum(count * fields.param_state_numel([shape]) for shape, count in shapes)


def full_offload(
    layouts: Sequence[BucketLayout],
    *,
    itemsize: int,
    rule: str = "adamw",
    weights_elsewhere: frozenset[int] = frozenset(),
) -> Placement:
    """``plan_placement`` of ``layouts`` with everything offloaded, ``rule``'s state in
    fp32 (``rule_state``), no budget."""
    from ..optim.state.placement import POOL_ALIGNMENT, plan_placement

    return plan_placement(
        layouts,
        itemsize=itemsize,
        state=rule_state(rule),
        resident_state=rule_state(rule),
        offload_fraction=1.0,
        device_free=2**62,
        auto_headroom=0.0,
        alignment=POOL_ALIGNMENT,
        weights_elsewhere=weights_elsewhere,
    )
