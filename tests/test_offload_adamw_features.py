"""fp16 loss scaling, offload_fraction, overlap_step, checkpoints, non-finite gradients.

CUDA form: every test builds through tests/helpers, so under ``--accelerator=cuda`` it runs
on ``cuda:0`` with the same tolerances (Note [no TF32 in the CUDA forms] in conftest.py).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

import zero_offload
from zero_offload import LossScalerConfig, OffloadAdamW, OffloadConfig

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
    mlp_train_both,
    offload_opt,
    torch_adamw,
    train,
)

pytestmark = pytest.mark.cuda_form

FP32_ATOL = 1e-5


def test_fp16_overflow_skips_the_step_and_lowers_the_scale_then_recovers() -> None:
    model, _ = make_pair(torch.float16)
    scaler = LossScalerConfig(initial_scale=2.0**10, growth_interval=2, hysteresis=1)
    opt = offload_opt(model, loss_scaler=scaler)
    assert opt.loss_scale == 2.0**10
    tokens, targets = batches(1)[0]
    opt.backward(lm_loss(model, tokens, targets))
    opt.step()
    opt.zero_grad()
    assert opt.skipped_steps == 0
    before = [p.detach().clone() for p in model.parameters()]
    # An overflow: one gradient is inf (as fp16 backward produces when the scale is too big).
    # (A .grad set by hand after the backward would be refused: Note [a gradient set by hand].)
    overflow = next(model.parameters()).register_hook(lambda g: torch.full_like(g, float("inf")))
    opt.backward(lm_loss(model, tokens, targets))
    overflow.remove()
    opt.step()
    opt.zero_grad()
    assert opt.skipped_steps == 1
    assert opt.loss_scale == 2.0**9
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    # Two clean steps grow the scale back.
    for _ in range(2):
        opt.backward(lm_loss(model, tokens, targets))
        opt.step()
        opt.zero_grad()
    assert opt.loss_scale == 2.0**10
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_fp16_hysteresis_tolerates_one_overflow() -> None:
    model, _ = make_pair(torch.float16)
    opt = offload_opt(model, loss_scaler=LossScalerConfig(initial_scale=256.0, hysteresis=2))
    first = next(model.parameters())
    for expected in (256.0, 128.0):
        first.grad = torch.full_like(first, float("nan"))
        opt.step()
        opt.zero_grad()
        assert opt.loss_scale == expected
    assert opt.skipped_steps == 2


@pytest.mark.parametrize("skip", [False, True])
def test_nonfinite_gradient_in_fp32_poisons_like_torch_unless_skipped(skip: bool) -> None:
    model, ref = make_pair()
    opt = offload_opt(model, skip_nonfinite=skip)
    ropt = torch_adamw(ref)
    for m, o in ((model, opt), (ref, ropt)):
        for p in m.parameters():
            p.grad = torch.ones_like(p)
        m.head.bias.grad[3] = float("nan")
        m.head.weight.grad[0, 0] = float("inf")
        if skip and o is opt:
            before = [p.detach().clone() for p in m.parameters()]
        o.step()
        o.zero_grad()
    if skip:
        assert opt.skipped_steps == 1
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
        return
    for a, b in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(torch.isnan(a), torch.isnan(b))
        assert torch.equal(torch.isinf(a), torch.isinf(b))


@pytest.mark.parametrize("fraction", [1.0, 0.0])
@pytest.mark.parametrize("clip", ["config", "method", "total"])
@pytest.mark.parametrize("bad", ["inf", "nan"])
def test_a_nonfinite_norm_clips_like_torch(bad: str, clip: str, fraction: float) -> None:
    """torch's coefficient of an infinite norm zeroes the gradients (the infinite element
    becomes NaN), of a NaN norm makes them all NaN; we used to clip nothing, stepping every
    finite gradient in full (Note [clipping by a total norm])."""
    model, ref = make_pair()
    config = {"max_grad_norm": 1.0} if clip == "config" else {}
    opt = offload_opt(model, offload_fraction=fraction, **config)
    ropt = torch_adamw(ref)
    for m in (model, ref):
        gen = torch.Generator().manual_seed(0)
        for p in m.parameters():
            p.grad = torch.randn(p.shape, generator=gen).to(p)
        m.head.weight.grad[0, 0] = float(bad)
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
    if clip == "method":
        opt.clip_grad_norm_(1.0)
    elif clip == "total":
        zero_offload.clip_grad_norm_([opt], 1.0)
    opt.step()
    ropt.step()
    for a, b in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(torch.isnan(a), torch.isnan(b))
        finite = ~torch.isnan(b)
        assert torch.allclose(a[finite], b[finite], rtol=1e-6, atol=1e-7)
    assert math.isnan(opt.last_grad_norm) == (bad == "nan")


@pytest.mark.parametrize("several", [False, True])
def test_error_if_nonfinite_raises_clipping_nothing_as_torchs(several: bool) -> None:
    """torch's ``error_if_nonfinite`` and ``foreach`` arguments used to be a TypeError."""
    model, _ = make_pair()
    opt = offload_opt(model)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    model.head.weight.grad[0, 0] = float("inf")
    clip = zero_offload.clip_grad_norm_ if several else type(opt).clip_grad_norm_
    with pytest.raises(RuntimeError, match=r"norm of order 2\.0 of the gradients is inf"):
        clip(opt, 1.0, error_if_nonfinite=True, foreach=True)
    assert opt._policy.clip.bound(opt._policy.router.backwards) is None  # nothing clipped
    assert math.isinf(float(clip(opt, 1.0, error_if_nonfinite=False, foreach=None)))


