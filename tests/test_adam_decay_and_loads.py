"""Four places where the offload optimizers parted from torch's (found by a probe, s14).

1. ``decoupled_weight_decay`` is each group's, as in torch's Adam and AdamW (Note [the
   decay's form is the group's] in zero_offload/optim/rule/adamw.py): Adam loading AdamW's
   state steps AdamW's decay, a value set by hand is stepped with, AdamW stays AdamW after
   loading Adam's state (by load_state_dict or load_streaming), our AdamW's state tells
   torch's Adam it is AdamW's, and OffloadAdam takes torch's decoupled_weight_decay=.
2. Tensor ``betas`` under a scheduler with ``cycle_momentum`` (which writes a float
   ``beta1`` beside the tensor ``beta2``) step as torch's do; the constructor still refuses
   mixed betas, as torch's does.
3. A torch state dict with state for a 0-element parameter loads (Note [an empty
   parameter's state is checked, then dropped] in optim/checkpoint/state_dict.py); a
   malformed entry for it is still refused, leaving the optimizer as it was.
4. ``torch.optim.Muon``'s state dicts keep no ``step``: refused, naming the way in, and
   that way is exact.

Parity: fp32 within 1e-6 over a few steps (our kernel and torch's for-loop part by a few
ulp per step). Host only: tiny CPU models on the host accelerator.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import nn

from zero_offload import OffloadAdam, OffloadAdamW, OffloadConfig, OffloadMuon

from .helpers.models import host_accelerator, max_diff, mlp, mlp_batches, mlp_loss

TOL = 1e-6
#: Large enough that Adam's L2 term and AdamW's decay part visibly in a few steps.
DECAY = {"lr": 0.05, "weight_decay": 0.5}


def _config() -> OffloadConfig:
    return OffloadConfig(bucket_bytes=4096, tile_elements=1024)


def _linear(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Linear(4, 3)


def _loss(model: nn.Module, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(5, 4, generator=g), torch.randn(5, 3, generator=g)
    return ((model(x) - y) ** 2).mean()


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        opt.zero_grad()
        _loss(model, step).backward()
        opt.step()


def _diff(a: nn.Module, b: nn.Module) -> float:
    return max(
        (x.detach() - y.detach()).abs().max().item()
        for x, y in zip(a.parameters(), b.parameters(), strict=True)
        if x.numel()
    )


def _ours(cls: type, model: nn.Module, **kwargs: object) -> torch.optim.Optimizer:
    return cls(model.parameters(), **kwargs, config=_config(), accelerator=host_accelerator())


def _torch_state(cls: type, steps: int = 2) -> tuple[nn.Module, dict]:
    """A model and the state dict of torch's ``cls`` after ``steps`` steps on it."""
    model = _linear()
    opt = cls(model.parameters(), **DECAY)
    _train(model, opt, range(steps))
    return model, copy.deepcopy(opt.state_dict())


# -- 1. decoupled_weight_decay is the group's ----------------------------------------------


@pytest.mark.parametrize(
    ("saver", "loader", "ours"),
    [
        (torch.optim.AdamW, torch.optim.Adam, OffloadAdam),  # Adam takes AdamW's decay
        (torch.optim.Adam, torch.optim.AdamW, OffloadAdamW),  # AdamW stays AdamW
    ],
)
def test_a_loaded_state_decides_the_decay_as_in_torch(
    saver: type, loader: type, ours: type
) -> None:
    trained, state = _torch_state(saver)
    model, ref = copy.deepcopy(trained), copy.deepcopy(trained)
    opt = _ours(ours, model, **DECAY)
    ropt = loader(ref.parameters(), **DECAY)
    opt.load_state_dict(copy.deepcopy(state))
    ropt.load_state_dict(copy.deepcopy(state))
    expected = ropt.param_groups[0]["decoupled_weight_decay"]
    assert expected is (saver is torch.optim.AdamW or loader is torch.optim.AdamW)
    assert opt.param_groups[0]["decoupled_weight_decay"] is expected
    _train(model, opt, range(2, 5))
    _train(ref, ropt, range(2, 5))
    assert _diff(model, ref) < TOL
    opt.close()


