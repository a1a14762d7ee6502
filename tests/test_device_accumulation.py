"""Micro-batches that add up on the device (Note [micro-batches add up on the device] in
zero_offload/optim/grads/device_acc.py): bitwise the host accumulator's results, one landing
per bucket per step, the host passes it saves, the budget's fallback, and the prediction of
a window's last micro-batch (right or wrong)."""

from __future__ import annotations

import logging

import pytest
import torch

import zero_offload.optim.grads.device_acc as device_acc
from zero_offload.memory.traffic import Category, Direction
from zero_offload.optim.grads.path import GradSource

from .helpers.device import on_device, run_device
from .helpers.dist import run_ranks
from .helpers.models import batches, lm_loss, make_pair, offload_opt

pytestmark = pytest.mark.cuda_form


def _train(accumulation: str, windows: list[int], *, dtype=torch.float32, announce=False, **cfg):
    """Steps of ``windows`` micro-batches each; the model, optimizer and grad norms."""
    model, _ = make_pair(dtype)
    opt = offload_opt(model, grad_accumulation=accumulation, **cfg)
    data = batches(sum(windows))
    norms, i = [], 0
    for micro in windows:
        for j in range(micro):
            loss = lm_loss(model, *data[i])
            i += 1
            if announce and j == micro - 1:
                opt.backward(loss, step=True)  # Note [stepping during backward]
            else:
                opt.backward(loss)
        opt.step()
        norms.append(opt.last_grad_norm)
        opt.zero_grad()
    return model, opt, norms


def _same(a, b, *, clipped: bool = False) -> None:
    """Two runs agree: the same weights, bitwise, unless a clip binds; then within one ulp
    of the training dtype (the norms are equal to about 1e-16, Note [micro-batches add up
    on the device])."""
    (model_a, opt_a, norms_a), (model_b, opt_b, norms_b) = a, b
    assert norms_a == pytest.approx(norms_b, rel=1e-14)
    for x, y in zip(model_a.parameters(), model_b.parameters(), strict=True):
        if clipped:
            ulp = torch.finfo(x.dtype).eps * y.detach().float().abs()
            assert bool(((x.detach().float() - y.detach().float()).abs() <= ulp).all())
        else:
            assert torch.equal(x, y)
    opt_a.close()
    opt_b.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("clip", [None, 1e-3], ids=["unclipped", "clipped"])
def test_device_sum_is_bitwise_the_host_sum(dtype, clip) -> None:
    # An fp32 add of the training-dtype gradient, in the same order, on either side: the
    # same sum, bitwise. Its norm is taken on the device per parameter (the host adds its
    # cells exactly): equal to about 1e-16, so a binding clip may move a last bit.
    windows = [4, 4, 4, 4]
    device = _train("auto", windows, dtype=dtype, max_grad_norm=clip)
    assert all(b.gradients.device_sum is not None for b in device[1].buckets)
    host = _train("host", windows, dtype=dtype, max_grad_norm=clip)
    assert all(b.gradients.device_sum is None for b in host[1].buckets)
    _same(device, host, clipped=clip is not None)


def test_a_wrong_prediction_lands_again_and_stays_exact() -> None:
    # Longer and shorter windows than the one before: a backward past the predicted last
    # adds on the device again and step() lands the sum again; a shorter one lands there.
    windows = [4, 2, 5, 3, 1, 3, 6]
    _same(_train("auto", windows), _train("host", windows))


@pytest.mark.parametrize("announce", [False, True], ids=["overlap_step", "announced"])
def test_delayed_and_announced_steps_are_exact(announce: bool) -> None:
    windows = [3, 3, 3, 3]
    cfg = {"announce": True} if announce else {"overlap_step": True}
    _same(_train("auto", windows, **cfg), _train("host", windows, **cfg))


def test_the_last_micro_batch_lands_during_its_backward() -> None:
    model, _ = make_pair()
    opt = offload_opt(model, tile_elements=1 << 20)
    data = batches(12)
    seen = []
    for step in range(3):
        for j in range(4):
            opt.backward(lm_loss(model, *data[4 * step + j]))
            seen.append({b.gradients.window_source() for b in opt.buckets})
        opt.step()
        opt.zero_grad()
    # Window 1 accumulates on the host (nothing predicted it); window 2 on the device,
    # landing after its 4th backward (window 1 had 4), before step(); so does window 3.
    assert seen[:4] == [{GradSource.STAGING}] + [{GradSource.ACCUMULATOR}] * 3
    assert seen[4:] == 2 * ([{GradSource.DEVICE}] * 3 + [{GradSource.ACCUMULATOR}])
    opt.close()


def _step_traffic(accumulation: str, micro: int) -> tuple[dict, dict, int, int]:
    """The D2H gradient copies and bytes, and the host passes, of the third step."""
    model, _ = make_pair()
    opt = offload_opt(model, tile_elements=1 << 20, grad_accumulation=accumulation)
    data = batches(3 * micro)
    for step in range(3):
        if step == 2:
            copies0 = opt.manager.counters.snapshot()
            passes0 = opt.manager.counters.passes()
        for j in range(micro):
            opt.backward(lm_loss(model, *data[micro * step + j]))
        opt.step()
        opt.zero_grad()
    key = f"{Direction.D2H.value}/{Category.GRADIENTS.value}"
    copies = {k: opt.manager.counters.snapshot()[key][k] - copies0[key][k] for k in copies0[key]}
    passes = {
        name: {k: v - passes0.get(name, {}).get(k, 0) for k, v in counts.items()}
        for name, counts in opt.manager.counters.passes().items()
        if counts["calls"] > passes0.get(name, {}).get("calls", 0)  # passes of this step
    }
    buckets = len(opt.buckets)
    params = sum(b.layout.real_in(*b.shard) for b in opt.buckets)
    opt.close()
    return copies, passes, buckets, params


