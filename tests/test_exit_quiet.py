"""A failure is reported once: a dropped optimizer's finalizer and the exit hooks pass over an
error a caller already met, and report one nobody met (Note [an error reaches the caller
once] in ``error_marks.py``, Note [a quiet exit after a failed stream] in
``memory/quiet_exit.py``, Note [a release after a collective failure the caller saw] in
``optim/lifetime.py``).

The drops run in this process (``sys.unraisablehook`` sees what a finalizer prints); the exits
run in child interpreters, the ZeRO-3 ones as two gloo ranks of which rank 1 dies, under a
timeout each."""

from __future__ import annotations

import gc
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from zero_offload import StreamError

from .helpers.models import batches, lm_loss, make_pair, offload_opt, train

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 120  # per child interpreter; a ZeRO-3 rank takes about 20 s on two loaded cores


def _fail() -> None:
    raise OSError("the copy failed")


def _dropped_reports(monkeypatch: pytest.MonkeyPatch, *, seen: bool) -> list[Any]:
    """What the finalizer of an optimizer whose d2h stream failed prints when it is dropped;
    ``seen``: a backward raised the failure to the caller first."""
    reports: list[Any] = []
    model, _ = make_pair()
    opt = offload_opt(model)
    train(model, opt, batches(1))
    opt.manager.d2h.submit(_fail)
    if seen:
        with pytest.raises(StreamError):  # the stream has failed by now (not a library call)
            opt.manager.d2h.synchronize()
        tokens, targets = next(iter(batches(1)))
        with pytest.raises(StreamError, match="the copy failed"):  # the backward's hook
            lm_loss(model, tokens, targets).backward()
    monkeypatch.setattr(sys, "unraisablehook", reports.append)
    del opt
    gc.collect()
    monkeypatch.undo()
    return reports


def test_a_dropped_optimizer_does_not_print_a_failure_the_caller_saw(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Its finalizer printed the StreamError the backward had raised, again."""
    assert _dropped_reports(monkeypatch, seen=True) == []


def test_a_dropped_optimizer_prints_a_failure_nobody_saw_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    reports = _dropped_reports(monkeypatch, seen=False)
    assert len(reports) == 1
    assert isinstance(reports[0].exc_value, StreamError)
    assert "the copy failed" in str(reports[0].exc_value)


# -- at exit, one process ------------------------------------------------------------------------

_ONE_PROCESS = """
import sys
sys.path.insert(0, {repo!r})
import torch
torch.set_num_threads(1)
from tests.helpers.models import batches, lm_loss, make_pair, offload_opt, train
from zero_offload import StreamError
model, _ = make_pair()
opt = offload_opt(model)
train(model, opt, batches(1))
def fail():
    raise OSError("the copy failed")
opt.manager.d2h.submit(fail)
if sys.argv[1] == "seen":
    try:
        opt.manager.d2h.synchronize()  # the stream has failed by now (not a library call)
    except StreamError:
        pass
    tokens, targets = next(iter(batches(1)))
    try:
        lm_loss(model, tokens, targets).backward()
    except StreamError:
        print("caught StreamError", flush=True)
print("end of script", flush=True)  # no close(): the finalizer releases at exit
"""


def _exit_reports(stderr: str) -> int:
    """How many errors the exit's finalizers printed: each report's traceback holds
    ``weakref.finalize``'s exit hook once."""
    return stderr.count("in _exitfunc")


def _run_one(mode: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _ONE_PROCESS.format(repo=str(REPO)), mode],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )


def test_exit_after_a_failure_the_caller_saw_is_quiet() -> None:
    result = _run_one("seen")
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout == "caught StreamError\nend of script\n", result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]


def test_exit_reports_a_failure_nobody_saw_once() -> None:
    """At exit every failed stream's error was passed over, so a failure no call had met
    (the script ended first) was lost without a word."""
    result = _run_one("unseen")
    assert result.stdout == "end of script\n", result.stderr[-3000:]
    assert _exit_reports(result.stderr) == 1, result.stderr[-6000:]
    assert "StreamError: work on stream 'd2h' failed with OSError: the copy failed" in (
        result.stderr
    )


# -- at exit, ZeRO-3 on two ranks of which one died ---------------------------------------------

_ZERO3 = """
import os, sys, time
from datetime import timedelta
sys.path.insert(0, {repo!r})
import torch
import torch.distributed as dist
torch.set_num_threads(1)
os.environ.setdefault("ZERO_OFFLOAD_DEVICE_BUDGET", "256MiB")
rank, port, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
dist.init_process_group(
    "gloo", init_method=f"tcp://127.0.0.1:{{port}}", rank=rank, world_size=2,
    timeout=timedelta(seconds=60),
)
from tests.helpers.zero3 import batches, gpt, loss_without, make_opt, share
from zero_offload import CollectiveError
model = gpt(torch.float32, layers=2)
opt = make_opt(model, offload=True, collective_timeout=3.0)
pairs = batches(2)

def train(ids, targets, last):
    loss_without(model, share(ids, rank, 2), share(targets, rank, 2), set()).backward()
    if last and rank == 1 and mode == "seen":
        os._exit(0)  # dies before the step's collectives
    opt.step()
    opt.zero_grad()

train(*pairs[0], last=False)
dist.barrier()
if rank == 1 and mode == "unseen":
    os._exit(0)  # dies after the last collective rank 0 makes before exiting
if mode == "seen":
    try:
        train(*pairs[1], last=True)
    except CollectiveError as exc:
        print("caught CollectiveError", flush=True)
print("end of script", flush=True)  # no close(): the finalizer closes at exit (collective)
"""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run_zero3(mode: str) -> subprocess.CompletedProcess[str]:
    """Rank 0's run (rank 1 dies); rank 0 hosts the rendezvous store, so it starts first."""
    code = _ZERO3.format(repo=str(REPO))
    port = str(_free_port())
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    rank0 = subprocess.Popen(
        [sys.executable, "-c", code, "0", port, mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    rank1 = subprocess.Popen(
        [sys.executable, "-c", code, "1", port, mode],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    try:
        out, err = rank0.communicate(timeout=TIMEOUT_S)
        rank1.wait(timeout=TIMEOUT_S)
    finally:
        for proc in (rank0, rank1):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return subprocess.CompletedProcess(rank0.args, rank0.returncode, out, err)


def test_zero3_exit_after_a_collective_failure_the_caller_saw_is_quiet() -> None:
    """The sharded offloader's close at exit gathers each unit once more over the broken
    process group: its own CollectiveError was printed on top of the one the step raised."""
    result = _run_zero3("seen")
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout == "caught CollectiveError\nend of script\n", result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]


def test_zero3_exit_reports_a_collective_failure_nobody_saw_once_naming_the_rank() -> None:
    result = _run_zero3("unseen")
    assert result.stdout == "end of script\n", result.stderr[-3000:]
    final = [line for line in result.stderr.splitlines() if "CollectiveError: rank" in line]
    assert final, result.stderr[-3000:]
    assert "rank 0/2" in final[-1] and "Rank(s) 1 did not report" in final[-1]
    assert _exit_reports(result.stderr) == 1, result.stderr[-6000:]
