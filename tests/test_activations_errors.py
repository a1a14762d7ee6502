"""Activation offload: bad input fails early with the value and the fix; checkpoint arguments."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.conftest import make_accelerator
from zero_offload.activations import (
    ActivationOffloadConfig,
    ActivationOffloader,
    checkpoint,
    offload_activations,
)


def small_offloader(**config: object) -> ActivationOffloader:
    config.setdefault("min_bytes", 0)
    config.setdefault("host_pool_bytes", 1 << 20)
    config.setdefault("device_pool_bytes", 1 << 20)
    return ActivationOffloader(
        accelerator=make_accelerator("host"),
        config=ActivationOffloadConfig(**config),  # type: ignore[arg-type]
    )


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("prefetch_depth", -1, r"prefetch_depth must be an int in \[0, 1024\], got -1"),
        ("prefetch_depth", 1.5, "prefetch_depth"),
        ("min_bytes", -5, "min_bytes"),
        ("host_pool_bytes", 100, r"host_pool_bytes must be >= 512 bytes, got 100"),
        ("device_pool_bytes", "lots", "device_pool_bytes"),
        ("max_offloads_in_flight", -1, "max_offloads_in_flight"),
        ("tier", "nvme", r"tier must be one of \('host',\), got 'nvme'"),
    ],
)
def test_config_rejects_bad_values(field: str, value: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ActivationOffloadConfig(**{field: value})  # type: ignore[arg-type]


def test_config_parses_byte_strings() -> None:
    config = ActivationOffloadConfig(min_bytes="64KiB", host_pool_bytes="1MiB")
    assert (config.min_bytes, config.host_pool_bytes) == (64 << 10, 1 << 20)


@pytest.mark.parametrize("field", ["min_bytes", "host_pool_bytes", "device_pool_bytes"])
def test_a_byte_string_without_a_unit_is_refused(field: str) -> None:
    """``"64"`` read as 64 bytes would offload every activation (``min_bytes``) or make a
    pool of nothing: a string needs its unit, as OffloadConfig's byte fields do."""
    with pytest.raises(ValueError, match=rf"ActivationOffloadConfig.{field}='64' has no unit"):
        ActivationOffloadConfig(**{field: "64"})  # type: ignore[arg-type]
    offloader = small_offloader()
    refused = pytest.raises(ValueError, match="min_bytes='64' has no unit")
    with refused, offload_activations(offloader=offloader, min_bytes="64"):  # type: ignore[arg-type]
        pass
    offloader.close()


def test_tensor_on_another_device_is_refused() -> None:
    offloader = small_offloader()
    weight = torch.randn(8, 8, requires_grad=True)
    with pytest.raises(ValueError, match=r"device meta .* works on cpu"):  # noqa: SIM117
        with offload_activations(offloader=offloader):
            (torch.randn(8, 8, device="meta") * weight.to("meta")).sum()


def test_non_tensor_output_is_refused() -> None:
    offloader = small_offloader()
    x = torch.randn(4, 4) * 1.0
    with pytest.raises(TypeError, match=r"returned int 3, which holds no tensor"):
        checkpoint(lambda t: 3, x, offloader=offloader)


def test_activation_larger_than_pool_is_refused() -> None:
    offloader = small_offloader(device_pool_bytes=4096)
    x = torch.randn(64, 64) * 1.0  # 16 KiB
    with pytest.raises(MemoryError, match=r"device_pool_bytes to at least 16384"):
        checkpoint(nn.Linear(64, 64), x, offloader=offloader)


def test_host_pool_full_names_the_setting() -> None:
    offloader = small_offloader(host_pool_bytes=64 << 10)
    layer = nn.Linear(64, 64)
    x = torch.randn(64, 64) * 1.0  # 16 KiB per input; five do not fit 64 KiB
    with pytest.raises(MemoryError, match=r"host_pool_bytes \(now 65536\)"):
        outs = [checkpoint(layer, x + i, offloader=offloader) for i in range(5)]
        del outs


def test_use_reentrant_true_is_refused() -> None:
    with pytest.raises(ValueError, match="use_reentrant"):
        checkpoint(
            nn.Linear(2, 2), torch.randn(2, 2), offloader=small_offloader(), use_reentrant=True
        )


def test_manager_and_accelerator_must_agree() -> None:
    offloader = small_offloader()
    with pytest.raises(ValueError, match=r"differs from manager\.accelerator"):
        ActivationOffloader(manager=offloader.manager, accelerator=make_accelerator("host"))


def test_checkpoint_arguments_match_torch() -> None:
    """Non-tensor args, kwargs, nested tuples, inputs without grad, tuple outputs, dropout."""
    torch.manual_seed(0)
    lin = nn.Linear(16, 16)
    offloader = small_offloader(prefetch_depth=2)

    def fn(pair, scale, *, bias, mask=None):  # type: ignore[no-untyped-def]
        a, (b, c) = pair
        h = nn.functional.dropout(lin(a) * scale + b, p=0.3) + bias
        return h * mask, c.sum() * h.mean()

    def grads(use_ours: bool) -> list[torch.Tensor]:
        lin.zero_grad(set_to_none=True)
        a = torch.randn(8, 16, generator=torch.Generator().manual_seed(1)) * 1.0
        b = torch.randn(8, 16, generator=torch.Generator().manual_seed(2))  # no grad
        c = a.detach().clone().requires_grad_()
        mask = torch.ones(8, 16)
        torch.manual_seed(7)
        args = ((a, (b, c)), 0.5)
        kwargs = {"bias": torch.full((16,), 0.1), "mask": mask}
        if use_ours:
            h, s = checkpoint(fn, *args, offloader=offloader, **kwargs)
        else:
            h, s = torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False, **kwargs)
        (h.square().sum() + s).backward()
        return [lin.weight.grad, lin.bias.grad, c.grad]  # type: ignore[list-item]

    expected = grads(False)
    for actual, want in zip(grads(True), expected, strict=True):
        assert torch.equal(actual, want)
    assert offloader.stats()["offloaded_tensors"] >= 4  # a, b, bias, mask left the device


def test_a_device_pool_over_the_budget_is_refused_naming_the_setting() -> None:
    """The documented one-liner reserves ActivationOffloadConfig's default pools (256 MiB on
    the device): on a small budget the refusal names device_pool_bytes, the one setting that
    fixes it, besides the budget; nothing stays reserved."""
    from zero_offload.errors import DeviceBudgetExceeded

    accelerator = make_accelerator("host", device_budget="16MiB")
    with pytest.raises(DeviceBudgetExceeded, match=r"device_pool_bytes \(now 268435456"):
        ActivationOffloader(
            accelerator=accelerator, config=ActivationOffloadConfig(host_pool_bytes=1 << 20)
        )
    assert accelerator.memory_stats()["in_use"] == 0
    small = ActivationOffloader(
        accelerator=accelerator,
        config=ActivationOffloadConfig(host_pool_bytes=1 << 20, device_pool_bytes="4MiB"),
    )
    small.close()
