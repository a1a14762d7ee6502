"""``overlap_step`` with one micro-batch a step takes the lone window's statistics on the
device (issue 39; Note [a lone window's statistics are taken on the device] in
``optim/grads/lone_stats.py``). Before, backward k+1 queued a statistics pass over the
landed gradient on the host worker, behind update k (first in, first out), and read it
once more on the host: 4 bytes a parameter a step in fp32, 2 in bf16. Here: the worker's
queue while update k runs, the host passes' bytes, the norm against torch's float64
per-parameter norms, and the weights against the host statistics' path (bitwise unclipped,
one ulp when a clip binds: the device accumulator's promise)."""

from __future__ import annotations

import math
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import zero_offload.optim.rule.adamw as adamw_rule
from zero_offload.accelerator import HostAccelerator
from zero_offload.config import AcceleratorConfig
from zero_offload.memory.traffic import Category, Direction

from .helpers.models import batches, lm_loss, make_pair, max_diff, offload_opt

pytestmark = pytest.mark.simulator_only(
    "the host worker's queue and passes; the torch reference's norm is bitwise on the CPU"
)

DTYPES = pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
STEPS = 5


def _slow_host_adam(monkeypatch: pytest.MonkeyPatch) -> None:
    """CPU Adam off the caller's thread (the delayed update) takes 20 ms a launch: update k
    outlasts backward k+1, as it does on a GPU at scale."""
    tile_step = adamw_rule.adam_step

    def slow(*args, **kwargs):
        if threading.current_thread() is not threading.main_thread():
            time.sleep(0.02)
        return tile_step(*args, **kwargs)

    monkeypatch.setattr(adamw_rule, "adam_step", slow)


class _Queue:
    """The host worker's submissions, in order: ``(phase, name, behind_an_update)``, where
    ``behind_an_update`` says a delayed update queued earlier had not finished yet."""

    def __init__(self, opt) -> None:
        self.phase = ""
        self.jobs: list[tuple[str, str, bool]] = []
        self._updates: list[threading.Event] = []
        worker = opt.manager.host_worker
        submit = worker.submit

        def logged(fn):
            name = getattr(getattr(fn, "func", fn), "__name__", repr(fn))
            behind = any(not done.is_set() for done in self._updates)
            self.jobs.append((self.phase, name, behind))
            if name != "update":
                return submit(fn)
            done = threading.Event()
            self._updates.append(done)

            def update():
                try:
                    return fn()
                finally:
                    done.set()

            return submit(update)

        worker.submit = logged  # type: ignore[method-assign]

    def update_running(self) -> bool:
        return any(not done.is_set() for done in self._updates)


def _run(dtype: torch.dtype, *, clip: float | None, accumulator: bool = False, check=None):
    """``STEPS`` steps of one micro-batch with ``overlap_step`` under the race checker;
    ``accumulator``: every window forced through the fp32 host accumulator and its host
    statistics (the path before the spare staging; on the host, not summed on the device). ``check(model, opt)`` runs before each
    backward. The model, the optimizer (closed), the norms, the queue, the host passes and
    D2H gradient bytes of step 3, and whether each backward after the first ran while an
    update was still running."""
    net, _ = make_pair(dtype)
    acc = HostAccelerator(AcceleratorConfig(check_races=True))
    opt = offload_opt(
        net, overlap_step=True, accelerator=acc, max_grad_norm=clip, grad_accumulation="host"
    )
    for bucket in opt.buckets:
        bucket.gradients.always_accumulate = accumulator
    queue = _Queue(opt)
    params = sum(b.layout.real_in(*b.shard) for b in opt.buckets)
    counters = opt.manager.counters
    key = f"{Direction.D2H.value}/{Category.GRADIENTS.value}"
    norms, overlapped = [], []
    try:
        for step, (tokens, targets) in enumerate(batches(STEPS)):
            if check is not None:
                check(net, opt)
            if step == 3:
                passes0, d2h0 = counters.passes(), counters.snapshot()[key]["bytes"]
            queue.phase = f"backward {step}"
            if step:
                overlapped.append(queue.update_running())
            opt.backward(lm_loss(net, tokens, targets))
            queue.phase = f"step {step}"
            opt.step()
            norms.append(opt.last_grad_norm)
            opt.zero_grad()
            if step == 3:
                passes = {
                    name: {k: v - passes0.get(name, {}).get(k, 0) for k, v in counts.items()}
                    for name, counts in counters.passes().items()
                    if counts["calls"] > passes0.get(name, {}).get("calls", 0)
                }
                d2h = counters.snapshot()[key]["bytes"] - d2h0
        opt.flush_pending_update()
    finally:
        opt.close()
    return net, norms, queue, passes, d2h / params, overlapped