@pytest.mark.parametrize(
    ("cls", "ref_cls"), [(OffloadAdam, torch.optim.Adam), (OffloadAdamW, torch.optim.AdamW)]
)
def test_a_decay_form_set_by_hand_is_stepped_as_in_torch(cls: type, ref_cls: type) -> None:
    model, ref = _linear(), _linear()
    opt, ropt = _ours(cls, model, **DECAY), ref_cls(ref.parameters(), **DECAY)
    flipped = not ropt.param_groups[0]["decoupled_weight_decay"]
    for optimizer in (opt, ropt):
        optimizer.param_groups[0]["decoupled_weight_decay"] = flipped
    _train(model, opt, range(3))
    _train(ref, ropt, range(3))
    assert _diff(model, ref) < TOL
    unflipped = _linear()
    _train(unflipped, ref_cls(unflipped.parameters(), **DECAY), range(3))
    assert _diff(model, unflipped) > 100 * TOL  # the two forms part: the test can fail
    opt.close()


def test_our_adamw_state_makes_torch_adam_step_adamw() -> None:
    """Our AdamW's state holds the key as torch's does, so torch's Adam loading it steps
    AdamW's decay, as it does loading torch's AdamW's."""
    model, ref = _linear(), _linear()
    opt = _ours(OffloadAdamW, model, **DECAY)
    ropt = torch.optim.AdamW(ref.parameters(), **DECAY)
    _train(model, opt, range(2))
    _train(ref, ropt, range(2))
    ours_saved, torch_saved = opt.state_dict(), ropt.state_dict()
    opt.close()
    assert ours_saved["param_groups"][0]["decoupled_weight_decay"] is True
    for saved, trained in ((ours_saved, model), (torch_saved, ref)):
        adam = torch.optim.Adam(trained.parameters(), **DECAY)
        adam.load_state_dict(saved)
        _train(trained, adam, range(2, 4))
    assert _diff(model, ref) < TOL


def test_a_decay_form_that_is_not_a_bool_is_refused() -> None:
    model = _linear()
    opt = _ours(OffloadAdam, model, **DECAY)
    opt.param_groups[0]["decoupled_weight_decay"] = 1
    _loss(model, 0).backward()
    with pytest.raises(TypeError, match="param group 0: decoupled_weight_decay must be a bool"):
        opt.step()
    opt.close()


# -- 2. tensor betas under cycle_momentum ----------------------------------------------------


SCHEDULERS: dict[str, Callable[[torch.optim.Optimizer], object]] = {
    "OneCycleLR": lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.05, total_steps=10),
    "CyclicLR": lambda o: torch.optim.lr_scheduler.CyclicLR(
        o, base_lr=0.001, max_lr=0.01, step_size_up=2
    ),
}


def _tensor_hyper() -> dict[str, object]:
    return {"lr": torch.tensor(0.01), "betas": (torch.tensor(0.9), torch.tensor(0.999))}


@pytest.mark.parametrize("scheduler", list(SCHEDULERS))
def test_tensor_betas_under_cycle_momentum_step_as_in_torch(scheduler: str) -> None:
    model, ref = _linear(), _linear()
    opt = _ours(OffloadAdamW, model, **_tensor_hyper())
    ropt = torch.optim.AdamW(ref.parameters(), **_tensor_hyper())
    schedules = [SCHEDULERS[scheduler](o) for o in (opt, ropt)]
    for step in range(4):
        for m, o, s in ((model, opt, schedules[0]), (ref, ropt, schedules[1])):
            o.zero_grad()
            _loss(m, step).backward()
            o.step()
            s.step()  # type: ignore[attr-defined]
    beta1, beta2 = opt.param_groups[0]["betas"]
    assert isinstance(beta1, float) and isinstance(beta2, torch.Tensor)  # mixed, stepped
    assert _diff(model, ref) < TOL
    opt.close()


