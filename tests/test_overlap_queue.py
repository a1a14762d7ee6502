"""``overlap_step`` with micro-batches (issue 39): the delayed update k runs on the host
worker while step k+1's forward and backward run, and nothing of that backward queues behind
it. On the H200 the next backward's accumulation passes queued on the one first-in-first-out
worker behind update k: backward stalled on staging, step() on the whole queue. With the
micro-batches summed on the device (Note [micro-batches add up on the device] in
optim/grads/device_acc.py) a backward gives the host worker nothing to do."""

from __future__ import annotations

import threading
import time

import pytest

import zero_offload.optim.rule.adamw as adamw_rule
from zero_offload.tracing import add_phase_listener

from .helpers.models import batches, lm_loss, make_pair, offload_opt

pytestmark = pytest.mark.cuda_form

MICRO = 4


def _slow_host_adam(monkeypatch: pytest.MonkeyPatch) -> None:
    """CPU Adam on the host worker takes 30 ms a tile: a delayed update outlasts the next
    step's backwards (as CPU Adam outlasts a GPU's backward at scale)."""
    tile_step = adamw_rule.adam_step

    def slow(*args, **kwargs):
        if threading.current_thread() is not threading.main_thread():
            time.sleep(0.03)
        return tile_step(*args, **kwargs)

    monkeypatch.setattr(adamw_rule, "adam_step", slow)


def _submits_during_backwards(accumulation: str) -> list[int]:
    """Host-worker tasks queued during each step's backwards (steps 3 and 4)."""
    model, _ = make_pair()
    opt = offload_opt(model, overlap_step=True, grad_accumulation=accumulation)
    worker = opt.manager.host_worker
    queued = [0]
    submit = worker.submit

    def counting(fn):
        queued[0] += 1
        return submit(fn)

    worker.submit = counting  # type: ignore[method-assign]
    data = batches(4 * MICRO)
    counts = []
    for step in range(4):
        queued[0] = 0
        for j in range(MICRO):
            opt.backward(lm_loss(model, *data[MICRO * step + j]))
        counts.append(queued[0])
        opt.step()
        opt.zero_grad()
    opt.close()
    return counts[2:]


def test_a_backward_queues_nothing_behind_the_delayed_update(monkeypatch) -> None:
    # Summed on the device: the window lands once update k no longer reads the host
    # accumulator (in step(), here), so step k+1's backwards queue nothing behind it.
    _slow_host_adam(monkeypatch)
    assert _submits_during_backwards("auto") == [0, 0]
    # On the host every micro-batch's passes queue behind the update (the H200 stall).
    assert all(n > 0 for n in _submits_during_backwards("host"))


def test_update_k_runs_while_step_k_plus_one_computes(monkeypatch) -> None:
    # A CPU Adam of 30 ms per tile: update k (on the host worker) is still running when
    # step k+1's backward runs; step() returns before it ends.
    model, _ = make_pair()
    opt = offload_opt(model, overlap_step=True, tile_elements=1 << 20)
    _slow_host_adam(monkeypatch)
    spans: list[tuple[float, float]] = []
    stop = add_phase_listener(
        lambda name, track, start, end: spans.append((start, end)) if name == "cpu_adam" else None,
        owner=opt.manager,
    )
    data = batches(3 * MICRO)
    backward_at: list[float] = []
    returned_at: list[float] = []
    try:
        for step in range(3):
            for j in range(MICRO):
                loss = lm_loss(model, *data[MICRO * step + j])
                backward_at.append(time.perf_counter())
                opt.backward(loss)
            opt.step()
            returned_at.append(time.perf_counter())
            opt.zero_grad()
        opt.flush_pending_update()
    finally:
        stop()
        opt.close()
    assert len(spans) == 3
    # Update 1, queued by the second step(), ended after that step() returned, and ran
    # while the third step's backwards did.
    start, end = spans[1]
    assert returned_at[1] < end
    assert start < backward_at[3 * MICRO - 1] and backward_at[2 * MICRO] < end
