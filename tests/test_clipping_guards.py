"""Note [clipping guarded at each framework's entry point]: every framework clipping entry
point, called on OffloadAdamW's parameters, raises naming the integration class before
anything is clipped; on other parameters it is the framework's own. CI runs this file against
the newest and the oldest framework versions pyproject.toml allows (.ci/run)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from .helpers.models import batches, lm_loss, make_pair, max_diff, offload_opt, torch_adamw


def _backward_once(model: nn.Module, opt) -> None:
    ((tokens, targets),) = batches(1)
    opt.backward(lm_loss(model, tokens, targets))


def _unclipped_step_matches_torch(model: nn.Module, ref: nn.Module, opt) -> None:
    """The refused call changed nothing: the step is torch's unclipped step."""
    opt.step()
    ropt = torch_adamw(ref)
    ((tokens, targets),) = batches(1)
    lm_loss(ref, tokens, targets).backward()
    ropt.step()
    assert max_diff(model, ref) < 1e-5


# -- torch ------------------------------------------------------------------------------


def test_torch_clip_grads_with_norm_on_our_parameters_is_refused() -> None:
    if not hasattr(torch.nn.utils, "clip_grads_with_norm_"):
        pytest.skip("torch < 2.6 has no clip_grads_with_norm_")
    model, ref = make_pair()
    opt = offload_opt(model)
    _backward_once(model, opt)
    with pytest.raises(RuntimeError, match="clip_grads_with_norm_ on parameters that"):
        torch.nn.utils.clip_grads_with_norm_(model.parameters(), 1.0, torch.tensor(5.0))
    _unclipped_step_matches_torch(model, ref, opt)
    opt.close()


def test_torch_clip_grads_with_norm_on_other_parameters_is_torchs_own() -> None:
    if not hasattr(torch.nn.utils, "clip_grads_with_norm_"):
        pytest.skip("torch < 2.6 has no clip_grads_with_norm_")
    torch.manual_seed(0)
    ours, theirs = nn.Linear(4, 4), nn.Linear(4, 4)
    opt = offload_opt(ours)
    theirs(torch.randn(3, 4)).square().sum().backward()
    before = [p.grad.clone() for p in theirs.parameters()]
    total = torch.nn.utils.get_total_norm([p.grad for p in theirs.parameters()])
    torch.nn.utils.clip_grads_with_norm_(theirs.parameters(), 0.5, total)
    for p, g in zip(theirs.parameters(), before, strict=True):
        torch.testing.assert_close(p.grad, g * (0.5 / (total + 1e-6)))
    opt.close()


def test_a_list_filtered_on_grad_is_refused_while_gradients_are_pending() -> None:
    """``[p for p in params if p.grad is not None]`` (mmengine, fairseq, many scripts) is
    empty for our parameters: torch's clip returned 0 and clipped nothing, silently (Note
    [a list filtered on .grad is empty]). Refused while a backward is not stepped; after
    the step, and with no offload optimizer pending, an empty list is torch's own."""
    model, ref = make_pair()
    opt = offload_opt(model)
    _backward_once(model, opt)
    filtered = [p for p in model.parameters() if p.grad is not None]
    assert filtered == []
    for name in ("clip_grad_norm_", "clip_grad_value_"):
        with pytest.raises(RuntimeError, match=rf"{name} got no parameters while .* Nothing"):
            getattr(torch.nn.utils, name)(filtered, 1.0)
    _unclipped_step_matches_torch(model, ref, opt)  # nothing was clipped
    assert float(torch.nn.utils.clip_grad_norm_([], 1.0)) == 0.0  # nothing pending
    opt.close()


# -- accelerate -------------------------------------------------------------------------


def test_a_plain_accelerator_clip_grad_norm_is_refused_and_changes_nothing() -> None:
    accelerate = pytest.importorskip("accelerate")
    model, ref = make_pair()
    opt = offload_opt(model)
    accelerator = accelerate.Accelerator(cpu=True)
    _backward_once(model, opt)
    with pytest.raises(RuntimeError, match=r"Accelerator\.clip_grad_norm_ .*OffloadAccelerator"):
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
    with pytest.raises(RuntimeError, match=r"Accelerator\.clip_grad_norm_ .*OffloadAccelerator"):
        accelerator.clip_grad_norm_(next(model.parameters()), float("inf"))  # one tensor
    with pytest.raises(RuntimeError, match=r"Accelerator\.clip_grad_value_ .*global norm"):
        accelerator.clip_grad_value_(model.parameters(), 0.1)
    _unclipped_step_matches_torch(model, ref, opt)
    opt.close()