def test_mixed_betas_are_refused_at_construction_as_in_torch() -> None:
    mixed = (0.9, torch.tensor(0.999))
    with pytest.raises(ValueError, match="both floats or both"):
        torch.optim.AdamW(_linear().parameters(), betas=mixed)
    with pytest.raises(ValueError, match=r"OffloadAdamW: betas must be both floats or both"):
        _ours(OffloadAdamW, _linear(), betas=mixed)
    # A group of its own takes them, as torch's add_param_group does.
    opt = _ours(OffloadAdamW, _linear())
    extra = nn.Parameter(torch.ones(3))
    opt.add_param_group({"params": [extra], "betas": mixed})
    assert opt.param_groups[1]["betas"] == mixed
    opt.close()


# -- 3. torch's state for a 0-element parameter --------------------------------------------


def _with_empty(seed: int = 0) -> nn.Module:
    model = _linear(seed)
    model.empty = nn.Parameter(torch.zeros(0))
    return model


def _empty_loss(model: nn.Module, step: int) -> torch.Tensor:
    return _loss(model, step) + model.empty.sum()


def _torch_state_with_empty() -> tuple[nn.Module, dict]:
    model = _with_empty()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(2):
        opt.zero_grad()
        _empty_loss(model, step).backward()
        opt.step()
    state = copy.deepcopy(opt.state_dict())
    assert tuple(state["state"][2]["exp_avg"].shape) == (0,)  # torch keeps the empty one
    return model, state


def test_torch_state_of_an_empty_parameter_loads_and_trains_as_torch() -> None:
    trained, state = _torch_state_with_empty()
    model, ref = copy.deepcopy(trained), copy.deepcopy(trained)
    opt = _ours(OffloadAdamW, model, lr=1e-2)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt.load_state_dict(copy.deepcopy(state))
    ropt.load_state_dict(copy.deepcopy(state))
    for step in range(2, 5):
        for m, o in ((model, opt), (ref, ropt)):
            o.zero_grad()
            _empty_loss(m, step).backward()
            o.step()
    assert _diff(model, ref) < TOL
    assert sorted(opt.state_dict()["state"]) == [0, 1]  # nothing kept for it
    opt.close()


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda e: e.update(exp_avg=torch.zeros(1)), r"'exp_avg' has shape \(1,\)"),
        (lambda e: e.pop("exp_avg_sq"), r"missing \['exp_avg_sq'\]"),
        (lambda e: e.update(step=torch.tensor(1.5)), "'step' must be a whole number"),
    ],
)
def test_a_malformed_empty_parameter_state_is_refused_and_changes_nothing(
    edit: Callable[[dict], object], message: str
) -> None:
    _, state = _torch_state_with_empty()
    edit(state["state"][2])
    model = _with_empty()
    opt = _ours(OffloadAdamW, model, lr=1e-2)
    _train(model, opt, range(1))
    before = opt.state_dict()
    with pytest.raises((ValueError, TypeError), match=f"state of parameter 2: {message}"):
        opt.load_state_dict(state)
    after = opt.state_dict()
    for index, entry in before["state"].items():
        for name, value in entry.items():
            assert torch.equal(value, after["state"][index][name])
    assert opt.param_groups[0]["lr"] == 1e-2
    opt.close()


def test_a_non_empty_parameter_not_trained_is_still_refused() -> None:
    trained, state = _torch_state(torch.optim.AdamW)
    model = copy.deepcopy(trained)
    model.bias.requires_grad_(False)
    opt = _ours(OffloadAdamW, model, **DECAY)
    with pytest.raises(ValueError, match="parameter 1: this optimizer does not train"):
        opt.load_state_dict(state)
    opt.close()


