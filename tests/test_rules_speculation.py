"""The other rules under speculative steps, tensor hyper-parameters and stepless state dicts.

1. Note [the buckets left to step() land before the decision] (update/eager.py): with
   ``speculative_step=True`` and clipping configured, the buckets that are not stepped during
   backward (a rule that reads whole parameters, Adafactor and Muon, whose shaped state the
   backup does not cover; buckets past ``speculation_bytes``) are stepped in ``step()``. With
   micro-batches their window is summed on the device, and its last flush lands it on the
   host only when the host worker has passed the previous step's end by then. It used not to
   land at all otherwise: the norm came from an older window and the step clipped by it, in
   about one run in seven. ``_slow_host_worker`` makes that timing certain: the host worker
   passes each step's end only once the next announced backward has returned. Every step's
   norm and the weights are then bitwise those of ``speculative_step=False``.
2. ``OffloadAdagrad`` and ``OffloadLion`` take a 1-element tensor ``lr`` (Lion: betas too), as
   torch's optimizers do: against ``torch.optim.Adagrad`` with a tensor lr and a ``LambdaLR``,
   and a torch Adagrad state dict saved with a tensor lr loads.
3. A state entry without ``step`` is refused naming the optimizer that loads it and what
   works (Note [a loaded entry needs its step] in checkpoint/state_dict.py); lion-pytorch's
   dicts (``exp_avg`` only) load into ``OffloadLion`` the way the message names, bitwise.

Host accelerator only: the gate in (1) holds the simulator's host worker.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn

from zero_offload import (
    OffloadAdafactor,
    OffloadAdagrad,
    OffloadAdamW,
    OffloadConfig,
    OffloadLion,
    OffloadMuon,
)
from zero_offload.optim.grads.device_window import DeviceWindow
from zero_offload.optim.update.eager import EagerStep

from .helpers.models import max_diff, mlp, mlp_batches, mlp_loss

# Without speculation the announced step runs in step(), and says so once per optimizer.
pytestmark = pytest.mark.filterwarnings("ignore:.*the announced step runs in step")

FP32_ATOL = 1e-5  # tests/test_lion_adagrad.py's bound for torch's Adagrad over 20 steps

# -- 1. speculative steps of the buckets left to step() ---------------------------------


class _Gates:
    """Holds the host worker at each window's end until ``release``, while ``active``."""

    def __init__(self) -> None:
        self.pending: list[threading.Event] = []
        self.held = 0
        self.active = False

    def hold(self, worker: Any) -> None:
        if not self.active:
            return
        gate = threading.Event()
        self.pending.append(gate)
        self.held += 1
        # A timeout, so that a mistake here fails the comparison rather than hangs.
        worker.submit(lambda: gate.wait(timeout=30))

    def release(self) -> None:
        for gate in self.pending:
            gate.set()
        self.pending.clear()


@pytest.fixture
def _slow_host_worker(monkeypatch: pytest.MonkeyPatch) -> Iterator[_Gates]:
    """A host worker slow to pass each step's end: ``DeviceWindow.consumed`` records the
    event a landing of the next window waits for, behind a task that waits for the test's
    ``release`` (called once the next announced backward returned)."""
    gates = _Gates()
    consumed = DeviceWindow.consumed

    def slow_consumed(self: DeviceWindow, worker: Any, **kwargs: Any) -> None:
        gates.hold(worker)
        consumed(self, worker, **kwargs)

    monkeypatch.setattr(DeviceWindow, "consumed", slow_consumed)
    yield gates
    gates.release()


def _adafactor(model: nn.Module, config: OffloadConfig) -> OffloadAdafactor:
    return OffloadAdafactor(model.parameters(), lr=1e-2, weight_decay=0.01, config=config)


def _muon(model: nn.Module, config: OffloadConfig) -> OffloadMuon:
    return OffloadMuon(model.parameters(), lr=0.02, adamw_lr=3e-3, config=config)


def _adamw(model: nn.Module, config: OffloadConfig) -> OffloadAdamW:
    return OffloadAdamW(model.parameters(), lr=1e-2, weight_decay=0.01, config=config)


# (build, speculation_bytes): Adafactor and Muon keep shaped state, never backed up; AdamW
# with no backup budget leaves every bucket to step() the same way.
RULES = {
    "adafactor": (_adafactor, "1GiB"),
    "muon": (_muon, "1GiB"),
    "adamw-over-budget": (_adamw, 0),
}