def test_a_plain_accelerator_clips_other_parameters_as_before() -> None:
    accelerate = pytest.importorskip("accelerate")
    torch.manual_seed(0)
    ours, theirs, expected = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)
    expected.load_state_dict(theirs.state_dict())
    opt = offload_opt(ours)
    accelerator = accelerate.Accelerator(cpu=True)
    x = torch.randn(3, 4)
    for model in (theirs, expected):
        model(x).square().sum().backward()
    norm = accelerator.clip_grad_norm_((p for p in theirs.parameters()), 0.5)  # a generator
    reference = torch.nn.utils.clip_grad_norm_(list(expected.parameters()), 0.5)
    torch.testing.assert_close(norm, reference)
    for a, b in zip(theirs.parameters(), expected.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad)
    opt.close()


# -- transformers -----------------------------------------------------------------------


@pytest.mark.parametrize("entry", ["_clip_grad_norm", "_get_grad_norm"])
def test_a_plain_trainers_clipping_hooks_are_refused(tmp_path: Path, entry: str) -> None:
    """Trainer clips and reads its logged grad_norm through these two methods; on ours they
    must raise naming OffloadTrainer (with accelerate >= 1.16 the accelerator found no
    gradient and returned 0)."""
    pytest.importorskip("transformers")
    from zero_offload import OffloadAdamW

    from .helpers.hf import tiny_gpt2, torch_trainer, training_args
    from .helpers.models import host_accelerator

    model = tiny_gpt2()
    opt = OffloadAdamW(model.parameters(), lr=1e-3, accelerator=host_accelerator())
    trainer = torch_trainer(model, training_args(tmp_path, max_steps=1), optimizers=(opt, None))
    if not hasattr(type(trainer), entry):
        pytest.skip(f"this transformers has no Trainer.{entry}")
    tokens = torch.randint(0, 64, (2, 16))
    opt.backward(model(input_ids=tokens, labels=tokens).loss)
    with pytest.raises(RuntimeError, match=rf"Trainer\.{entry} .*OffloadTrainer"):
        getattr(trainer, entry)(model)
    assert opt.grad_norm().item() > 0  # the gradients are there, and were not clipped
    opt.close()


# -- Lightning --------------------------------------------------------------------------


def _lightning() -> object:
    return pytest.importorskip("lightning.pytorch")


def test_a_plain_lightning_modules_clip_is_refused_when_it_would_clip() -> None:
    pl = _lightning()
    model, ref = make_pair()
    opt = offload_opt(model)
    _backward_once(model, opt)
    module = pl.LightningModule()
    with pytest.raises(RuntimeError, match=r"clip_gradients .*OffloadLightningModule"):
        module.clip_gradients(opt, gradient_clip_val=1.0, gradient_clip_algorithm="norm")
    from lightning.pytorch.plugins.precision import Precision
    from lightning.pytorch.utilities import GradClipAlgorithmType

    with pytest.raises(RuntimeError, match=r"Precision\.clip_gradients .*OffloadLightningModule"):
        Precision().clip_gradients(opt, 1.0, GradClipAlgorithmType.NORM)
    Precision().clip_gradients(opt, 0.0, GradClipAlgorithmType.NORM)  # 0: Lightning's no-op
    _unclipped_step_matches_torch(model, ref, opt)
    opt.close()


def test_fabric_clip_gradients_is_refused() -> None:
    pytest.importorskip("lightning.fabric")
    from lightning.fabric import Fabric

    model, _ = make_pair()
    opt = offload_opt(model)
    _backward_once(model, opt)
    fabric = Fabric(accelerator="cpu", devices=1)
    with pytest.raises(RuntimeError, match=r"Fabric\.clip_gradients .*opt\.clip_grad_norm_"):
        fabric.clip_gradients(model, opt, max_norm=1.0)
    with pytest.raises(RuntimeError, match=r"Fabric\.clip_gradients"):
        fabric.clip_gradients(model, opt, clip_val=0.1)
    opt.close()


# -- import order -----------------------------------------------------------------------

_ORDER = """
import {first}
import {second}
import inspect
import torch
import accelerate.accelerator as acc_module
from zero_offload import OffloadAdamW
model = torch.nn.Linear(8, 8)
opt = OffloadAdamW(model.parameters(), lr=1e-3)
model(torch.randn(2, 8)).square().sum().backward()
try:
    accelerate.Accelerator(cpu=True).clip_grad_norm_(model.parameters(), 1.0)
except RuntimeError as exc:
    assert "OffloadAccelerator" in str(exc), exc
else:
    raise SystemExit("not refused")
# The library's own loader stays on the module (Note [a hook on import, in either order]).
assert "HookedLoader" not in type(acc_module.__loader__).__name__, acc_module.__loader__
assert "def clip_grad_norm_" in inspect.getsource(acc_module)
opt.close()
print("refused")
"""


@pytest.mark.parametrize(
    ("first", "second"),
    [("zero_offload", "accelerate"), ("accelerate", "zero_offload")],
    ids=["zero_offload-first", "accelerate-first"],
)
def test_the_guard_holds_in_either_import_order(first: str, second: str) -> None:
    pytest.importorskip("accelerate")
    script = textwrap.dedent(_ORDER).format(first=first, second=second)
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and "refused" in done.stdout, done.stdout + done.stderr
