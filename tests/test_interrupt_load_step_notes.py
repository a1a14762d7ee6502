"""What a Ctrl-C inside ``step()`` says it did (Note [what a stopped step says] in
``optim/update/failures.py``): the buckets stepped, and whether the one it stopped in was
untouched, partly stepped, or stepped but not counted; or that the step was applied whole
and needs no reload, only ``zero_grad()``.

Before, every interrupt said "bucket k was partly stepped", also when bucket k's update had
not started, and one that came after every bucket was stepped said nothing at all. (Beside
``test_interrupt_load.py``: the note a cut load leaves is the other half of the same seam.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from zero_offload.optim.flat_bucket import FlatBucket
from zero_offload.optim.update.modes import ImmediateUpdate
from zero_offload.optim.update.reconcile import WriteChecks

from .helpers.models import batches, lm_loss, make_pair, offload_opt, train


def _on_call(real: Callable[..., Any], nth: int, *, after: bool) -> Callable[..., Any]:
    """``real``, but its ``nth`` call raises KeyboardInterrupt, before calling it or (with
    ``after``) once it returned."""
    calls = [0]

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == nth and not after:
            raise KeyboardInterrupt(f"injected at call {nth}")
        out = real(*args, **kwargs)
        if calls[0] == nth:
            raise KeyboardInterrupt(f"injected after call {nth}")
        return out

    return wrapper


def _note_of_an_interrupted_step(
    monkeypatch: pytest.MonkeyPatch, owner: Any, name: str, nth: int, *, after: bool = False
) -> str:
    """Train a step, then interrupt the next one at ``owner.name``'s ``nth`` call; the
    note it carries."""
    model, _ = make_pair()
    opt = offload_opt(model)
    assert len(opt.buckets) == 13
    train(model, opt, batches(1))
    lm_loss(model, *batches(2)[1]).backward()
    with monkeypatch.context() as patch:
        patch.setattr(owner, name, _on_call(getattr(owner, name), nth, after=after))
        with pytest.raises(KeyboardInterrupt) as caught:
            opt.step()
    opt.close()
    notes = getattr(caught.value, "__notes__", [])
    assert len(notes) == 1, notes
    return notes[0]


@pytest.mark.parametrize(
    ("nth", "told"),
    [
        (1, "no bucket was stepped; bucket 0 was not: its update had not started"),
        (3, "buckets [0, 1] were stepped; bucket 2 was not: its update had not started"),
    ],
)
def test_a_ctrl_c_before_a_buckets_update_says_it_was_not_stepped(
    monkeypatch: pytest.MonkeyPatch, nth: int, told: str
) -> None:
    note = _note_of_an_interrupted_step(monkeypatch, WriteChecks, "takes", nth)
    assert told in note and "partly" not in note
    assert f"step() in bucket {nth - 1} was interrupted by KeyboardInterrupt" in note
    assert "opt.zero_grad()" in note and "load_state_dict" in note


def test_a_ctrl_c_inside_a_buckets_update_says_it_was_partly_stepped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from zero_offload.optim.state.host import HostState

    note = _note_of_an_interrupted_step(monkeypatch, HostState, "update", 3)
    assert "buckets [0, 1] were stepped; bucket 2 was partly stepped" in note


def test_a_ctrl_c_after_a_buckets_update_says_its_count_was_not_advanced(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    note = _note_of_an_interrupted_step(monkeypatch, FlatBucket, "publish", 3)
    told = "buckets [0, 1] were stepped; bucket 2's state was stepped but its step count was not"
    assert told in note


def test_a_ctrl_c_between_buckets_names_the_next_as_untouched(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    note = _note_of_an_interrupted_step(monkeypatch, FlatBucket, "commit", 3, after=True)
    assert "buckets [0, 1, 2] were stepped; bucket 3 was not: its update had not started" in note


@pytest.mark.parametrize(
    ("owner", "name", "nth"),
    [(ImmediateUpdate, "_land", 1), (FlatBucket, "commit", 13)],
    ids=["while-landing", "after-the-last-commit"],
)
def test_a_ctrl_c_after_the_whole_step_says_so_and_zero_grad_goes_on_bitwise(
    monkeypatch: pytest.MonkeyPatch, owner: Any, name: str, nth: int
) -> None:
    """The note says the step was applied whole; its recovery (zero_grad, no reload) trains
    on bitwise like the uninterrupted run."""
    data = batches(4)
    model, twin = make_pair()
    opt, twin_opt = offload_opt(model), offload_opt(twin)
    train(model, opt, data[:1])
    train(twin, twin_opt, data[:2])
    lm_loss(model, *data[1]).backward()
    with monkeypatch.context() as patch:
        # the first call of this step (train above made the earlier ones)
        patch.setattr(owner, name, _on_call(getattr(owner, name), nth, after=True))
        with pytest.raises(KeyboardInterrupt) as caught:
            opt.step()
    (note,) = caught.value.__notes__
    assert "step() while landing the weights was interrupted by KeyboardInterrupt" in note
    assert "the step was applied whole (buckets [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]" in note
    assert "Nothing needs reloading: call opt.zero_grad()" in note
    assert "partly" not in note and "load_state_dict" not in note
    opt.zero_grad()
    train(model, opt, data[2:])
    train(twin, twin_opt, data[2:])
    for ours, theirs in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(ours, theirs)
    opt.close()
    twin_opt.close()