# -- 4. torch.optim.Muon's state dicts ------------------------------------------------------


class _Matrices(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.ps = nn.ParameterList(
            [
                nn.Parameter(torch.randn(4, 6, generator=g)),
                nn.Parameter(torch.randn(6, 5, generator=g)),
            ]
        )

    def loss(self, step: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(200 + step)
        return sum((torch.sin(p) * torch.randn(p.shape, generator=g)).sum() for p in self.ps)


def _muon_train(model: _Matrices, opt: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        opt.zero_grad()
        model.loss(step).backward()
        opt.step()


def test_torch_muon_state_is_refused_naming_the_way_in_and_that_way_is_exact() -> None:
    trained = _Matrices()
    topt = torch.optim.Muon(trained.parameters(), lr=0.02)
    _muon_train(trained, topt, range(2))
    state = copy.deepcopy(topt.state_dict())
    assert all(set(entry) == {"momentum_buffer"} for entry in state["state"].values())
    model, ref = copy.deepcopy(trained), copy.deepcopy(trained)
    opt = _ours(OffloadMuon, model, lr=0.02)
    with pytest.raises(
        ValueError,
        match=r"state of parameter 0: missing \['step'\].*torch\.optim\.Muon's state dicts keep "
        r"none \(only 'momentum_buffer'\).*s\.setdefault\('step', torch\.tensor\(1\.0\)\)",
    ):
        opt.load_state_dict(copy.deepcopy(state))
    assert opt.state_dict()["state"] == {}  # nothing was loaded
    for entry in state["state"].values():  # the way the message names
        entry.setdefault("step", torch.tensor(1.0))
    opt.load_state_dict(copy.deepcopy(state))
    ropt = torch.optim.Muon(ref.parameters(), lr=0.02)
    ropt.load_state_dict(copy.deepcopy(state))
    _muon_train(model, opt, range(2, 5))
    _muon_train(ref, ropt, range(2, 5))
    assert _diff(model, ref) < TOL
    opt.close()


def test_adam_takes_torchs_decoupled_weight_decay_argument() -> None:
    """``OffloadAdam(decoupled_weight_decay=True)`` steps as torch's Adam with it: AdamW's
    decay; the defaults and groups hold the key as torch's do."""
    model = mlp()
    ref = copy.deepcopy(model)
    opt = OffloadAdam(model.parameters(), lr=1e-2, weight_decay=0.5, decoupled_weight_decay=True,
                      accelerator=host_accelerator())  # fmt: skip
    ropt = torch.optim.Adam(
        ref.parameters(), lr=1e-2, weight_decay=0.5, decoupled_weight_decay=True
    )
    assert opt.defaults["decoupled_weight_decay"] is True
    assert opt.param_groups[0]["decoupled_weight_decay"] is True
    for x, y in mlp_batches(3):
        for m, o in ((model, opt), (ref, ropt)):
            mlp_loss(m, x, y).backward()
            o.step()
            o.zero_grad()
    assert max_diff(model, ref) < 1e-6
    opt.close()


def test_adamw_stays_adamw_after_streaming_an_adam_state(tmp_path) -> None:
    """An ``OffloadAdam`` checkpoint (its groups hold False) streamed into ``OffloadAdamW``
    completes the groups as ``load_state_dict`` does: AdamW's decay."""
    model = mlp()
    adam = OffloadAdam(model.parameters(), lr=1e-2, accelerator=host_accelerator())
    x, y = mlp_batches(1)[0]
    mlp_loss(model, x, y).backward()
    adam.step()
    adam.zero_grad()
    adam.save_streaming(tmp_path / "adam")
    adam.close()
    adamw = OffloadAdamW(model.parameters(), lr=1e-2, accelerator=host_accelerator())
    adamw.load_streaming(tmp_path / "adam")
    assert adamw.param_groups[0]["decoupled_weight_decay"] is True
    adamw.close()
