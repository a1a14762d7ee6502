"""ZeRO-3 with parameter offload (``OffloadConfig(offload_parameters=True)`` on several gloo
ranks, Note [a sharded unit] in params/sharded_fetch.py): parity with stage 2 and with one
process on the global batch, collective bytes per step against the paper's 3Ψ, host bytes
per rank against their formula, ranks that leave different blocks out, a rank killed
mid-gather, and the estimator's rows against a real build (with NVMe too:
test_zero3_nvme.py).

Tolerances. Stage 3 and stage 2 on the same two ranks reduce the same per-rank gradients
(each element is ``g0/2 + g1/2`` in both, and a sum of two floats does not depend on the
order), take the same norms of the same values, and run the same CPU Adam on the same
shards: without clipping they agree bitwise. Against one process on the global batch
(each rank's mean over its share, then the mean over ranks, instead of one mean), each
gradient differs by a few ulp, as in test_dist_offload.py: fp32 weights then stay within
``FP32_ATOL`` (Adam's update is relative to sqrt(v), so relative gradient noise stays
relative; with lr 1e-3 over a few steps of O(0.02..1) weights the drift is ~1e-6). With
clipping the two norms differ by the same few ulp, which scales every update alike.

bf16 runs its forward and backward in bf16, so each rank's gradient of its share is rounded
to bf16 before the mean over ranks, where one process rounds the full batch's: gradients
differ by about one bf16 ulp (2**-8 relative) and the norms by about 1e-3 relative. Adam's
update is ``lr * m / (sqrt(v) + eps)``, at most about ``lr`` in size; where the two
gradients' signs differ (a gradient near zero) the two updates can be opposite, ``2 lr``
apart per step. So each weight stays within ``2 lr`` per step plus one bf16 ulp of its
magnitude (the rounding of the fp32 master), ``_bf16_bound``; and the disagreement is rare
(measured: 1e-5 mean absolute difference after 4 steps, a fifth of the elements differ),
which the mean bound, a twentieth of one step's ``lr``, checks.
"""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest
import torch

from zero_offload.estimate import ModelShape, estimate, param_offload_bytes
from zero_offload.memory.align import aligned
from zero_offload.optim.state.placement import POOL_ALIGNMENT

from .helpers import zero3
from .helpers.zero3 import SEQ, VOCAB, batches, gpt, loss_without, one_process, run, share, skipped

FP32_ATOL = 1e-5
STEPS = 4
LR = 1e-3  # tests/helpers/zero3.py make_opt


def _per_step(counters: list[dict]) -> list[dict[str, int]]:
    """Bytes each collective moved in each step, from the counters after each step."""
    return [
        {op: after[op]["bytes"] - before.get(op, {}).get("bytes", 0) for op in after}
        for before, after in itertools.pairwise(counters)
    ]


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x.float() - y.float()).abs().max().item() for x, y in zip(a, b, strict=True))


def _bf16_bound(a: list[torch.Tensor], b: list[torch.Tensor], steps: int) -> None:
    """Every element within ``2 lr`` per step plus one bf16 ulp of its magnitude, and the
    mean absolute difference below ``lr / 20`` (module docstring)."""
    total, count = 0.0, 0
    for x, y in zip(a, b, strict=True):
        x, y = x.float(), y.float()
        big = torch.maximum(x.abs(), y.abs()).clamp_min(1e-30)
        ulp = torch.exp2(torch.floor(torch.log2(big)) - 7)
        assert bool(((x - y).abs() <= 2 * LR * steps + ulp).all())
        total += (x - y).abs().sum().item()
        count += x.numel()
    assert total / count < LR / 20


def _close_to_one_process(
    weights: list[torch.Tensor], reference: list[torch.Tensor], steps: int = STEPS
) -> None:
    if weights[0].dtype == torch.bfloat16:
        _bf16_bound(weights, reference, steps)
    else:
        assert _max_diff(weights, reference) < FP32_ATOL


DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]


