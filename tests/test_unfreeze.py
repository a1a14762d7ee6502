"""Unfreezing layers during a run (gradual unfreezing), the two ways the step's refusal
offers, each beside torch's AdamW, which steps a parameter from the first step a gradient
reaches it. Before, the refusal for a parameter frozen at the build advised
``add_param_group``, which refuses a parameter already in a group: a dead end."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from .helpers.models import max_diff, mlp, mlp_batches, mlp_loss, mlp_opt, mlp_torch_adamw

TOL = 1e-6


def _freeze(model: nn.Module, frozen: bool) -> None:
    for param in model[0].parameters():
        param.requires_grad_(not frozen)


def _step(model: nn.Module, opt: torch.optim.Optimizer, batch: tuple) -> None:
    opt.zero_grad()
    mlp_loss(model, *batch).backward()
    opt.step()


def test_frozen_at_the_build_unfrozen_by_the_rebuild_the_refusal_gives() -> None:
    model = mlp()
    ref = copy.deepcopy(model)
    for m in (model, ref):
        _freeze(m, True)
    opt, ropt = mlp_opt(model), mlp_torch_adamw(ref)
    pairs = mlp_batches(5)
    for m, o in ((model, opt), (ref, ropt)):
        _step(m, o, pairs[0])
        _freeze(m, False)
    mlp_loss(model, *pairs[1]).backward()
    with pytest.raises(ValueError, match=r"rebuild: sd = opt\.state_dict\(\); opt\.close\(\)"):
        opt.step()
    opt.zero_grad()
    sd = opt.state_dict()  # the recipe the refusal gives
    opt.close()
    opt = mlp_opt(model)
    opt.load_state_dict(sd)
    for batch in pairs[1:]:
        _step(model, opt, batch)
        _step(ref, ropt, batch)
    assert max_diff(model, ref) < TOL
    opt.close()


def test_frozen_after_the_build_steps_again_once_unfrozen() -> None:
    model = mlp()
    ref = copy.deepcopy(model)
    opt, ropt = mlp_opt(model), mlp_torch_adamw(ref)
    for i, batch in enumerate(mlp_batches(6)):
        for m, o in ((model, opt), (ref, ropt)):
            _freeze(m, i < 3)  # frozen for the first three steps, after the build
            _step(m, o, batch)
    assert max_diff(model, ref) < TOL
    opt.close()