def _train_micro(
    build: Callable[[nn.Module, OffloadConfig], Any],
    gates: _Gates,
    *,
    speculative: bool,
    max_grad_norm: float,
    speculation_bytes: int | str,
    steps: int = 10,
    micro: int = 2,
) -> tuple[nn.Module, list[float | None], int, int]:
    """``steps`` announced steps of ``micro`` micro-batches each; the model, each step's
    norm, the rollbacks and how many times the host worker was held."""
    model = mlp()
    config = OffloadConfig(
        bucket_bytes=1024,
        tile_elements=1024,
        max_grad_norm=max_grad_norm,
        speculative_step=speculative,
        speculation_bytes=speculation_bytes,
    )
    opt = build(model, config)
    data = mlp_batches(steps * micro)
    norms: list[float | None] = []
    held = gates.held
    gates.active = True
    for s in range(steps):
        for j in range(micro):
            x, y = data[s * micro + j]
            opt.backward(mlp_loss(model, x, y) / micro, step=j == micro - 1)
        gates.release()  # the host worker passes the previous step's end only now
        opt.step()
        norms.append(opt.last_grad_norm)
        opt.zero_grad()
    gates.active = False
    gates.release()
    failures = opt.speculation_failures
    opt.close()
    return model, norms, failures, gates.held - held


@pytest.mark.parametrize("max_grad_norm", [0.08, 1e6], ids=["clip-binds", "clip-never-binds"])
@pytest.mark.parametrize("rule", list(RULES))
def test_buckets_left_to_step_clip_by_their_window_norm(
    _slow_host_worker: _Gates, rule: str, max_grad_norm: float
) -> None:
    build, speculation_bytes = RULES[rule]
    runs = {
        speculative: _train_micro(
            build,
            _slow_host_worker,
            speculative=speculative,
            max_grad_norm=max_grad_norm,
            speculation_bytes=speculation_bytes,
        )
        for speculative in (True, False)
    }
    spec_model, spec_norms, failures, held = runs[True]
    plain_model, plain_norms, _, _ = runs[False]
    assert held >= 9  # the gate held the worker at every step's end but the last
    assert spec_norms == plain_norms  # every step's norm, bitwise
    assert max_diff(spec_model, plain_model) == 0.0
    # No bucket was stepped during backward, so none was rolled back.
    assert failures == 0


