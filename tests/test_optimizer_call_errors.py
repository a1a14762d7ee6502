"""Calls refused with the usual messages, before anything changes: add_param_group after
close(), with a group that is not a dict (torch's TypeError) or has no 'params';
backward(step=) that is not a bool."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from .helpers.models import mlp, mlp_batches, mlp_loss, mlp_opt


def test_add_param_group_after_close_says_closed() -> None:
    opt = mlp_opt(mlp())
    opt.close()
    with pytest.raises(RuntimeError, match=r"add_param_group\(\) after close\(\)"):
        opt.add_param_group({"params": [nn.Parameter(torch.randn(2))]})


def test_add_param_group_refuses_a_group_that_is_not_a_dict_or_has_no_params() -> None:
    opt = mlp_opt(mlp())
    extra = nn.Parameter(torch.randn(4))
    with pytest.raises(TypeError, match=r"param_group must be a dict.*got list"):
        opt.add_param_group([extra])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"param group 1 has no 'params' entry.*\['lr'\]"):
        opt.add_param_group({"lr": 0.1})
    with pytest.raises(TypeError, match=r"'params' must be a tensor or an ordered iterable"):
        opt.add_param_group({"params": {extra}})
    assert len(opt.param_groups) == 1
    opt.add_param_group({"params": extra})  # one tensor is a group of one, as in torch
    assert len(opt.param_groups) == 2
    opt.close()


def test_backward_step_must_be_a_bool() -> None:
    model = mlp()
    opt = mlp_opt(model)
    x, y = mlp_batches(1)[0]
    with pytest.raises(TypeError, match=r"step must be a bool.*got 'yes' \(str\)"):
        opt.backward(mlp_loss(model, x, y), step="yes")  # type: ignore[arg-type]
    assert not opt.step_announced and opt.backwards == 0
    opt.backward(mlp_loss(model, x, y), step=True)
    opt.step()
    opt.close()