@pytest.mark.parametrize("fraction", [0.0, 0.5])
def test_offload_fraction_gives_the_same_training(fraction: float) -> None:
    model, ref = make_pair()
    full = offload_opt(ref, offload_fraction=1.0)
    part = offload_opt(model, offload_fraction=fraction)
    resident = sum(b.layout.numel for b in part.buckets if b.resident)
    total = sum(b.layout.numel for b in part.buckets)
    assert resident >= (1 - fraction) * total
    if fraction > 0:
        assert resident < total
    data = batches(10)
    train(model, part, data)
    train(ref, full, data)
    assert max_diff(model, ref) < FP32_ATOL


def test_resident_and_offloaded_agree_when_stepping_twice_on_one_gradient() -> None:
    model, ref = make_pair()
    resident = offload_opt(model, offload_fraction=0.0, max_grad_norm=0.01)
    offloaded = offload_opt(ref, offload_fraction=1.0, max_grad_norm=0.01)
    tokens, targets = batches(1)[0]
    for m, o in ((model, resident), (ref, offloaded)):
        lm_loss(m, tokens, targets).backward()
        o.step()
        o.step()  # same gradients again, as torch allows
    assert max_diff(model, ref) < 1e-5


def test_auto_offload_fraction_keeps_what_fits() -> None:
    model, _ = make_pair()
    numel = sum(p.numel() for p in model.parameters())
    roomy = offload_opt(model, offload_fraction="auto", accelerator=host_accelerator())
    assert all(b.resident for b in roomy.buckets)
    roomy.close()
    # A budget for the weights, the gradient buffers and about a third of the state.
    model, _ = make_pair()
    tight = offload_opt(
        model,
        offload_fraction="auto",
        auto_headroom=0.0,
        accelerator=host_accelerator(device_budget=4 * numel + 64 * 1024 + 6 * numel),
    )
    kinds = {b.resident for b in tight.buckets}
    assert kinds == {True, False}  # some buckets resident, some offloaded


