"""``overlap_step`` with ``overlap_landing="at_first_use"`` (issue 39; Note [weights landed at
their first use] in views/in_flight.py): without a device shadow, ``step()`` k+1 issues update
k's weight copies across the link and returns; each bucket is waited for where one of its
parameters is first read, so the forward's first layers run while later buckets cross. The
bits are those of ``"at_step"``, which waits for every copy inside ``step()``."""

from __future__ import annotations

import copy
import io
import threading

import pytest
import torch
from torch.utils._python_dispatch import _disable_current_modes

from zero_offload import OffloadConfig, OverlapLanding
from zero_offload.optim.update.modes import DelayedUpdate
from zero_offload.views.in_flight import is_in_flight

from .helpers.device import run_accelerator
from .helpers.dist import run_ranks
from .helpers.models import batches, lm_loss, make_pair, offload_opt

pytestmark = pytest.mark.cuda_form

STEPS = 5


def _weights(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten().float().cpu() for p in model.parameters()])


def _train(
    landing: str,
    dtype: torch.dtype = torch.bfloat16,
    micro: int = 2,
    *,
    accelerator=None,
    after_step=None,
    **config: object,
):
    """``STEPS`` steps of ``micro`` micro-batches with ``overlap_step`` and no shadow; the
    weights after the last update landed, each forward's loss, and how many parameters were
    in flight when each ``step()`` returned. ``after_step(model, step)`` runs between a
    step and the next forward."""
    model, _ = make_pair(dtype)
    opt = offload_opt(
        model,
        overlap_step=True,
        overlap_shadow="off",
        overlap_landing=landing,
        accelerator=accelerator,
        **config,
    )
    data = batches(STEPS * micro)
    losses: list[float] = []
    in_flight: list[int] = []
    for step in range(STEPS):
        for j in range(micro):
            loss = lm_loss(model, *data[micro * step + j])
            losses.append(loss.item())
            opt.backward(loss)
        opt.step()
        in_flight.append(sum(is_in_flight(p) for p in model.parameters()))
        opt.zero_grad()
        if after_step is not None:
            after_step(model, step)
    opt.flush_pending_update()
    weights = _weights(model)
    opt.close()
    assert not any(is_in_flight(p) for p in model.parameters())
    return weights, losses, in_flight


@pytest.mark.parametrize(
    ("dtype", "micro", "nvme"),
    [(torch.bfloat16, 2, False), (torch.float32, 1, False), (torch.bfloat16, 2, True)],
    ids=["bf16x2", "fp32x1", "bf16x2-nvme"],
)
def test_landing_at_first_use_changes_no_bit(tmp_path, dtype, micro, nvme) -> None:
    # With NVMe state the store publishes through the same copies (host_budget=1: every
    # bucket's state on disk).
    def nvme_dir(name: str) -> dict:
        return {"nvme_dir": tmp_path / name, "host_budget": 1} if nvme else {}

    at_step, losses, in_flight = _train("at_step", dtype, micro, **nvme_dir("a"))
    first_use, first_losses, first_in_flight = _train("at_first_use", dtype, micro, **nvme_dir("b"))
    assert torch.equal(at_step, first_use)
    assert losses == first_losses
    # step() k+1 returned with every parameter still in flight (the first step publishes
    # nothing: no update was pending); "at_step" leaves none.
    params = sum(1 for _ in make_pair(dtype)[0].parameters())
    assert in_flight == [0] * STEPS
    assert first_in_flight == [0] + [params] * (STEPS - 1)


@pytest.mark.simulator_only("a slow simulated link keeps the copies in flight")
def test_the_forward_lands_bucket_by_bucket_while_later_ones_cross(monkeypatch) -> None:
    # A 2 MB/s link (strict mode and the race checker in CI's passes): at each step's first
    # landing, the bucket of the first layers (the highest index: buckets take parameters in
    # reverse registration order), copies of later buckets are still crossing. The bits
    # are those of "at_step" over the same link.
    landings: list[tuple[int, bool]] = []  # (bucket, some other bucket's copy still pending)
    real = DelayedUpdate._land_one

    def land_one(self, bucket, events, gather, stream) -> None:
        others = [
            event
            for other in self._deferred
            if other is not bucket and other.views.in_flight is not None
            for event in other.views.in_flight._land.args[1]
        ]
        landings.append((bucket.layout.index, not all(e.query() for e in others)))
        real(self, bucket, events, gather, stream)

    monkeypatch.setattr(DelayedUpdate, "_land_one", land_one)
    slow = run_accelerator(link_bandwidth=2e6)
    first_use, losses, _ = _train("at_first_use", accelerator=slow)
    monkeypatch.undo()
    at_step, at_step_losses, _ = _train("at_step", accelerator=run_accelerator(link_bandwidth=2e6))
    assert torch.equal(first_use, at_step) and losses == at_step_losses
    # Steps 2..STEPS publish, and so does flush_pending_update(): every bucket lands once
    # each time, the first layers' first (those of the last step and of the flush are
    # landed by the flush and the read of the weights, in the same order).
    top = max(index for index, _ in landings)
    firsts = landings[:: top + 1]
    assert len(landings) == STEPS * (top + 1), landings
    assert all(index == top for index, _ in firsts), landings
    assert any(pending for _, pending in firsts), landings


