"""A weight write made between a step and a checkpoint survives the resume, in either load
order (Note [weights written outside the optimizer] in views/param_views.py, and Note
[a loaded state claims no weights] in optim/checkpoint/state_dict.py): step, write under
``no_grad`` (an EMA swap, a re-init), save model and optimizer, resume, step on; the result
is bitwise the uninterrupted run's. Consolidated and streaming checkpoints, ``overlap_step``
on and off, and parameter offload.

CUDA form (``cuda_form``): the model, the data and the accelerator come from
tests/helpers/device.py, so under ``--accelerator=cuda`` all of it runs on ``cuda:0``,
bitwise as on the host (Note [no TF32 in the CUDA forms] in conftest.py)."""

from __future__ import annotations

import pytest
import torch

from zero_offload import OffloadAdamW, OffloadConfig
from zero_offload.demo.model import GPTConfig, TinyGPT

from .helpers.device import on_device, run_accelerator, run_device

VOCAB, SEQ = 64, 16
MODES = ["plain", "overlap", "param_offload"]

pytestmark = pytest.mark.cuda_form


def _model(seed: int) -> TinyGPT:
    torch.manual_seed(seed)
    config = GPTConfig(vocab_size=VOCAB, seq_len=SEQ, layers=3, hidden=32, heads=4)
    return TinyGPT(config).to(run_device(), torch.bfloat16)


def _opt(model: TinyGPT, mode: str) -> OffloadAdamW:
    extra = {"model": model} if mode == "param_offload" else {}
    return OffloadAdamW(
        model.parameters(),
        lr=1e-2,
        betas=(0.9, 0.95),
        weight_decay=0.1,
        config=OffloadConfig(
            bucket_bytes=8192,
            tile_elements=1024,
            overlap_step=mode == "overlap",
            offload_parameters=mode == "param_offload",
        ),
        accelerator=run_accelerator(device_budget="64MiB"),
        **extra,
    )


def _steps(model: TinyGPT, opt: OffloadAdamW, seeds: range) -> None:
    for seed in seeds:
        gen = torch.Generator().manual_seed(seed)
        ids = on_device(torch.randint(0, VOCAB, (2, SEQ), generator=gen))
        model(ids, ids).backward()
        opt.step()
        opt.zero_grad()


def _write(model: TinyGPT) -> None:
    """What a user writes between steps: a re-initialised layer and a scaled one, through
    the parameter and through ``.data`` (no version counter moves for the latter)."""
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        first = model.blocks[0].mlp[0].weight
        first.copy_(torch.randn(first.shape, generator=gen).to(first.device, first.dtype))
    model.blocks[2].mlp[2].weight.data.mul_(-0.5)


def _finish(model: TinyGPT, opt: OffloadAdamW) -> dict[str, torch.Tensor]:
    opt.close()  # lands a pending delayed update
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _uninterrupted(mode: str) -> dict[str, torch.Tensor]:
    model = _model(0)
    opt = _opt(model, mode)
    _steps(model, opt, range(3))
    _write(model)
    _steps(model, opt, range(3, 6))
    return _finish(model, opt)


@pytest.mark.parametrize("order", ["model_first", "optimizer_first"])
@pytest.mark.parametrize("kind", ["consolidated", "streaming"])
@pytest.mark.parametrize("mode", MODES)
def test_a_write_before_the_save_survives_the_resume(tmp_path, mode, kind, order) -> None:
    want = _uninterrupted(mode)
    model = _model(0)
    opt = _opt(model, mode)
    _steps(model, opt, range(3))
    _write(model)
    model_state = {name: value.clone() for name, value in model.state_dict().items()}
    if kind == "consolidated":
        opt_state = opt.state_dict()
    else:
        opt.save_streaming(tmp_path / "ckpt")
    opt.close()

    resumed = _model(1)  # another initialisation: everything comes from the checkpoint
    ropt = _opt(resumed, mode)

    def load_optimizer() -> None:
        if kind == "consolidated":
            ropt.load_state_dict(opt_state)
        else:
            ropt.load_streaming(tmp_path / "ckpt")

    if order == "model_first":
        resumed.load_state_dict(model_state)
        load_optimizer()
    else:
        load_optimizer()
        resumed.load_state_dict(model_state)
    _steps(resumed, ropt, range(3, 6))
    got = _finish(resumed, ropt)
    for name, value in want.items():
        assert torch.equal(got[name], value), (name, (got[name] - value).abs().max())
