"""Note [stepping during backward]: an announced step runs bucket by bucket while backward
goes on, bitwise equal to the ordinary step."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from ._models import batches, host_accelerator, lm_loss, make_pair, max_diff, offload_opt


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
    assert all(share is not None and share > 0.0 for share in shares), shares


def test_clipping_after_an_announced_step_is_refused() -> None:
    model, _ = make_pair()
    opt = offload_opt(model)
    opt.backward(lm_loss(model, *batches(1)[0]), step=True)
    with pytest.raises(RuntimeError, match=r"step ran during backward, unclipped"):
        opt.clip_grad_norm_(1.0)
    opt.step()


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
