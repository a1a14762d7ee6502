"""OffloadAdamW over several gloo ranks (spawned processes on the host accelerator).

Tolerance: ``FP32_ATOL`` (1e-5), as in test_offload_adamw_parity.py. Each rank averages
the loss over its share of the global batch and the reduce-scatter averages those means
over the ranks; with equal shares that is the mean over the full batch in exact
arithmetic, but summed in a different order (per rank, then across ranks), so each
gradient differs from the one-process gradient by a few ulp. Adam divides by
sqrt(v) + eps, so such relative noise stays relative in the update: over 20 steps of
lr 1e-3 on O(1) weights the drift stays well below 1e-5 absolute.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from .helpers.dist import data, resume, run_ranks, shard_batch, uneven_loss, uneven_skip
from .helpers.models import lm_loss, make_pair, offload_opt, torch_adamw, train

FP32_ATOL = 1e-5
STEPS = 20


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x.float() - y.float()).abs().max().item() for x, y in zip(a, b, strict=True))


def _reference(steps: int, *, clip: float | None = None) -> tuple[list, list]:
    """Weights after ``steps`` full-batch steps: one-process OffloadAdamW, torch AdamW."""
    model, ref = make_pair()
    opt = offload_opt(model, max_grad_norm=clip)
    ropt = torch_adamw(ref)
    train(model, opt, data(steps))
    for tokens, targets in data(steps):
        lm_loss(ref, tokens, targets).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
        ropt.step()
        ropt.zero_grad()
    opt.close()
    return [p.detach() for p in model.parameters()], [p.detach() for p in ref.parameters()]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """Two ranks train STEPS steps (shared by the parity and the traffic tests)."""
    return run_ranks(2, "train", tmp_path_factory.mktemp("two"), steps=STEPS, clip=None)


def test_two_ranks_match_one_process_and_torch(two_ranks: list[dict]) -> None:
    _check_parity(two_ranks, clip=None)


def test_three_ranks_with_clipping_match_one_process_and_torch(tmp_path: Path) -> None:
    """3 ranks give uneven pieces (parameters straddle shards) and exercise clipping."""
    _check_parity(run_ranks(3, "train", tmp_path, steps=STEPS, clip=0.5), clip=0.5)


def _check_parity(results: list[dict], *, clip: float | None) -> None:
    ours, torch_ref = _reference(STEPS, clip=clip)
    for rank, result in enumerate(results):
        assert _max_diff(result["weights"], ours) < FP32_ATOL, rank
        assert _max_diff(result["weights"], torch_ref) < FP32_ATOL, rank
        # every rank saw the same global norm, so every rank clipped by the same factor
        assert result["norms"] == results[0]["norms"]
    if clip is not None:
        assert max(results[0]["norms"]) > clip  # clipping was active


def test_traffic_per_step_is_the_zero_formula(two_ranks: list[dict]) -> None:
    world, itemsize = 2, 4  # fp32 training dtype
    traffic = two_ranks[0]["traffic"]  # rank 0's first step
    padded = sum(traffic["padded"])  # elements of every bucket, padding included
    assert sum(traffic["shard"]) * world == padded

    def moved(key: str, op: str) -> int:
        after, before = traffic[f"{key}_after"], traffic[f"{key}_before"]
        return after.get(op, {}).get("bytes", 0) - before.get(op, {}).get("bytes", 0)

    # One backward and one step: each bucket reduce-scattered once and all-gathered once,
    # in the training dtype: 2 x the model's bytes, what one data-parallel all-reduce moves.
    assert moved("comm", "reduce_scatter") == padded * itemsize
    assert moved("comm", "all_gather") == padded * itemsize
    # ... plus one all-reduce of float64s: the norm, the overflow flag, and one "got a
    # gradient" flag per parameter (Note [ranks in lockstep]); and, the first backward
    # only, one "got a gradient after it went" flag per bucket (Note [a parameter's
    # gradient may arrive several times]).
    first_backward = len(traffic["padded"]) * 8
    assert moved("comm", "all_reduce") == (2 + sum(traffic["slots"])) * 8 + first_backward
    # Only this rank's 1/N of the gradients leaves the device.
    assert moved("d2h", "device_to_host/gradients") == padded * itemsize // world
    # Host memory per rank: 4 fp32 fields (master, exp_avg, exp_avg_sq, and grad_staging
    # in the fp32 training dtype; no accumulator with one micro-batch) over this rank's
    # shard of each bucket, each block rounded up to the 512-byte pool alignment: 1/N of
    # world size 1 plus padding.
    assert traffic["host_pool"] == sum(4 * -(-4 * k // 512) * 512 for k in traffic["shard"])
    # The updated shard goes back to the device, padding left out (it never changes).
    assert moved("d2h", "host_to_device/weights") == sum(traffic["owned_real"]) * itemsize


def test_one_ranks_overflow_makes_every_rank_skip(tmp_path: Path) -> None:
    results = run_ranks(2, "overflow", tmp_path, steps=4, bad_step=2)
    for result in results:
        assert result["skipped"] == 1
        assert result["scales"] == results[0]["scales"]
        assert _max_diff(result["weights"], results[0]["weights"]) == 0.0


def test_checkpoint_from_two_ranks_resumes_on_one_and_three(tmp_path: Path) -> None:
    half = STEPS // 2
    saved = run_ranks(2, "save", tmp_path, steps=half)
    assert saved[0]["shard_keys"] and saved[1]["shard_keys"]
    ours, _ = _reference(STEPS)
    one = resume(0, 1, tmp_path, first=half, steps=STEPS)  # no process group: one rank
    assert _max_diff(one, ours) < FP32_ATOL
    for result in run_ranks(3, "resume", tmp_path, first=half, steps=STEPS):
        assert _max_diff(result["weights"], ours) < FP32_ATOL


def test_a_failed_rank_stops_the_others_within_the_timeout(tmp_path: Path) -> None:
    timeout = 3.0
    results = run_ranks(2, "failure", tmp_path, fail_step=2, timeout=timeout)
    assert results[1]["error"] == "rank 1 fails on purpose"
    survivor = results[0]
    assert survivor["type"] == "CollectiveError", survivor
    assert "rank 0/2" in survivor["error"] and "reduce_scatter" in survivor["error"]
    # Note [naming the absent rank]: the survivor names the rank that never arrived.
    assert "Rank(s) 1 did not report" in survivor["error"], survivor["error"]
    assert survivor["seconds"] < timeout + 5.0 + 2.0  # + the roll call's grace


def test_fp16_mean_does_not_overflow_and_subgroup_checkpoints_gather(tmp_path: Path) -> None:
    results = run_ranks(3, "collectives", tmp_path)
    for result in results:
        assert result["mean"] == [40000.0] * 4  # 3 x 40000 overflows fp16; the mean does not
    assert results[0]["gathered"] is None  # not in the group
    assert results[1]["gathered"] == [0, 1]  # group rank 0 (global 1) gets the whole state
    assert results[2]["gathered"] is None


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_with_different_unused_parameters_match_one_process(
    world: int, tmp_path: Path
) -> None:
    """Note [ranks in lockstep]: every bucket goes once per backward in one order, so uneven
    gradients give the single-process result on the global batch (the mean of the ranks'
    losses), where gloo used to abort on mismatched reduce-scatters."""
    steps = 5
    results = run_ranks(world, "uneven", tmp_path, steps=steps)
    _, ref = make_pair()
    ropt = torch_adamw(ref)
    for step, (tokens, targets) in enumerate(data(steps)):
        losses = [
            uneven_loss(
                ref,
                shard_batch(tokens, r, world),
                shard_batch(targets, r, world),
                skip=uneven_skip(step, r),
            )
            for r in range(world)
        ]
        (sum(losses) / world).backward()
        ropt.step()
        ropt.zero_grad()
    expected = [p.detach() for p in ref.parameters()]
    for result in results:
        assert _max_diff(result["weights"], expected) < FP32_ATOL


def test_user_collectives_on_the_default_group_during_backward_do_not_collide(
    tmp_path: Path,
) -> None:
    """Note [a process group of the optimizer's own]: the loop's own all-reduce and broadcast on
    the default group, issued mid-backward while the reduce-scatters are in flight, match
    each other and training matches one process."""
    steps = 3
    results = run_ranks(2, "user_collectives", tmp_path, steps=steps)
    ours, _ = _reference(steps)
    for rank, result in enumerate(results):
        assert result["flags"] == [(1.0, 1.0)] * steps, rank  # 0 + 1; rank 0's flag
        assert _max_diff(result["weights"], ours) < FP32_ATOL, rank
