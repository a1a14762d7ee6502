"""An error raised inside a library hook reaches the user as itself (Note [errors raised
inside autograd hooks] in ``zero_offload/hook_errors.py``, issue 36).

On the H200 under ``TORCH_CUDA_SANITIZER=1`` the sanitizer's report, raised in activation
offload's unpack hook, surfaced as ``SystemError: run_backward returned NULL without setting
an exception``: the sanitizer's own trace hooks cleared it on the way out of autograd. A CPU
has no trace hooks, so these tests stand in for them by turning whatever backward raises
into that ``SystemError`` (``_as_the_sanitizer_reports_it``), and check that the library's
backward entry point raises the hook's error in its place.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

from zero_offload import (
    AcceleratorConfig,
    HostAccelerator,
    OffloadAdamW,
    OffloadConfig,
    hook_errors,
)
from zero_offload.activations import (
    ActivationOffloadConfig,
    ActivationOffloader,
    checkpoint,
    offload_activations,
)
from zero_offload.errors import StreamError, StreamRaceError

LOST = "<built-in method run_backward> returned NULL without setting an exception"


class HookFailed(Exception):
    """What a library hook raises in these tests."""


@pytest.fixture
def _as_the_sanitizer_reports_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every error out of autograd becomes the SystemError the H200 run showed."""
    original = torch.autograd.backward

    def lossy(*args, **kwargs):  # type: ignore[no-untyped-def]
        try:
            return original(*args, **kwargs)
        except BaseException:
            raise SystemError(LOST) from None

    monkeypatch.setattr(torch.autograd, "backward", lossy)


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh())


def _setup(**accelerator: object) -> tuple[nn.Sequential, OffloadAdamW, ActivationOffloader]:
    model = _model()
    opt = OffloadAdamW(
        model.parameters(),
        lr=1e-3,
        config=OffloadConfig(bucket_bytes=4096, tile_elements=1024),
        accelerator=HostAccelerator(AcceleratorConfig(device_budget="1GiB", **accelerator)),  # type: ignore[arg-type]
    )
    offloader = ActivationOffloader(
        manager=opt.manager,
        config=ActivationOffloadConfig(
            min_bytes=0, host_pool_bytes=1 << 20, device_pool_bytes=1 << 20
        ),
    )
    return model, opt, offloader


def _loss(model: nn.Sequential, offloader: ActivationOffloader) -> torch.Tensor:
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    with offload_activations(offloader=offloader):
        return model(x).square().sum()


def _failing_unpack(offloader: ActivationOffloader) -> None:
    def unpack(handle):  # type: ignore[no-untyped-def]
        raise HookFailed("unpack failed")

    offloader.unpack = unpack  # type: ignore[method-assign]


def test_on_cpu_a_hook_error_reaches_plain_backward_whole() -> None:
    """torch 2.13 on CPU hands the hook's own error to ``loss.backward()``, under torch's
    checkpoint too: the loss is CUDA's trace hooks', not autograd's."""
    model, opt, offloader = _setup()
    _failing_unpack(offloader)
    with pytest.raises(HookFailed, match="unpack failed"):
        _loss(model, offloader).backward()
    x = torch.randn(8, 16, requires_grad=True) * 2  # not a leaf: offloadable
    with pytest.raises(HookFailed, match="unpack failed"):
        checkpoint(model, x, offloader=offloader).sum().backward()
    opt.close()


@pytest.mark.usefixtures("_as_the_sanitizer_reports_it")
def test_opt_backward_raises_the_hooks_error_not_autograds() -> None:
    model, opt, offloader = _setup()
    _failing_unpack(offloader)
    with pytest.raises(SystemError, match="NULL without setting"):
        _loss(model, offloader).backward()  # no entry point of ours: what autograd says
    with pytest.raises(HookFailed, match="unpack failed") as raised:
        opt.backward(_loss(model, offloader))
    assert isinstance(raised.value.__context__, SystemError)  # what autograd made of it
    assert hook_errors._kept == []  # nothing kept once the entry point returned
    opt.close()


@pytest.mark.usefixtures("_as_the_sanitizer_reports_it")
def test_a_race_in_the_unpack_hook_reaches_opt_backward_as_the_race() -> None:
    """The H200's failure end to end, on the race checker: the view built on the compute
    stream (the old order) races with the copy back, and ``opt.backward`` raises the race
    report, not SystemError."""
    model, opt, offloader = _setup(check_races=True)
    accelerator = opt.manager.accelerator
    accelerator.stream_context = lambda stream: contextlib.nullcontext()  # type: ignore[method-assign]
    with pytest.raises(StreamRaceError, match="set_ building a reloaded activation's view"):
        opt.backward(_loss(model, offloader))
    with contextlib.suppress(StreamError, StreamRaceError):
        opt.close()


def test_an_error_outside_an_entry_point_is_not_kept() -> None:
    """A kept error holds its frames and their tensors: only a running entry point keeps."""

    @hook_errors.reported
    def hook() -> None:
        raise HookFailed("no entry point")

    with pytest.raises(HookFailed):
        hook()
    assert hook_errors._kept == []


def test_an_error_backward_raises_itself_is_raised_as_is() -> None:
    _, opt, _ = _setup()
    with pytest.raises(RuntimeError, match="does not require grad"):
        opt.backward(torch.zeros(()))
    opt.close()
