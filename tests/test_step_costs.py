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

from .helpers.device import on_device, run_accelerator, run_device
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
            # Landed first: a gradient still landing splits CPU Adam into more launches
            # (Note [a launch spans the tiles that landed]), each with its own ops, and
            # how far it got depends on the machine's load; this counts the ops per bucket.
            opt.manager.synchronize()
            with _Ops() as ops:
                opt.step()
            opt.zero_grad()
        counts[layers] = sum(ops.kernels.values())
        opt.close()
    assert counts[50] == counts[200] <= 16, counts


class _AllOps(TorchDispatchMode):
    """Every op dispatched, views included."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def test_the_replaced_parameter_check_makes_no_tensor_per_parameter() -> None:
    # ``ParamViews.detached()`` runs at every step() (check_untouched): it finds where each
    # slot starts by arithmetic, not by slicing the bucket per parameter (before: one
    # aten.slice per parameter, 400 here, a large share of step() for small parameters).
    model = _model(200)  # 400 parameters, one bucket
    opt = OffloadAdamW(model.parameters(), accelerator=host_accelerator())
    views = opt.buckets[0].views
    with _AllOps() as ops:
        assert views.detached() == []
    assert ops.count == 0
    # Still seen: a parameter given other storage, and one viewing the wrong slot.
    first, second = views.params[0], views.params[2]
    kept = second.data
    first.data = first.data.clone()
    second.data = views.weights_dev[1 : 1 + second.numel()].view(second.shape)
    assert [i for i, _ in views.detached()] == [0, 2]
    second.data = kept
    assert [i for i, _ in views.detached()] == [0]
    opt.close()


def test_the_statistics_of_a_tile_of_many_parameters_are_one_launch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Note [one launch for many ranges] (kernels/stats.py): the host pass over a landed tile
    # of 400 parameters sums every parameter's cells in one launch (before: one grad_stats
    # launch per parameter, 400 a tile on the host worker, which step() waited for).
    from zero_offload.optim.grads import host_passes

    calls: collections.Counter[str] = collections.Counter()
    for name in ("grad_stats", "grad_stats_ranges"):
        kernel = getattr(host_passes, name, None)

        def counting(*args: Any, _name: str = name, _kernel: Any = kernel, **kwargs: Any) -> Any:
            calls[_name] += 1
            return _kernel(*args, **kwargs)

        monkeypatch.setattr(host_passes, name, counting, raising=False)
    model = _model(200)  # 400 parameters, one bucket, one tile
    opt = OffloadAdamW(model.parameters(), accelerator=host_accelerator())
    x = torch.randn(4, 8)
    for _ in range(2):
        calls.clear()
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()
        assert calls == {"grad_stats_ranges": 1}, calls
    opt.close()


def _launches(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The elements of each CPU Adam launch (``adam_step`` through the AdamW rule)."""
    import zero_offload.optim.rule.adamw as adamw_rule

    sizes: list[int] = []
    kernel = adamw_rule.adam_step

    def counting(param: Any, *args: Any, **kwargs: Any) -> Any:
        sizes.append(param.numel())
        return kernel(param, *args, **kwargs)

    monkeypatch.setattr(adamw_rule, "adam_step", counting)
    return sizes


@pytest.mark.cuda_form
def test_a_bucket_whose_gradient_landed_is_one_launch_and_one_weight_copy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Note [a launch spans the tiles that landed]: 64 tiles of 1024 elements, all landed
    # when step() runs, make one Adam launch and one weight copy (before: 64 and 64).
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 256, bias=False).to(run_device())  # 65536 elements
    config = OffloadConfig(tile_elements=1024)
    opt = OffloadAdamW(model.parameters(), config=config, accelerator=run_accelerator())
    launches, copies = _launches(monkeypatch), _copies(monkeypatch)
    x = on_device(torch.randn(4, 256))
    for _ in range(2):
        model(x).square().sum().backward()
        opt.manager.synchronize()  # every gradient tile on the host
        launches.clear()
        copies.clear()
        opt.step()
        opt.zero_grad()
        assert launches == [256 * 256]
        assert copies[Direction.H2D] == 1, copies
    opt.close()


@pytest.mark.simulator_only("a slow simulated link keeps the gradient's copies in flight")
def test_adam_still_follows_a_gradient_that_is_landing(monkeypatch: pytest.MonkeyPatch) -> None:
    # While the tiles are still on their way (a slow link), a launch takes what landed:
    # several launches, the first before the last tile landed (Note [Adam follows the
    # gradient in]).
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 256, bias=False)
    opt = OffloadAdamW(
        model.parameters(),
        config=OffloadConfig(tile_elements=1024),
        accelerator=host_accelerator(link_latency=2e-3),
    )
    launches = _launches(monkeypatch)
    model(torch.randn(4, 256)).square().sum().backward()
    opt.step()
    assert len(launches) > 1 and sum(launches) == 256 * 256
    opt.close()


