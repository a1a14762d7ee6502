"""Note [a backward carries the loss scale]: with fp16 parameters (the dynamic loss scaler) a
gradient from a backward that did not carry the scale is refused at its hook, naming the
fix, and nothing of that backward reaches the optimizer; ``opt.backward(loss)`` and a
backward inside ``opt.scaled_backward()`` carry it, and match the scaled torch reference.
bf16 and fp32 models keep their plain ``loss.backward()``.

CUDA form: built through tests/helpers (on CUDA the hooks run on autograd's device threads,
which is why the mark is shared by every thread).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from .helpers.device import run_device
from .helpers.models import mlp, mlp_batches, mlp_loss, mlp_opt

pytestmark = pytest.mark.cuda_form

REFUSED = r"did not carry the loss scale.*65536.*Call opt\.backward\(loss\)"


def _weights(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _reference_norm(model: nn.Module, x: torch.Tensor, y: torch.Tensor, scale: float) -> float:
    """torch's gradient norm of the scaled loss, unscaled (fp32 sums), on a copy."""
    ref = copy.deepcopy(model)
    (mlp_loss(ref, x, y) * scale).backward()
    norms = torch.stack([torch.linalg.vector_norm(p.grad.float()) for p in ref.parameters()])
    return float(torch.linalg.vector_norm(norms)) / scale


def test_plain_backward_on_an_fp16_model_is_refused_and_nothing_steps() -> None:
    model = mlp(dtype=torch.float16)
    opt = mlp_opt(model)
    (x, y), (x2, y2) = mlp_batches(2)
    before = _weights(model)
    with pytest.raises(RuntimeError, match=REFUSED):
        mlp_loss(model, x, y).backward()
    assert all(p.grad is None for p in model.parameters())
    assert opt.backwards == 0
    opt.step()  # nothing of the refused backward is in the window: nothing to step
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    # The fix the message names works, and its norm is torch's on the scaled loss, unscaled.
    opt.backward(mlp_loss(model, x2, y2))
    want = _reference_norm(model, x2, y2, opt.loss_scale)
    assert float(opt.grad_norm()) == pytest.approx(want, rel=1e-3)
    opt.step()
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    opt.close()


def test_the_first_fp16_group_makes_a_plain_backward_of_an_fp32_model_refused() -> None:
    model = mlp()
    opt = mlp_opt(model)
    x, y = mlp_batches(1)[0]
    mlp_loss(model, x, y).backward()  # fp32: no loss scale, a plain backward is right
    opt.step()
    opt.zero_grad()
    extra = nn.Linear(8, 8).to(run_device(), torch.float16)
    opt.add_param_group({"params": list(extra.parameters())})
    assert opt.loss_scale == 65536.0
    with pytest.raises(RuntimeError, match=REFUSED):
        (mlp_loss(model, x, y) + extra(y.half()).float().sum()).backward()
    assert opt.backwards == 1
    opt.close()


def test_a_backward_inside_scaled_backward_is_taken_and_the_block_closes() -> None:
    """Code that applies the scale itself (as the integrations do) marks its backward; the
    block is closed again when it raises."""
    model = mlp(dtype=torch.float16)
    opt = mlp_opt(model)
    twin = copy.deepcopy(model)
    twin_opt = mlp_opt(twin)
    x, y = mlp_batches(1)[0]
    with opt.scaled_backward():
        (mlp_loss(model, x, y) * opt.loss_scale).backward()
    twin_opt.backward(mlp_loss(twin, x, y))
    assert torch.equal(opt.grad_norm(), twin_opt.grad_norm())
    with pytest.raises(KeyError), opt.scaled_backward():
        raise KeyError("inside the block")
    opt.zero_grad()
    with pytest.raises(RuntimeError, match=REFUSED):
        mlp_loss(model, x, y).backward()
    for o in (opt, twin_opt):
        o.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_plain_backward_stays_right_without_a_loss_scale(dtype: torch.dtype) -> None:
    model = mlp(dtype=dtype)
    opt = mlp_opt(model)
    x, y = mlp_batches(1)[0]
    mlp_loss(model, x, y).backward()
    assert opt.loss_scale == 1.0 and opt.backwards == 1
    assert float(opt.grad_norm()) == pytest.approx(_reference_norm(model, x, y, 1.0), rel=1e-2)
    opt.close()
