"""Device memory against a formula, and tile pipelining against a slow simulated link."""

from __future__ import annotations

import time

import torch
from torch import nn

from zero_offload import AcceleratorConfig, HostAccelerator, OffloadAdamW, OffloadConfig
from zero_offload.optim.placement import GRAD_BUFFERS

from ._models import batches, make_pair, offload_opt, train

ALIGN = 512


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def test_peak_device_bytes_stay_within_the_formula() -> None:
    model, _ = make_pair(torch.bfloat16, layers=3, dim=64, vocab=256)
    acc = HostAccelerator(AcceleratorConfig(device_budget="64MiB"))
    bucket_bytes = 16384
    opt = offload_opt(model, accelerator=acc, bucket_bytes=bucket_bytes)
    acc.ledger.reset_peak()
    train(model, opt, batches(4, vocab=256))
    params = sum(p.numel() for p in model.parameters())
    buckets = len(opt.buckets)
    # Every term of the device bytes the library may hold:
    weights = 2 * params  # training-dtype (bf16) weights, 2 bytes each
    padding = buckets * ALIGN  # each bucket padded to a multiple of 256 elements (512 bytes)
    # Two gradient buffers of the largest bucket: bucket_bytes, or one parameter larger than
    # that (it gets a bucket of its own), plus its padding.
    largest = max(bucket_bytes, 2 * max(p.numel() for p in model.parameters()))
    grads = GRAD_BUFFERS * (largest + ALIGN)
    formula = weights + padding + grads
    peak = acc.memory_stats()["peak"]
    assert peak <= formula, (peak, formula)
    # And far below what keeping everything on the device would take: weights 2 + grads 2 +
    # fp32 master, exp_avg, exp_avg_sq 12 = 16 bytes per parameter.
    assert peak * 6 <= 16 * params
    # The pool never needed more than two gradient buffers at once.
    device_pool = opt.manager.pools[0]
    stats = device_pool.stats()
    assert stats["peak_bytes_in_use"] <= stats["capacity_bytes"]
    assert stats["defragmentations"] == 0  # same blocks every step: no fragmentation


def test_budget_for_weights_alone_is_not_enough_and_says_so() -> None:
    model, _ = make_pair(torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    acc = HostAccelerator(AcceleratorConfig(device_budget=2 * params + 1024))
    try:
        offload_opt(model, accelerator=acc)
    except MemoryError as exc:
        assert "gradient buffers" in str(exc)
    else:
        raise AssertionError("a budget without room for gradient buffers was accepted")


def _step_seconds(tile_elements: int, bandwidth: float | None, numel: int) -> float:
    """Median time of ``opt.step()`` alone (gradients already on the host)."""
    torch.manual_seed(0)
    model = nn.Linear(numel // 1024, 1024, bias=False)
    acc = HostAccelerator(AcceleratorConfig(device_budget="512MiB", link_bandwidth=bandwidth))
    opt = OffloadAdamW(
        model.parameters(),
        lr=1e-3,
        config=OffloadConfig(bucket_bytes=64 * 2**20, tile_elements=tile_elements),
        accelerator=acc,
    )
    times = []
    for _ in range(5):
        model(torch.randn(2, numel // 1024)).sum().backward()
        opt._grad_stats()  # gradients on the host and statistics done: time the update alone
        start = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - start)
        opt.zero_grad()
    opt.close()
    return sorted(times)[2]


def test_tile_pipelining_hides_the_weight_copies_behind_the_cpu_update() -> None:
    numel = 2**24  # 16M fp32 parameters: 64 MiB of weights go back to the device per step
    compute = _step_seconds(numel, None, numel)  # the CPU update alone, no link
    bandwidth = 4 * numel / compute  # a simulated link whose copy takes as long as the update
    one_tile = _step_seconds(numel, bandwidth, numel)  # compute everything, then copy it all
    tiled = _step_seconds(numel // 16, bandwidth, numel)  # copy tile i while computing tile i+1
    assert one_tile >= 0.95 * 4 * numel / bandwidth  # the link is slow: at least the copy time
    # Pipelined: about max(compute, copy) plus one tile; demand a third of the copy hidden.
    assert tiled < one_tile - compute / 3, (compute, one_tile, tiled)