@pytest.fixture(scope="module", params=DTYPES)
def two_ranks(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Stage 3 and stage 2 on two ranks, and one process, STEPS steps without clipping."""
    dtype = request.param
    out = tmp_path_factory.mktemp(f"two_{str(dtype).split('.')[-1]}")
    return {
        "stage3": run(2, "train", out, dtype=dtype, steps=STEPS),
        "stage2": run(2, "train", out, dtype=dtype, steps=STEPS, offload=False),
        "one": one_process(dtype=dtype, steps=STEPS),
    }


def test_two_ranks_equal_stage_two_bitwise_and_one_process(two_ranks: dict) -> None:
    stage3, stage2, one = two_ranks["stage3"], two_ranks["stage2"], two_ranks["one"]
    for rank in range(2):
        # Each rank's model ends with the whole gathered weights (close is collective).
        assert _max_diff(stage3[rank]["weights"], stage2[rank]["weights"]) == 0.0
        _close_to_one_process(stage3[rank]["weights"], one["weights"])
    assert _max_diff(stage3[0]["weights"], stage3[1]["weights"]) == 0.0
    assert stage3[0]["gathers"] > 0 and one["gathers"] is None


def test_collective_bytes_per_step_are_three_psi_against_two(two_ranks: dict) -> None:
    """ZeRO's analysis: stage 3 moves 3Ψ per step (all-gather in forward, all-gather in
    backward, reduce-scatter) and stage 2 2Ψ. Ψ here is what each stage reduces per step,
    its buckets' padded bytes; stage 3's buckets never span two units, so its Ψ has a
    little more padding than stage 2's. Measured exactly: a unit whose ring slot still
    holds it from the forward is not gathered again for its backward, the last ``ring``
    units of the forward; that is all the 3Ψ saves."""
    for rank in range(2):
        result = two_ranks["stage3"][rank]
        counters = result["counters"]
        psi = sum(result["unit_bytes"])
        kept = sum(result["unit_bytes"][-result["ring"] :])  # no tied units here
        for moved in _per_step(counters):
            assert moved["reduce_scatter"] == psi
            assert moved["all_gather"] == 2 * psi - kept  # forward Ψ + backward Ψ - kept
            total = moved["reduce_scatter"] + moved["all_gather"]
            assert 2.5 * psi < total <= 3 * psi
        # The profiler's collective rows count the same bytes over the recorded steps.
        steps = len(counters) - 1
        profiled = result["profiled"]
        assert profiled["reduce-scatter"] == steps * psi
        assert profiled["all-gather"] == steps * (2 * psi - kept)
        stage2_profiled = two_ranks["stage2"][rank]["profiled"]
        assert stage2_profiled["all-gather"] == stage2_profiled["reduce-scatter"] > 0
        stage2 = two_ranks["stage2"][rank]["counters"]
        for moved in _per_step(stage2):
            assert moved["all_gather"] == moved["reduce_scatter"]  # 2Ψ
            # the same model: Ψ of the two stages differs by padding only
            assert abs(moved["reduce_scatter"] - psi) <= 0.1 * psi


def _host_formula(buckets: list[tuple[int, int, int]]) -> int:
    """Each rank's host pool: per bucket of ``k = shard_numel`` elements of ``s`` bytes,
    only its shard (Note [a sharded unit]): the fp32 master ``a(4k)`` (the home of an fp32
    bucket), Adam's two fp32 moments ``2 a(4k)``, the gradient staging ``a(s k)``, and for
    bf16 the weights' home ``a(s k)``, which CPU Adam writes and the fetch reads."""
    total = 0
    for _, shard, itemsize in buckets:
        total += aligned(4 * shard, POOL_ALIGNMENT)  # master
        total += 2 * aligned(4 * shard, POOL_ALIGNMENT)  # exp_avg, exp_avg_sq
        total += aligned(itemsize * shard, POOL_ALIGNMENT)  # gradient staging
        if itemsize != 4:
            total += aligned(itemsize * shard, POOL_ALIGNMENT)  # the home (weights_staging)
    return total


def test_host_bytes_per_rank_are_the_shards(two_ranks: dict) -> None:
    one = two_ranks["one"]
    for result in two_ranks["stage3"]:
        assert result["host_pool"] == _host_formula(result["buckets"])
        assert all(padded == 2 * shard for padded, shard, _ in result["buckets"])
        # Half of one process's, up to the padding and alignment of the shards.
        assert result["host_pool"] <= 0.6 * one["host_pool"]


@pytest.mark.parametrize(
    ("world", "dtype", "ckpt"),
    [
        pytest.param(2, torch.bfloat16, "torch", id="2-bf16-torch"),
        pytest.param(3, torch.float32, "torch", id="3-fp32-torch"),
        pytest.param(3, torch.bfloat16, "offload", id="3-bf16-offload"),
    ],
)
def test_clipping_and_checkpointing_match_one_process(
    world: int, dtype: torch.dtype, ckpt: str, tmp_path: Path
) -> None:
    """3 ranks give uneven pieces (parameters straddle shards); the norm is clipped every
    step (clip 0.05 is below the gradients' norm) and each block recomputes its forward in
    the backward with its unit gathered (torch's non-reentrant checkpointing, or ours with
    the block inputs offloaded to the host)."""
    kwargs = {"dtype": dtype, "steps": STEPS, "clip": 0.05, "ckpt": ckpt}
    results = run(world, "train", tmp_path, **kwargs)
    one = one_process(**kwargs)
    assert min(one["norms"]) > 0.05  # every step clips
    for result in results:
        _close_to_one_process(result["weights"], one["weights"])
        assert _max_diff(result["weights"], results[0]["weights"]) == 0.0
        # the norms: a few fp32 ulp apart, or about one bf16 ulp (module docstring)
        rel = 1e-4 if dtype == torch.float32 else 1e-2
        assert result["norms"] == pytest.approx(one["norms"], rel=rel)