@pytest.mark.simulator_only("a slow simulated link makes a missing wait read old weights")
def test_a_forward_that_does_not_wait_reads_old_weights(monkeypatch) -> None:
    # The control for the tests above: landing without the wait (the fingerprints only)
    # over the same slow link trains another model, so those tests can fail.
    def no_wait(self, bucket, events, gather, stream) -> None:
        bucket.views.remember()

    at_step, _, _ = _train("at_step", accelerator=run_accelerator(link_bandwidth=2e6))
    monkeypatch.setattr(DelayedUpdate, "_land_one", no_wait)
    unwaited, _, _ = _train("at_first_use", accelerator=run_accelerator(link_bandwidth=2e6))
    assert not torch.equal(at_step, unwaited)


def _write(model: torch.nn.Module, step: int) -> None:
    """Writes between a step and the next forward, each through a different door."""
    params = list(model.parameters())
    with torch.no_grad():
        if step == 1:
            params[0].mul_(0.5)  # an op on the parameter
        elif step == 2:
            params[-1].data.add_(0.25)  # through .data: no version counter moves
        elif step == 3:
            model.load_state_dict({k: v * 0.75 for k, v in model.state_dict().items()})


def test_writes_between_step_and_forward_land_first_and_win() -> None:
    # Each write lands its bucket first (fingerprints taken before it), so the next step
    # sees it and the written weights win over nothing: as with "at_step".
    at_step, losses, _ = _train("at_step", after_step=_write)
    first_use, first_losses, _ = _train("at_first_use", after_step=_write)
    assert torch.equal(at_step, first_use) and losses == first_losses
    assert not torch.equal(at_step, _train("at_step")[0])  # the writes changed the run


def test_reads_outside_the_forward_see_the_published_weights() -> None:
    # state_dict(), deepcopy, torch.save and a plain read, right after step(): each lands
    # what it reads and sees what "at_step" shows at the same point.
    seen: dict[str, list[torch.Tensor]] = {"at_step": [], "at_first_use": []}

    def read(into: list[torch.Tensor]):
        def after_step(model: torch.nn.Module, step: int) -> None:
            if step == 1:
                into.append(torch.cat([v.flatten().float() for v in model.state_dict().values()]))
            elif step == 2:
                into.append(_weights(copy.deepcopy(model)))
            elif step == 3:
                buffer = io.BytesIO()
                torch.save(list(model.parameters()), buffer)
                buffer.seek(0)
                loaded = torch.load(buffer, weights_only=False)
                into.append(torch.cat([p.detach().flatten().float().cpu() for p in loaded]))
                assert not any(is_in_flight(p) for p in loaded)
            elif step == 4:
                into.append(next(model.parameters()).sum().float().reshape(1).cpu())

        return after_step

    for landing, into in seen.items():
        _train(landing, after_step=read(into))
    assert len(seen["at_step"]) == 4
    for a, b in zip(seen["at_step"], seen["at_first_use"], strict=True):
        assert torch.equal(a.cpu(), b.cpu())


def test_the_optimizer_lands_everything_before_it_reads_the_weights() -> None:
    # state_dict() and close() with every bucket in flight: nothing stays in flight, the
    # state is the same as "at_step"'s, and the model keeps working after close.
    states = {}
    for landing in ("at_step", "at_first_use"):
        model, _ = make_pair(torch.bfloat16)
        opt = offload_opt(model, overlap_step=True, overlap_shadow="off", overlap_landing=landing)
        for tokens, targets in batches(3):
            opt.backward(lm_loss(model, tokens, targets))
            opt.step()
            opt.zero_grad()
        states[landing] = opt.state_dict()
        assert not any(is_in_flight(p) for p in model.parameters())
        opt.backward(lm_loss(model, *batches(1, seed=1)[0]))
        opt.step()
        opt.close()
        assert not any(is_in_flight(p) for p in model.parameters())
        states[landing]["after_close"] = _weights(model)
    a, b = states["at_step"], states["at_first_use"]
    assert torch.equal(a["after_close"], b["after_close"])
    for index, entry in a["state"].items():
        for key, value in entry.items():
            other = b["state"][index][key]
            assert torch.equal(value, other) if torch.is_tensor(value) else value == other


