"""Gradient accumulation does not stall backward on the host passes: Note [two staging
buffers for accumulation] in ``optim/grads/to_host.py``.

The stall is counted, not timed: ``HostGradients.staging_waits`` counts the flushes whose
staging buffer the host worker had not yet passed over, so the autograd thread waited. The
host worker's progress is held by gates (tasks queued on it that block until the test opens
them), on a slow simulated link, so "the host is one micro-batch behind" is a fact of the
test, not a race. Parity: the gated run is bitwise the ungated one (same accumulation order).
"""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from zero_offload.memory.align import aligned
from zero_offload.optim.grads import buffers
from zero_offload.thread_budget import ThreadBudget

from .helpers.models import host_accelerator, max_diff, mlp, mlp_batches, mlp_loss, mlp_opt

MICRO = 4
LINK_LATENCY = 0.002  # seconds per simulated copy: the D2H tiles land late
GATE_TIMEOUT = 2.0  # seconds a gate holds the worker at most (so a stall cannot hang a test)


class _Gate:
    """A task for the host worker that blocks it until ``open`` (or the timeout)."""

    def __init__(self) -> None:
        self.reached = threading.Event()  # the worker got here: everything before it ran
        self._open = threading.Event()
        self.timed_out = False

    def __call__(self) -> None:
        self.reached.set()
        self.timed_out = not self._open.wait(GATE_TIMEOUT)

    def open(self) -> None:
        self._open.set()


def _opt(model: nn.Module):
    accelerator = host_accelerator(link_latency=LINK_LATENCY, check_races=True)
    # The host's accumulation passes are what these tests watch (on the device: Note
    # [micro-batches add up on the device], tests/test_device_accumulation.py).
    return mlp_opt(model, accelerator=accelerator, grad_accumulation="host")


def _window(model, opt, data, *, lag: int | None) -> tuple[list[int], list[_Gate]]:
    """One accumulating window of ``len(data)`` micro-batches and a step. With ``lag``, the
    host worker runs micro-batch k's passes only after micro-batch k+lag's backward (a gate
    queued before each backward, opened ``lag`` backwards later). Returns the staging waits
    of each micro-batch's backward, and the gates."""
    worker = opt.manager.host_worker
    gates: list[_Gate] = []
    waits = []
    for k, (x, y) in enumerate(data):
        if lag is not None:
            gates.append(_Gate())
            worker.submit(gates[-1])
        before = sum(b.gradients.staging_waits for b in opt.buckets)
        mlp_loss(model, x, y).backward()
        waits.append(sum(b.gradients.staging_waits for b in opt.buckets) - before)
        if lag is not None and k >= lag:
            gates[k - lag].open()
            # The passes of micro-batch k-lag are done; the worker holds at the next gate.
            assert gates[k - lag + 1].reached.wait(GATE_TIMEOUT)
    for gate in gates:
        gate.open()
    opt.step()
    opt.zero_grad()
    return waits, gates