def test_tied_weights_and_prefetch_two(tmp_path: Path) -> None:
    """A tied embedding and head is one unit with a slot of its own, used at both ends of
    the forward and first in the backward: its slot holds it, so no gather is out of the
    canonical order."""
    kwargs = {"dtype": torch.float32, "steps": STEPS, "tied": True, "prefetch": 2}
    results = run(2, "train", tmp_path, **kwargs)
    one = one_process(**kwargs)
    for result in results:
        _close_to_one_process(result["weights"], one["weights"])


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_leaving_different_blocks_out_match_one_process(world: int, tmp_path: Path) -> None:
    """A block one rank does not run still takes part in its gathers on that rank (Note [a
    sharded unit]) and its gradient bucket in the reduce-scatters (Note [ranks in
    lockstep]); the result is one process on the global batch: the mean of the ranks'
    losses."""
    steps = 5
    results = run(world, "train", tmp_path, dtype=torch.float32, steps=steps, uneven=True)
    ref = gpt(torch.float32, layers=4)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    for step, (ids, targets) in enumerate(batches(steps)):
        losses = [
            loss_without(ref, share(ids, r, world), share(targets, r, world), skipped(step, r, 4))
            for r in range(world)
        ]
        (sum(losses) / world).backward()
        opt.step()
        opt.zero_grad()
    expected = [p.detach() for p in ref.parameters()]
    for result in results:
        assert _max_diff(result["weights"], expected) < FP32_ATOL


def test_a_rank_killed_mid_gather_stops_the_others_within_the_timeout(tmp_path: Path) -> None:
    timeout = 3.0
    results = run(2, "killed", tmp_path, timeout=timeout)
    assert results[1] == {"died": True}
    survivor = results[0]
    assert survivor["type"] == "CollectiveError", survivor
    error = survivor["error"]
    assert "rank 0/2" in error, error
    # The unit it was gathering, named: which one depends on how far the prefetches ran
    # ahead before rank 1 died (a later block's, or under load the final norm's).
    assert re.search(r"all_gather of unit '(blocks\.\d+|norm|[a-z_]*head)'", error), error
    assert "Rank(s) 1 did not report" in error, error  # Note [naming the absent rank]
    assert survivor["seconds"] < timeout + 5.0 + 2.0  # + the roll call's grace


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_estimators_zero3_rows_are_a_real_builds_pools(dtype: torch.dtype, tmp_path: Path):
    """The estimator's "ZeRO-Offload + parameter offload" row on two ranks (ZeRO-3 with
    offload) is what two ranks build: the window of gathered units, the gradient buffers,
    each rank's host shards; so the row says it runs."""
    shape = ModelShape(layers=4, hidden=64, heads=4, vocab=VOCAB, seq_len=SEQ)
    results = run(2, "pools", tmp_path, dtype=dtype, hidden=64, bucket_bytes=16384)
    window, grad_buffers, host = param_offload_bytes(
        shape, itemsize=dtype.itemsize, bucket_bytes=16384, world_size=2
    )
    for result in results:
        capacity = result["capacity"]
        assert capacity["window"] == window
        assert capacity["device"] == grad_buffers  # the optimizer's device pool: no weights
        assert capacity["host"] == host
    table = estimate(shape, dtype=dtype, world_size=2, device_memory=2**30, bucket_bytes=16384)
    row = {row.name: row for row in table.rows}["ZeRO-Offload + parameter offload"]
    assert row.device_model_states == window
    assert row.library == "yes"


def scenario_one_call_on_two_units_of_a_slot(rank: int, world: int, out: object) -> dict:
    """ZeRO-3 on ``world`` ranks: one op on parameters of blocks 0 and 3 (ring slot 0 with
    ``prefetch_layers=1``) after a step, then the same through a clone of the first."""
    model = zero3.gpt(torch.float32, layers=4)
    opt = zero3.make_opt(model, offload=True, prefetch_layers=1)
    zero3.train(model, opt, 1, rank, world, norms=[])
    first, last = next(model.blocks[0].parameters()), next(model.blocks[3].parameters())
    try:
        _ = first + last
        refused = ""
    except RuntimeError as error:
        refused = str(error)
    total = (first.clone() + last).sum().item()
    opt.close()
    return {"refused": refused, "total": total}


def test_several_ranks_refuse_one_call_on_two_units_sharing_a_slot(tmp_path: Path) -> None:
    """With several ranks a read outside the window is gathered into the unit's slot: one
    call on two units sharing it would run on the first one's placeholder (a segfault on one
    rank). Each rank refuses alike, before any gather, naming both units; a clone of the
    first reads both."""
    results = zero3.run(2, scenario_one_call_on_two_units_of_a_slot, tmp_path)
    for rank, result in enumerate(results):
        assert "share window slot" in result["refused"], f"rank {rank}: {result['refused']!r}"
        assert f"rank {rank}" in result["refused"]
    assert results[0]["total"] == results[1]["total"]
