"""What a step costs that time cannot show on 2 cores (issue 39), counted: weight and
gradient copies per bucket, and torch ops dispatched by ``step()``, for a model of many
small parameters. On a GPU each copy and each op is a launch from the Python thread that
also launches backward; here they are counted, not timed.

Note [a run spans the gaps between its slots] (``optim/flat_bucket.py``) makes a bucket
of 400 parameters one run: one gradient copy per flush and one weight copy per step
(before it: one weight copy per parameter pair, 201). Note [one fingerprint pass per
bucket] keeps the write check's ops per bucket.
"""

from __future__ import annotations

import collections
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from zero_offload import OffloadAdamW, OffloadConfig
from zero_offload.memory import manager as manager_module
from zero_offload.memory.traffic import Direction

from .helpers.models import host_accelerator

#: Ops that only make views or metadata (no kernel on a GPU).
VIEWS = {"aten.slice.Tensor", "aten.detach.default", "aten.view.dtype", "aten.view.default"}


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.kernels: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func) not in VIEWS:
            self.kernels[str(func)] += 1
        return func(*args, **(kwargs or {}))


def _model(layers: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(layers)])


def _copies(monkeypatch: pytest.MonkeyPatch) -> collections.Counter[Any]:
    counted: collections.Counter[Any] = collections.Counter()
    copy = manager_module.TieredMemoryManager.copy

    def counting(self: Any, dst: torch.Tensor, src: torch.Tensor, **kwargs: Any) -> Any:
        counted[kwargs.get("direction")] += 1
        return copy(self, dst, src, **kwargs)

    monkeypatch.setattr(manager_module.TieredMemoryManager, "copy", counting)
    return counted


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_bucket_of_many_parameters_is_two_copies_a_step(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _model(200).to(dtype)  # 400 parameters, one bucket
    opt = OffloadAdamW(model.parameters(), config=OffloadConfig(), accelerator=host_accelerator())
    assert len(opt.buckets) == 1
    copies = _copies(monkeypatch)
    x = torch.randn(4, 8, dtype=dtype)
    for _ in range(3):
        copies.clear()
        model(x).float().sum().backward()
        opt.step()
        opt.zero_grad()
        assert copies[Direction.D2H] == 1, copies
        assert copies[Direction.H2D] == 1, copies
    opt.close()


def test_step_dispatches_ops_per_bucket_not_per_parameter() -> None:
    """Kernels (not views) dispatched by ``step()``: the same for 100 and 400 parameters in
    one bucket (the CPU update itself is numba, not torch)."""
    counts = {}
    for layers in (50, 200):
        model = _model(layers)
        opt = OffloadAdamW(model.parameters(), accelerator=host_accelerator())
        x = torch.randn(4, 8)
        for _ in range(2):  # the second step is the steady state
            model(x).sum().backward()
            with _Ops() as ops:
                opt.step()
            opt.zero_grad()
        counts[layers] = sum(ops.kernels.values())
        opt.close()
    assert counts[50] == counts[200] <= 16, counts