def test_overlap_step_matches_a_hand_written_delayed_update() -> None:
    model, ref = make_pair()
    opt = offload_opt(model, overlap_step=True)
    # Reference (Note [delayed parameter update]): the weights the forward sees lag the
    # fp32 master by one update; the gradient of step k updates the master at step k and
    # reaches the forward's weights at step k+1.
    master = copy.deepcopy(ref)
    ropt = torch.optim.AdamW(master.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    pending = None
    for tokens, targets in batches(8):
        lm_loss(model, tokens, targets).backward()
        opt.step()
        opt.zero_grad()
        lm_loss(ref, tokens, targets).backward()
        if pending is not None:
            with torch.no_grad():
                for p, q in zip(ref.parameters(), pending, strict=True):
                    p.copy_(q)
        for p, q in zip(master.parameters(), ref.parameters(), strict=True):
            p.grad, q.grad = q.grad, None
        ropt.step()
        ropt.zero_grad()
        pending = [p.detach().clone() for p in master.parameters()]
        assert max_diff(model, ref) < FP32_ATOL
    opt.flush_pending_update()
    assert max_diff(model, master) < FP32_ATOL


def test_state_dict_save_20_load_continue_40_is_bitwise() -> None:
    data = batches(40)
    model, _ = make_pair()
    opt = offload_opt(model)
    train(model, opt, data)

    first, _ = make_pair()
    opt1 = offload_opt(first)
    train(first, opt1, data[:20])
    model_state = copy.deepcopy(first.state_dict())
    opt_state = copy.deepcopy(opt1.state_dict())
    assert set(opt_state["state"][0]) >= {"step", "exp_avg", "exp_avg_sq", "master"}

    resumed, _ = make_pair(seed=7)  # different initial weights: everything must come from disk
    resumed.load_state_dict(model_state)
    opt2 = offload_opt(resumed)
    opt2.load_state_dict(opt_state)
    train(resumed, opt2, data[20:])
    for a, b in zip(model.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)


def test_model_loaded_after_the_optimizer_refreshes_the_master() -> None:
    model, ref = make_pair()
    opt = offload_opt(model)
    other, _ = make_pair(seed=5)
    model.load_state_dict(other.state_dict())  # written behind the optimizer's back
    ref.load_state_dict(other.state_dict())
    ropt = torch_adamw(ref)
    data = batches(3)
    train(model, opt, data)
    train(ref, ropt, data)
    assert max_diff(model, ref) < FP32_ATOL


def test_torch_adamw_state_dict_loads() -> None:
    model, ref = make_pair()
    ropt = torch_adamw(ref)
    data = batches(6)
    train(ref, ropt, data[:3])
    model.load_state_dict(ref.state_dict())
    opt = offload_opt(model)
    opt.load_state_dict(ropt.state_dict())
    train(ref, ropt, data[3:])
    train(model, opt, data[3:])
    assert max_diff(model, ref) < FP32_ATOL


def test_amsgrad_true_after_load_is_honoured_or_refused():
    m = mlp()
    r = copy.deepcopy(m)
    D = mlp_batches(6)
    ro = torch.optim.AdamW(
        r.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, amsgrad=True
    )
    for x, y in D[:3]:
        mlp_loss(r, x, y).backward()
        ro.step()
        ro.zero_grad()
    m.load_state_dict(r.state_dict())
    o = mlp_opt(m)
    try:
        o.load_state_dict(copy.deepcopy(ro.state_dict()))
    except (ValueError, TypeError):
        return  # refused: fine
    mlp_train_both(m, o, r, ro, D[3:])
    assert max_diff(m, r) < 1e-5


def test_fp32_checkpoint_loads_into_an_fp16_optimizer_keeping_its_scaler() -> None:
    fp32, _ = make_pair()
    source = offload_opt(fp32)
    train(fp32, source, batches(1))
    half, _ = make_pair(torch.float16)
    opt = offload_opt(half)
    scale = opt.loss_scale
    state = source.state_dict()
    opt.load_state_dict(state)  # no scaler state in an fp32 checkpoint: keep the current one
    assert opt.loss_scale == scale


def test_add_param_group_after_construction() -> None:
    model, ref = make_pair()
    for m in (model, ref):
        m.head.requires_grad_(False)
    body = [p for p in model.parameters() if p.requires_grad]
    opt = OffloadAdamW(
        body,
        lr=1e-3,
        betas=(0.9, 0.95),
        weight_decay=0.1,
        config=OffloadConfig(bucket_bytes=8192, tile_elements=1024),
        accelerator=host_accelerator(),
    )
    ropt = torch.optim.AdamW(
        [p for p in ref.parameters() if p.requires_grad],
        lr=1e-3,
        betas=(0.9, 0.95),
        weight_decay=0.1,
    )
    data = batches(6)
    train(model, opt, data[:3])
    train(ref, ropt, data[:3])
    for m, o in ((model, opt), (ref, ropt)):
        m.head.requires_grad_(True)
        o.add_param_group({"params": list(m.head.parameters()), "lr": 2e-3})
    train(model, opt, data[3:])
    train(ref, ropt, data[3:])
    assert len(opt.param_groups) == 2
    assert max_diff(model, ref) < FP32_ATOL


def test_grad_norm_reads_the_norm_without_clipping() -> None:
    model, ref = make_pair()
    opt = offload_opt(model)
    twin = offload_opt(ref)
    tokens, targets = batches(1)[0]
    for m in (model, ref):
        lm_loss(m, tokens, targets).backward()
    norm = opt.grad_norm()
    assert norm.item() == pytest.approx(twin.clip_grad_norm_(1e-3).item(), rel=0, abs=0)
    opt.step()  # unclipped
    twin.step()  # clipped to 1e-3: far from the unclipped step
    ref_model, _ = make_pair()
    plain = offload_opt(ref_model)
    lm_loss(ref_model, tokens, targets).backward()
    plain.step()
    assert max_diff(model, ref_model) == 0.0
    assert max_diff(model, ref) > 0.0
