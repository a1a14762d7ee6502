"""``opt.state`` and state exchange as torch code drives them, against ``torch.optim.AdamW``.

- A fresh optimizer's ``opt.state`` is empty as a mapping (Note [opt.state is torch's before
  the first step] in ``optim/reports/live.py``), so torch's documented DCP resume
  (``get_state_dict`` -> ``dcp.load`` -> ``set_state_dict``) runs its fake step and loads the
  state into a new optimizer.
- Writes torch code makes to reset state apply (Note [writes through opt.state]), on one rank
  and on two gloo ranks (each rank its shard); bad writes are refused, changing nothing.
- DCP exchange with torch's AdamW both ways, nested and flattened (Notes [torch's
  implementation switches in a group] in ``optim/rule/values.py`` and [a field DCP rebuilt
  as {}] in ``optim/checkpoint/loaded_fields.py``).
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    get_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)

from zero_offload import OffloadAdafactor, OffloadAdagrad, OffloadAdamW, OffloadConfig

from .helpers.dist import free_port, join_gloo
from .helpers.models import batches, host_accelerator, lm_loss, make_pair, offload_opt, torch_adamw

STEPS = 8
EDIT_AT = 4
TOL = 1e-6  # the unedited runs differ by ~3e-8 (the kernels' rounding)


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, pairs: list) -> None:
    for tokens, targets in pairs:
        lm_loss(model, tokens, targets).backward()
        opt.step()
        opt.zero_grad()


def _max_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max(
        (p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters(), strict=True)
    )


def _build(kind: str, model: torch.nn.Module, **config: object) -> torch.optim.Optimizer:
    return torch_adamw(model) if kind == "torch" else offload_opt(model, **config)


def _reference(steps: int = STEPS) -> torch.nn.Module:
    """The uninterrupted torch run."""
    _, ref = make_pair()
    _train(ref, torch_adamw(ref), batches(steps))
    return ref


# -- issue: opt.state is empty before the first step, so DCP's resume loads ----------------


def test_a_fresh_optimizer_state_is_empty_as_torch_but_still_hands_out_views() -> None:
    model, ref = make_pair()
    opt, ropt = offload_opt(model), torch_adamw(ref)
    assert not opt.state and len(opt.state) == len(ropt.state) == 0
    p = model.head.weight
    assert p not in opt.state and list(opt.state) == []
    entry = opt.state[p]  # torch's defaultdict gives {}: ours gives the live views
    assert int(entry["step"]) == 0 and entry["exp_avg"].shape == p.shape
    _train(model, opt, batches(1))
    _train(ref, ropt, batches(1))
    assert len(opt.state) == len(ropt.state) == sum(1 for _ in model.parameters())
    assert p in opt.state
    opt.close()


def _saved(kind: str, data: list, path: Path) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A model trained ``EDIT_AT`` steps by ``kind``'s optimizer, saved with DCP at
    ``path``; the model and its optimizer."""
    model, _ = make_pair()
    opt = _build(kind, model)
    _train(model, opt, data[:EDIT_AT])
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(path))
    return model, opt