def _offloaded(opt) -> list:
    return [b for b in opt.buckets if hasattr(b.gradients, "staging_waits")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_host_one_micro_batch_behind_never_stalls_backward(dtype: torch.dtype) -> None:
    # The host passes over micro-batch k run during backward k+1. With one staging buffer
    # each backward of micro-batches 2..4 waited for them (measured before this change, the
    # same loop: 1-2 waits per micro-batch, each held until the gate's timeout); with two,
    # flush k+1 goes to the buffer of flush k-1, long consumed.
    model, plain_model = mlp(dtype=dtype), mlp(dtype=dtype)
    opt, plain = _opt(model), _opt(plain_model)
    assert len(_offloaded(opt)) >= 2  # several buckets share the worker
    data = mlp_batches(3 * MICRO)
    # Warm-up: a window that accumulates, so the next first flush goes straight into the
    # accumulator (the steady state of an accumulating loop; Note [no accumulator for one
    # backward]).
    _window(model, opt, data[:MICRO], lag=None)
    _window(plain_model, plain, data[:MICRO], lag=None)
    for start in (MICRO, 2 * MICRO):
        waits, gates = _window(model, opt, data[start : start + MICRO], lag=1)
        assert waits == [0] * MICRO
        assert not any(g.timed_out for g in gates), "the test, not a stall, opened each gate"
        _window(plain_model, plain, data[start : start + MICRO], lag=None)
    # The same sums in the same order: bitwise the run whose host kept up.
    assert max_diff(model, plain_model) == 0.0
    assert opt.last_grad_norm == plain.last_grad_norm
    opt.close()
    plain.close()


def test_a_host_two_micro_batches_behind_waits_for_a_buffer() -> None:
    # Both buffers busy: flush k waits for the pass over flush k-2. The count can fail.
    model = mlp()
    opt = _opt(model)
    data = mlp_batches(2 * MICRO)
    _window(model, opt, data[:MICRO], lag=None)
    waits, _ = _window(model, opt, data[MICRO:], lag=2)
    assert waits[:2] == [0, 0]
    assert all(w >= 1 for w in waits[2:]), waits
    opt.close()


def test_the_second_buffer_exists_only_once_a_window_accumulates() -> None:
    # Memory: a(k s) pinned bytes per offloaded bucket, k the training dtype's bytes and s
    # the shard's elements, in a pool of its own created by the first second flush.
    model = mlp(dtype=torch.bfloat16)
    opt = _opt(model)
    acc = opt.accelerator
    data = mlp_batches(3)
    _window(model, opt, data[:1], lag=None)  # one micro-batch: no second buffer
    assert all(b.gradients.spare_staging.memory.pool is None for b in _offloaded(opt))
    _window(model, opt, data[1:3], lag=None)
    for bucket in _offloaded(opt):
        spare = bucket.gradients.spare_staging
        assert spare.memory.pool is not None
        # the shard's bf16 elements (one rank: the whole padded bucket), aligned
        expected = aligned(2 * bucket.gradients.layout.shard_numel, spare.memory.pool.alignment)
        assert spare.memory.capacity == spare.memory.pool.capacity == expected
        assert spare.tensor is not None and spare.tensor.dtype == torch.bfloat16
    opt.close()
    assert acc.memory_stats()["in_use"] == 0


def test_a_failed_second_buffer_allocation_leaves_nothing_behind(monkeypatch) -> None:
    model = mlp()
    opt = _opt(model)
    acc = opt.accelerator
    data = mlp_batches(3)
    mlp_loss(model, *data[0]).backward()

    def failing(nbytes, *, owner):
        raise MemoryError("simulated: cannot pin the second staging buffer")

    for bucket in _offloaded(opt):  # the accumulator's pool still works
        monkeypatch.setattr(bucket.gradients.spare_staging.memory, "alloc", failing)
    with pytest.raises(MemoryError):
        mlp_loss(model, *data[1]).backward()
    monkeypatch.undo()
    opt.zero_grad()
    assert all(b.gradients.open.block is None for b in opt.buckets), "leaked a device buffer"
    assert all(b.gradients.spare_staging.block is None for b in _offloaded(opt))
    assert any(b.gradients.grad_acc is not None for b in _offloaded(opt))  # it got that far
    _window(model, opt, data[1:3], lag=None)  # trains on afterwards
    opt.close()
    assert acc.memory_stats()["in_use"] == 0


@pytest.mark.parametrize(
    ("share", "torch_threads", "expected"),
    [
        (4, 8, 4),  # a quarter of 16 cores
        (4, 1, 1),  # a process told to use one thread keeps to it
        (1, 8, 1),  # 2-4 cores: one thread
    ],
)
def test_host_pass_threads_follow_the_budget_and_torch(
    monkeypatch, share: int, torch_threads: int, expected: int
) -> None:
    budget = ThreadBudget(
        cores=4 * share,
        cores_reason="test",
        numba_alone=4 * share,
        numba_beside=2 * share,
        numba_beside_launcher=4 * share - 1,
        host_pass=share,
        split_reason="test",
    )
    monkeypatch.setattr(buffers, "thread_budget", lambda: budget)
    monkeypatch.setattr(buffers.torch, "get_num_threads", lambda: torch_threads)
    monkeypatch.setattr(buffers.numba.config, "NUMBA_NUM_THREADS", 16)
    assert buffers.host_pass_threads() == expected
