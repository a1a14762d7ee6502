"""An error the optimizer's public methods raised reached the caller: a dropped optimizer's
finalizer, or the exit, does not print it again (Note [an error reaches the caller once] in
``error_marks.py``), and a collective failure the caller met covers the later failures of
that optimizer's collectives only (Note [a collective failure breaks its owner's
collectives]).

The failures are a stream's (Note [stream errors are sticky]): the release that follows
meets them again. A ``StepFailed`` from the update's tile loop and the errors of the state
dict methods left through no call that marks, so a program that caught one and went on saw
it printed again when it dropped the optimizer. The drops run in this process
(``sys.unraisablehook`` sees what a finalizer prints); the exit runs in a child
interpreter."""

from __future__ import annotations

import gc
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from zero_offload import CollectiveError, StepFailed, StreamError
from zero_offload.collectives import Comm, Pending, surface_collective_errors, wait_work
from zero_offload.error_marks import surfaced
from zero_offload.memory.quiet_exit import passed_over

from .helpers.models import batches, lm_loss, make_pair, offload_opt, train

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 120  # the child interpreter, on two loaded cores


def _fail() -> None:
    raise OSError("the copy failed")


def _failing_update(opt: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Bucket 1's update meets a failed h2d stream, as a publication's copy would: the step
    stops there with a ``StepFailed`` whose cause is the stream's error."""
    h2d = opt.manager.h2d

    def update(*args: object, **kwargs: object) -> None:
        h2d.submit(_fail)
        h2d.synchronize()

    monkeypatch.setattr(opt.buckets[1].store, "update", update)


def _step_failed(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """An optimizer whose step raised a ``StepFailed`` that the caller caught (in a list,
    for ``_printed_when_dropped`` to take)."""
    model, _ = make_pair()
    opt = offload_opt(model)
    train(model, opt, batches(1))
    _failing_update(opt, monkeypatch)
    lm_loss(model, *batches(1)[0]).backward()
    with pytest.raises(StepFailed, match="bucket 1 was partly stepped") as caught:
        opt.step()
    assert isinstance(caught.value.__cause__, StreamError)
    return [opt]


def _printed_when_dropped(held: list[Any], monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """What the finalizer of the optimizer ``held`` alone prints when it is dropped."""
    reports: list[Any] = []
    monkeypatch.setattr(sys, "unraisablehook", reports.append)
    finalizer = held[0]._finalizer
    held.clear()
    gc.collect()
    monkeypatch.setattr(sys, "unraisablehook", sys.__unraisablehook__)
    assert not finalizer.alive
    return reports


def test_a_caught_step_failed_is_not_printed_again_when_the_optimizer_is_dropped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The finalizer printed the h2d stream's error the StepFailed had carried, again."""
    assert _printed_when_dropped(_step_failed(monkeypatch), monkeypatch) == []


def test_close_after_a_caught_step_failed_still_raises_the_stream_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """close() was asked: a failed stream's error without a collective behind it is raised
    (Note [a release after a collective failure the caller saw] in ``optim/lifetime.py``)."""
    (opt,) = _step_failed(monkeypatch)
    with pytest.raises(StreamError, match="the copy failed"):
        opt.close()


def _trained() -> list[Any]:
    """An optimizer after one step, in a list for ``_printed_when_dropped`` to take."""
    model, _ = make_pair()
    opt = offload_opt(model)
    train(model, opt, batches(1))
    return [opt]


def _state_dict(opt: Any, saved: dict[str, Any]) -> None:
    opt.state_dict()


def _load_state_dict(opt: Any, saved: dict[str, Any]) -> None:
    opt.load_state_dict(saved)


@pytest.mark.parametrize("call", [_state_dict, _load_state_dict], ids=["save", "load"])
def test_a_caught_state_dict_error_is_not_printed_again_when_the_optimizer_is_dropped(
    call: Callable[[Any, dict[str, Any]], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The state dict methods drain the host worker first, and meet its failure."""
    held = _trained()
    saved = held[0].state_dict()
    held[0].manager.host_worker.submit(_fail)
    with pytest.raises(StreamError, match="the copy failed"):
        call(held[0], saved)
    assert _printed_when_dropped(held, monkeypatch) == []


def test_a_failure_nobody_saw_is_still_printed_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The marks do not silence a failure no public method raised."""
    held = _trained()
    held[0].manager.host_worker.submit(_fail)
    reports = _printed_when_dropped(held, monkeypatch)
    assert len(reports) == 1
    assert isinstance(reports[0].exc_value, StreamError)
    assert "the copy failed" in str(reports[0].exc_value)


_CAUGHT_AT_EXIT = """
import sys
sys.path.insert(0, {repo!r})
import torch
torch.set_num_threads(1)
from tests.helpers.models import batches, lm_loss, make_pair, offload_opt, train
from zero_offload import StepFailed
model, _ = make_pair()
opt = offload_opt(model)
train(model, opt, batches(1))
h2d = opt.manager.h2d
def fail():
    raise OSError("the copy failed")
def update(*args, **kwargs):
    h2d.submit(fail)
    h2d.synchronize()
opt.buckets[1].store.update = update
lm_loss(model, *batches(1)[0]).backward()
try:
    opt.step()
except StepFailed:
    print("caught StepFailed", flush=True)
print("end of script", flush=True)  # no close(): the finalizer releases at exit
"""


def test_exit_after_a_caught_step_failed_is_quiet() -> None:
    """At exit the StepFailed is not the error the script died of (``sys.last_value``):
    only its mark tells the exit's release that the caller met it."""
    result = subprocess.run(
        [sys.executable, "-c", _CAUGHT_AT_EXIT.format(repo=str(REPO))],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout == "caught StepFailed\nend of script\n", result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]


# -- two optimizers' collectives in one process -------------------------------------------------


class _BrokenWork:
    """A torch.distributed Work whose peer's socket closed."""

    def wait(self) -> None:
        raise RuntimeError("Connection closed by peer (injected)")


def _collective_failure(comm: Comm, what: str) -> CollectiveError:
    """What ``comm``'s collective ``what`` raises when its peer is gone."""
    with pytest.raises(CollectiveError, match="Connection closed by peer") as caught:
        wait_work(Pending(_BrokenWork(), what, on_cuda=False), comm)
    return caught.value


def _comm() -> Comm:
    """An optimizer's comm over two ranks (``make_comm``'s; each optimizer makes its own)."""
    return Comm(group=None, rank=0, world_size=2, timeout=5.0)


def test_a_collective_failure_the_caller_saw_covers_its_own_optimizer_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Optimizer A's failure reached its caller (through ``surface_collective_errors``, as
    a step's would); B's, which no caller met, was passed over with it when B was dropped.
    The roll call (Note [naming the absent rank]) finds no store here and says so at once."""
    a, b = _comm(), _comm()
    # A ZeRO-3 optimizer's gather comm, over a group of its own, shares its counters.
    a_gathers = Comm(group=None, rank=0, world_size=2, timeout=5.0, counters=a.counters)
    b_failure = _collective_failure(b, "reduce_scatter of bucket 0")  # met by nobody yet
    with pytest.raises(CollectiveError), surface_collective_errors():
        raise _collective_failure(a, "all_gather of bucket 1 weights")
    # A's later collectives fail because of the one its caller met: passed over.
    for later in (
        _collective_failure(a, "all_gather of bucket 2 weights"),
        _collective_failure(a_gathers, "all_gather of unit 3"),
    ):
        assert surfaced(later)
        assert passed_over(later, dropped=True)
    # B's failure is its own: its finalizer prints it, once.
    assert not surfaced(b_failure)
    assert not passed_over(b_failure, dropped=True)
    assert passed_over(_collective_failure(b, "reduce_scatter of bucket 1"), dropped=True)
    # Nor does the error a script died of cover another optimizer's (sys.last_value).
    c, d = _comm(), _comm()
    monkeypatch.setattr(sys, "last_value", _collective_failure(c, "all_reduce"), raising=False)
    assert passed_over(_collective_failure(c, "all_gather of bucket 0 weights"), dropped=True)
    assert not passed_over(_collective_failure(d, "all_gather of bucket 0 weights"), dropped=True)


def test_a_caught_clip_error_is_not_printed_again_when_the_optimizer_is_dropped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """clip_grad_norm_ waits for the window's gradients on the host worker, and meets its
    failure: it reached the caller like step()'s."""
    model, _ = make_pair()
    held = [offload_opt(model)]
    train(model, held[0], batches(1))
    lm_loss(model, *batches(1)[0]).backward()
    held[0].manager.host_worker.submit(_fail)
    with pytest.raises(StreamError, match="the copy failed"):
        held[0].clip_grad_norm_(1.0)
    assert _printed_when_dropped(held, monkeypatch) == []