@DTYPES
@pytest.mark.parametrize("clip", [None, 0.5], ids=["unclipped", "clipped"])
def test_a_backward_queues_nothing_behind_the_delayed_update(monkeypatch, dtype, clip) -> None:
    _slow_host_adam(monkeypatch)
    _, _, queue, _, _, overlapped = _run(dtype, clip=clip)
    # Update k was still running on the host worker while backward k+1 ran ...
    assert all(overlapped)
    # ... and that backward queued nothing there: no statistics pass behind Adam k. The
    # worker's queue holds the updates, and what step() itself queues.
    assert [job for job in queue.jobs if job[0].startswith("backward")] == []
    updates = [phase for phase, name, _ in queue.jobs if name == "update"]
    assert updates == [f"step {k}" for k in range(STEPS)]
    # The path forced through the host accumulator still passes over every tile behind
    # the running update (what the lone window did before).
    _, _, forced, _, _, _ = _run(dtype, clip=clip, accumulator=True)
    assert any(behind for phase, _, behind in forced.jobs if phase.startswith("backward"))


@DTYPES
def test_the_host_makes_no_statistics_pass(dtype) -> None:
    # Step 3's host passes over the gradient: none (before: a statistics pass reading the
    # landed training-dtype gradient, k bytes a parameter: fp32 4, bf16 2). What crosses the
    # link is unchanged: k bytes a parameter (bucket padding: a few percent).
    k = dtype.itemsize
    _, _, _, passes, d2h, _ = _run(dtype, clip=0.5)
    assert passes == {}
    assert k <= d2h < 1.1 * k
    _, _, _, forced, forced_d2h, _ = _run(dtype, clip=0.5, accumulator=True)
    assert forced_d2h == d2h and set(forced) == {"accumulation"}


@DTYPES
@pytest.mark.parametrize("clip", [None, 0.5], ids=["unclipped", "clipped"])
def test_results_match_the_host_statistics_path(dtype, clip) -> None:
    # The device accumulator's promise (Note [micro-batches add up on the device]): the
    # norm equal to about 1e-16; unclipped the weights bitwise, clipped within one ulp.
    net, norms, _, _, _, _ = _run(dtype, clip=clip)
    ref, ref_norms, _, _, _, _ = _run(dtype, clip=clip, accumulator=True)
    assert norms == pytest.approx(ref_norms, rel=1e-14)
    if clip is None:
        assert max_diff(net, ref) == 0.0
        return
    for x, y in zip(net.parameters(), ref.parameters(), strict=True):
        ulp = torch.finfo(x.dtype).eps * y.detach().float().abs()
        assert bool(((x.detach().float() - y.detach().float()).abs() <= ulp).all())


@DTYPES
def test_the_norm_is_torch_float64_norms_per_parameter(dtype) -> None:
    # The reference with the same semantics: torch's float64 norm of each parameter's
    # gradient, squared and added exactly, at the weights each forward saw.
    twin, _ = make_pair(dtype)
    expected: list[float] = []

    def reference(net, _opt) -> None:
        twin.load_state_dict(net.state_dict())
        twin.zero_grad(set_to_none=True)
        tokens, targets = batches(STEPS)[len(expected)]
        lm_loss(twin, tokens, targets).backward()
        norms = [
            torch.linalg.vector_norm(p.grad.reshape(-1), dtype=torch.float64).item()
            for p in twin.parameters()
        ]
        expected.append(math.sqrt(math.fsum(n * n for n in norms)))

    _, norms, _, _, _, _ = _run(dtype, clip=0.5, check=reference)
    assert norms == expected