def test_the_speculated_buckets_still_roll_back_beside_those_left_to_step(
    _slow_host_worker: _Gates, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A budget for some of AdamW's buckets: those are stepped during backward and rolled
    # back when the clip binds; the rest wait for step(). Bitwise the ordinary step. A
    # speculated bucket's update runs on the host worker, and backward may wait for it (its
    # staging is the next flush's): the worker is let go at the first hand-over.
    hand_over = EagerStep.hand_over

    def let_go_first(self: EagerStep, bucket: Any) -> None:
        _slow_host_worker.release()
        hand_over(self, bucket)

    monkeypatch.setattr(EagerStep, "hand_over", let_go_first)
    runs = {
        speculative: _train_micro(
            _adamw,
            _slow_host_worker,
            speculative=speculative,
            max_grad_norm=0.08,
            speculation_bytes=8000,
            steps=6,
        )
        for speculative in (True, False)
    }
    assert runs[True][1] == runs[False][1]
    assert max_diff(runs[True][0], runs[False][0]) == 0.0
    assert runs[True][2] > 0  # the clip bound and the speculated buckets were restored


# -- 2. a tensor lr ---------------------------------------------------------------------


def _schedule(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 0.9**epoch)


def _step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    mlp_loss(model, x, y).backward()
    opt.step()
    opt.zero_grad()


ADAGRAD_ARGS: dict[str, Any] = {"lr_decay": 0.01, "weight_decay": 0.1, "eps": 1e-10}


def test_adagrad_takes_a_tensor_lr_and_a_scheduler_as_torch() -> None:
    model = mlp()
    ref = copy.deepcopy(model)
    opt = OffloadAdagrad(
        model.parameters(),
        lr=torch.tensor(0.01),
        config=OffloadConfig(bucket_bytes=1024),
        **ADAGRAD_ARGS,
    )
    ropt = torch.optim.Adagrad(ref.parameters(), lr=torch.tensor(0.01), **ADAGRAD_ARGS)
    sched, rsched = _schedule(opt), _schedule(ropt)
    for x, y in mlp_batches(12):
        _step(model, opt, x, y)
        _step(ref, ropt, x, y)
        sched.step()
        rsched.step()
    lr = opt.param_groups[0]["lr"]
    assert isinstance(lr, torch.Tensor) and lr.item() == ropt.param_groups[0]["lr"].item()
    assert max_diff(model, ref) < FP32_ATOL
    opt.close()


def test_a_torch_adagrad_state_with_a_tensor_lr_loads() -> None:
    trained = mlp()
    ropt = torch.optim.Adagrad(trained.parameters(), lr=torch.tensor(0.01), **ADAGRAD_ARGS)
    data = mlp_batches(10)
    for x, y in data[:4]:
        _step(trained, ropt, x, y)
    state = copy.deepcopy(ropt.state_dict())
    model = copy.deepcopy(trained)
    opt = OffloadAdagrad(model.parameters(), lr=0.5, **ADAGRAD_ARGS)
    opt.load_state_dict(state)
    lr = opt.param_groups[0]["lr"]
    assert isinstance(lr, torch.Tensor) and lr.item() == pytest.approx(0.01)
    assert lr is not state["param_groups"][0]["lr"]  # a copy, as torch takes
    for x, y in data[4:]:
        _step(model, opt, x, y)
        _step(trained, ropt, x, y)
    assert max_diff(model, trained) < FP32_ATOL
    opt.close()


def test_lion_takes_tensor_hyper_parameters_as_their_values() -> None:
    model = mlp()
    ref = copy.deepcopy(model)
    opt = OffloadLion(
        model.parameters(),
        lr=torch.tensor(1e-3),
        betas=(torch.tensor(0.9), torch.tensor(0.99)),
        weight_decay=0.1,
    )
    ropt = OffloadLion(ref.parameters(), lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1)
    sched = _schedule(opt)
    for x, y in mlp_batches(8):
        ropt.param_groups[0]["lr"] = float(opt.param_groups[0]["lr"])  # the same value
        _step(model, opt, x, y)
        _step(ref, ropt, x, y)
        sched.step()
    assert isinstance(opt.param_groups[0]["lr"], torch.Tensor)
    assert max_diff(model, ref) == 0.0
    opt.close()
    ropt.close()


@pytest.mark.parametrize("cls", [OffloadAdagrad, OffloadLion])
@pytest.mark.parametrize(
    ("lr", "error", "message"),
    [
        (torch.tensor([0.1, 0.2]), ValueError, r"lr must have exactly 1 element"),
        (torch.tensor(-0.1), ValueError, r"lr must be >= 0"),
        (torch.tensor(1), TypeError, r"lr must be a real floating-point tensor"),
    ],
)
def test_a_bad_tensor_lr_is_still_refused(
    cls: type, lr: torch.Tensor, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        cls(mlp().parameters(), lr=lr)


# -- 3. a state entry without its step -------------------------------------------------


def _stepless(state: dict[str, Any], keep: tuple[str, ...]) -> dict[str, Any]:
    out = copy.deepcopy(state)
    out["state"] = {i: {k: v for k, v in e.items() if k in keep} for i, e in out["state"].items()}
    out.pop("zero_offload", None)
    return out


def test_lion_refuses_lion_pytorchs_state_naming_itself_and_the_way_in() -> None:
    trained = mlp()
    opt = OffloadLion(trained.parameters(), lr=1e-3, weight_decay=0.1)
    data = mlp_batches(8)
    for x, y in data[:3]:
        _step(trained, opt, x, y)
    # lion-pytorch's layout: exp_avg only, and its three hyper-parameters per group.
    state = _stepless(opt.state_dict(), keep=("exp_avg",))
    state["param_groups"] = [
        {k: g[k] for k in ("lr", "betas", "weight_decay", "params")} for g in state["param_groups"]
    ]
    model = copy.deepcopy(trained)
    fresh = OffloadLion(model.parameters(), lr=1e-3, weight_decay=0.1)
    with pytest.raises(ValueError, match=r"missing \['step'\]") as refused:
        fresh.load_state_dict(copy.deepcopy(state))
    message = str(refused.value)
    assert "OffloadLion" in message and "lion-pytorch" in message
    assert "Muon" not in message
    assert "s.setdefault('step', torch.tensor(1.0))" in message
    assert fresh.state_dict()["state"] == {}  # nothing was loaded
    for entry in state["state"].values():  # the way the message names
        entry.setdefault("step", torch.tensor(1.0))
    fresh.load_state_dict(state)
    for x, y in data[3:]:
        _step(model, fresh, x, y)
        _step(trained, opt, x, y)
    assert max_diff(model, trained) == 0.0  # Lion's update reads no count
    fresh.close()
    opt.close()


@pytest.mark.parametrize(
    ("build", "fields", "name"),
    [
        (lambda m: OffloadAdagrad(m.parameters()), ("sum",), "adagrad"),
        (lambda m: OffloadAdamW(m.parameters()), ("exp_avg", "exp_avg_sq"), "adamw"),
        (
            lambda m: OffloadAdafactor(m.parameters()),
            ("row_var", "col_var", "variance"),
            "adafactor",
        ),
    ],
    ids=["adagrad", "adamw", "adafactor"],
)
def test_a_rule_that_reads_the_count_refuses_a_stepless_state_naming_itself(
    build: Callable[[nn.Module], Any], fields: tuple[str, ...], name: str
) -> None:
    model = mlp()
    opt = build(model)
    x, y = mlp_batches(1)[0]
    _step(model, opt, x, y)
    state = _stepless(opt.state_dict(), keep=fields)
    with pytest.raises(ValueError, match=r"missing \['step'\]") as refused:
        opt.load_state_dict(state)
    message = str(refused.value)
    assert f"the {name} update reads" in message and "Nothing was loaded" in message
    assert "Muon" not in message and "setdefault" not in message
    opt.close()
