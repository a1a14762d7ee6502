"""The step at the speed of its bytes (Note [no accumulator for one backward]): Adam reads a
lone flush's gradient from staging, the accumulator exists only once a window accumulates.

Each fast path is compared bitwise (``torch.equal``) with the fp32-accumulator path, forced
with ``require_accumulator()``; accumulation is compared with torch (1e-5, as elsewhere).

CUDA form (``cuda_form``, docs/gpu.md): the models, batches and optimizers come from
tests/helpers, so under ``--accelerator=cuda`` they run on ``cuda:0``, bitwise where they are
bitwise here. Simulator only: the tests that time tiles over a simulated link and count the
host accelerator's thread events.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

import zero_offload.optim.rule.adamw as tiles
from zero_offload.tracing import add_phase_listener

from .helpers.models import (
    batches,
    host_accelerator,
    lm_loss,
    make_pair,
    max_diff,
    mlp,
    mlp_batches,
    mlp_loss,
    mlp_opt,
    offload_opt,
    torch_adamw,
)

pytestmark = pytest.mark.cuda_form


def _train(model, opt, data, *, micro: int = 1, clip: float | None = None) -> None:
    for i in range(0, len(data), micro):
        for tokens, targets in data[i : i + micro]:
            opt.backward(lm_loss(model, tokens, targets))
        if clip is not None:
            opt.clip_grad_norm_(clip)
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("clip", [None, 0.05])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_adam_from_staging_is_bitwise_the_accumulator_path(
    dtype: torch.dtype, clip: float | None
) -> None:
    fast_model, plain_model = make_pair(dtype)
    fast = offload_opt(fast_model)
    plain = offload_opt(plain_model, grad_accumulation="host")  # the host accumulator's path
    for bucket in plain.buckets:
        bucket.gradients.always_accumulate = True
    data = batches(4)
    _train(fast_model, fast, data, clip=clip)
    _train(plain_model, plain, data, clip=clip)
    assert max_diff(fast_model, plain_model) == 0.0
    assert fast.last_grad_norm == plain.last_grad_norm
    # One backward per step: no accumulator was ever allocated.
    assert all(b.gradients.grad_acc is None for b in fast.buckets)
    assert all(b.gradients.accumulators.pool is None for b in fast.buckets)


def test_accumulation_allocates_the_accumulator_and_matches_torch() -> None:
    model, ref = make_pair()
    opt = offload_opt(model)
    ropt = torch_adamw(ref)
    data = batches(8)
    _train(model, opt, data[:2])  # one micro-batch per step first: no accumulator
    assert all(b.gradients.grad_acc is None for b in opt.buckets)
    _train(model, opt, data[2:], micro=3)
    assert all(b.gradients.grad_acc is not None for b in opt.buckets)
    for tokens, targets in data[:2]:
        lm_loss(ref, tokens, targets).backward()
        ropt.step()
        ropt.zero_grad()
    for i in range(2, 8, 3):
        for tokens, targets in data[i : i + 3]:
            lm_loss(ref, tokens, targets).backward()
        ropt.step()
        ropt.zero_grad()
    assert max_diff(model, ref) < 1e-5


def test_accumulation_survives_a_lagging_host_worker() -> None:
    model, ref = make_pair()
    opt = offload_opt(model)
    ropt = torch_adamw(ref)
    data = batches(4)
    for i in range(0, 4, 2):
        for tokens, targets in data[i : i + 2]:
            lm_loss(model, tokens, targets).backward()
            # Stall the host worker: the next backward's copies must not overwrite a
            # staging buffer it has not added up yet (Note [staging is reused only once
            # consumed]).
            opt.manager.host_worker.submit(lambda: time.sleep(0.2))
            lm_loss(ref, tokens, targets).backward()
        opt.step()
        opt.zero_grad()
        ropt.step()
        ropt.zero_grad()
    assert max_diff(model, ref) < 1e-5


@pytest.mark.parametrize("micro", [1, 3])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_step_that_needs_no_statistics_is_bitwise_the_waiting_one(
    dtype: torch.dtype, micro: int
) -> None:
    # Note [a step that needs no statistics]: without clipping, step() starts CPU Adam as
    # the gradient tiles land. A clip that never binds makes the step wait for the
    # statistics first, with the same arithmetic (the coefficient is exactly 1).
    fast_model, waiting_model = make_pair(dtype)
    fast = offload_opt(fast_model)
    waiting = offload_opt(waiting_model, max_grad_norm=1e30)
    assert not fast._policy.needs_statistics() and waiting._policy.needs_statistics()
    data = batches(3 * micro)
    _train(fast_model, fast, data, micro=micro)
    _train(waiting_model, waiting, data, micro=micro)
    assert max_diff(fast_model, waiting_model) == 0.0
    assert fast.last_grad_norm == waiting.last_grad_norm
    assert fast.state_dict()["state"][0]["step"] == waiting.state_dict()["state"][0]["step"]


def test_a_host_worker_failure_after_a_fast_step_says_the_step_was_applied(monkeypatch):
    # Note [a step that needs no statistics]: the update runs before the host worker's
    # statistics are read, so their failure comes after the step changed every bucket.
    # It must say so (StepFailed), not look like a step that changed nothing.
    import time

    from zero_offload.errors import StreamError
    from zero_offload.optim.grads.host_passes import HostPasses
    from zero_offload.optim.update.modes import StepFailed

    model = mlp()
    opt = mlp_opt(model)
    assert not opt._policy.needs_statistics()
    (x, y), (x2, y2) = mlp_batches(2)
    mlp_loss(model, x, y).backward()
    opt.step()
    opt.zero_grad()
    last = opt.buckets[0].layout.index  # backward reaches the first layer's bucket last
    real = HostPasses.summed

    def failing(self, partials):
        if self.layout.index == last:
            time.sleep(0.05)  # the caller is past its last submit when this fails
            raise MemoryError("injected")
        return real(self, partials)

    monkeypatch.setattr(HostPasses, "summed", failing)
    before = [p.detach().clone() for p in model.parameters()]
    mlp_loss(model, x2, y2).backward()
    with pytest.raises(StepFailed, match=r"step\(\) was applied to buckets .*rebuild"):
        opt.step()
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    with pytest.raises(StreamError, match="injected"):  # the worker's error is sticky
        opt.close()


@pytest.mark.simulator_only(reason="tiles timed over a simulated link")
@pytest.mark.skipif(
    os.environ.get("ZERO_OFFLOAD_STRICT") == "1",
    reason="times tiles against the step: strict mode completes compute events late by design, "
    "and on a loaded machine (CI's passes run side by side) the gradient had landed before "
    "step() waited (0.2-10 ms of waiting, the same before this wave's changes)",
)
@pytest.mark.parametrize("clip", [None, 1e30])
def test_cpu_adam_starts_before_the_last_gradient_tile_lands_unless_it_must_wait(
    clip: float | None,
) -> None:
    # One 128 x 512 weight (65536 elements, a lone gradient) in 16 tiles of 4096, over a
    # simulated link of 5 ms per tile: the gradient takes 80 ms to land.
    from zero_offload.optim.rule import adamw as tiles

    torch.manual_seed(0)
    model = torch.nn.Linear(512, 128, bias=False)
    accel = host_accelerator(link_bandwidth=4096 * 4 / 5e-3)
    opt = offload_opt(model, accelerator=accel, tile_elements=4096, max_grad_norm=clip)
    first_tile_at = []
    kernel = tiles.adam_step

    def timed(*args, **kwargs):
        if not first_tile_at:
            first_tile_at.append(time.perf_counter())
        return kernel(*args, **kwargs)

    x = torch.randn(4, 512)
    # One step first: what the first step pays once (kernels loaded from numba's cache, the
    # pools' first blocks) is out of the step timed below; on a loaded machine it took longer
    # than the 80 ms of copies, which then landed before the wait.
    model(x).square().sum().backward()
    opt.step()
    opt.zero_grad()
    waited = []
    stop_listening = add_phase_listener(
        lambda name, track, start, end: waited.append(end - start) if name == "wait_grads" else 0
    )
    try:
        tiles.adam_step = timed
        model(x).square().sum().backward()
        opt.step()
    finally:
        tiles.adam_step = kernel
        stop_listening()
    # Either way the time spent waiting for the gradient shows as wait_grads (not as CPU
    # Adam): most of the 80 ms the copies take.
    assert sum(waited) > 0.03
    landing = opt.buckets[0].gradients._landing
    assert len(landing) == 16
    last_landed = landing[-1][1].completed_at()
    if clip is None:
        # Started on the first tile while (at least) the last 60 ms of copies were to come.
        assert first_tile_at[0] < last_landed
    else:
        # Clipping is configured: the norm, so every tile, comes first.
        assert first_tile_at[0] > last_landed


def test_a_delayed_update_behind_the_next_backward_does_not_wait_for_it(monkeypatch):
    # overlap_step queues the update on the host worker; here it is slow, so the next
    # backward's flushes (and their host-worker events) are queued behind it. The update
    # must not wait for those events (Note [Adam follows the gradient in]): it would wait
    # for work queued after itself, forever. Run in a thread, so a regression fails, not
    # hangs.
    import threading
    import time

    kernel = tiles.adam_step

    def slow(*args, **kwargs):
        time.sleep(0.02)
        return kernel(*args, **kwargs)

    monkeypatch.setattr(tiles, "adam_step", slow)
    model = mlp()
    opt = mlp_opt(model, overlap_step=True)
    batches = mlp_batches(4)
    done = threading.Event()

    def train():
        # A thread of the user's: bound to the optimizer's device first, as on CUDA
        # (torch.cuda.set_device); strict mode refuses an unbound one.
        opt.accelerator.bind_thread()
        for x, y in batches:
            mlp_loss(model, x, y).backward()
            opt.step()
            opt.zero_grad()
        opt.flush_pending_update()
        done.set()

    worker = threading.Thread(target=train, daemon=True)
    worker.start()
    worker.join(timeout=60)
    assert done.is_set(), "the delayed update waited for work queued behind it"
    opt.close()


def test_a_window_after_an_accumulating_one_accumulates_from_its_first_flush() -> None:
    # Note [no accumulator for one backward]: a loop that accumulates every step sends each
    # window's first flush straight into the accumulator (no statistics pass, no fold);
    # when it stops accumulating, the next window is stepped from the accumulator and the
    # one after reads staging again. Bitwise the always-accumulating path throughout.
    # On the host (on the device: tests/test_device_accumulation.py).
    model, plain_model = make_pair()
    opt = offload_opt(model, grad_accumulation="host")
    plain = offload_opt(plain_model, grad_accumulation="host")
    for bucket in plain.buckets:
        bucket.gradients.always_accumulate = True
    data = batches(9)
    sources = []
    for micro, chunk in [(3, data[0:3]), (3, data[3:6]), (1, data[6:7]), (1, data[7:8])]:
        for o, m in ((opt, model), (plain, plain_model)):
            for j, (tokens, targets) in enumerate(chunk):
                o.backward(lm_loss(m, tokens, targets))
                if o is opt and j == 0:
                    sources.append({b.gradients.window_source().value for b in opt.buckets})
            o.step()
            o.zero_grad()
        assert micro == len(chunk)
    assert sources == [{"grad_staging"}, {"grad_acc"}, {"grad_acc"}, {"grad_staging"}]
    assert max_diff(model, plain_model) == 0.0
    assert opt.last_grad_norm == plain.last_grad_norm


@pytest.mark.simulator_only(reason="the host accelerator's thread events, a simulated latency")
def test_a_flush_in_many_tiles_records_its_blocks_once(monkeypatch) -> None:
    # Note [Adam follows the gradient in]: a lone gradient of 256 tiles is 256 copies, and
    # the step's weights go back in 256 more. Only a flush's last copy records its end on
    # the staging block (the stream is in order), and the pools drop completed events at
    # doubling lengths only: filtering the pending ones at every record was quadratic.
    from zero_offload.accelerator.threads import ThreadEvent

    torch.manual_seed(0)
    model = torch.nn.Linear(1024, 256, bias=False)  # 262144 elements = 256 tiles of 1024
    # 0.5 ms a copy keeps every copy pending while the next is recorded: the worst case.
    opt = offload_opt(model, tile_elements=1024, accelerator=host_accelerator(link_latency=5e-4))
    x = torch.randn(2, 1024)
    queries = []
    real = ThreadEvent.query
    monkeypatch.setattr(ThreadEvent, "query", lambda self: queries.append(1) or real(self))
    model(x).square().sum().backward()
    opt.step()
    assert len(opt.buckets[0].gradients._landing) == 256
    assert len(queries) < 10_000  # about 3700; filtering at every record: 64700
    opt.close()
