"""torch.compile around an offload optimizer, the ways users compile (found by a probe of
torch.compile beside torch): a forward and backward compiled together with the step outside
(Note [the router's hooks run eagerly] in ``optim/router.py``), and HF exports of a compiled
model (Note [a compiled model is its original module] in ``weights/checkpoint.py``).

Host accelerator only: compiling on CPU takes seconds per graph, so the models are tiny and
the steps few.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from torch._dynamo.utils import counters

from zero_offload import OffloadAdamW, OffloadConfig, load_pretrained, save_pretrained

from .helpers.models import host_accelerator

HYPER = {"lr": 1e-2, "betas": (0.9, 0.95), "weight_decay": 0.1}
MICRO = 2


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _data(steps: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    gen = torch.Generator().manual_seed(1)
    return [
        [(torch.randn(4, 8, generator=gen), torch.randn(4, 4, generator=gen)) for _ in range(MICRO)]
        for _ in range(steps)
    ]


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> None:
    torch._dynamo.reset()
    counters.clear()


@pytest.mark.parametrize("fraction", [1.0, 0.0])
@pytest.mark.parametrize("how", ["loss.backward", "opt.backward"])
def test_a_backward_inside_a_compiled_function_trains_like_torch(how: str, fraction: float) -> None:
    """It used to raise CaptureRefused at the first gradient's copy (the message blamed the
    step, kept outside), or, with nothing to copy (resident state), had dynamo compile the
    library's bookkeeping (18 graphs, the recompile limit hit)."""
    model = _mlp()
    ref = copy.deepcopy(model)
    config = OffloadConfig(offload_fraction=fraction, bucket_bytes=1024)
    opt = OffloadAdamW(model.parameters(), **HYPER, config=config, accelerator=host_accelerator())
    ropt = torch.optim.AdamW(ref.parameters(), **HYPER)

    def fwd_bwd(net: nn.Module, optimizer: torch.optim.Optimizer | None):
        def run(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            loss = (net(x) - y).square().mean() / MICRO
            if optimizer is None:
                loss.backward()
            else:
                optimizer.backward(loss)
            return loss.detach()

        return torch.compile(run)

    ours = fwd_bwd(model, opt if how == "opt.backward" else None)
    theirs = fwd_bwd(ref, None)
    for step in _data(3):
        for x, y in step:
            ours(x, y)
            theirs(x, y)
        opt.step()
        opt.zero_grad()
        ropt.step()
        ropt.zero_grad()
    for a, b in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert counters["stats"]["unique_graphs"] <= 6  # ours and torch's, with graph breaks
    opt.close()


def test_pretrained_exports_of_a_compiled_model_use_the_original_names(tmp_path: Path) -> None:
    """``save_pretrained(torch.compile(model))`` wrote every key under ``_orig_mod.`` (so
    transformers loaded a random model), and ``load_pretrained`` matched the same way (Note
    [a compiled model is its original module] in ``weights/checkpoint.py``)."""
    model = _mlp()
    compiled = torch.compile(model)
    opt = OffloadAdamW(compiled.parameters(), **HYPER, accelerator=host_accelerator())
    x, y = _data(1)[0][0]
    (compiled(x) - y).square().mean().backward()
    opt.step()
    files = save_pretrained(compiled, tmp_path, optimizer=opt)
    saved = load_file(files[0])
    assert saved.keys() == model.state_dict().keys()
    with torch.device("meta"):
        fresh = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    wrapped = torch.compile(fresh)
    assert load_pretrained(wrapped, tmp_path, accelerator=host_accelerator()) is wrapped
    reader = OffloadAdamW(wrapped.parameters(), **HYPER, accelerator=host_accelerator())
    for name, tensor in fresh.state_dict().items():
        assert torch.equal(tensor, model.state_dict()[name]), name
    reader.close()
    opt.close()


def test_pretrained_exports_of_compiled_blocks_use_the_original_names(tmp_path: Path) -> None:
    """Blocks compiled one by one put ``_orig_mod`` inside every name of theirs
    (``0._orig_mod.weight``): ``save_pretrained`` wrote those names, which no uncompiled
    model has, and ``load_pretrained`` matched none of them (Note [a compiled model is its
    original module] in ``weights/checkpoint.py``). Nothing here runs a compiled graph: the
    names come from the wrappers alone."""
    model = _mlp()
    plain_keys = list(model.state_dict().keys())
    model[0] = torch.compile(model[0])
    model[2] = torch.compile(model[2])
    assert any("_orig_mod" in key for key in model.state_dict())
    opt = OffloadAdamW(model.parameters(), **HYPER, accelerator=host_accelerator())
    files = save_pretrained(model, tmp_path, optimizer=opt)
    saved = load_file(files[0])
    assert list(saved.keys()) == plain_keys
    with torch.device("meta"):
        fresh = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    fresh[2] = torch.compile(fresh[2])  # compiled the other way: the names still match
    assert load_pretrained(fresh, tmp_path, accelerator=host_accelerator()) is fresh
    reader = OffloadAdamW(fresh.parameters(), **HYPER, accelerator=host_accelerator())
    for (name, tensor), key in zip(fresh.state_dict().items(), plain_keys, strict=True):
        assert torch.equal(tensor, saved[key]), name
    reader.close()
    opt.close()


@pytest.mark.parametrize("what", ["opt.step", "train_step"])
def test_a_compiled_step_runs_eagerly_and_steps_like_torch(what: str) -> None:
    """torch's docs compile the step (``torch.compile(opt.step)``, with a scheduler), or a
    whole train step calling it. Ours failed with dynamo's internal 'Guard failed on the
    same frame it was created', or CaptureRefused (Note [the step runs eagerly])."""
    model = _mlp()
    ref = copy.deepcopy(model)
    opt = OffloadAdamW(model.parameters(), **HYPER, accelerator=host_accelerator())
    ropt = torch.optim.AdamW(ref.parameters(), **HYPER)
    scheds = [
        torch.optim.lr_scheduler.LinearLR(o, start_factor=0.5, total_iters=3) for o in (opt, ropt)
    ]

    def compiled_for(net: nn.Module, optimizer: torch.optim.Optimizer, sched: object):
        if what == "opt.step":
            step = torch.compile(optimizer.step)

            def run(x: torch.Tensor, y: torch.Tensor) -> None:
                (net(x) - y).square().mean().backward()
                step()
                sched.step()
                optimizer.zero_grad()

            return run

        @torch.compile
        def train_step(x: torch.Tensor, y: torch.Tensor) -> None:
            (net(x) - y).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()

        def run(x: torch.Tensor, y: torch.Tensor) -> None:
            train_step(x, y)
            sched.step()

        return run

    ours, theirs = compiled_for(model, opt, scheds[0]), compiled_for(ref, ropt, scheds[1])
    for step in _data(3):
        x, y = step[0]
        ours(x, y)
        theirs(x, y)
    assert opt.param_groups[0]["lr"] == ropt.param_groups[0]["lr"]
    for a, b in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    opt.close()
