"""A Ctrl-C (KeyboardInterrupt) anywhere inside ``load_state_dict`` or ``load_streaming``:
either the optimizer is as it was before the call, or every later ``step()`` and save
refuses, naming the call and the bucket it stopped in, until the same load is called
again; after it, training is bitwise the uninterrupted resume's (Note [a load cut short] in
``optim/update/resume.py``).

Before, a load cut between buckets let the next step train silently on a mix of the
checkpoint's state and the one before it, and one cut inside an NVMe bucket failed the next
step with a StorageError blaming an I/O error.

The interrupt is injected by ``sys.settrace``: the k-th line the load's own code runs
raises, for k spread over the whole load (its checks, every bucket's copy, tile by tile, the
groups and the loss scaler after them).
"""

from __future__ import annotations

import copy
import linecache
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from zero_offload import OffloadAdamW

from .helpers.models import batches, lm_loss, make_pair, offload_opt, train

_OPTIM = Path(__file__).resolve().parents[1] / "zero_offload" / "optim"
LOAD_CODE = (str(_OPTIM / "checkpoint"), str(_OPTIM / "update"))

#: How the optimizer is built and how it loads: (config, load by state dict or streamed).
KINDS: dict[str, tuple[dict[str, Any], str]] = {
    "state_dict": ({}, "state_dict"),
    "streaming-host": ({}, "streaming"),
    "streaming-nvme": ({"host_budget": 1}, "streaming"),
}

#: Where the interrupt lands, as a share of the lines an uninterrupted load runs.
POINTS = [0.05, 0.3, 0.55, 0.62, 0.7, 0.78, 0.86, 0.9, 0.93, 0.95, 0.97, 0.98, 0.99, 0.995]

DATA = batches(6)


class Run:
    """One optimizer of ``kind`` over a fresh model, trained two steps, checkpointed, then
    trained two more (so its state differs from the checkpoint's)."""

    def __init__(self, kind: str, root: Path) -> None:
        config, self.route = KINDS[kind]
        if "host_budget" in config:
            config = {**config, "nvme_dir": root / "nvme"}
        self.root = root
        self.model, _ = make_pair()
        self.opt = offload_opt(self.model, **config)
        train(self.model, self.opt, DATA[:2])
        self.weights = copy.deepcopy(self.model.state_dict())
        if self.route == "state_dict":
            self.checkpoint: Any = copy.deepcopy(self.opt.state_dict())
        else:
            self.opt.save_streaming(root / "ckpt")
            self.checkpoint = root / "ckpt"
        train(self.model, self.opt, DATA[2:4])

    def load(self) -> None:
        if self.route == "state_dict":
            self.opt.load_state_dict(self.checkpoint)
        else:
            self.opt.load_streaming(self.checkpoint)

    def saved(self, name: str) -> dict[str, Any]:
        """The optimizer's whole state, as ``save_streaming``'s metadata records it (every
        tile's checksum, the step counts, the groups, the loss scaler, the skip count)."""
        self.opt.save_streaming(self.root / name)
        meta = torch.load(self.root / name / "rank0" / "meta.pt", weights_only=True)
        meta.pop("save_id")
        return meta

    def resume(self) -> None:
        """The model's checkpoint loaded, then three steps from it."""
        self.model.load_state_dict(self.weights)
        train(self.model, self.opt, DATA[2:5])


