"""What a plain training loop does by hand, beside torch's AdamW: each either matches torch or
is refused (or, where the step already ran, warned) loudly; before, each trained on
silently apart from torch, or failed with an unrelated error.

- a ``.grad`` set by hand after a backward gave that parameter its gradient (Note [a
  gradient set by hand] in ``optim/router.py``): torch steps the ``.grad`` set, we stepped
  the sum; now refused, nothing taken. On a parameter no backward reached, it is stepped
  as torch steps it;
- a parameter or a group taken out of ``param_groups`` by hand: torch stops stepping it, we
  stepped it on (or raised ``IndexError``); now refused before anything changes;
- hyper-parameters changed, or ``zero_grad()`` called in place of ``step()``, after an
  announced step ran during backward (Note [stepping during backward] in
  ``optim/update/eager.py``): warned, naming what changed;
- pickling or copying the optimizer: a ``TypeError`` naming ``state_dict()``;
- torch's state-dict hooks (Note [torch's state-dict hooks] in
  ``optim/checkpoint/torch_hooks.py``): run in torch's order with torch's contract, also
  with parameter offload, whose own load pre-hook had the wrong signature, and through a
  consolidated checkpoint of two ranks.
"""

from __future__ import annotations

import copy
import io
import os
import pickle
import warnings
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from zero_offload import OffloadAdamW, OffloadConfig

from .helpers.dist import free_port, join_gloo
from .helpers.models import (
    batches,
    host_accelerator,
    lm_loss,
    make_pair,
    max_diff,
    mlp,
    mlp_batches,
    mlp_loss,
    mlp_opt,
    mlp_torch_adamw,
    offload_opt,
)


