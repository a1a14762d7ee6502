"""``overlap_step`` with one micro-batch a step takes the lone window's statistics on the
device (issue 39; Note [a lone window's statistics are taken on the device] in
``optim/grads/lone_stats.py``). Before, backward k+1 queued a statistics pass over the
landed gradient on the host worker, behind update k (first in, first out), and read it
once more on the host: 4 bytes a parameter a step in fp32, 2 in bf16. Here: the worker's
queue while update k runs, the host passes' bytes, the norm against torch's float64
per-parameter norms, and the weights against the host statistics' path (bitwise unclipped,
one ulp when a clip binds: the device accumulator's promise). With several ranks the norms
are taken on the comm stream behind each reduce-scatter: the same counts on 2 gloo ranks,
compute's waits in backward, and the step's ordering under the race checker in strict
mode."""

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


def _count_waits() -> list[int]:
    """In a spawned rank: from now on ``waits[0]`` counts the manager's waits that met an
    unfinished event (the compute stream waiting for a reduce-scatter)."""
    from zero_offload.memory.manager import TieredMemoryManager

    waits = [0]
    original = TieredMemoryManager.wait_for

    def counting(self: TieredMemoryManager, events: Any, *, category: Any) -> Any:
        events = list(events)
        waits[0] += any(not event.query() for event in events)
        return original(self, events, category=category)

    TieredMemoryManager.wait_for = counting  # type: ignore[method-assign]
    return waits


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


# -- several ranks: the norms on the comm stream, compute never waits for a reduce-scatter --


def _two_rank_entry(rank: int, world: int, port: int, out: str) -> None:
    """One rank's overlap_step run, one micro-batch, clipping; counts the compute stream's
    waits on an unfinished event during its backwards."""
    import torch.distributed as dist

    from .helpers.dist import data, join_gloo, shard_batch

    join_gloo(rank, world, port)
    waits = _count_waits()
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


def test_two_ranks_never_wait_for_a_reduce_scatter_and_match_one_process(tmp_path: Path) -> None:
    """With several ranks the shard is only this rank's after the reduce-scatter: norms on the
    compute stream would make compute wait for every bucket's (13 waits a backward at 13
    buckets); on the comm stream, behind it, none. The run matches one process's overlap
    run."""
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


