"""Note [parameters that share memory] (optim/shared_memory.py): Parameters over one storage, or
over overlapping views of one tensor, are refused at construction and by add_param_group,
naming both, since their slots would untie them where torch keeps them equal. One Parameter
object tied in two modules, disjoint or interleaved views and frozen aliases still build."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from zero_offload import OffloadAdamW

from .helpers.models import host_accelerator, mlp, mlp_batches, mlp_loss, mlp_opt

SHARED = "share memory"


def _opt(params: object) -> OffloadAdamW:
    return OffloadAdamW(params, lr=0.1, accelerator=host_accelerator())  # type: ignore[arg-type]


def test_two_parameters_over_one_storage_are_refused_naming_both() -> None:
    w = torch.randn(3, 3)
    a, b = nn.Parameter(w), nn.Parameter(w)
    with pytest.raises(ValueError, match=r"parameter 0 .* and parameter 1 .* share memory"):
        _opt([a, b])
    with pytest.raises(ValueError, match=r"parameter 0 \('a', .* and parameter 2 \('b', "):
        _opt([("a", a), ("other", nn.Parameter(torch.randn(2))), ("b", b)])
    # In separate groups too, and through torch.from_numpy twice (two storages, one buffer).
    with pytest.raises(ValueError, match=SHARED):
        _opt([{"params": [a]}, {"params": [b], "lr": 0.01}])
    array = torch.randn(4).numpy()
    with pytest.raises(ValueError, match=SHARED):
        _opt([nn.Parameter(torch.from_numpy(array)), nn.Parameter(torch.from_numpy(array))])


def test_overlapping_views_are_refused_and_disjoint_ones_build() -> None:
    w = torch.randn(6, 4)
    with pytest.raises(ValueError, match=r"parameter 0 .*\(3, 4\).* and parameter 1 .*\(4, 4\)"):
        _opt([nn.Parameter(w[:3]), nn.Parameter(w[2:])])
    with pytest.raises(ValueError, match=SHARED):  # a column overlaps a row block
        _opt([nn.Parameter(w[:, 1]), nn.Parameter(w[4:])])
    for parts in ([w[:3], w[3:]], [w[0::2], w[1::2]], [w[:, 0], w[:, 1]]):
        _opt([nn.Parameter(p) for p in parts]).close()  # no shared element


def test_add_param_group_refuses_memory_of_an_existing_parameter_and_changes_nothing() -> None:
    model = mlp()
    opt = mlp_opt(model)
    first = next(model.parameters())
    alias = nn.Parameter(first.data[:2])  # the optimizer's own slot for parameter 0
    with pytest.raises(ValueError, match=r"parameter 0 .* and parameter 6 .* share memory"):
        opt.add_param_group({"params": [alias]})
    assert len(opt.param_groups) == 1 and len(opt.buckets) == len(mlp_opt(mlp()).buckets)
    x, y = mlp_batches(1)[0]
    mlp_loss(model, x, y).backward()
    opt.step()
    opt.close()


def test_one_tied_parameter_and_frozen_aliases_build() -> None:
    embed, head = nn.Embedding(8, 4), nn.Linear(4, 8, bias=False)
    head.weight = embed.weight  # tied as tie_weights ties: one Parameter object
    model = nn.ModuleDict({"embed": embed, "head": head})
    opt = _opt(model.parameters())
    tokens = torch.tensor([1, 2, 3])
    head(embed(tokens)).sum().backward()
    opt.step()
    assert head.weight is embed.weight
    opt.close()
    w = torch.randn(3)
    frozen = [nn.Parameter(w, requires_grad=False), nn.Parameter(w, requires_grad=False)]
    _opt([*frozen, nn.Parameter(torch.randn(2))]).close()
