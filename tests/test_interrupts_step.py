"""Interrupts are not failures (issue 29 "Nothing lost").

A Ctrl-C or a ``sys.exit`` inside ``step()`` leaves as itself, with what was stepped in a
note (Note [an interrupt is not a failure] in ``optim/update/modes.py``); a Ctrl-C anywhere
on the gradient path leaves an optimizer that ``zero_grad()`` makes clean, training like
torch afterwards (Note [an interrupted gradient path] in ``optim/grads/to_host.py``).

CUDA form: the in-process tests build through tests/helpers (``cuda_form``: ``cuda:0`` under
``--accelerator=cuda``, TF32 off); the two that interrupt a subprocess build on the host
accelerator there, and stay host only.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from zero_offload.optim.flat_bucket import FlatBucket
from zero_offload.optim.grads.lifecycle import BucketGrads
from zero_offload.optim.grads.to_host import HostGradients

from .helpers.models import batches, lm_loss, make_pair, max_diff, offload_opt, torch_adamw, train

REPO = Path(__file__).resolve().parents[1]
TOL = 1e-5

_STEP = """
import os, signal, sys, warnings
sys.path.insert(0, {repo!r})
warnings.simplefilter("ignore")
import torch
torch.set_num_threads(1)
from tests.helpers.models import batches, lm_loss, make_pair, offload_opt
from zero_offload import StepFailed
model, _ = make_pair()
opt = offload_opt(model)
assert len(opt.buckets) > 3
victim = opt.buckets[2].store
real = victim.update
SIGNAL = signal.{signal}
if SIGNAL == signal.SIGTERM:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(3))

def update(*args, **kwargs):
    os.kill(os.getpid(), SIGNAL)  # arrives mid-update, on this (the main) thread
    return real(*args, **kwargs)

victim.update = update
lm_loss(model, *batches(1)[0]).backward()
try:
    try:
        opt.step()
    except Exception as exc:  # must not catch an interrupt
        print("swallowed:", type(exc).__name__, exc, file=sys.stderr)
        sys.exit(5)
except KeyboardInterrupt as exc:
    print("NOTES:", *getattr(exc, "__notes__", []), file=sys.stderr)
    sys.exit(7)