def _counted_two_rank_entry(rank: int, world: int, port: int, out: str, dtype_name: str) -> None:
    """One rank's overlap_step runs (one micro-batch, a binding clip) under the race
    checker in strict mode, over a slow link, with this rank's reduce-scatters held back
    on the comm stream: first the lone window's path (``device``), then every window
    forced through the host accumulator and its host statistics (``host``, the path with
    the host's exactly added cells). Saves per run: the norms, the weights, each
    backward's compute waits on an unfinished event, step 3's host passes, and the host
    worker jobs each backward queued while a delayed update was still running."""
    import torch.distributed as dist

    from .helpers.dist import data, join_gloo, shard_batch

    join_gloo(rank, world, port)
    dtype = getattr(torch, dtype_name)
    tile_step = adamw_rule.adam_step

    def slow(*args, **kwargs):  # as _slow_host_adam: update k outlasts backward k+1
        if threading.current_thread() is not threading.main_thread():
            time.sleep(0.02)
        return tile_step(*args, **kwargs)

    adamw_rule.adam_step = slow
    waits = _count_waits()
    results = {}
    for variant in ("device", "host"):
        model, _ = make_pair(dtype)
        acc = HostAccelerator(AcceleratorConfig(check_races=True, strict=True, link_bandwidth=2e7))
        opt = offload_opt(
            model,
            overlap_step=True,
            max_grad_norm=0.5,
            accelerator=acc,
            grad_accumulation="host",
        )
        for bucket in opt.buckets:
            bucket.gradients.always_accumulate = variant == "host"
        queue = _Queue(opt)
        comm = opt._ranks.stream
        counters = opt.manager.counters
        params = sum(b.layout.real_in(*b.shard) for b in opt.buckets)
        norms, backward_waits = [], []
        for step, (tokens, targets) in enumerate(data(STEPS)):
            if step == 3:
                passes0 = counters.passes()
            loss = lm_loss(
                model, shard_batch(tokens, rank, world), shard_batch(targets, rank, world)
            )
            queue.phase = f"backward {step}"
            comm.submit(lambda: time.sleep(0.3))  # the reduce-scatters run past backward
            before = waits[0]
            opt.backward(loss)
            backward_waits.append(waits[0] - before)
            queue.phase = f"step {step}"
            opt.step()
            norms.append(opt.last_grad_norm)
            opt.zero_grad()
            if step == 3:
                passes = {
                    name: (counts["calls"] - passes0.get(name, {}).get("calls", 0))
                    for name, counts in counters.passes().items()
                }
                read = sum(
                    counts["read"] - passes0.get(name, {}).get("read", 0)
                    for name, counts in counters.passes().items()
                )
        opt.flush_pending_update()
        opt.close()
        results[variant] = {
            "norms": norms,
            "weights": [p.detach().clone() for p in model.parameters()],
            "waits": backward_waits,
            "passes": {name: calls for name, calls in passes.items() if calls},
            "read_per_param": read / params,
            "behind": sum(
                behind for phase, _, behind in queue.jobs if phase.startswith("backward")
            ),
        }
    torch.save(results, f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


@DTYPES
def test_two_ranks_take_the_norms_on_the_comm_stream(tmp_path: Path, dtype) -> None:
    """Several ranks: each rank's shard is its own once the reduce-scatter ends, on the comm
    stream, so the norms are taken there (issue 39): no host statistics pass (before: one
    per bucket and tile, k bytes a parameter a step read behind the delayed update), no
    compute wait in backward, and the step orders its read after the comm stream's event,
    under the race checker in strict mode while the reduce-scatters run past backward (a
    missing order is a StreamRaceError there: the step's read of the norms, the gradient
    buffer's reuse, norms on the compute stream; or a gloo size mismatch: the step's
    all-gathers issued before the last reduce-scatters). Against the host statistics' path
    of the same 2 ranks: the norm to about 1e-16, the weights within one ulp (the clip
    binds)."""
    from .helpers.dist import spawn_ranks

    spawn_ranks(_counted_two_rank_entry, 2, str(tmp_path), str(dtype).split(".")[-1])
    for rank in range(2):
        result = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        device, host = result["device"], result["host"]
        assert device["passes"] == {}, (rank, device["passes"])
        assert device["read_per_param"] == 0.0
        assert device["behind"] == 0
        assert device["waits"] == [0] * STEPS, (rank, device["waits"])
        assert host["passes"] and host["behind"] > 0  # what the host path still does
        assert device["norms"] == pytest.approx(host["norms"], rel=1e-14)
        for x, y in zip(device["weights"], host["weights"], strict=True):
            ulp = torch.finfo(x.dtype).eps * y.float().abs()
            assert bool(((x.float() - y.float()).abs() <= ulp).all()), rank


def _leave_after_a_backward_entry(rank: int, world: int, port: int, out: str, how: str) -> None:
    """Two steps, then a backward with no step (its reduce-scatters held back on the comm
    stream), then ``how``: close, flush the pending update then close, or add a parameter
    group (after zero_grad) then close. The last parameter is left out of the optimizer
    until then (its gradient dropped)."""
    import faulthandler
    import os

    from zero_offload import OffloadAdamW, OffloadConfig

    from .helpers.dist import data, join_gloo, shard_batch

    join_gloo(rank, world, port)
    faulthandler.dump_traceback_later(120, exit=True)  # a hang fails the test, not CI
    model, _ = make_pair()
    *first, last = list(model.parameters())
    building = how == "add_param_group"  # no slow link: the build meets the reduce-scatters
    link = {} if building else {"link_bandwidth": 2e7}
    acc = HostAccelerator(AcceleratorConfig(check_races=True, **link))
    config = OffloadConfig(
        bucket_bytes=8192, tile_elements=1024, overlap_step=True, max_grad_norm=0.5
    )
    opt = OffloadAdamW(first, lr=1e-3, weight_decay=0.1, config=config, accelerator=acc)
    comm = opt._ranks.stream
    said = "left"
    try:
        for step, (tokens, targets) in enumerate(data(3)):
            if step == 2 or not building:  # the reduce-scatters run past backward
                comm.submit(lambda: time.sleep(0.5 if building else 0.3))
            share = shard_batch(tokens, rank, world), shard_batch(targets, rank, world)
            opt.backward(lm_loss(model, *share))
            last.grad = None
            if step < 2:
                opt.step()
                opt.zero_grad()
        if how == "flush":
            opt.flush_pending_update()
        if how == "add_param_group":
            opt.zero_grad()
            opt.add_param_group({"params": [last]})
        opt.close()
    except Exception as exc:  # the message is what is checked
        said = f"{type(exc).__name__}: {exc}"
    Path(out, f"rank{rank}.txt").write_text(said)
    os._exit(0)  # a broken group's destructor would wait on the other rank


@pytest.mark.parametrize("how", ["close", "flush", "add_param_group"])
def test_two_ranks_leave_after_a_backward_without_a_step(tmp_path: Path, how: str) -> None:
    """Note [caller collectives follow the reduce-scatters] (optim/ranks.py): a close or a
    flush after a backward with no step issues its all-gathers on the caller's thread, and
    no host pass ordered them after the reduce-scatters the comm thread still had to issue
    (gloo aborted the process on the size mismatch); ``add_param_group``'s agreement was
    never ordered after them (both ranks hung, before this session too)."""
    from .helpers.dist import spawn_ranks

    spawn_ranks(_leave_after_a_backward_entry, 2, str(tmp_path), how)
    for rank in range(2):
        assert (tmp_path / f"rank{rank}.txt").read_text() == "left", rank
