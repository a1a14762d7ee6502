"""What a resume keeps, whatever happens between the load and the first step: a read of
``opt.state`` (Lightning's restore iterates it), torch.distributed.checkpoint's route, and
either load order under parameter offload. Each resume is compared bitwise with the
uninterrupted run, or with what the docs name as its equal.

- reading ``opt.state`` after a load changes nothing (Note [a master read after a load] in
  optim/flat_bucket.py), while a master written through it after the load is kept;
- DCP's recipe carries the pending ``overlap_step`` update and the fp16 loss scaler (Note
  [our fields ride in the first param group] in optim/checkpoint/group_fields.py);
- a pending update loaded under parameter offload gives one result in both orders, or
  refuses the order that lost it (Note [a resumed update is published at the step, not at
  the load] in optim/update/modes.py).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from lightning.fabric.utilities.optimizer import _optimizer_to_device
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

import zero_offload
from zero_offload import HostAccelerator, OffloadAdagrad, OffloadAdamW, OffloadConfig, OffloadLion
from zero_offload.config import AcceleratorConfig, LossScalerConfig
from zero_offload.optim.checkpoint.group_fields import GROUP_KEY

FIRST, STEPS = 3, 6  # saved after FIRST steps, compared after STEPS
RULES = {"adamw": OffloadAdamW, "lion": OffloadLion, "adagrad": OffloadAdagrad}
SCALER = LossScalerConfig(initial_scale=2.0**16, growth_interval=3, hysteresis=1)


class _Net(nn.Module):
    """Two linear blocks in a ModuleList (parameter offload's units)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(8, 16), nn.Linear(16, 4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks[1](torch.tanh(self.blocks[0](x)))


def _net(seed: int, dtype: torch.dtype) -> _Net:
    torch.manual_seed(seed)
    return _Net().to(dtype)


def _opt(model: nn.Module, rule: str = "adamw", **config: Any) -> torch.optim.Optimizer:
    extra = {"model": model} if config.get("offload_parameters") else {}
    return RULES[rule](
        model.parameters(),
        lr=1e-2,
        weight_decay=0.1,
        config=OffloadConfig(bucket_bytes=1024, tile_elements=1024, **config),
        accelerator=HostAccelerator(AcceleratorConfig(device_budget="64MiB")),
        **extra,
    )


def _data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [
        (torch.randn(4, 8, generator=gen), torch.randn(4, 4, generator=gen)) for _ in range(STEPS)
    ]


def _train(model: nn.Module, opt: Any, data: list) -> None:
    dtype = next(model.parameters()).dtype
    for x, y in data:
        loss = ((model(x.to(dtype)).float() - y) ** 2).mean()
        if dtype == torch.float16:
            opt.backward(loss)
        else:
            loss.backward()
        opt.step()
        opt.zero_grad()


def _weights(model: nn.Module, opt: Any) -> list[torch.Tensor]:
    opt.close()  # lands a pending update
    return [p.detach().clone() for p in model.parameters()]


def _uninterrupted(dtype: torch.dtype, rule: str = "adamw", **config: Any) -> list[torch.Tensor]:
    model = _net(0, dtype)
    opt = _opt(model, rule, **config)
    _train(model, opt, _data())
    return _weights(model, opt)


def _saved(dtype: torch.dtype, rule: str = "adamw", **config: Any) -> tuple[dict, dict]:
    """The model's and the optimizer's state dicts after FIRST steps."""
    model = _net(0, dtype)
    opt = _opt(model, rule, **config)
    _train(model, opt, _data()[:FIRST])
    saved = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    opt.close()
    return saved


def _bitwise(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


# -- a read of opt.state after a load -------------------------------------------------------


def _read_all(opt: Any) -> None:
    """Every field of every entry, as Lightning's ``_optimizer_to_device`` or a print does."""
    for _, entry in opt.state.items():
        for value in entry.values():
            value.sum()


@pytest.mark.parametrize("order", ["model_first", "optimizer_first"])
@pytest.mark.parametrize("route", ["state_dict", "streaming", "consolidated"])
@pytest.mark.parametrize("rule", ["adamw", "lion"])
def test_reading_opt_state_after_loading_a_pending_update_changes_nothing(
    rule: str, route: str, order: str, tmp_path: Path
) -> None:
    """Before, the read took the stale weights into the master and dropped the pending
    update's publication: 1e-2 off the uninterrupted run (without the read: bitwise)."""
    ref = _uninterrupted(torch.float32, rule, overlap_step=True)
    model = _net(0, torch.float32)
    opt = _opt(model, rule, overlap_step=True)
    _train(model, opt, _data()[:FIRST])
    weights, state = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    opt.save_streaming(tmp_path / "streamed")
    zero_offload.save_consolidated(opt, tmp_path / "opt.pt")
    opt.close()
    model = _net(5, torch.float32)
    opt = _opt(model, rule, overlap_step=True)
    loads = {
        "state_dict": lambda: opt.load_state_dict(state),
        "streaming": lambda: opt.load_streaming(tmp_path / "streamed"),
        "consolidated": lambda: zero_offload.load_consolidated(opt, tmp_path / "opt.pt"),
    }
    if order == "model_first":
        model.load_state_dict(weights)
    loads[route]()
    _read_all(opt)
    if order == "optimizer_first":
        model.load_state_dict(weights)
    assert torch.equal(opt.state_dict()["state"][0]["master"], state["state"][0]["master"])
    _train(model, opt, _data()[FIRST:])
    assert _bitwise(_weights(model, opt), ref)


def test_lightnings_restore_keeps_the_pending_update() -> None:
    """``trainer.fit(ckpt_path=...)`` moves the restored state with ``_optimizer_to_device``,
    which iterates ``opt.state`` and writes every field back."""
    ref = _uninterrupted(torch.float32, overlap_step=True)
    weights, state = _saved(torch.float32, overlap_step=True)
    model = _net(5, torch.float32)
    model.load_state_dict(weights)
    opt = _opt(model, overlap_step=True)
    opt.load_state_dict(state)
    _optimizer_to_device(opt, torch.device("cpu"))
    _train(model, opt, _data()[FIRST:])
    assert _bitwise(_weights(model, opt), ref)


def test_a_bf16_resume_with_a_read_between_the_loads_is_bitwise() -> None:
    """Optimizer first, ``opt.state`` read (the resumed step count printed), model second:
    before, the master took the fresh model's weights at the read (1.95e-3 off)."""
    ref = _uninterrupted(torch.bfloat16)
    weights, state = _saved(torch.bfloat16)
    model = _net(5, torch.bfloat16)
    opt = _opt(model)
    opt.load_state_dict(state)
    assert int(opt.state[model.blocks[0].weight]["step"]) == FIRST
    model.load_state_dict(weights)
    _train(model, opt, _data()[FIRST:])
    assert _bitwise(_weights(model, opt), ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_master_written_through_opt_state_after_a_load_is_kept(dtype: torch.dtype) -> None:
    """The write wins at the next step, as it does in a run that was never interrupted."""
    data = _data()
    model = _net(0, dtype)
    opt = _opt(model)
    _train(model, opt, data[:FIRST])
    weights, state = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    opt.state[model.blocks[1].weight]["master"].add_(0.25)
    _train(model, opt, data[FIRST:])
    ref = _weights(model, opt)
    model = _net(5, dtype)
    opt = _opt(model)
    model.load_state_dict(weights)
    opt.load_state_dict(state)
    opt.state[model.blocks[1].weight]["master"].add_(0.25)
    _train(model, opt, data[FIRST:])
    assert _bitwise(_weights(model, opt), ref)


# -- torch.distributed.checkpoint ---------------------------------------------------------


def _dcp_resume(path: Path, dtype: torch.dtype, rule: str = "adamw", **config: Any) -> Any:
    """torch's recipe: save after FIRST steps, then a fresh model and optimizer load it;
    returns the resumed model, its optimizer and the state the saving optimizer had."""
    model = _net(0, dtype)
    opt = _opt(model, rule, **config)
    _train(model, opt, _data()[:FIRST])
    msd, osd = get_state_dict(model, opt)
    saved = opt.state_dict()
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(path))
    opt.close()
    model = _net(5, dtype)
    opt = _opt(model, rule, **config)
    msd, osd = get_state_dict(model, opt)
    both = {"model": msd, "optim": osd}
    dcp.load(both, checkpoint_id=str(path))
    set_state_dict(model, opt, model_state_dict=both["model"], optim_state_dict=both["optim"])
    return model, opt, saved


@pytest.mark.parametrize("rule", ["adamw", "adagrad"])
def test_dcp_resumes_a_pending_update_bitwise(rule: str, tmp_path: Path) -> None:
    """Before, DCP dropped ``pending_update`` with the top-level key: the model resumed one
    update behind (1e-2 off after five steps)."""
    ref = _uninterrupted(torch.float32, rule, overlap_step=True)
    model, opt, saved = _dcp_resume(tmp_path, torch.float32, rule, overlap_step=True)
    assert saved["zero_offload"]["pending_update"]
    assert opt.state_dict()["zero_offload"]["pending_update"]
    assert all(GROUP_KEY not in group for group in opt.param_groups)  # torch's keys only
    _train(model, opt, _data()[FIRST:])
    assert _bitwise(_weights(model, opt), ref)


def test_dcp_resumes_the_fp16_loss_scaler_bitwise(tmp_path: Path) -> None:
    """Before, the scale restarted from the template's (131072 saved, 65536 loaded)."""
    ref = _uninterrupted(torch.float16, loss_scaler=SCALER)
    model, opt, saved = _dcp_resume(tmp_path, torch.float16, loss_scaler=SCALER)
    assert saved["zero_offload"]["loss_scaler"]["scale"] != SCALER.initial_scale
    assert opt.state_dict()["zero_offload"]["loss_scaler"] == saved["zero_offload"]["loss_scaler"]
    _train(model, opt, _data()[FIRST:])
    assert _bitwise(_weights(model, opt), ref)


def test_fields_in_a_group_are_believed_only_of_the_state_they_were_saved_with() -> None:
    """Ours (an update pending) into torch's AdamW, which keeps the group's key, steps and
    saves: the stale fields must not publish the old master over torch's weights."""
    weights, state = _saved(torch.float32, overlap_step=True)
    theirs = _net(5, torch.float32)
    theirs.load_state_dict(weights)
    torch_opt = torch.optim.AdamW(theirs.parameters(), lr=1e-2, weight_decay=0.1)
    del state["zero_offload"]  # torch keeps only state and param_groups
    torch_opt.load_state_dict(state)
    _train(theirs, torch_opt, _data()[FIRST : FIRST + 1])
    stepped = torch_opt.state_dict()
    assert GROUP_KEY in stepped["param_groups"][0]
    results = []
    for keep in (True, False):
        dict_ = copy.deepcopy(stepped)
        if not keep:
            del dict_["param_groups"][0][GROUP_KEY]
        model = _net(6, torch.float32)
        model.load_state_dict(theirs.state_dict())
        opt = _opt(model)
        opt.load_state_dict(dict_)
        assert not opt.state_dict()["zero_offload"]["pending_update"]
        _train(model, opt, _data()[FIRST + 1 :])
        results.append(_weights(model, opt))
    assert _bitwise(*results)


def test_flattened_dcp_warns_that_it_dropped_our_fields(tmp_path: Path) -> None:
    """A flattened dict is rebuilt from the loading optimizer's group keys: the fields are
    lost, and an optimizer that could have needed them says so."""
    model = _net(0, torch.float32)
    opt = _opt(model, overlap_step=True)
    _train(model, opt, _data()[:FIRST])
    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    msd, osd = get_state_dict(model, opt, options=flat)
    opt.close()
    model = _net(5, torch.float32)
    opt = _opt(model, overlap_step=True)
    with pytest.warns(UserWarning, match="flush_pending_update"):
        set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd, options=flat)
    opt.close()


# -- a pending update loaded under parameter offload ----------------------------------------


def _resumed(order: str, dtype: torch.dtype, weights: dict, state: dict, **config: Any) -> Any:
    model = _net(5, dtype)
    opt = _opt(model, **config)
    if order == "model_first":
        model.load_state_dict(weights)
    opt.load_state_dict(copy.deepcopy(state))
    if order == "optimizer_first":
        model.load_state_dict(weights)
    return model, opt


def test_a_pending_update_under_bf16_parameter_offload_resumes_alike_in_both_orders() -> None:
    """As without parameter offload: the first forward on the checkpoint's weights, its
    step publishes the update. Before, optimizer first lost the update (1.4e-2 off)."""
    weights, state = _saved(torch.bfloat16, overlap_step=True)
    model, opt = _resumed("model_first", torch.bfloat16, weights, state)
    _train(model, opt, _data()[FIRST:])
    plain = _weights(model, opt)
    for order in ("model_first", "optimizer_first"):
        model, opt = _resumed(order, torch.bfloat16, weights, state, offload_parameters=True)
        _train(model, opt, _data()[FIRST:])
        assert _bitwise(_weights(model, opt), plain), order


def test_a_pending_update_under_fp32_parameter_offload_refuses_the_order_that_lost_it() -> None:
    """fp32 parameters are the master there: the model loaded second erases the update, so
    the step refuses, naming the order that works; model first, it is as if flushed."""
    weights, state = _saved(torch.float32, overlap_step=True)
    model, opt = _resumed("optimizer_first", torch.float32, weights, state, offload_parameters=True)
    x, y = _data()[FIRST]
    ((model(x) - y) ** 2).mean().backward()
    with pytest.raises(ValueError, match="Load the model first, then the optimizer"):
        opt.step()
    opt.close()
    # model first: the update reaches the weights at the load, as flush_pending_update()
    # before the save would have put it there
    model = _net(0, torch.float32)
    opt = _opt(model, overlap_step=True)
    _train(model, opt, _data()[:FIRST])
    opt.flush_pending_update()
    flushed = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    opt.close()
    model, opt = _resumed("model_first", torch.float32, *flushed)
    _train(model, opt, _data()[FIRST:])
    ref = _weights(model, opt)
    model, opt = _resumed("model_first", torch.float32, weights, state, offload_parameters=True)
    _train(model, opt, _data()[FIRST:])
    assert _bitwise(_weights(model, opt), ref)
