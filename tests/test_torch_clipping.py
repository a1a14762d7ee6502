"""Note [torch's clipping cannot see our gradients]: torch's clipping on OffloadAdamW's
parameters raises before clipping anything; on other parameters it is torch's own."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from .helpers.models import batches, lm_loss, make_pair, max_diff, offload_opt, torch_adamw


def test_torch_clip_grad_norm_on_our_parameters_is_refused_and_changes_nothing() -> None:
    model, ref = make_pair()
    opt = offload_opt(model)
    untouched, _ = make_pair()
    (tokens, targets), (tokens2, targets2) = batches(2)
    opt.backward(lm_loss(model, tokens, targets))
    with pytest.raises(RuntimeError, match=r"clip_grad_norm_ on parameters that .*Nothing was clipped.*opt\.clip_grad_norm_"):  # fmt: skip
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    with pytest.raises(RuntimeError, match="clip_grad_value_ on parameters that"):
        torch.nn.utils.clip_grad_value_(list(model.parameters()), 0.1)
    with pytest.raises(RuntimeError, match="clip_grad_norm_ on parameters that"):
        torch.nn.utils.clip_grad.clip_grad_norm_(next(model.parameters()), 1.0)
    # The refused calls changed nothing: the step is torch's unclipped step.
    opt.step()
    ropt = torch_adamw(ref)
    lm_loss(ref, tokens, targets).backward()
    ropt.step()
    assert max_diff(model, ref) < 1e-5
    assert max_diff(untouched, ref) > 0  # (the comparison can see a step)
    # After close() the parameters are nobody's: torch's own clip runs (on no gradients).
    opt.close()
    lm_loss(model, tokens2, targets2).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    assert norm.item() > 0


def test_torch_clipping_on_other_parameters_is_torchs_own() -> None:
    torch.manual_seed(0)
    ours, theirs = nn.Linear(4, 4), nn.Linear(4, 4)
    opt = offload_opt(ours)
    expected = nn.Linear(4, 4)
    expected.load_state_dict(theirs.state_dict())
    x = torch.randn(3, 4)
    for model in (theirs, expected):
        model(x).square().sum().backward()
    norm = torch.nn.utils.clip_grad_norm_((p for p in theirs.parameters()), 0.5)  # a generator
    # torch's own function, on a copy: the same norm and the same clipped gradients
    import torch.nn.utils.clip_grad as clip_grad

    reference = clip_grad.clip_grad_norm_.__wrapped__(list(expected.parameters()), 0.5)
    assert torch.equal(norm, reference)
    for a, b in zip(theirs.parameters(), expected.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)
    torch.nn.utils.clip_grad_value_(theirs.parameters(), 0.01)
    assert all(p.grad.abs().max() <= 0.01 for p in theirs.parameters())
    opt.close()


# accelerate, Trainer, Lightning and Fabric: tests/test_clipping_guards.py
