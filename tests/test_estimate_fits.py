"""What fits: the host reserve, and "largest that fits", which never contradicts "fits"
(Note [largest that fits grows the row's own family] in zero_offload/estimate/rows.py)."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zero_offload.estimate import ModelShape, estimate, host_reserve, offload_adamw_bytes
from zero_offload.estimate.nvme import _ring_units, context_tiers, home_tiers, state_tiers
from zero_offload.estimate.pools import shape_bucket_numels, shape_offload_bytes
from zero_offload.estimate.rows import Context
from zero_offload.params import window
from zero_offload.partition import plan_buckets

GiB, MiB = 2**30, 2**20

shapes = st.builds(
    ModelShape,
    layers=st.integers(1, 6),
    hidden=st.sampled_from([64, 128, 192]),
    heads=st.sampled_from([4, 8]),
    vocab=st.integers(50, 4000),
    seq_len=st.integers(8, 256),
    micro_batch=st.integers(1, 3),
    kv_heads=st.sampled_from([None, 2, 4]),
    tied=st.booleans(),
    arch=st.sampled_from(["gpt", "llama", "qwen2"]),
)


def _module(widths: list[int]) -> torch.nn.Module:
    with torch.device("meta"):  # shapes only
        return torch.nn.Sequential(*(torch.nn.Linear(a, b) for a, b in itertools.pairwise(widths)))


def _check_rows(result: object, params: int) -> None:
    for row in result.rows:  # type: ignore[attr-defined]
        assert row.fits is not None, row.name
        if row.fits:
            assert row.largest_fitting_params >= params, row
        else:
            assert row.largest_fitting_params < params, row


@settings(max_examples=40, deadline=None)
@given(
    shape=shapes,
    device_scale=st.floats(0.05, 3.0),
    host_scale=st.floats(0.0, 3.0),
    bucket_kib=st.sampled_from([4, 64, 1024]),
)
def test_largest_never_contradicts_fits_for_a_shape(
    shape: ModelShape, device_scale: float, host_scale: float, bucket_kib: int
) -> None:
    need = 20 * shape.params  # about what DDP needs: budgets around it decide both ways
    device = max(MiB, int(device_scale * need))
    host = 2 * GiB + int(host_scale * need)  # the 2 GiB reserve, then the pools
    result = estimate(shape, device_memory=device, host_memory=host, bucket_bytes=bucket_kib * 1024)
    _check_rows(result, shape.params)
    for row in result.rows:
        if row.largest_fitting_layers:  # the largest fits, one layer more does not
            member = shape.with_layers(row.largest_fitting_layers)
            assert member.params == row.largest_fitting_params
            kwargs = {"device_memory": device, "host_memory": host}
            kwargs["bucket_bytes"] = bucket_kib * 1024
            rows = {r.name: r for r in estimate(member, **kwargs).rows}
            assert rows[row.name].fits
            bigger = {
                r.name: r for r in estimate(shape.with_layers(member.layers + 1), **kwargs).rows
            }
            assert not bigger[row.name].fits


@settings(max_examples=30, deadline=None)
@given(
    params=st.integers(10**5, 10**8),
    device_scale=st.floats(0.05, 3.0),
    host_scale=st.floats(0.0, 3.0),
    world=st.sampled_from([1, 2, 8]),
)
def test_largest_never_contradicts_fits_for_a_count(
    params: int, device_scale: float, host_scale: float, world: int
) -> None:
    need = 16 * params
    result = estimate(
        params,
        world_size=world,
        device_memory=max(MiB, int(device_scale * need)),
        host_memory=2 * GiB + int(host_scale * need),
    )
    _check_rows(result, params)


@settings(max_examples=20, deadline=None)
@given(
    widths=st.lists(st.integers(1, 700), min_size=2, max_size=6),
    device_scale=st.floats(0.05, 3.0),
    host_scale=st.floats(0.0, 3.0),
)
def test_largest_never_contradicts_fits_for_a_module(
    widths: list[int], device_scale: float, host_scale: float
) -> None:
    model = _module(widths)
    params = sum(p.numel() for p in model.parameters())
    need = 16 * params + 8 * MiB  # fp32: 16 bytes per parameter, and a bucket's buffers
    result = estimate(
        model,
        device_memory=max(MiB, int(device_scale * need)),
        host_memory=2 * GiB + int(host_scale * need),
        bucket_bytes="64KiB",
    )
    assert result.params == params
    _check_rows(result, params)


def test_the_row_that_fit_with_no_headroom_does_not() -> None:
    # 7.5 B parameters on a 128 GiB host: ZeRO-Offload's pools are 16 bytes per parameter,
    # 111.8 GiB, which fits 128 GiB less the 12.8 GiB reserve; 7.8 B (116.2 GiB) would
    # leave less than the reserve, and so does not fit, though it is under 128 GiB.
    for params, fits in ((7_500_000_000, True), (7_800_000_000, False)):
        result = estimate(params, device_memory="80GiB", host_memory="128GiB")
        row = {r.name: r for r in result.rows}["ZeRO-Offload"]
        assert row.host < 128 * GiB
        assert row.fits is fits, (params, row.host / GiB)
    assert result.host_reserve == host_reserve(128 * GiB) == int(12.8 * GiB)
    assert "12.80 GiB kept free" in result.table()
    assert host_reserve(8 * GiB) == 2 * GiB  # the floor


@pytest.mark.parametrize("world", [1, 3])
@pytest.mark.parametrize("bucket_numel", [64, 1000, 4096, 50_000])
@pytest.mark.parametrize(
    "shape",
    [
        ModelShape(layers=7, hidden=64, heads=4, vocab=101, seq_len=33),
        ModelShape(layers=13, hidden=48, heads=4, vocab=77, seq_len=8, tied=True, arch="llama"),
        ModelShape(
            layers=5, hidden=32, heads=4, kv_heads=2, ffn=40, vocab=9, seq_len=8, arch="qwen2"
        ),
    ],
)
def test_the_cycle_counted_pools_equal_the_planners(
    shape: ModelShape, bucket_numel: int, world: int
) -> None:
    # shape_offload_bytes counts the packer's repeating cycle instead of walking every
    # layer: it must equal plan_buckets + plan_placement over every parameter.
    planned = plan_buckets([list(enumerate(shape.parameter_shapes()))], bucket_numel=bucket_numel)
    assert shape_bucket_numels(shape, bucket_numel=bucket_numel) == Counter(
        b.numel for b in planned
    )
    kwargs = {"itemsize": 2, "bucket_bytes": 2 * bucket_numel, "world_size": world}
    assert shape_offload_bytes(shape, **kwargs) == offload_adamw_bytes(
        shape.parameter_shapes(), **kwargs
    )


@pytest.mark.parametrize("bucket_numel", [100_000, 1_000_000])
def test_the_cycle_of_buckets_that_span_many_blocks_equals_the_planner(bucket_numel: int) -> None:
    """Small blocks in large buckets: each bucket spans up to about 600 blocks and the cycle
    is over a thousand blocks long (Note [the open bucket by where it began] in
    zero_offload/estimate/buckets.py; where that state was the bucket's shapes, an estimate of
    such a shape took 38 s)."""
    shape = ModelShape(layers=3000, hidden=16, heads=2, vocab=37, seq_len=8)
    planned = plan_buckets([list(enumerate(shape.parameter_shapes()))], bucket_numel=bucket_numel)
    assert shape_bucket_numels(shape, bucket_numel=bucket_numel) == Counter(
        b.numel for b in planned
    )


def test_the_homes_on_nvme_are_planned_in_runs_not_one_unit_at_a_time(monkeypatch) -> None:
    """Homes beyond the host budget (parameter offload to NVMe) at a million layers: the
    window's slots are planned over runs of alike units (``_ring_units``), a few per group,
    not over every unit; "largest that fits" tries such counts (one estimate walked a
    million units per try, 21 s)."""
    calls = []
    real = window.plan_slots

    def plan_slots(unit_bytes: list[int], tied: list[bool], **kwargs: int) -> tuple:
        calls.append(len(unit_bytes))
        return real(unit_bytes, tied, **kwargs)

    monkeypatch.setattr(window, "plan_slots", plan_slots)
    shape = ModelShape(layers=10**6, hidden=16, heads=2, vocab=37, seq_len=8)
    kwargs = {"device_memory": "64MiB", "host_memory": "2GiB", "disk_memory": "1TiB"}
    result = estimate(shape, bucket_bytes="8KiB", **kwargs)
    assert calls and max(calls) < 100, calls
    assert any(row.disk for row in result.rows)  # the homes went to NVMe somewhere


@settings(max_examples=200, deadline=None)
@given(
    runs=st.lists(st.tuples(st.integers(0, 5), st.integers(0, 40)), min_size=1, max_size=6),
    prefetch=st.integers(0, 4),
)
def test_runs_of_units_plan_the_slots_every_unit_plans(
    runs: list[tuple[int, int]], prefetch: int
) -> None:
    units = [nbytes for nbytes, count in runs for _ in range(count)]
    whole = window.plan_slots(units, [False] * len(units), prefetch_layers=prefetch)[1]
    cut = window.plan_slots(*_ring_units(runs, prefetch), prefetch_layers=prefetch)[1]
    assert cut == whole


def _homes_unit_by_unit(groups: list, ctx: Context, budget: int, prefetch: int) -> tuple:
    """``home_tiers`` as it was, one unit and one bucket at a time: the homes kept in
    ``budget`` in bucket order, the rest on disk, the window planned over every unit."""
    from zero_offload.config import OffloadConfig
    from zero_offload.memory.storage import IO_ALIGNMENT
    from zero_offload.weights.nvme_home import home_ring_bytes

    tiers = context_tiers(ctx)
    kept = moved = home_disk = 0
    records = []
    for keys, repeats in groups:
        for _ in range(repeats):
            unit = 0
            for t in (tiers(k) for k in keys):
                if not moved and kept + t.home <= budget:
                    kept += t.home
                    continue
                moved += t.home
                unit += t.home_file
            home_disk += unit
            records.append(unit)
    host, disk = state_tiers(groups, ctx, budget - kept)
    if not moved:
        return host, disk
    slots = window.plan_slots(records[::-1], [False] * len(records), prefetch_layers=prefetch)[1]
    host += home_ring_bytes(OffloadConfig().tile_elements, ctx.itemsize) - moved
    return host + sum(n + IO_ALIGNMENT for n in slots if n), disk + home_disk


@settings(max_examples=150, deadline=None)
@given(
    groups=st.lists(
        st.tuples(
            st.lists(st.sampled_from([512, 4096, 30_000, 262_144]), min_size=1, max_size=3).map(
                tuple
            ),
            st.integers(0, 40),
        ),
        min_size=1,
        max_size=4,
    ),
    budget=st.one_of(st.integers(-10_000, 0), st.integers(0, 10**7), st.just(10**9)),
    prefetch=st.integers(0, 4),
    itemsize=st.sampled_from([2, 4]),
)
def test_homes_placed_by_runs_match_the_walk_unit_by_unit(
    groups: list, budget: int, prefetch: int, itemsize: int
) -> None:
    """Whole repeats kept or moved at once, then the window over runs (``_ring_units``):
    the same bytes as the walk over every unit, a budget already spent (negative) too."""
    ctx = Context(itemsize=itemsize, world_size=1, ranks_per_node=1, bucket_bytes=65536)
    ours = home_tiers(groups, ctx, budget, prefetch_layers=prefetch)
    assert ours == _homes_unit_by_unit(groups, ctx, budget, prefetch)


def test_activations_are_the_papers_for_the_default_gpt_shape() -> None:
    s, b, h, a = 512, 2, 256, 8
    shape = ModelShape(layers=2, hidden=h, heads=a, vocab=100, seq_len=s, micro_batch=b)
    # Korthikanti et al., section 4.1: sbh(34 + 5as/h) bytes in 16-bit training.
    assert shape.layer_activation_bytes(2) == 34 * s * b * h + 5 * a * s * s * b
    assert shape.layer_activation_bytes(4) == 2 * shape.layer_activation_bytes(2)


def test_grouped_query_attention_and_a_gated_mlp_change_the_terms() -> None:
    s, h, a, f = 128, 256, 8, 688
    mha = ModelShape(layers=1, hidden=h, heads=a, vocab=10, seq_len=s, ffn=f, arch="llama")
    gqa = ModelShape(
        layers=1, hidden=h, heads=a, vocab=10, seq_len=s, ffn=f, arch="llama", kv_heads=2
    )
    # K and V: 2 bytes each per token and key/value width (h for MHA, h/4 here).
    assert mha.layer_activation_bytes(2) - gqa.layer_activation_bytes(2) == 4 * s * (h - h // 4)
    plain = ModelShape(layers=1, hidden=h, heads=a, vocab=10, seq_len=s, ffn=f)
    # Gated: the gate's and up projection's outputs, the activation and the product, 8f
    # per token, against the plain MLP's 4f (both: the input 2h and the mask h).
    assert mha.layer_activation_bytes(2) - plain.layer_activation_bytes(2) == 4 * s * f
    # Experts: e of them per token, and the router's fp32 logits (4 bytes per expert).
    moe = ModelShape(
        layers=1,
        hidden=h,
        heads=a,
        vocab=10,
        seq_len=s,
        ffn=f,
        arch="llama",
        experts=4,
        experts_per_token=2,
    )
    assert moe.layer_activation_bytes(2) - mha.layer_activation_bytes(2) == s * (8 * f + 16)
