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


@functools.lru_cache(maxsize=16)
def rule_state(rule: str = "adamw", moments_dtype: str = "float32") -> StateFields:
    """The state fields of optimizer ``rule`` with its default options, its moments in
    ``moments_dtype`` (``OffloadConfig.moments_dtype``: ``"float32"``, the default, or
    ``"bfloat16"``; the fields that follow it are the rule's to say, the master is always
    fp32): what every offloaded row sizes, as the optimizer asks its rule (Note [the rule
    is the only place that knows the optimizer]; ``segment_plan.plan_segment``)."""
    import torch

    from ..optim.rule import by_name

    dtype = torch.bfloat16 if moments_dtype == "bfloat16" else torch.float32
    return by_name(rule).state_fields(dtype, ())


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
    """fp32 bytes of ``rule``'s shaped state (Note [rules that read a whole parameter];
    fp32 whatever ``moments_dtype``) over ``(shape, count)`` pairs: ``count`` parameters of
    each shape, alignment aside; 0 for an elementwise rule."""
    fields = rule_state(rule)
    return 4 * sum(count * fields.param_state_numel([shape]) for shape, count in shapes)


def full_offload(
    layouts: Sequence[BucketLayout],
    *,
    itemsize: int | Sequence[int],
    rule: str = "adamw",
    moments_dtype: str = "float32",
    weights_elsewhere: frozenset[int] = frozenset(),
) -> Placement:
    """``plan_placement`` of ``layouts`` with everything offloaded, ``rule``'s state with
    its moments in ``moments_dtype`` (``rule_state``), no budget. A resident bucket's state
    would be fp32 whatever ``moments_dtype`` (as ``segment_plan`` places it); with
    everything offloaded there is none."""
    from ..optim.state.placement import POOL_ALIGNMENT, plan_placement

    return plan_placement(
        layouts,
        itemsize=itemsize,
        state=rule_state(rule, moments_dtype),
        resident_state=rule_state(rule),
        offload_fraction=1.0,
        device_free=2**62,
        auto_headroom=0.0,
        alignment=POOL_ALIGNMENT,
        weights_elsewhere=weights_elsewhere,
    )