def test_a_delayed_update_follows_its_landing_while_the_next_backward_flushes(
    monkeypatch,
) -> None:
    # Windows of 4 (summed on the device from the second), then of 1: update k reads the
    # landing of window k's device sum into the host accumulator, tile by tile as it
    # crosses a slow link, while backward k+1's lone flush says the accumulator no longer
    # holds only that landing. The update still follows the landing's copies
    # (DeviceWindow.landing), under the race checker; bitwise the host accumulator's path.
    _slow_host_adam(monkeypatch)

    def run(accumulation: str, accumulator: bool):
        net, _ = make_pair(torch.bfloat16)
        acc = HostAccelerator(AcceleratorConfig(link_bandwidth=2e6, check_races=True))
        opt = offload_opt(net, overlap_step=True, accelerator=acc, grad_accumulation=accumulation)
        for bucket in opt.buckets:
            bucket.gradients.always_accumulate = accumulator
        data, at = batches(11), 0
        try:
            for micro in (4, 4, 1, 1, 1):
                for tokens, targets in data[at : at + micro]:
                    opt.backward(lm_loss(net, tokens, targets))
                at += micro
                opt.step()
                opt.zero_grad()
            opt.flush_pending_update()
            return net, all(b.gradients.device_sum is not None for b in opt.buckets)
        finally:
            opt.close()

    net, summed_on_device = run("auto", accumulator=False)
    ref, _ = run("host", accumulator=True)
    assert summed_on_device
    assert max_diff(net, ref) == 0.0


# -- several ranks: the statistics stay the host's, compute never waits for a reduce-scatter --


def _two_rank_entry(rank: int, world: int, port: int, out: str) -> None:
    """One rank's overlap_step run, one micro-batch, clipping; counts the compute stream's
    waits on an unfinished event during its backwards."""
    import torch.distributed as dist

    from zero_offload.memory.manager import TieredMemoryManager

    from .helpers.dist import data, join_gloo, shard_batch

    join_gloo(rank, world, port)
    waits = [0]
    original = TieredMemoryManager.wait_for

    def counting(self: TieredMemoryManager, events: Any, *, category: Any) -> Any:
        events = list(events)
        waits[0] += any(not event.query() for event in events)
        return original(self, events, category=category)

    TieredMemoryManager.wait_for = counting  # type: ignore[method-assign]
    model, _ = make_pair()
    opt = offload_opt(model, overlap_step=True, max_grad_norm=0.5)
    for tokens, targets in data(STEPS):
        loss = lm_loss(model, shard_batch(tokens, rank, world), shard_batch(targets, rank, world))
        before = waits[0]
        opt.backward(loss)
        backward_waits = waits[0] - before
        opt.step()
        opt.zero_grad()
        waits.append(backward_waits)
    opt.close()  # lands the pending update
    weights = [p.detach().clone() for p in model.parameters()]
    torch.save({"weights": weights, "waits": waits[1:]}, f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


def test_two_ranks_keep_the_host_statistics_and_match_one_process(tmp_path: Path) -> None:
    """With several ranks the shard is only this rank's after the reduce-scatter: norms on the
    compute stream would make compute wait for every bucket's (13 waits a backward at 13
    buckets before this was kept on the host); the run matches one process's overlap run."""
    from .helpers.dist import data, spawn_ranks

    spawn_ranks(_two_rank_entry, 2, str(tmp_path))
    model, _ = make_pair()
    opt = offload_opt(model, overlap_step=True, max_grad_norm=0.5)
    for tokens, targets in data(STEPS):
        lm_loss(model, tokens, targets).backward()
        opt.step()
        opt.zero_grad()
    opt.close()
    for rank in range(2):
        result = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        assert result["waits"] == [0] * STEPS, (rank, result["waits"])
        pairs = zip(result["weights"], model.parameters(), strict=True)
        assert max((x - y.detach()).abs().max().item() for x, y in pairs) < 1e-5, rank