@pytest.mark.parametrize("kind", ["torch", "ours"])
def test_dcp_resume_into_a_fresh_optimizer_loads_the_state(kind: str, tmp_path: Path) -> None:
    """torch's documented recipe; before, the template of a fresh OffloadAdamW had no state
    keys and the resume silently started from step 0 (5.9e-2 off torch's)."""
    ref, data = _reference(), batches(STEPS)
    model, opt = _saved(kind, data, tmp_path)
    saved = {k: v.clone() for k, v in opt.state[model.head.weight].items()}

    fresh, _ = make_pair(seed=7)
    fresh_opt = _build(kind, fresh)
    msd2, osd2 = get_state_dict(fresh, fresh_opt)
    assert len(osd2["state"]) == sum(1 for _ in fresh.parameters())
    sd = {"model": msd2, "optim": osd2}
    dcp.load(sd, checkpoint_id=str(tmp_path))
    set_state_dict(fresh, fresh_opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    loaded = fresh_opt.state[fresh.head.weight]
    assert int(loaded["step"]) == EDIT_AT
    assert torch.equal(loaded["exp_avg"], saved["exp_avg"])
    _train(fresh, fresh_opt, data[EDIT_AT:])
    assert _max_diff(fresh, ref) < TOL


@pytest.mark.parametrize(
    "config",
    [{}, {"overlap_step": True}, {"nvme": True}],
    ids=["plain", "overlap_step", "nvme"],
)
def test_torch_fake_step_leaves_weights_bitwise_and_counts_one_step(
    config: dict, tmp_path: Path
) -> None:
    """``_init_optim_state``'s step (lr 0, zero gradients set by hand) moves no weight and
    counts 1 step, as torch's does; NVMe state then refuses the dict, naming the streaming
    calls. A stepped optimizer is not stepped again (see test_grad_lifecycle)."""
    if config.pop("nvme", False):
        config.update(nvme_dir=str(tmp_path), host_budget=0)
    model, ref = make_pair()
    opt, ropt = offload_opt(model, **config), torch_adamw(ref)
    before = [p.detach().clone() for p in model.parameters()]
    get_optimizer_state_dict(ref, ropt)
    if "nvme_dir" in config:
        with pytest.raises(RuntimeError, match="save_streaming"):
            get_optimizer_state_dict(model, opt)
    else:
        osd = get_optimizer_state_dict(model, opt)
        assert len(osd["state"]) == len(ropt.state)
        assert all(float(e["step"]) == 1 for e in osd["state"].values())
    opt.flush_pending_update()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert all(torch.equal(a, b) for a, b in zip(before, ref.parameters(), strict=True))
    assert {int(s) for bucket in opt.buckets for s in bucket.steps} == {1}  # NVMe: no views
    assert all(float(ropt.state[p]["step"]) == 1 for p in ref.parameters())
    assert all(p.grad is None for p in model.parameters())
    opt.close()


# -- issue: writes through opt.state apply, as torch's -----------------------------------


def _edit(opt: torch.optim.Optimizer, p: torch.Tensor, how: str) -> None:
    state = opt.state[p]
    if how == "assign_exp_avg":
        state["exp_avg"] = torch.zeros_like(p)
    elif how == "assign_step":
        state["step"] = torch.tensor(0.0)
    elif how == "update":
        state.update(exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
    elif how == "clear":
        state.clear()
    elif how == "assign_entry":
        opt.state[p] = {}
    elif how == "del_entry":
        del opt.state[p]
    elif how == "reset_all":
        opt.state = defaultdict(dict)


@pytest.mark.parametrize(
    "how",
    ["assign_exp_avg", "assign_step", "update", "clear", "assign_entry", "del_entry", "reset_all"],
)
def test_state_writes_apply_as_torchs(how: str) -> None:
    model, ref = make_pair()
    opt, ropt = offload_opt(model), torch_adamw(ref)
    for i, (tokens, targets) in enumerate(batches(STEPS)):
        if i == EDIT_AT:
            _edit(opt, model.head.weight, how)
            _edit(ropt, ref.head.weight, how)
        for m, o in ((model, opt), (ref, ropt)):
            lm_loss(m, tokens, targets).backward()
            o.step()
            o.zero_grad()
    assert _max_diff(model, ref) < TOL
    steps = opt.state_dict()["state"]
    rsteps = ropt.state_dict()["state"]
    assert {k: float(v["step"]) for k, v in steps.items()} == {
        k: float(v["step"]) for k, v in rsteps.items()
    }
    opt.close()


def test_bad_state_writes_are_refused_and_change_nothing() -> None:
    model, _ = make_pair()
    opt = offload_opt(model)
    _train(model, opt, batches(2))
    p = model.head.weight
    saved = opt.state_dict()
    state = opt.state[p]
    with pytest.raises(TypeError, match=r"no field 'momentum_buffer'.*'exp_avg'.*load_state_dict"):
        state["momentum_buffer"] = torch.zeros_like(p)
    with pytest.raises(TypeError, match=r"cannot lose its field 'exp_avg'.*load_state_dict"):
        del state["exp_avg"]
    with pytest.raises(ValueError, match=r"shape \(3,\)"):
        state["exp_avg"] = torch.zeros(3)
    with pytest.raises(TypeError, match="floating dtype"):
        state["exp_avg"] = torch.zeros_like(p, dtype=torch.int64)
    with pytest.raises(ValueError, match="'step' must be a whole number >= 0"):
        state["step"] = -1
    with pytest.raises(ValueError, match="'step' must be a whole number >= 0"):
        state["step"] = 1.5
    with pytest.raises(TypeError, match="no field 'bogus'"):  # checked first: nothing written
        state.update(exp_avg=torch.zeros_like(p), bogus=torch.zeros_like(p))
    with pytest.raises(TypeError, match="must be a tensor"):
        opt.state[p] = {"exp_avg": 0.0}
    with pytest.raises(TypeError, match=r"can only be reset.*load_state_dict"):
        opt.state = {p: {}}
    with pytest.raises(TypeError, match=r"can only be reset.*load_state_dict"):
        opt.state = [1]
    after = opt.state_dict()["state"]
    for index, entry in saved["state"].items():
        assert all(torch.equal(v, after[index][k]) for k, v in entry.items())
    opt.announce_step()
    lm_loss(model, *batches(1)[0]).backward()
    with pytest.raises(RuntimeError, match=r"step is announced.*call step\(\) first"):
        state["exp_avg"] = torch.zeros_like(p)
    opt.step()
    opt.close()
    with pytest.raises(RuntimeError, match="after close"):
        state.clear()


# -- found by a review of the state API -----------------------------------------------------


def test_dcp_between_a_backward_and_the_first_step_runs_no_fake_step() -> None:
    """torch skips its fake step where a ``.grad`` exists; ours are in the buckets, so the
    fake step ran over the window's gradients, was refused, and left ``lr`` at 0."""
    model, ref = make_pair()
    opt, ropt = offload_opt(model), torch_adamw(ref)
    data = batches(2)
    for m in (model, ref):
        lm_loss(m, *data[0]).backward()
    get_optimizer_state_dict(model, opt)
    get_optimizer_state_dict(ref, ropt)
    assert opt.param_groups[0]["lr"] == ropt.param_groups[0]["lr"] > 0
    for m, o in ((model, opt), (ref, ropt)):
        o.step()
        o.zero_grad()
        _train(m, o, data[1:])
    assert _max_diff(model, ref) < TOL
    opt.close()


def test_a_step_count_written_zero_keeps_its_entry_as_torchs() -> None:
    """``step = 0`` with the moments kept: the entry left the mapping and the next
    ``state_dict()`` (the written moments lost at a save), where torch keeps it."""
    model, ref = make_pair()
    opt, ropt = offload_opt(model), torch_adamw(ref)
    data = batches(1)
    _train(model, opt, data)
    _train(ref, ropt, data)
    for m, o in ((model, opt), (ref, ropt)):
        o.state[m.head.weight]["step"] = torch.tensor(0.0)
        o.state[m.head.weight]["exp_avg"] = torch.ones_like(m.head.weight)
    assert model.head.weight in opt.state and ref.head.weight in ropt.state
    ours, theirs = opt.state_dict()["state"], ropt.state_dict()["state"]
    assert ours.keys() == theirs.keys()
    index = next(i for i, q in enumerate(model.parameters()) if q is model.head.weight)
    assert float(ours[index]["step"]) == 0 and bool((ours[index]["exp_avg"] == 1).all())
    fresh, _ = make_pair()
    again = offload_opt(fresh)
    again.load_state_dict(opt.state_dict())
    assert fresh.head.weight in again.state
    opt.state[model.head.weight].clear()
    assert model.head.weight not in opt.state
    again.close()
    opt.close()


def test_pop_returns_the_state_as_it_was() -> None:
    """``MutableMapping.pop`` read the live views after resetting them: zeros."""
    model, ref = make_pair()
    opt, ropt = offload_opt(model), torch_adamw(ref)
    data = batches(1)
    _train(model, opt, data)
    _train(ref, ropt, data)
    ours, theirs = opt.state.pop(model.head.weight), ropt.state.pop(ref.head.weight)
    assert int(ours["step"]) == int(theirs["step"]) == 1
    torch.testing.assert_close(ours["exp_avg"], theirs["exp_avg"])
    assert model.head.weight not in opt.state and int(opt.state[model.head.weight]["step"]) == 0
    opt.close()


def test_moving_the_state_to_the_cpu_copies_nothing_and_changes_nothing() -> None:
    """Lightning's teardown (``_optimizer_to_device(opt, "cpu")``) writes every entry back as
    itself: a host view moved to the CPU is the view, so nothing is copied (Note [a view
    written onto itself]); a write of anything else still copies."""
    from torch.utils._python_dispatch import TorchDispatchMode

    moves = pytest.importorskip("lightning.fabric.utilities.optimizer")

    class CountCopies(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.copies = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.copies += func is torch.ops.aten.copy_.default
            return func(*args, **(kwargs or {}))

    model, ref = make_pair()
    opt, ropt = offload_opt(model), torch_adamw(ref)
    data = batches(2)
    _train(model, opt, data[:1])
    _train(ref, ropt, data[:1])
    before = {name: t.clone() for name, t in opt.state[model.head.weight].items()}
    with CountCopies() as counted:
        moves._optimizer_to_device(opt, torch.device("cpu"))
    assert counted.copies == 0
    after = opt.state[model.head.weight]
    assert all(torch.equal(after[name], t) for name, t in before.items())
    with CountCopies() as counted:
        opt.state[model.head.weight]["exp_avg"] = before["exp_avg"] * 1  # another tensor
    assert counted.copies == 1
    _train(model, opt, data[1:])
    _train(ref, ropt, data[1:])
    assert _max_diff(model, ref) < TOL
    opt.close()


def test_writes_that_read_the_entry_itself_apply_as_torchs() -> None:
    """``update`` swapping two fields, and a field written as a negated view of itself
    (``torch._neg_view``: the same memory, negated lazily): as torch's dict holds them."""
    model, ref = make_pair()
    opt, ropt = offload_opt(model), torch_adamw(ref)
    data = batches(2)
    _train(model, opt, data[:1])
    _train(ref, ropt, data[:1])
    for m, o in ((model, opt), (ref, ropt)):
        entry = o.state[m.head.weight]
        entry.update({"exp_avg": entry["exp_avg_sq"], "exp_avg_sq": entry["exp_avg"]})
        o.state[m.blocks[0].linear1.weight]["exp_avg"] = torch._neg_view(
            o.state[m.blocks[0].linear1.weight]["exp_avg"]
        )
    for name in ("exp_avg", "exp_avg_sq"):
        torch.testing.assert_close(
            opt.state[model.head.weight][name], ropt.state[ref.head.weight][name]
        )
    torch.testing.assert_close(
        opt.state[model.blocks[0].linear1.weight]["exp_avg"],
        ropt.state[ref.blocks[0].linear1.weight]["exp_avg"].resolve_neg(),
    )
    opt.close()


# -- two gloo ranks: each rank writes its shard ------------------------------------------


def _sharded_writes(rank: int, world: int, port: int, out: str) -> None:
    join_gloo(rank, world, port)
    model, _ = make_pair()
    opt = offload_opt(model)
    for tokens, targets in batches(2, batch=2 * world):
        per = tokens.shape[0] // world
        mine = slice(rank * per, (rank + 1) * per)
        opt.backward(lm_loss(model, tokens[mine], targets[mine]))
        opt.step()
        opt.zero_grad()
    head, embed = model.head.weight, model.embed.weight
    opt.state[head]["exp_avg"] = torch.ones_like(head)  # whole-shaped: this rank's piece
    piece = opt.state[head]["exp_avg_sq"]
    opt.state[head]["exp_avg_sq"] = torch.full_like(piece, 2.0)  # piece-shaped
    opt.state[embed].clear()
    sd = opt.state_dict()
    index = {id(p): i for i, p in enumerate(model.parameters())}
    result = {
        "head": {k: v for k, v in sd["state"][index[id(head)]].items()},
        "embed_listed": index[id(embed)] in sd["state"],
        "len": len(opt.state),
        "params": sum(1 for _ in model.parameters()),
    }
    opt.state = {}
    result["len_after_reset"] = len(opt.state)
    result["steps_after_reset"] = [int(opt.state[p]["step"]) for p in model.parameters()]
    torch.save(result, Path(out) / f"r{rank}.pt")
    opt.close()
    os._exit(0)


def test_writes_on_two_ranks_apply_to_each_ranks_shard(tmp_path: Path) -> None:
    mp.spawn(_sharded_writes, args=(2, free_port(), str(tmp_path)), nprocs=2)
    for rank in range(2):
        got = torch.load(tmp_path / f"r{rank}.pt", weights_only=False)
        assert torch.equal(got["head"]["exp_avg"], torch.ones_like(got["head"]["exp_avg"]))
        assert torch.equal(got["head"]["exp_avg_sq"], torch.full_like(got["head"]["exp_avg_sq"], 2))
        assert float(got["head"]["step"]) == 2
        assert not got["embed_listed"]  # cleared: step 0, as torch lists no such entry
        assert got["len"] == got["params"] - 1
        assert got["len_after_reset"] == 0 and set(got["steps_after_reset"]) == {0}


# -- issue: DCP exchange with torch's AdamW ----------------------------------------------

_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


@pytest.mark.parametrize(("src", "dst"), [("ours", "torch"), ("torch", "ours")])
def test_dcp_checkpoints_cross_between_torch_and_ours(src: str, dst: str, tmp_path: Path) -> None:
    """A torch checkpoint lacks our ``master``: loading one into ours needs
    ``allow_partial_load`` (docs/checkpoints.md); the master then comes from the weights."""
    ref, data = _reference(), batches(STEPS)
    _saved(src, data, tmp_path)
    fresh, _ = make_pair(seed=7)
    fresh_opt = _build(dst, fresh)
    msd2, osd2 = get_state_dict(fresh, fresh_opt)
    sd = {"model": msd2, "optim": osd2}
    planner = DefaultLoadPlanner(allow_partial_load=dst == "ours")
    dcp.load(sd, checkpoint_id=str(tmp_path), planner=planner)
    set_state_dict(fresh, fresh_opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    _train(fresh, fresh_opt, data[EDIT_AT:])
    assert _max_diff(fresh, ref) < TOL


@pytest.mark.parametrize(("src", "dst"), [("ours", "torch"), ("torch", "ours"), ("ours", "ours")])
def test_flattened_state_dicts_cross_between_torch_and_ours(src: str, dst: str) -> None:
    ref, data = _reference(), batches(STEPS)
    model, _ = make_pair()
    opt = _build(src, model)
    _train(model, opt, data[:EDIT_AT])
    osd = get_optimizer_state_dict(model, opt, options=_FLAT)
    fresh, _ = make_pair()
    fresh.load_state_dict(model.state_dict())
    fresh_opt = _build(dst, fresh)
    set_optimizer_state_dict(fresh, fresh_opt, osd, options=_FLAT)
    _train(fresh, fresh_opt, data[EDIT_AT:])
    assert _max_diff(fresh, ref) < TOL


@pytest.mark.parametrize(
    ("ours", "theirs"),
    [
        (OffloadAdamW, torch.optim.AdamW),
        (OffloadAdagrad, torch.optim.Adagrad),
        (OffloadAdafactor, torch.optim.Adafactor),
    ],
)
def test_groups_hold_torchs_keys(ours: Callable, theirs: Callable) -> None:
    model, ref = make_pair()
    opt = ours(model.parameters(), accelerator=host_accelerator())
    assert set(opt.param_groups[0]) == set(theirs(ref.parameters()).param_groups[0])
    assert set(opt.defaults) == set(theirs(ref.parameters()).defaults)
    opt.close()


def test_torch_switches_refused_in_a_group_and_taken_from_a_loaded_dict() -> None:
    model, ref = make_pair()
    opt = OffloadAdamW([model.embed.weight], config=OffloadConfig(), accelerator=host_accelerator())
    for key, value in (("fused", True), ("capturable", True), ("differentiable", True)):
        with pytest.raises(ValueError, match=rf"{key}={value} is not supported"):
            opt.add_param_group({"params": [model.head.weight], key: value})
    assert len(opt.param_groups) == 1
    opt.close()
    model, ref = make_pair()
    opt = offload_opt(model)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    _train(ref, ropt, batches(1))
    saved = ropt.state_dict()
    saved["param_groups"][0].update(fused=True, foreach=True)  # a fused torch run's dict
    opt.load_state_dict(saved)
    group = opt.param_groups[0]
    assert (group["fused"], group["foreach"], group["capturable"]) == (None, None, False)
    saved["param_groups"][0]["fused"] = "yes"
    with pytest.raises(TypeError, match="'fused' must be None or a bool"):
        opt.load_state_dict(saved)
    opt.close()
