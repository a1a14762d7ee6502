"""``opt.placement`` after ``close()``: the optimizer holds nothing, and every figure says so
(``optim/reports/summary.py``)."""

from __future__ import annotations

import pytest
import torch

from zero_offload import OffloadAdamW, OffloadConfig
from zero_offload.accelerator import HostAccelerator
from zero_offload.config import AcceleratorConfig
from zero_offload.demo.model import GPTConfig, TinyGPT


@pytest.mark.parametrize("offload_parameters", [False, True])
def test_placement_after_close_holds_nothing(offload_parameters: bool) -> None:
    torch.manual_seed(0)
    net = TinyGPT(GPTConfig(vocab_size=50, seq_len=8, layers=2, hidden=32, heads=2))
    acc = HostAccelerator(AcceleratorConfig(device_budget="64MiB"))
    extra = {"model": net} if offload_parameters else {}
    config = OffloadConfig(bucket_bytes=16384, offload_parameters=offload_parameters)
    opt = OffloadAdamW(net.parameters(), lr=1e-3, accelerator=acc, config=config, **extra)
    ids = torch.randint(0, 50, (2, 8))
    opt.backward(net(ids, ids))
    opt.step()
    opt.zero_grad()
    before = opt.placement
    assert before.parameters > 0 and before.pageable + before.pinned > 0
    assert before.device_pools > 0
    opt.close()
    after = opt.placement
    held = (after.device, after.host, after.nvme, after.pinned, after.pageable, after.parameters)
    assert held == (0, 0, 0, 0, 0, 0)
    assert after.device_pools == 0 == after.device_in_use == acc.memory_stats()["in_use"]
    assert after.device_budget == before.device_budget
    assert opt.manager.pool_stats() == {}  # it listed the closed pools' capacities