def test_the_setting_is_checked() -> None:
    assert OffloadConfig(overlap_step=True).overlap_landing is OverlapLanding.AT_STEP
    config = OffloadConfig(overlap_step=True, overlap_landing="at_first_use")
    assert config.overlap_landing is OverlapLanding.AT_FIRST_USE
    with pytest.raises(ValueError, match=r"overlap_landing='at_first_use'.*overlap_step=False"):
        OffloadConfig(overlap_landing="at_first_use")
    with pytest.raises(
        ValueError, match=r"overlap_landing must be 'at_step' or 'at_first_use', got 'lazy'"
    ):
        OffloadConfig(overlap_step=True, overlap_landing="lazy")


def test_a_second_thread_reading_waits_for_the_same_landing() -> None:
    # Two threads read parameters of one bucket at once: it lands once, both see its bits.
    def race(model: torch.nn.Module, step: int) -> None:
        if step != 2:
            return
        param = next(model.parameters())
        sums: list[torch.Tensor] = []
        threads = [
            threading.Thread(target=lambda: sums.append(param.detach().float().sum()))
            for _ in range(2)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert len(sums) == 2 and torch.equal(sums[0], sums[1])

    at_step, _, _ = _train("at_step", after_step=race)
    assert torch.equal(at_step, _train("at_first_use", after_step=race)[0])


@pytest.mark.simulator_only("spawns gloo ranks on the host accelerator")
def test_two_ranks_land_their_gathered_buckets_at_first_use(tmp_path) -> None:
    # Each bucket's all-gather is waited for where the bucket lands; the bits are those of
    # "at_step" on every rank.
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first_use = run_ranks(
        2, "overlap", tmp_path / "a", steps=4, shadow=False, landing="at_first_use"
    )
    at_step = run_ranks(2, "overlap", tmp_path / "b", steps=4, shadow=False)
    for a, b in zip(first_use, at_step, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a["weights"], b["weights"], strict=True))


def test_a_compiled_forward_is_refused_by_name() -> None:
    # torch.compile would trace the landing out of the graph and read weights mid-copy:
    # the first compiled forward over parameters in flight raises, naming the fix.
    model, _ = make_pair()
    opt = offload_opt(
        model, overlap_step=True, overlap_shadow="off", overlap_landing="at_first_use"
    )
    compiled = torch.compile(model, backend="eager")
    data = batches(3)  # the third forward is the first over weights in flight
    # Dynamo compiles nothing under a dispatch mode (strict mode's device check, on under
    # ZERO_OFFLOAD_STRICT=1); this test is about compilation, so it runs without it.
    with (
        _disable_current_modes(),
        pytest.raises(
            Exception, match=r"overlap_landing='at_step' \(the default\) with torch.compile"
        ),
    ):
        for tokens, targets in data:
            opt.backward(lm_loss(compiled, tokens, targets))
            opt.step()
            opt.zero_grad()
    opt.close()
    assert not any(is_in_flight(p) for p in model.parameters())


def test_a_read_on_a_side_stream_lands_for_the_forwards_stream_too() -> None:
    # An EMA on a side stream reads the parameters first: the bucket lands on the stream
    # step() ran on (the forward's) and the side stream waits for that landing; the EMA and
    # the training see the bits of "at_step".
    seen: dict[str, list[torch.Tensor]] = {}
    trained: dict[str, torch.Tensor] = {}
    for landing in ("at_step", "at_first_use"):
        acc = run_accelerator()
        side = acc.new_stream("ema")
        into = seen[landing] = []

        def ema(model: torch.nn.Module, step: int, acc=acc, side=side, into=into) -> None:
            with acc.stream_context(side):
                into.append(torch.cat([p.detach().flatten().float() for p in model.parameters()]))
            acc.synchronize()

        trained[landing] = _train(landing, accelerator=acc, after_step=ema)[0]
    assert torch.equal(trained["at_step"], trained["at_first_use"])
    for a, b in zip(seen["at_step"], seen["at_first_use"], strict=True):
        assert torch.equal(a.cpu(), b.cpu())


@pytest.mark.parametrize(
    "rule", ["OffloadLion", "OffloadAdagrad", "OffloadAdafactor", "OffloadMuon"]
)
def test_every_rule_lands_at_first_use_bitwise(rule: str) -> None:
    # The landing is the publication's, whatever the rule (issue 37: every rule works with
    # overlap_step): the bits of "at_step".
    import zero_offload

    cls = getattr(zero_offload, rule)

    def train(landing: str) -> torch.Tensor:
        model, _ = make_pair(torch.bfloat16)
        config = OffloadConfig(
            bucket_bytes=8192,
            tile_elements=1024,
            overlap_step=True,
            overlap_shadow="off",
            overlap_landing=landing,
        )
        opt = cls(model.parameters(), lr=1e-3, config=config, accelerator=run_accelerator())
        for tokens, targets in batches(4):
            opt.backward(lm_loss(model, tokens, targets))
            opt.step()
            opt.zero_grad()
        opt.flush_pending_update()
        weights = _weights(model)
        opt.close()
        return weights

    assert torch.equal(train("at_step"), train("at_first_use"))