def _weights(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def test_a_grad_set_after_backward_is_refused_and_one_set_alone_matches_torch() -> None:
    model, ref = mlp(), mlp()
    opt, ropt = mlp_opt(model), mlp_torch_adamw(ref)
    (x, y), (x2, y2) = mlp_batches(2)
    mlp_loss(model, x, y).backward()
    first = next(model.parameters())
    mine = torch.full_like(first, 0.5)
    first.grad = mine
    before = _weights(model)
    with pytest.raises(RuntimeError, match=r"parameter 0 .* set by hand after a backward"):
        opt.step()
    assert first.grad is mine  # left where it was, nothing taken
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    # Dropping the window first is what torch's replacement means: the step sees .grad only.
    opt.zero_grad()
    first.grad = mine.clone()
    opt.step()
    ref_first = next(ref.parameters())
    ref_first.grad = mine.clone()
    ropt.step()
    assert max_diff(model, ref) < 1e-6
    # A parameter no backward reached in the window: its hand-set .grad adds to the step as
    # torch's .grad would (the others have theirs from the backward).
    opt.zero_grad()
    ropt.zero_grad()
    last = list(model.parameters())[-1]
    with torch.no_grad():
        loss, rloss = mlp_loss(model, x2, y2), mlp_loss(ref, x2, y2)
    assert loss.item() == rloss.item()
    # Freeze the last layer for the backward, then hand it a gradient.
    for m in (model, ref):
        list(m.parameters())[-1].requires_grad_(False)
    mlp_loss(model, x2, y2).backward()
    mlp_loss(ref, x2, y2).backward()
    for m in (model, ref):
        tail = list(m.parameters())[-1]
        tail.requires_grad_(True)
        tail.grad = torch.full_like(tail, -0.25)
    opt.step()
    ropt.step()
    assert last.grad is None
    assert max_diff(model, ref) < 1e-6
    opt.close()


def test_parameters_or_groups_taken_out_of_param_groups_are_refused() -> None:
    model = mlp()
    params = list(model.parameters())
    opt = offload_opt(model, lr=1e-2)
    opt.param_groups[0]["params"].remove(params[0])
    (x, y) = mlp_batches(1)[0]
    mlp_loss(model, x, y).backward()
    before = _weights(model)
    with pytest.raises(ValueError, match=r"parameter 0 .* no longer in param group 0's"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    opt.param_groups[0]["params"].insert(0, params[0])  # put back: it steps
    opt.step()
    assert not torch.equal(before[0], params[0])
    opt.close()
    # A whole group taken out.
    model = mlp()
    params = list(model.parameters())
    opt = OffloadAdamW(
        [{"params": params[:2]}, {"params": params[2:], "lr": 1e-3}],
        lr=1e-2,
        accelerator=host_accelerator(),
    )
    del opt.param_groups[1]
    mlp_loss(model, x, y).backward()
    with pytest.raises(ValueError, match=r"param group 1 of .* was removed from param_groups"):
        opt.step()
    opt.close()


def test_changes_after_an_announced_step_are_warned() -> None:
    model, ref = mlp(), mlp()
    opt, ropt = mlp_opt(model), mlp_torch_adamw(ref)
    x, y = mlp_batches(1)[0]
    opt.backward(mlp_loss(model, x, y), step=True)
    opt.param_groups[0]["lr"] = 0.0  # a scheduler stepped before the optimizer
    with pytest.warns(
        UserWarning, match=r"param group 0's hyper-parameters changed .*lr 0.01 -> 0.0"
    ):
        opt.step()
    # The step ran with the announced lr: torch's step at that lr.
    mlp_loss(ref, x, y).backward()
    ropt.step()
    assert max_diff(model, ref) < 1e-6
    # zero_grad() in place of step(): the step ran during backward and is kept, aloud.
    opt.param_groups[0]["lr"] = 1e-2
    opt.zero_grad()
    ropt.zero_grad()
    opt.backward(mlp_loss(model, x, y), step=True)
    with pytest.warns(UserWarning, match=r"zero_grad\(\) after an announced backward"):
        opt.zero_grad()
    mlp_loss(ref, x, y).backward()
    ropt.step()
    assert max_diff(model, ref) < 1e-6
    # An unchanged announced step says nothing.
    opt.backward(mlp_loss(model, x, y), step=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.step()
        opt.zero_grad()
    opt.close()


def test_pickling_or_copying_the_optimizer_names_state_dict() -> None:
    model = mlp()
    opt = mlp_opt(model)
    for attempt in (
        lambda: pickle.dumps(opt),
        lambda: copy.deepcopy(opt),
        lambda: copy.copy(opt),
        lambda: torch.save(opt, io.BytesIO()),
    ):
        with pytest.raises(TypeError, match=r"cannot be pickled or copied.*opt\.state_dict\(\)"):
            attempt()
    x, y = mlp_batches(1)[0]
    opt.backward(mlp_loss(model, x, y))
    opt.step()  # still trains
    opt.close()


def _record(opt: torch.optim.Optimizer, calls: list[str]) -> None:
    """Register the four state-dict hooks of torch's Optimizer on ``opt``, recording calls;
    the save's post-hook adds a key, the load's pre-hook changes the lr it loads."""

    def saved(o: torch.optim.Optimizer, sd: dict) -> dict:
        calls.append("save_post")
        return {**sd, "mine": 7}

    def loading(o: torch.optim.Optimizer, sd: dict) -> dict:
        calls.append("load_pre")
        assert sd.pop("mine") == 7  # our key, taken off before the optimizer reads the rest
        groups = [{**g, "lr": 0.125} for g in sd["param_groups"]]
        return {**sd, "param_groups": groups}

    opt.register_state_dict_pre_hook(lambda o: calls.append("save_pre"))
    opt.register_state_dict_post_hook(saved)
    opt.register_load_state_dict_pre_hook(loading)
    opt.register_load_state_dict_post_hook(lambda o: calls.append("load_post"))


@pytest.mark.parametrize("offload_parameters", [False, True])
def test_torch_state_dict_hooks_run_as_torch_runs_them(offload_parameters: bool) -> None:
    model, ref = make_pair()
    config = {"offload_parameters": True} if offload_parameters else {}
    extra = {"model": model} if offload_parameters else {}
    if extra:
        opt = OffloadAdamW(model.parameters(), lr=1e-3, config=OffloadConfig(**config),
                           accelerator=host_accelerator(), **extra)  # fmt: skip
    else:
        opt = offload_opt(model)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    calls: dict[str, list[str]] = {"ours": [], "torch": []}
    _record(opt, calls["ours"])
    _record(ropt, calls["torch"])
    for m, o in ((model, opt), (ref, ropt)):
        tokens, targets = batches(1)[0]
        lm_loss(m, tokens, targets).backward()
        o.step()
        o.zero_grad()
    saved, rsaved = opt.state_dict(), ropt.state_dict()
    assert saved["mine"] == rsaved["mine"] == 7
    opt.load_state_dict(saved)
    ropt.load_state_dict(rsaved)
    assert calls["ours"] == calls["torch"] == ["save_pre", "save_post", "load_pre", "load_post"]
    assert opt.param_groups[0]["lr"] == ropt.param_groups[0]["lr"] == 0.125
    assert "mine" in saved  # the caller's dict is left as it was
    opt.close()


def _consolidated_with_hooks(rank: int, world: int, port: int, out: str) -> None:
    from zero_offload.checkpoint_io import load_consolidated, save_consolidated

    join_gloo(rank, world, port)
    model, _ = make_pair()
    opt = offload_opt(model)
    calls: list[str] = []
    _record(opt, calls)
    tokens, targets = batches(1)[0]
    opt.backward(lm_loss(model, tokens, targets))
    opt.step()
    opt.zero_grad()
    path = Path(out) / "opt.pt"
    save_consolidated(opt, path)
    load_consolidated(opt, path)  # the load pre-hook finds the post-hook's key
    torch.save({"calls": calls, "lr": opt.param_groups[0]["lr"]}, Path(out) / f"r{rank}.pt")
    opt.close()
    os._exit(0)


def test_the_hooks_keys_survive_a_consolidated_checkpoint_of_two_ranks(tmp_path: Path) -> None:
    """Each rank's state_dict() runs the hooks; the merge on rank 0 keeps what they added
    (it rebuilt only torch's keys and ours: the load pre-hook found no key)."""
    mp.spawn(_consolidated_with_hooks, args=(2, free_port(), str(tmp_path)), nprocs=2)
    assert torch.load(tmp_path / "opt.pt", weights_only=True)["mine"] == 7
    for rank in range(2):
        found = torch.load(tmp_path / f"r{rank}.pt")
        assert found["calls"][-2:] == ["load_pre", "load_post"], found
        assert found["lr"] == 0.125