def test_the_accumulation_of_a_tile_of_many_parameters_is_one_launch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Note [one accumulation launch for many ranges] (kernels/accumulate.py): with an
    # accumulator (two micro-batches summed on the host), the pass over a landed tile of 400
    # parameters accumulates every piece and takes its statistics in one launch (before:
    # one accumulate_grad launch per parameter, 400 a tile on the host worker).
    from zero_offload.optim.grads import host_passes

    calls: collections.Counter[str] = collections.Counter()
    names = ("accumulate_grad", "accumulate_grad_ranges", "grad_stats", "grad_stats_ranges")
    for name in names:
        kernel = getattr(host_passes, name, None)

        def counting(*args: Any, _name: str = name, _kernel: Any = kernel, **kwargs: Any) -> Any:
            calls[_name] += 1
            return _kernel(*args, **kwargs)

        monkeypatch.setattr(host_passes, name, counting, raising=False)
    tiles: list[tuple[bool, collections.Counter[str]]] = []  # (accumulates, its launches)
    pass_tile = host_passes.pass_tile

    def counted_tile(*args: Any, **kwargs: Any) -> None:
        before = calls.copy()
        pass_tile(*args, **kwargs)
        tiles.append((args[3] is not None, calls - before))

    monkeypatch.setattr(host_passes, "pass_tile", counted_tile)
    model = _model(200)  # 400 parameters, one bucket, one tile
    config = OffloadConfig(grad_accumulation="host")
    opt = OffloadAdamW(model.parameters(), config=config, accelerator=host_accelerator())
    assert len(opt.buckets) == 1
    x = torch.randn(4, 8)
    for _ in range(2):
        tiles.clear()
        for _ in range(2):  # the second flush lands in the accumulator
            model(x).sum().backward()
        opt.step()
        opt.zero_grad()
        accumulating = [launches for accumulates, launches in tiles if accumulates]
        assert accumulating, tiles
        for launches in accumulating:
            assert launches == {"accumulate_grad_ranges": 1}, launches
    opt.close()


@pytest.mark.parametrize("accumulation", ["host", "statistics"])
def test_a_tiles_pieces_are_cut_once(monkeypatch: pytest.MonkeyPatch, accumulation: str) -> None:
    # Note [a tile's ranges are cut once] (optim/grads/host_passes.py): cutting a tile into
    # its pieces walks the bucket's slots in Python (about 3 ms a tile at 400 parameters);
    # the cut depends only on the bucket and the tile's bounds, so after the first step no
    # tile is cut again, and the pass gets the same ranges (the norms match the first
    # step's cut: the same partials, checked by the bitwise norm tests elsewhere).
    from zero_offload.optim.grads import host_passes

    cuts: list[tuple[int, int]] = []
    real = host_passes.pieces

    def counting(slots: Any, shard: Any, lo: int, hi: int) -> Any:
        cuts.append((lo, hi))
        return real(slots, shard, lo, hi)

    monkeypatch.setattr(host_passes, "pieces", counting)
    # ... and planned for the kernels once (Note [ranges planned once]): each launch gets
    # the kept plan, not ranges to check and cut again.
    launched: list[object] = []
    real_acc, real_stats = host_passes.accumulate_grad_ranges, host_passes.grad_stats_ranges

    def accumulate(acc: Any, src: Any, ranges: Any, **kwargs: Any) -> Any:
        launched.append(ranges)
        return real_acc(acc, src, ranges, **kwargs)

    def stats(grad: Any, ranges: Any, **kwargs: Any) -> Any:
        launched.append(ranges)
        return real_stats(grad, ranges, **kwargs)

    monkeypatch.setattr(host_passes, "accumulate_grad_ranges", accumulate)
    monkeypatch.setattr(host_passes, "grad_stats_ranges", stats)
    model = _model(200)  # 400 parameters, one bucket
    config = OffloadConfig(grad_accumulation="host", tile_elements=1024)
    opt = OffloadAdamW(model.parameters(), config=config, accelerator=host_accelerator())
    x = torch.randn(4, 8)
    micro = 2 if accumulation == "host" else 1
    per_step = []
    for _ in range(3):
        cuts.clear()
        for _ in range(micro):
            model(x).sum().backward()
        opt.step()
        opt.zero_grad()
        per_step.append(list(cuts))
    assert per_step[0], "the first step cuts its tiles"
    assert len(set(per_step[0])) == len(per_step[0])  # each tile once
    assert per_step[1] == per_step[2] == []
    plans = (host_passes.AccumulateRanges, host_passes.StatsRanges)
    assert launched and all(isinstance(ranges, plans) for ranges in launched)
    opt.close()