def _lines_in_library(call: Callable[[], None], stop_at: int | None) -> int:
    """Run ``call`` counting the lines it runs in the load's own code (``LOAD_CODE``: the
    checkpoint package, whose per-tile callback runs inside the state stores' loops, and
    the update package, where the load completes); the ``stop_at``-th raises
    KeyboardInterrupt there. Returns the count.

    A ``with`` line is not counted: raised there by a trace function, as the block ends,
    the interrupt skips ``__exit__`` (a lock stays held, grad mode stays off), which is the
    tracer's doing, not the load's."""
    count = [0]

    def local(frame: Any, event: str, arg: Any) -> Any:
        if event == "line":
            text = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
            if text.startswith(("with ", "async with ")):
                return local
            count[0] += 1
            if count[0] == stop_at:
                raise KeyboardInterrupt(
                    f"Ctrl-C at {frame.f_code.co_filename}:{frame.f_lineno} (line {stop_at})"
                )
        return local

    def scope(frame: Any, event: str, arg: Any) -> Any:
        return local if frame.f_code.co_filename.startswith(LOAD_CODE) else None

    sys.settrace(scope)
    try:
        call()
    finally:
        sys.settrace(None)
    return count[0]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Per kind: the lines its load runs, the state it loads, and the weights and state of
    the uninterrupted resume (the load, then the same three steps)."""
    out = {}
    for kind in KINDS:
        run = Run(kind, tmp_path_factory.mktemp(kind))
        lines = _lines_in_library(run.load, None)
        loaded = run.saved("loaded")
        run.resume()
        params = [p.detach().clone() for p in run.model.parameters()]
        out[kind] = (lines, loaded, params, run.saved("after"))
        run.opt.close()
    return out


@pytest.mark.parametrize("point", POINTS)
@pytest.mark.parametrize("kind", list(KINDS))
def test_a_load_cut_anywhere_is_undone_or_refused_then_redone_bitwise(
    kind: str, point: float, tmp_path: Path, uninterrupted: dict[str, Any]
) -> None:
    lines, loaded, resumed_params, resumed_state = uninterrupted[kind]
    run = Run(kind, tmp_path)
    before = run.saved("before")
    cut: BaseException | None = None
    try:
        _lines_in_library(run.load, max(1, int(point * lines)))
    except KeyboardInterrupt as exc:
        cut = exc
    # else: the load ended first (a whole load, which the checks below take as one)
    try:
        after = run.saved("after_cut")
    except RuntimeError as exc:  # refused: the load was cut while it copied
        message = str(exc)
        assert "save_streaming(): the optimizer state is half-loaded" in message, message
        assert "was interrupted by KeyboardInterrupt" in message
        assert " of 13)" in message or "after all 13 buckets were copied" in message
        assert "Call opt.load_" in message
        lm_loss(run.model, *DATA[2]).backward()
        with pytest.raises(RuntimeError, match=r"step\(\): the optimizer state is half-loaded"):
            run.opt.step()
        run.opt.zero_grad()
        if run.route == "state_dict":
            with pytest.raises(RuntimeError, match=r"state_dict\(\): .* half-loaded"):
                run.opt.state_dict()
    else:  # all or nothing
        assert after in (before, loaded), f"{cut}: a state in between, and no refusal"
    run.load()  # the documented recovery: the same load again
    run.resume()
    for ours, theirs in zip(run.model.parameters(), resumed_params, strict=True):
        assert torch.equal(ours, theirs)
    assert run.saved("resumed") == resumed_state
    run.opt.close()


def _cut_in_a_bucket(load: Callable[[], None], nth: int, *, first: bool = False) -> BaseException:
    """Interrupt ``load`` as its ``nth`` bucket begins to be written (``first``: just
    before, which for the first bucket is before the load writes anything)."""
    from zero_offload.optim.update.resume import LoadGuard

    real, calls = LoadGuard.begin, [0]

    def begin(self: LoadGuard, position: int) -> None:
        calls[0] += 1
        if calls[0] == nth and first:
            raise KeyboardInterrupt
        real(self, position)
        if calls[0] == nth:
            raise KeyboardInterrupt

    LoadGuard.begin = begin  # type: ignore[method-assign]
    try:
        with pytest.raises(KeyboardInterrupt) as info:
            load()
    finally:
        LoadGuard.begin = real  # type: ignore[method-assign]
    return info.value


@pytest.mark.parametrize("kind", list(KINDS))
def test_the_refusal_names_the_call_the_bucket_and_what_each_bucket_holds(
    kind: str, tmp_path: Path
) -> None:
    run = Run(kind, tmp_path)
    exc = _cut_in_a_bucket(run.load, 4)
    where = "inside bucket 3 (4 of 13): buckets 0-2 and part of bucket 3 hold the checkpoint's"
    assert any(where in note for note in getattr(exc, "__notes__", [])), exc
    lm_loss(run.model, *DATA[2]).backward()
    with pytest.raises(RuntimeError) as refused:
        run.opt.step()
    message = str(refused.value)
    assert message.startswith("OffloadAdamW.step(): the optimizer state is half-loaded: ")
    assert where in message and "buckets 4-12, the param groups" in message
    call = "opt.load_state_dict(state_dict)" if run.route == "state_dict" else "load_streaming("
    assert call in message and "nothing was stepped" in message
    run.opt.close()  # closes, publishing nothing
    assert run.opt.closed
    with pytest.raises(RuntimeError, match="after close"):
        run.opt.step()


def test_a_cut_load_then_another_cut_load_then_a_whole_one(tmp_path: Path) -> None:
    """A second load cut before it writes anything leaves the first one's record; one cut
    after it wrote is told from its own bucket; a whole one ends the refusals."""
    run = Run("streaming-host", tmp_path)
    _cut_in_a_bucket(run.load, 6)
    with pytest.raises(RuntimeError, match=r"inside bucket 5 \(6 of 13\)"):
        run.saved("refused")
    _cut_in_a_bucket(run.load, 1, first=True)
    with pytest.raises(RuntimeError, match=r"inside bucket 5 \(6 of 13\)"):
        run.saved("refused")
    _cut_in_a_bucket(run.load, 2, first=True)
    with pytest.raises(RuntimeError, match=r"before bucket 1 \(2 of 13\): bucket 0 holds"):
        run.saved("refused")
    run.load()
    run.saved("whole")  # no refusal
    run.opt.close()


def test_a_load_cut_before_it_writes_changes_nothing(tmp_path: Path) -> None:
    run = Run("state_dict", tmp_path)
    before = run.saved("before")
    _cut_in_a_bucket(run.load, 1, first=True)
    assert run.saved("after") == before
    train(run.model, run.opt, DATA[4:5])
    run.opt.close()


def test_a_load_refused_by_its_checks_is_no_cut(tmp_path: Path) -> None:
    """A mismatch found before the copy leaves the optimizer as it was and trains on."""
    run = Run("state_dict", tmp_path)
    bad = copy.deepcopy(run.checkpoint)
    bad["state"][0]["exp_avg"] = bad["state"][0]["exp_avg"][:1]
    before = run.saved("before")
    with pytest.raises(ValueError):
        run.opt.load_state_dict(bad)
    assert run.saved("after") == before
    train(run.model, run.opt, DATA[4:5])
    run.opt.close()


def test_overlap_step_a_cut_load_publishes_nothing_at_close(tmp_path: Path) -> None:
    """With ``overlap_step`` an update is pending when the load starts; cut, close()
    publishes nothing of the mixed state into the model."""
    model, _ = make_pair()
    opt: OffloadAdamW = offload_opt(model, overlap_step=True)
    train(model, opt, DATA[:2])
    opt.save_streaming(tmp_path / "ckpt")
    train(model, opt, DATA[2:3])  # an update of our own pending again
    weights = [p.detach().clone() for p in model.parameters()]
    _cut_in_a_bucket(lambda: opt.load_streaming(tmp_path / "ckpt"), 3)
    opt.close()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), weights, strict=True))
