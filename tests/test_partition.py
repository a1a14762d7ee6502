"""Partition arithmetic on its own: buckets, padding, and which rank owns which shard."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zero_offload.partition import clip_runs, plan_buckets

shapes = st.lists(
    st.lists(st.integers(0, 40), min_size=0, max_size=3).map(tuple), min_size=1, max_size=12
)


def _groups(draw_shapes: list[list[tuple[int, ...]]]) -> list[list[tuple[int, tuple[int, ...]]]]:
    groups, index = [], 0
    for members in draw_shapes:
        groups.append([(index + i, shape) for i, shape in enumerate(members)])
        index += len(members)
    return groups


@settings(max_examples=200, deadline=None)
@given(
    group_shapes=st.lists(shapes, min_size=1, max_size=3),
    bucket_numel=st.integers(1, 3000),
    world_size=st.integers(1, 7),
    align_numel=st.sampled_from([1, 4, 128]),
    slot_align=st.sampled_from([1, 16, 32]),
)
def test_shards_tile_each_bucket_once_with_padding_only_at_the_end(
    group_shapes: list[list[tuple[int, ...]]],
    bucket_numel: int,
    world_size: int,
    align_numel: int,
    slot_align: int,
) -> None:
    groups = _groups(group_shapes)
    buckets = plan_buckets(
        groups,
        bucket_numel=bucket_numel,
        world_size=world_size,
        align_numel=align_numel,
        slot_align_numel=slot_align,
    )
    placed = [slot.index for b in buckets for slot in b.slots]
    nonempty = [i for members in groups for i, shape in members if _numel(shape) > 0]
    assert sorted(placed) == sorted(nonempty)  # every parameter with elements, once
    for bucket in buckets:
        assert bucket.padded_numel % (world_size * align_numel) == 0
        assert bucket.numel <= bucket.padded_numel < bucket.numel + world_size * align_numel
        # parameters are packed from 0, each slot aligned, with gaps only to reach the next
        # aligned offset (Note [slots are aligned]); padding is [numel, padded_numel) only
        end = 0
        for slot in bucket.slots:
            assert slot.offset % slot_align == 0
            assert end <= slot.offset < end + slot_align
            end = slot.end
        assert end == bucket.numel
        assert bucket.param_numel == sum(slot.numel for slot in bucket.slots)
        assert bucket.numel <= max(bucket_numel, bucket.slots[0].numel) or len(bucket.slots) == 1
        # shards: equal, contiguous, in rank order, covering [0, padded_numel) exactly once
        ranges = [bucket.shard_range(r) for r in range(world_size)]
        assert ranges[0][0] == 0 and ranges[-1][1] == bucket.padded_numel
        for (_, stop), (start, _) in itertools.pairwise(ranges):
            assert stop == start
        assert {stop - start for start, stop in ranges} == {bucket.shard_numel}
        # each parameter's owned pieces tile it exactly once, in rank order
        for slot in bucket.slots:
            pieces = [bucket.owned_piece(slot, *r) for r in ranges]
            covered = [(lo, hi) for lo, hi in pieces if lo < hi]
            assert covered[0][0] == 0 and covered[-1][1] == slot.numel
            for (_, hi), (lo, _) in itertools.pairwise(covered):
                assert hi == lo
        # real elements per shard add up to the bucket's real elements
        assert sum(bucket.real_in(*r) for r in ranges) == bucket.numel


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for dim in shape:
        n *= dim
    return n


@settings(max_examples=200, deadline=None)
@given(
    runs=st.lists(
        st.tuples(st.integers(0, 100), st.integers(1, 50), st.integers(1, 9)), max_size=6
    ),
    start=st.integers(0, 120),
    width=st.integers(0, 60),
)
def test_clip_runs_keeps_exactly_the_elements_inside_the_shard(runs, start, width) -> None:
    runs = [(lo, lo + n, step) for lo, n, step in runs]
    stop = start + width
    clipped = clip_runs(runs, start, stop)
    expected = [
        (e - start, step) for lo, hi, step in runs for e in range(lo, hi) if start <= e < stop
    ]
    assert [(e, step) for lo, hi, step in clipped for e in range(lo, hi)] == expected
    assert all(0 <= lo < hi <= width for lo, hi, _ in clipped)


def test_shard_range_names_the_bad_rank() -> None:
    (bucket,) = plan_buckets([[(0, (10,))]], bucket_numel=100, world_size=2, align_numel=4)
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\), got 2"):
        bucket.shard_range(2)


def test_slots_are_aligned_to_16_elements_by_default() -> None:
    # Note [slots are aligned]: 3 + 5 + 20 elements land at 0, 16 and 32, not 0, 3, 8.
    (bucket,) = plan_buckets([[(0, (20,)), (1, (5,)), (2, (3,))]], bucket_numel=1000)
    assert [slot.offset for slot in bucket.slots] == [0, 16, 32]  # reversed registration order
    assert (bucket.numel, bucket.param_numel) == (52, 28)
    assert bucket.padded_numel == 128


def test_offload_adamw_parameters_start_on_64_byte_boundaries() -> None:
    # Odd sizes (35, 5, 15, 3 elements): packed tight, most would start mid-vector.
    import torch

    from .helpers.models import offload_opt

    model = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Linear(5, 3))
    opt = offload_opt(model)
    assert all(param.data_ptr() % 64 == 0 for param in model.parameters())
    opt.close()