def test_a_step_lands_once_per_bucket_and_the_host_makes_no_pass() -> None:
    # Four micro-batches of an fp32 model, one tile per bucket. On the device: one D2H per
    # bucket per step (the fp32 sum: 4 bytes per element), and no host pass over the
    # gradient (its statistics are taken on the device). On the host: a D2H per
    # micro-batch, and an accumulation pass over each (the first overwrites).
    copies, passes, buckets, params = _step_traffic("auto", 4)
    assert copies["copies"] == buckets
    assert passes == {}
    host_copies, host_passes, _, _ = _step_traffic("host", 4)
    assert host_copies["copies"] == 4 * buckets
    acc = host_passes["accumulation"]
    # 4 flushes of fp32 gradients: each reads its staging (4 B), the last three the
    # accumulator too (4 B), and each writes the accumulator (4 B).
    assert (acc["read"], acc["written"]) == ((4 + 3 * 8) * params, 4 * 4 * params)
    assert (acc["read"] + acc["written"]) / params == 44.0


def test_no_room_in_the_budget_accumulates_on_the_host_and_says_so(monkeypatch, caplog) -> None:
    # A reserve the size of the whole budget: no bucket's accumulator fits.
    monkeypatch.setattr(device_acc, "RESERVE_FRACTION", 1.0)
    with caplog.at_level(logging.WARNING, logger="zero_offload"):
        device = _train("auto", [3, 3, 3])
    assert all(b.gradients.device_sum is None for b in device[1].buckets)
    messages = [r.getMessage() for r in caplog.records if "accumulates its micro" in r.message]
    assert len(messages) == 1 and "device budget" in messages[0]
    notes = device[1].manager.step_notes
    assert [v for k, v in notes.items() if k.endswith("host_accumulating_buckets")] == [
        len(device[1].buckets)
    ]
    _same(device, _train("host", [3, 3, 3]))


def test_zero_grad_mid_window_forgets_the_device_sum() -> None:
    def run(accumulation: str):
        model, _ = make_pair()
        opt = offload_opt(model, grad_accumulation=accumulation)
        data = batches(16)
        for i, plan in enumerate([4, 4, -2, 4, 2]):  # -2: two backwards, then zero_grad
            for j in range(abs(plan)):
                opt.backward(lm_loss(model, *data[(3 * i + j) % 16]))
            if plan > 0:
                opt.step()
            opt.zero_grad()
        return model, opt, [opt.last_grad_norm]

    _same(run("auto"), run("host"))


@pytest.mark.simulator_only("spawns gloo ranks on the host accelerator")
def test_two_ranks_sum_their_shards_on_the_device(tmp_path) -> None:
    # Each rank sums its shard of the reduce-scattered micro-batches: the host's sum; the
    # clip binds (0.5), so the weights agree to one ulp (the norm: Note [micro-batches add
    # up on the device]).
    for acc in ("auto", "host"):
        (tmp_path / acc).mkdir()
    runs = {
        acc: run_ranks(
            2,
            "accumulate",
            tmp_path / acc,
            windows=[3, 3, 2, 3],
            accumulation=acc,
            clip=0.5,
        )
        for acc in ("auto", "host")
    }
    for device, host in zip(runs["auto"], runs["host"], strict=True):
        assert all(device["on_device"]) and not any(host["on_device"])
        assert device["norms"] == pytest.approx(host["norms"], rel=1e-14)
        for x, y in zip(device["weights"], host["weights"], strict=True):
            assert bool(((x - y).abs() <= torch.finfo(x.dtype).eps * y.abs()).all())


@pytest.mark.parametrize("accumulation", ["auto", "host"])
def test_the_estimator_rows_hold_the_built_accumulators(accumulation: str) -> None:
    # The rows "micro-batches summed on the device / on the host" against the pools an
    # accumulating optimizer built (estimate/accumulation.py): exact, pool by pool.
    from zero_offload.demo.model import GPTConfig, TinyGPT
    from zero_offload.estimate import estimate

    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=50, seq_len=16, layers=2, hidden=64, heads=4)
    model = TinyGPT(cfg).to(run_device(), torch.bfloat16)
    opt = offload_opt(model, bucket_bytes=64 * 1024, grad_accumulation=accumulation)
    tokens = on_device(torch.randint(0, 50, (2, 16)))
    for _ in range(2):  # the first window accumulates on the host, the second where asked
        for _ in range(2):
            opt.backward(model(tokens).float().square().mean())
        opt.step()
        opt.zero_grad()
    pools = {p.name: p for p in opt.manager.pools}
    device_acc = sum(p.capacity for n, p in pools.items() if n.endswith(".grad_acc_dev"))
    host_acc = sum(p.capacity for n, p in pools.items() if n.endswith(".grad_acc"))
    spare = sum(p.capacity for n, p in pools.items() if n.endswith(".grad_staging_spare"))
    opt.close()
    rows = {r.name: r for r in estimate(model, dtype=torch.bfloat16, bucket_bytes=64 * 1024).rows}
    base = rows["ZeRO-Offload + checkpointing"]
    device_row = rows["ZeRO-Offload + ckpt, micro-batches summed on the device"]
    host_row = rows["ZeRO-Offload + ckpt, micro-batches summed on the host"]
    # The first (host) window built the host accumulator and the spare in both runs; the
    # spare goes back once the device sums (Note [the spare goes when the device sums]).
    if accumulation == "auto":
        assert spare == 0
        assert device_row.host - base.host == host_acc
        assert device_row.device_buffers - base.device_buffers == device_acc > 0
    else:
        assert host_row.host - base.host == host_acc + spare > host_acc
        assert device_acc == 0