print("not interrupted", file=sys.stderr)
sys.exit(6)
"""


def _run_step(signal: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _STEP.format(repo=str(REPO), signal=signal)],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_ctrl_c_in_step_is_a_keyboard_interrupt_naming_what_was_stepped() -> None:
    done = _run_step("SIGINT")
    assert done.returncode == 7, done.stderr[-3000:]
    notes = done.stderr.split("NOTES:", 1)[1]
    assert "interrupted by KeyboardInterrupt" in notes
    assert "buckets [0, 1] were stepped; bucket 2 was partly stepped" in notes
    assert "opt.zero_grad()" in notes and "load_state_dict" in notes


def test_sys_exit_from_a_sigterm_handler_in_step_exits() -> None:
    done = _run_step("SIGTERM")
    assert done.returncode == 3, done.stderr[-3000:]
    assert "StepFailed" not in done.stderr and "swallowed" not in done.stderr


# -- the gradient path -----------------------------------------------------------------


def _raise_on_call(real: Callable[..., Any], nth: int) -> Callable[..., Any]:
    """``real``, but the ``nth`` call raises KeyboardInterrupt (before calling it)."""
    calls = [0]

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == nth:
            raise KeyboardInterrupt(f"injected at call {nth}")
        return real(*args, **kwargs)

    return wrapper


def _raise_after_call(real: Callable[..., Any], nth: int) -> Callable[..., Any]:
    """``real``, but the ``nth`` call raises KeyboardInterrupt once it has returned."""
    calls = [0]

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        out = real(*args, **kwargs)
        calls[0] += 1
        if calls[0] == nth:
            raise KeyboardInterrupt(f"injected after call {nth}")
        return out

    return wrapper


# (where, nth call): each patches one step of the gradient path of the optimizer ``opt``.
POINTS = [
    ("backward hook adds a gradient", 3),
    ("a buffer opened, not yet FILLING", 2),
    ("flush starts", 1),
    ("flush starts", 3),
    ("D2H tile copy", 1),
    ("D2H tile copy", 4),
    ("D2H copies queued, buffer not released", 2),
    ("host pass queued", 1),
    ("host pass queued", 5),
    ("flushed, lifecycle not told", 2),
]


def _inject(monkeypatch: pytest.MonkeyPatch, opt: Any, where: str, nth: int) -> None:
    if where == "backward hook adds a gradient":
        monkeypatch.setattr(HostGradients, "add_grad", _raise_on_call(HostGradients.add_grad, nth))
    elif where == "a buffer opened, not yet FILLING":
        monkeypatch.setattr(
            BucketGrads, "start_filling", _raise_on_call(BucketGrads.start_filling, nth)
        )
    elif where == "flush starts":
        monkeypatch.setattr(FlatBucket, "flush", _raise_on_call(FlatBucket.flush, nth))
    elif where == "D2H tile copy":
        monkeypatch.setattr(opt.manager, "copy", _raise_on_call(opt.manager.copy, nth))
    elif where == "D2H copies queued, buffer not released":
        monkeypatch.setattr(
            HostGradients,
            "_copy_to_staging",
            _raise_after_call(HostGradients._copy_to_staging, nth),
        )
    elif where == "host pass queued":
        worker = opt.manager.host_worker
        monkeypatch.setattr(worker, "submit", _raise_after_call(worker.submit, nth))
    elif where == "flushed, lifecycle not told":
        monkeypatch.setattr(BucketGrads, "flushed", _raise_on_call(BucketGrads.flushed, nth))
    else:
        raise AssertionError(where)


@pytest.mark.cuda_form
@pytest.mark.parametrize("micro_batches", [1, 2])
@pytest.mark.parametrize(("where", "nth"), POINTS)
def test_ctrl_c_on_the_gradient_path_then_zero_grad_trains_like_torch(
    monkeypatch: pytest.MonkeyPatch, where: str, nth: int, micro_batches: int
) -> None:
    model, ref = make_pair()
    opt = offload_opt(model)
    ropt = torch_adamw(ref)
    data = batches(4)
    # A complete backward first (micro_batches=2): the interrupted one is the window's second.
    for tokens, targets in data[: micro_batches - 1]:
        lm_loss(model, tokens, targets).backward()
    with monkeypatch.context() as patch:
        _inject(patch, opt, where, nth)
        with pytest.raises(KeyboardInterrupt, match="injected"):
            lm_loss(model, *data[0]).backward()
            opt.step()  # a point the backward did not reach is reached here
    opt.zero_grad()  # the window is discarded: nothing of it reaches a step
    assert not any(b.grads.holds_device_buffer for b in opt.buckets)
    train(model, opt, data[1:])
    train(ref, ropt, data[1:])
    assert max_diff(model, ref) < TOL
    opt.close()
    assert opt.closed


@pytest.mark.cuda_form
def test_ctrl_c_on_the_gradient_path_and_no_zero_grad_close_still_works(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model, _ = make_pair()
    opt = offload_opt(model)
    with monkeypatch.context() as patch:
        _inject(patch, opt, "flushed, lifecycle not told", 1)
        with pytest.raises(KeyboardInterrupt):
            lm_loss(model, *batches(1)[0]).backward()
    # A step without zero_grad says what to do rather than "a bug".
    with pytest.raises(RuntimeError, match=r"interrupted half-way.*Call opt\.zero_grad\(\)"):
        opt.step()
    opt.close()
    assert opt.closed


@pytest.mark.cuda_form
def test_an_interrupt_while_a_delayed_update_settles_stays_an_interrupt(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With ``overlap_step``, Ctrl-C while ``step()`` waits for the previous update leaves
    as ``KeyboardInterrupt``, not ``StepFailed`` (Note [an interrupt is not a failure])."""
    model, _ = make_pair()
    opt = offload_opt(model, overlap_step=True)
    try:
        train(model, opt, batches(1))  # one delayed update now pending
        lm_loss(model, *batches(1)[0]).backward()

        def interrupted() -> None:
            raise KeyboardInterrupt

        monkeypatch.setattr(opt.manager.host_worker, "synchronize", interrupted)
        with pytest.raises(KeyboardInterrupt):
            opt.step()
    finally:
        monkeypatch.undo()
        opt.close()


@pytest.mark.simulator_only("a slow simulated link keeps the weight copies in flight")
@pytest.mark.parametrize("nth", [1, 3, 5])
def test_a_ctrl_c_in_step_leaves_no_weight_copy_in_flight(
    nth: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C just after a bucket's weight copies were issued, then the note's recovery at
    once (zero_grad, the model's and the optimizer's checkpoints loaded): the interrupted
    step's copies used to land after the reload, over the checkpoint's weights, and the run
    went on 1e-3 off torch with no error (Note [an interrupted step's copies land before it
    leaves] in optim/update/modes.py)."""
    import copy

    from .helpers.models import host_accelerator

    data = batches(4)
    model, ref = make_pair()
    opt = offload_opt(model, accelerator=host_accelerator(link_latency=0.05))
    ropt = torch_adamw(ref)
    train(model, opt, data[:1])
    train(ref, ropt, data[:1])
    weights, state = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    lm_loss(model, *data[1]).backward()
    real, calls = FlatBucket.publish, [0]

    def publish(self: FlatBucket) -> Any:
        published = real(self)
        calls[0] += 1
        if calls[0] == nth:
            raise KeyboardInterrupt(f"Ctrl-C after bucket {nth - 1}'s copies were issued")
        return published

    monkeypatch.setattr(FlatBucket, "publish", publish)
    with pytest.raises(KeyboardInterrupt):
        opt.step()
    monkeypatch.setattr(FlatBucket, "publish", real)
    opt.zero_grad()
    model.load_state_dict(weights)
    opt.load_state_dict(state)
    train(model, opt, data[1:3])
    train(ref, ropt, data[1:3])
    assert max_diff(model, ref) < TOL
    opt.close()
