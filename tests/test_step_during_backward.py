"""Note [stepping during backward]: an announced step runs bucket by bucket while backward
goes on, bitwise equal to the ordinary step; a call between the announcement and step() (a
backward that raises, a second backward, state_dict, load_state_dict, add_param_group, a
gradient set by hand) either keeps training equal to torch.optim.AdamW (1e-5, fp32, as in
the parity tests) or is refused.

CUDA form (``cuda_form``): the tests that build through tests/helpers run on ``cuda:0`` under
``--accelerator=cuda`` (Note [no TF32 in the CUDA forms] in conftest.py: bitwise stays
bitwise). The eager-step test slows the host accelerator's simulated link and the profiler
test times it: host only."""

from __future__ import annotations

import copy
import time

import pytest
import torch
from torch import nn

from zero_offload import OffloadAdamW, OffloadConfig

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


class _SlowBackward(torch.autograd.Function):
    """Identity; its backward sleeps, like the device still busy with the first layers."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        time.sleep(0.3)
        return grad


def _loss(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    x = _SlowBackward.apply(model.embed(tokens))  # backward sleeps before the embedding
    for block in model.blocks:
        x = block(x)
    logits = model.head(model.norm(x))
    return nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


@pytest.mark.parametrize("micro", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_step_during_backward_is_bitwise_the_ordinary_step(
    dtype: torch.dtype, micro: int
) -> None:
    eager_model, plain_model = make_pair(dtype)
    # A slow simulated link: the gradient copies take long, so they and the CPU Adam of
    # the early buckets overlap the rest of backward.
    eager = offload_opt(eager_model, accelerator=host_accelerator(link_bandwidth=2e8))
    plain = offload_opt(plain_model)
    data = batches(3 * micro)
    shares = []
    for i in range(0, len(data), micro):
        chunk = data[i : i + micro]
        for j, (tokens, targets) in enumerate(chunk):
            eager.backward(_loss(eager_model, tokens, targets), step=j == len(chunk) - 1)
            plain.backward(_loss(plain_model, tokens, targets))
        eager.step()
        plain.step()
        shares.append(eager.share_stepped_during_backward)
        eager.zero_grad()
        plain.zero_grad()
    assert max_diff(eager_model, plain_model) == 0.0
    assert eager.state_dict()["state"][0]["step"] == plain.state_dict()["state"][0]["step"]
    # The head's buckets finished their CPU Adam while backward slept above the embedding.
    # On a loaded machine one step's host worker may not get a core within the 0.3 s sleep
    # (the first step also warms the kernels), so the overlap must show in some step, not
    # in every one; a step that never runs during backward gives 0.0 (or None) every time.
    assert all(share is not None for share in shares), shares
    assert max(shares) > 0.0, shares


@pytest.mark.cuda_form
def test_clipping_after_an_announced_step_is_refused() -> None:
    model, _ = make_pair()
    opt = offload_opt(model)
    opt.backward(lm_loss(model, *batches(1)[0]), step=True)
    with pytest.raises(RuntimeError, match=r"step ran during backward, unclipped"):
        opt.clip_grad_norm_(1.0)
    opt.step()


@pytest.mark.cuda_form
@pytest.mark.parametrize(
    ("config", "reason"),
    [
        ({"max_grad_norm": 1.0}, "clipping is configured"),
        ({"skip_nonfinite": True}, "an overflow could skip the step"),
        ({"overlap_step": True}, "overlap_step delays the update"),
        ({"offload_fraction": 0.0}, "resident on the device"),
    ],
)
def test_where_a_step_cannot_run_during_backward_it_runs_in_step(config: dict, reason: str) -> None:
    model, ref = make_pair()
    opt = offload_opt(model, **config)
    twin = offload_opt(ref, **config)
    tokens, targets = batches(1)[0]
    with pytest.warns(UserWarning, match=reason):
        opt.backward(lm_loss(model, tokens, targets), step=True)
    twin.backward(lm_loss(ref, tokens, targets))
    for o in (opt, twin):
        o.step()
        o.zero_grad()
        if config.get("overlap_step"):
            o.flush_pending_update()
    assert max_diff(model, ref) == 0.0


def _speculative_pair(dtype: torch.dtype, **config: object):
    spec_model, plain_model = make_pair(dtype)
    spec = offload_opt(spec_model, speculative_step=True, **config)
    plain = offload_opt(plain_model, **config)
    return spec_model, spec, plain_model, plain


@pytest.mark.cuda_form
@pytest.mark.parametrize(
    ("max_grad_norm", "speculation_bytes", "failures"),
    [
        (1e6, "1GiB", 0),  # configured, never binding: the speculation stands
        (1e-3, "1GiB", 3),  # binding every step: restored and stepped again
        (1e6, 40_000, 0),  # a small backup budget: the buckets beyond it wait for step()
    ],
)
def test_speculative_steps_are_bitwise_the_ordinary_step(
    max_grad_norm: float, speculation_bytes: int | str, failures: int
) -> None:
    spec_model, spec, plain_model, plain = _speculative_pair(
        torch.bfloat16, max_grad_norm=max_grad_norm, speculation_bytes=speculation_bytes
    )
    for tokens, targets in batches(3):
        spec.backward(_loss(spec_model, tokens, targets), step=True)
        plain.backward(_loss(plain_model, tokens, targets))
        for o in (spec, plain):
            o.step()
            o.zero_grad()
        assert spec.last_grad_norm == plain.last_grad_norm
    assert max_diff(spec_model, plain_model) == 0.0
    assert spec.speculation_failures == failures
    assert spec.share_stepped_during_backward is not None


@pytest.mark.cuda_form
def test_a_speculative_step_that_overflows_is_restored_and_skipped() -> None:
    spec_model, spec, plain_model, plain = _speculative_pair(torch.float16)
    poisoned = {"on": False}

    def poison(grad: torch.Tensor) -> torch.Tensor:
        return torch.full_like(grad, float("inf")) if poisoned["on"] else grad

    spec_model.embed.weight.register_hook(poison)  # the last gradient: after the others
    plain_model.embed.weight.register_hook(poison)
    for step, (tokens, targets) in enumerate(batches(3)):
        poisoned["on"] = step == 1
        spec.backward(lm_loss(spec_model, tokens, targets), step=True)
        plain.backward(lm_loss(plain_model, tokens, targets))
        for o in (spec, plain):
            o.step()
            o.zero_grad()
    assert spec.skipped_steps == plain.skipped_steps == 1
    assert spec.speculation_failures == 1
    assert spec.loss_scale == plain.loss_scale
    assert max_diff(spec_model, plain_model) == 0.0


def test_the_profiler_reports_the_share_and_the_rollbacks() -> None:
    from zero_offload import profile

    model, _ = make_pair(torch.bfloat16)
    opt = offload_opt(model, speculative_step=True, max_grad_norm=1e-3)
    with profile(opt, link_bandwidth=1e9, sample_rss=False) as prof:
        for tokens, targets in batches(2):
            opt.backward(_loss(model, tokens, targets), step=True)
            opt.step()
            opt.zero_grad()
            prof.step()
    notes = prof.to_dict()["step_notes"]
    assert notes["speculation_failures"] == 2  # clipping binds at 1e-3
    assert 0.0 < notes["share_stepped_during_backward"] <= 1.0
    assert "speculation failures 2" in prof.report()


def _forward(model, x, boom=False):
    h = model[0](x)
    if boom:

        def hk(g):
            raise RuntimeError("boom")

        h.register_hook(hk)
    for layer in list(model)[1:]:
        h = layer(h)
    return h


@pytest.mark.cuda_form
def test_announced_backward_that_raises_then_zero_grad_recovers():
    # An exact announced step keeps no backup: the buckets it stepped before the backward
    # raised stay stepped (counted, with a warning naming them), the others are not, and
    # the optimizer trains on normally afterwards.
    m = mlp()
    o = mlp_opt(m)
    D = mlp_batches(3)
    x, y = D[0]
    with pytest.raises(RuntimeError, match="boom"):
        o.backward(((_forward(m, x, True) - y) ** 2).mean(), step=True)
    with pytest.warns(UserWarning, match=r"buckets \[.*\] were stepped"):
        o.zero_grad()
    counts = {int(o.state[p]["step"]) for p in m.parameters()}
    assert counts == {0, 1}
    for x, y in D[1:]:
        o.backward(((_forward(m, x) - y) ** 2).mean(), step=True)
        o.step()
        o.zero_grad()
    assert {int(o.state[p]["step"]) for p in m.parameters()} == {2, 3}


@pytest.mark.cuda_form
def test_second_backward_after_announced_one_is_refused_or_counted():
    m = mlp()
    r = copy.deepcopy(m)
    o = mlp_opt(m)
    ro = mlp_torch_adamw(r)
    D = mlp_batches(2)
    o.backward(mlp_loss(m, *D[0]), step=True)
    try:
        mlp_loss(m, *D[1]).backward()
    except RuntimeError:
        return  # refused, as Note [stepping during backward] promises
    o.step()
    for x, y in D:
        mlp_loss(r, x, y).backward()
    ro.step()
    assert max_diff(m, r) < 1e-5, "the second backward's gradients were silently dropped"


@pytest.mark.cuda_form
def test_state_dict_between_announced_backward_and_step_does_not_double_step():
    m = mlp()
    r = copy.deepcopy(m)
    o = mlp_opt(m)
    ro = mlp_torch_adamw(r)
    x, y = mlp_batches(1)[0]
    o.backward(mlp_loss(m, x, y), step=True)
    o.state_dict()
    o.step()
    mlp_loss(r, x, y).backward()
    ro.step()
    assert int(o.state[next(m.parameters())]["step"]) == 1
    assert max_diff(m, r) < 1e-5


@pytest.mark.cuda_form
def test_load_state_dict_between_announced_backward_and_step():
    m = mlp()
    r = copy.deepcopy(m)
    o = mlp_opt(m)
    ro = mlp_torch_adamw(r)
    D = mlp_batches(4)
    for x, y in D[:2]:
        for mod, opt in ((m, o), (r, ro)):
            mlp_loss(mod, x, y).backward()
            opt.step()
            opt.zero_grad()
    sd, rsd, msd = (
        copy.deepcopy(o.state_dict()),
        copy.deepcopy(ro.state_dict()),
        copy.deepcopy(m.state_dict()),
    )
    for mod, opt in ((m, o), (r, ro)):
        mlp_loss(mod, *D[2]).backward()
        opt.step()
        opt.zero_grad()
    o.backward(mlp_loss(m, *D[3]), step=True)
    mlp_loss(r, *D[3]).backward()
    m.load_state_dict(msd)
    o.load_state_dict(sd)
    r.load_state_dict(msd)
    ro.load_state_dict(rsd)
    try:
        o.step()
    except RuntimeError:
        return  # a clear refusal would be acceptable
    ro.step()
    assert int(o.state[next(m.parameters())]["step"]) == 3
    assert max_diff(m, r) < 1e-5


@pytest.mark.cuda_form
def test_add_param_group_after_announce():
    from .helpers.models import host_accelerator

    m = mlp()
    ps = list(m.parameters())
    for p in ps[2:]:
        p.requires_grad_(False)
    o = OffloadAdamW(
        ps[:2], lr=1e-2, config=OffloadConfig(bucket_bytes=2048), accelerator=host_accelerator()
    )
    x, y = mlp_batches(1)[0]
    assert o.announce_step()
    for p in ps[2:]:
        p.requires_grad_(True)
    try:
        o.add_param_group({"params": ps[2:]})
    except RuntimeError:
        return  # a clear refusal is fine
    mlp_loss(m, x, y).backward()
    o.step()  # KeyError(1) today, forever after


@pytest.mark.cuda_form
def test_refused_eager_step_leaves_state_unchanged():
    m = mlp()
    r = copy.deepcopy(m)
    o = mlp_opt(m)
    ro = mlp_torch_adamw(r)
    x, y = mlp_batches(1)[0]
    o.backward(mlp_loss(m, x, y), step=True)
    p = next(m.parameters())
    p.grad = torch.zeros_like(p)
    with pytest.raises(RuntimeError, match="set by hand"):
        o.step()
    p.grad = None
    o.step()
    mlp_loss(r, x, y).backward()
    ro.step()
    assert max_diff(m, r) < 1e-5, "the announced update was applied twice"
