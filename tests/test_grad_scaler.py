"""torch's ``GradScaler`` beside an offload optimizer (Note [torch's GradScaler cannot see our
gradients] in ``optim/torch_grad_scaler.py``): an enabled one is refused before it touches
anything, naming the optimizer's own loss scaling; a disabled one passes through; and fp16
autocast over fp32 weights, scaled by the optimizer (``LossScalerConfig(autocast_fp16=True)``),
trains as torch's ``autocast`` + ``GradScaler`` recipe does, overflows and skipped steps
included.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from zero_offload import LossScalerConfig, OffloadAdamW, OffloadConfig

from .helpers.models import host_accelerator

LR, BETAS, WD = 1e-2, (0.9, 0.95), 0.1


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 8))


def _data(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 16, generator=gen), torch.randn(4, 8, generator=gen)) for _ in range(n)]


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.float16):
        out = model(x)
    return (out.float() - y).square().mean()


def _ours(model: nn.Module, **scaler: object) -> OffloadAdamW:
    config = OffloadConfig(
        bucket_bytes=2048, tile_elements=1024, loss_scaler=LossScalerConfig(**scaler)
    )
    return OffloadAdamW(
        model.parameters(),
        lr=LR,
        betas=BETAS,
        weight_decay=WD,
        config=config,
        accelerator=host_accelerator(),
    )


@pytest.mark.parametrize("method", ["unscale_", "step"])
def test_an_enabled_grad_scaler_is_refused_naming_the_optimizers_own_scaling(
    method: str,
) -> None:
    """It used to unscale nothing (``unscale_``) or fail with torch's bare 'No inf checks
    were recorded for this optimizer' (``step``)."""
    model = _mlp()
    opt = _ours(model)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    x, y = _data(1)[0]
    scaler.scale(_loss(model, x, y)).backward()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=f"GradScaler.{method}") as info:
        getattr(scaler, method)(opt)
    message = str(info.value)
    assert "opt.backward(loss)" in message and "autocast_fp16=True" in message
    assert "Nothing was unscaled or stepped" in message
    assert id(opt) not in scaler._per_optimizer_states  # torch's scaler never saw it
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    opt.close()


def test_a_disabled_grad_scaler_passes_through_as_torchs_does() -> None:
    """``GradScaler(enabled=False)``, the bf16 setting of an fp16-ready loop."""
    model = _mlp()
    ref = copy.deepcopy(model)
    opt = _ours(model)
    ropt = torch.optim.AdamW(ref.parameters(), lr=LR, betas=BETAS, weight_decay=WD)
    for net, optimizer in ((model, opt), (ref, ropt)):
        scaler = torch.amp.GradScaler("cpu", enabled=False)
        for x, y in _data(3):
            scaler.scale((net(x) - y).square().mean()).backward()
            scaler.unscale_(optimizer)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
    for a, b in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    opt.close()


def test_fp16_autocast_over_fp32_weights_scales_like_torchs_grad_scaler() -> None:
    """The same schedule (hysteresis 1 is GradScaler's) from a scale too large to start
    with: the first steps overflow and are skipped, the scale backs off, then grows every
    ``growth_interval`` clean steps; weights and scales equal torch's throughout."""
    steps, growth = 14, 3
    model = _mlp()
    ref = copy.deepcopy(model)
    opt = _ours(model, initial_scale=2.0**24, growth_interval=growth, hysteresis=1,
                autocast_fp16=True)  # fmt: skip
    ropt = torch.optim.AdamW(ref.parameters(), lr=LR, betas=BETAS, weight_decay=WD)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24, growth_interval=growth)
    skipped = 0
    for x, y in _data(steps):
        assert opt.loss_scale == scaler.get_scale()
        opt.backward(_loss(model, x, y))
        opt.step()
        opt.zero_grad()
        scaler.scale(_loss(ref, x, y)).backward()
        before = scaler.get_scale()
        scaler.step(ropt)
        scaler.update()
        ropt.zero_grad()
        skipped += scaler.get_scale() < before
    assert opt.skipped_steps == skipped > 0
    assert opt.loss_scale == scaler.get_scale()
    for a, b in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    opt.close()


def test_autocast_fp16_must_be_a_bool() -> None:
    with pytest.raises(TypeError, match="autocast_fp16 must be True or False, got str 'yes'"):
        LossScalerConfig(autocast_fp16="yes")  # type: ignore[arg-type]


def test_in_flight_staging_is_refused_with_the_autocast_scaler() -> None:
    """A scaler that may skip a step keeps every step in ``step()``, as fp16 parameters do."""
    config = OffloadConfig(
        grad_staging="in_flight", loss_scaler=LossScalerConfig(autocast_fp16=True)
    )
    with pytest.raises(ValueError, match=r"autocast_fp16=True\) brings a loss scaler"):
        OffloadAdamW(_mlp().parameters(), config=config, accelerator=host_accelerator())
