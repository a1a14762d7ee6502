"""A clip in the middle of an accumulation window (Note [a clip in the middle of a window]
in optim/update/window_clip.py): torch scales the partial ``.grad`` sum in place, we bound
the window's sum at the step. Where the clip bound, ``step()`` refuses before anything
changes; where it did not, both are the unclipped step.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from zero_offload import OffloadAdamW, OffloadConfig
from zero_offload.integrations.accelerate import OffloadAccelerator

from .helpers.device import on_device, run_device
from .helpers.hf import tiny_gpt2
from .helpers.models import host_accelerator

MICRO = 2


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(8, 8).to(run_device())


def _batches() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [on_device(torch.randn(4, 8, generator=gen)) for _ in range(MICRO)]


def _window(model: nn.Module, opt: object, max_norm: float, *, every: bool) -> list[float]:
    """One window of ``MICRO`` backwards, clipped after each (``every``) or after the last."""
    norms = []
    for i, x in enumerate(_batches()):
        loss = model(x).square().mean()
        if isinstance(opt, OffloadAdamW):
            opt.backward(loss)
        else:
            loss.backward()
        if every or i == MICRO - 1:
            clip = opt.clip_grad_norm_ if isinstance(opt, OffloadAdamW) else None
            if clip is not None:
                norms.append(float(clip(max_norm)))
            else:
                norms.append(float(nn.utils.clip_grad_norm_(model.parameters(), max_norm)))
    return norms


def _weights(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.cuda_form
def test_a_binding_clip_before_the_last_backward_is_refused_and_changes_nothing() -> None:
    model = _model()
    opt = OffloadAdamW(model.parameters(), lr=1e-2, accelerator=host_accelerator())
    before = _weights(model)
    norms = _window(model, opt, 0.05, every=True)
    assert norms[0] > 0.05  # the first clip binds
    with pytest.raises(RuntimeError, match=r"clip_grad_norm_\(max_norm=0.05\) bound this window"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, _weights(model), strict=True))
    with pytest.raises(RuntimeError, match="after its backward 1"):
        opt.step()  # refused again: nothing was consumed
    opt.zero_grad()  # drops the window; the next one clipped once steps as torch's
    ref_model = _model()
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2)
    assert _window(model, opt, 0.05, every=False) == pytest.approx(
        _window(ref_model, ref, 0.05, every=False), rel=1e-6
    )
    opt.step()
    ref.step()
    for ours, theirs in zip(model.parameters(), ref_model.parameters(), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)
    opt.close()


@pytest.mark.cuda_form
def test_a_clip_that_did_not_bind_is_the_unclipped_step_as_in_torch() -> None:
    model, ref_model = _model(), _model()
    opt = OffloadAdamW(model.parameters(), lr=1e-2, accelerator=host_accelerator())
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2)
    assert _window(model, opt, 100.0, every=True) == pytest.approx(
        _window(ref_model, ref, 100.0, every=True), rel=1e-6
    )
    opt.step()
    ref.step()
    for ours, theirs in zip(model.parameters(), ref_model.parameters(), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)
    opt.close()


def test_a_clip_of_the_previous_window_is_not_taken_for_a_dropped_one() -> None:
    """A binding clip at the end of window 1 holds for its step; window 2's backwards and
    its own end-of-window clip do not make it a dropped one."""
    model = _model()
    opt = OffloadAdamW(model.parameters(), lr=1e-2, accelerator=host_accelerator())
    for _ in range(2):
        _window(model, opt, 0.05, every=False)
        opt.step()
        opt.step()  # a second step on the same clipped gradients, as torch allows
    opt.close()


def test_accelerate_clipping_every_micro_batch_is_refused_naming_sync_gradients() -> None:
    """accelerate's accumulate() without the sync_gradients check: torch's loop clips each
    partial sum; ours says so at the window's step instead of training elsewhere."""
    model = tiny_gpt2()
    opt = OffloadAdamW(model.parameters(), lr=1e-3, accelerator=host_accelerator())
    accelerator = OffloadAccelerator(cpu=True, gradient_accumulation_steps=2)
    model, opt = accelerator.prepare(model, opt)
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    with pytest.raises(RuntimeError, match=r"accelerator\.sync_gradients"):
        for _ in range(2):
            with accelerator.accumulate(model):
                accelerator.backward(model(input_ids=tokens, labels=tokens).loss)
                accelerator.clip_grad_norm_(model.parameters(), 0.01)
                opt.step()
                opt.zero_grad()


@pytest.mark.cuda_form
def test_a_step_announced_after_a_binding_clip_is_refused_and_nothing_is_announced() -> None:
    """The announced step would run during the next backward, which drops the clip."""
    model = _model()
    opt = OffloadAdamW(model.parameters(), lr=1e-2, accelerator=host_accelerator())
    first, second = _batches()
    opt.backward(model(first).square().mean())
    assert float(opt.clip_grad_norm_(0.05)) > 0.05
    with pytest.raises(RuntimeError, match=r"a step announced .* after clip_grad_norm_"):
        opt.backward(model(second).square().mean(), step=True)
    assert not opt.step_announced
    opt.zero_grad()
    opt.backward(model(first).square().mean(), step=True)  # unclipped: as torch's would be
    opt.step()
    opt.close()


def test_reading_the_norm_every_micro_batch_is_no_clip() -> None:
    """accelerate's clip_grad_norm_(..., inf) reads the norm (as torch's changes nothing);
    with OffloadConfig(max_grad_norm=...) bounding the window at the step, a read after each
    micro-batch is no clip in the middle of the window."""
    model = tiny_gpt2()
    opt = OffloadAdamW(
        model.parameters(),
        lr=1e-3,
        accelerator=host_accelerator(),
        config=OffloadConfig(max_grad_norm=0.05),
    )
    accelerator = OffloadAccelerator(cpu=True, gradient_accumulation_steps=2)
    model, opt = accelerator.prepare(model, opt)
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    for _ in range(4):
        with accelerator.accumulate(model):
            accelerator.backward(model(input_ids=tokens, labels=tokens).loss)
            assert float(accelerator.clip_grad_norm_(model.parameters(), float("inf"))) > 0.05
            opt.step()
            opt.zero_grad()
    assert opt.optimizer.skipped_steps == 0 and opt.optimizer.last_grad_norm > 0.05


def test_reading_the_norm_with_an_infinity_keeps_the_window_s_clip() -> None:
    """accelerate's clip_grad_norm_(..., inf), numpy's inf as float('inf'), reads the norm:
    a clip taken before it still bounds the step (as in torch, where the read changes
    nothing)."""
    import numpy as np

    def run(read: object) -> list[torch.Tensor]:
        model = tiny_gpt2()
        opt = OffloadAdamW(model.parameters(), lr=1e-3, accelerator=host_accelerator())
        accelerator = OffloadAccelerator(cpu=True)
        model, opt = accelerator.prepare(model, opt)
        tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
        accelerator.backward(model(input_ids=tokens, labels=tokens).loss)
        norm = float(accelerator.clip_grad_norm_(model.parameters(), 0.01))
        if read is not None:
            assert float(accelerator.clip_grad_norm_(model.parameters(), read)) == norm
        opt.step()
        return _weights(model)

    clipped = run(None)
    for read in (float("inf"), np.float64("inf")):
        assert all(torch.equal(a, b) for a, b in zip(run(read), clipped, strict=True))
