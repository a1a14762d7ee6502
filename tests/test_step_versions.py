"""A step moves the version counters of the parameters it updates, as torch's in-place step
does (Note [a step moves the version counters] in ``views/param_views.py``): a backward
through a graph saved before the step is refused by autograd, as under torch, instead of
mixing old activations with new weights; an announced step refuses, naming itself, a
backward that reads a weight it already stepped; and ``clip_grad_norm_(inf)`` measures
without clipping, as torch's."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from zero_offload import OffloadAdamW

from .helpers.models import (
    max_diff,
    mlp,
    mlp_batches,
    mlp_loss,
    mlp_opt,
    mlp_torch_adamw,
    offload_opt,
    torch_adamw,
)

STALE = "modified by an inplace operation"


@pytest.mark.parametrize("overlap", [False, True], ids=["step", "overlap_step"])
def test_a_backward_through_a_graph_saved_before_the_step_is_refused(overlap: bool) -> None:
    """Two losses of one forward; the first's backward, a step, then the second's backward
    through the retained graph (a GAN stepping D, then G's loss through D's graph). torch
    refuses it; before, ours ran it silently, on old activations and stepped weights."""
    model = mlp()
    ref = copy.deepcopy(model)
    x, y = mlp_batches(1)[0]
    for m, opt in ((ref, mlp_torch_adamw(ref)), (model, mlp_opt(model, overlap_step=overlap))):
        out = m(x)
        first, second = ((out - y) ** 2).mean(), out.abs().mean()
        first.backward(retain_graph=True)
        opt.step()
        with pytest.raises(RuntimeError, match=STALE):
            second.backward()
        if isinstance(opt, OffloadAdamW):
            opt.close()


def test_a_step_moves_only_the_stepped_parameters_and_no_write_is_seen() -> None:
    """A parameter no gradient reached keeps its counter (torch skips it), and the versions
    the write check keeps move with the step's (a counter the step moved is not a write:
    nothing is reconciled, the run stays torch's)."""
    model = mlp()
    ref = copy.deepcopy(model)
    opt, ropt = mlp_opt(model), mlp_torch_adamw(ref)
    frozen = model[0].bias
    for (x, y), step in zip(mlp_batches(4), range(4), strict=True):
        for m, o in ((model, opt), (ref, ropt)):
            o.zero_grad()
            m[0].bias.requires_grad_(step % 2 == 1)  # no gradient on even steps
            mlp_loss(m, x, y).backward()
            before = frozen._version
            o.step()
            if o is opt:
                moved = frozen._version - before
                assert moved == (1 if step % 2 == 1 else 0)
                assert all(not b.views.changed_params() for b in opt.buckets)
    assert max_diff(model, ref) < 1e-6
    opt.close()


class _ReadsDetached(nn.Module):
    """``w`` gets its gradient from one use, early in backward; its value is read later
    through ``w.detach()``, outside that gradient's path."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(16, 16)
        self.w = nn.Parameter(torch.randn(16, 16) * 0.2)
        self.o = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(torch.tanh(self.a(x)) @ self.w.detach())
        return self.o(h) + (x @ self.w).mean() * 0.1


def test_an_announced_step_refuses_a_backward_that_reads_a_stepped_weight() -> None:
    """With ``backward(step=True)`` the bucket of ``w`` is stepped while backward still has
    to read ``w`` (through the detached use). Before, that read took the stepped weight: 2e-2
    off torch after 8 steps, without a word. Now the backward raises, naming the announced
    step and what to do, with torch's own refusal as its cause; a plain backward matches
    torch."""
    model = _ReadsDetached()
    opt = offload_opt(model, lr=1e-2, bucket_bytes=1024)  # w's bucket is not the last
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    with pytest.raises(RuntimeError, match=r"announced step ran during this backward") as info:
        opt.backward(((model(x) - y) ** 2).mean(), step=True)
    assert STALE in str(info.value.__cause__)
    assert "backward() without step=True" in str(info.value)
    with pytest.warns(UserWarning, match="keep that step"):
        opt.zero_grad()
    opt.close()
    model, ref = _ReadsDetached(), _ReadsDetached()
    opt = offload_opt(model, lr=1e-2, bucket_bytes=1024)
    ropt = torch_adamw(ref, lr=1e-2)
    for _ in range(4):
        for m, o in ((model, opt), (ref, ropt)):
            o.zero_grad()
            ((m(x) - y) ** 2).mean().backward()
            o.step()
    assert max_diff(model, ref) < 1e-6
    opt.close()


def test_clip_grad_norm_inf_measures_and_clips_nothing() -> None:
    """``clip_grad_norm_(inf)``, torch's idiom for logging the norm: the norm, and a step as
    if unclipped. Before, refused ("max_norm must be a finite number > 0") although torch's
    guard sends ``clip_grad_norm_`` calls here."""
    model = mlp()
    ref = copy.deepcopy(model)
    opt, ropt = mlp_opt(model), mlp_torch_adamw(ref)
    for x, y in mlp_batches(3):
        for m, o in ((model, opt), (ref, ropt)):
            o.zero_grad()
            mlp_loss(m, x, y).backward()
        norm = opt.clip_grad_norm_(float("inf"))
        want = torch.nn.utils.clip_grad_norm_(ref.parameters(), float("inf"))
        torch.testing.assert_close(norm, want, rtol=1e-6, atol=0)
        opt.step()
        ropt.step()
    assert max_diff(model, ref) < 1e-6
    with pytest.raises(ValueError, match="max_norm must be a number > 0"):
        opt.clip_grad_norm_(float("nan"))
    opt.close()
