"""OffloadTrainer against the same Trainer run with torch's AdamW (tiny GPT-2, CPU).

Tolerances. fp32: torch's fused and for-loop AdamW differ by 6e-7 in the weights after
these 12 steps, and OffloadAdamW's CPU kernel by the same; losses agree to 1 ulp of ~3.9
(2.4e-7) and logged grad norms to 1e-7 relative. We allow 1e-6 / 1e-6 / 3e-6. bf16 autocast:
the first steps are bitwise equal; from the step where the two fp32 weight copies differ
by 1 ulp, bf16 rounding of those weights turns the ulp into a 2**-8 relative difference of
a few activations, so losses differ by up to 5e-5 and grad norms by 3.5e-4 relative.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import Trainer

from zero_offload import LossScalerConfig, OffloadAdamW
from zero_offload.integrations.accelerate import OffloadAcceleratedOptimizer
from zero_offload.integrations.transformers import OffloadTrainer

from .helpers.hf import (
    TokenDataset,
    count_state_io,
    logged,
    max_weight_diff,
    offload_config,
    offload_trainer,
    run_trainer_ranks,
    tiny_gpt2,
    torch_trainer,
    training_args,
    weights,
)
from .helpers.models import host_accelerator

MAX_GRAD_NORM = 0.5  # the norms of these runs are 1.2 to 1.7: clipping binds every step


def _run_pair(tmp_path: Path, **overrides: object) -> tuple[Trainer, Trainer]:
    ref = torch_trainer(tiny_gpt2(), training_args(tmp_path / "torch", **overrides))
    ref.train()
    ours = offload_trainer(tiny_gpt2(), training_args(tmp_path / "offload", **overrides))
    ours.train()
    return ref, ours


def test_import_zero_offload_does_not_import_the_frameworks() -> None:
    code = (
        "import sys, zero_offload, zero_offload.integrations; "
        "print(sorted(m for m in ('transformers', 'accelerate', 'peft') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.cuda_form
@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"gradient_checkpointing": True},
        {"max_grad_norm": 0.0},  # no clipping: grad_norm is still logged
    ],
    ids=["clip", "grad-checkpointing", "no-clip"],
)
def test_parity_with_torch_adamw_trainer(tmp_path: Path, overrides: dict) -> None:
    ref, ours = _run_pair(tmp_path, **overrides)
    ref_norms, our_norms = logged(ref, "grad_norm"), logged(ours, "grad_norm")
    assert len(our_norms) == 12
    if ref.args.max_grad_norm > 0:
        assert min(ref_norms) > MAX_GRAD_NORM  # clipping binds in every step
    torch.testing.assert_close(logged(ours, "loss"), logged(ref, "loss"), rtol=0, atol=1e-6)
    torch.testing.assert_close(our_norms, ref_norms, rtol=1e-6, atol=0)
    assert logged(ours, "learning_rate") == logged(ref, "learning_rate")
    assert max_weight_diff(weights(ours.model), weights(ref.model)) < 3e-6
    # Note [offload metrics in the framework's logs]: in every training record.
    cpu_adam, held = logged(ours, "offload/cpu_adam_ms"), logged(ours, "offload/host_bytes")
    assert len(cpu_adam) == 12 and min(cpu_adam) > 0
    placement = ours.offload_optimizer.placement
    # The first window is summed on the host and pins the spare gradient staging, which
    # goes back once the buckets sum on the device (Note [the spare goes when the device
    # sums] in optim/grads/staging.py).
    assert held[1:] == [float(placement.pinned + placement.pageable)] * 11
    assert held[0] > held[1]
    assert len(logged(ours, "offload/exposed_transfer_ms")) == 12
    assert not logged(ref, "offload/cpu_adam_ms")


@pytest.mark.cuda_form
def test_parity_bf16(tmp_path: Path) -> None:
    ref, ours = _run_pair(tmp_path, bf16=True)
    torch.testing.assert_close(logged(ours, "loss"), logged(ref, "loss"), rtol=0, atol=2e-4)
    torch.testing.assert_close(
        logged(ours, "grad_norm"), logged(ref, "grad_norm"), rtol=2e-3, atol=0
    )


@pytest.mark.cuda_form
def test_optimizer_is_built_from_training_arguments(tmp_path: Path) -> None:
    trainer = offload_trainer(tiny_gpt2(), training_args(tmp_path, adam_epsilon=1e-7))
    wrapper = trainer.create_optimizer()
    assert isinstance(wrapper, OffloadAcceleratedOptimizer)
    opt = trainer.offload_optimizer
    decay, no_decay = opt.param_groups
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    # Trainer's rule: biases and norms get no decay.
    assert all("bias" in names[id(p)] or "ln_" in names[id(p)] for p in no_decay["params"])
    assert not any("bias" in names[id(p)] or "ln_" in names[id(p)] for p in decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(trainer.model.parameters()))
    for group in opt.param_groups:
        assert group["betas"] == (0.9, 0.95) and group["eps"] == 1e-7 and group["lr"] == 1e-3
    assert opt.config.max_grad_norm == MAX_GRAD_NORM
    assert opt.config.bucket_bytes == 8192  # offload_config is used


@pytest.mark.cuda_form
def test_prepare_does_not_round_trip_the_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    trainer = offload_trainer(tiny_gpt2(), training_args(tmp_path, max_steps=1))
    calls = count_state_io(monkeypatch)
    trainer.train()
    assert calls == []
    assert isinstance(trainer.optimizer, OffloadAcceleratedOptimizer)
    assert trainer.accelerator._optimizers == [trainer.optimizer]  # registered once


@pytest.mark.cuda_form
def test_user_optimizer_trains_like_the_built_one(tmp_path: Path) -> None:
    built = offload_trainer(tiny_gpt2(), training_args(tmp_path / "a", max_steps=4))
    built.train()
    model = tiny_gpt2()
    decay = set(built.get_decay_parameter_names(model))
    named = list(model.named_parameters())
    opt = OffloadAdamW(
        [
            {"params": [p for n, p in named if n in decay], "weight_decay": 0.1},
            {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
        ],
        lr=1e-3,
        betas=(0.9, 0.95),
        config=offload_config(),
        accelerator=host_accelerator(),
    )
    given = OffloadTrainer(
        model=model,
        args=training_args(tmp_path / "b", max_steps=4),
        train_dataset=TokenDataset(),
        optimizers=(opt, None),
    )
    given.train()
    assert given.offload_optimizer is opt
    assert logged(given, "grad_norm") == logged(built, "grad_norm")
    assert max_weight_diff(weights(given.model), weights(built.model)) == 0.0


@pytest.mark.parametrize("max_grad_norm", [MAX_GRAD_NORM, 0.0], ids=["clip", "no-clip"])
def test_plain_trainer_with_offload_adamw_names_the_integration(
    tmp_path: Path, max_grad_norm: float
) -> None:
    """Trainer clips, and reads the grad_norm it logs even without clipping, with
    torch.nn.utils.clip_grad_norm_, which finds no param.grad: it would clip nothing and
    log 0. The optimizer must refuse loudly at the first step and point to OffloadTrainer."""
    model = tiny_gpt2()
    opt = OffloadAdamW(model.parameters(), lr=1e-3, accelerator=host_accelerator())
    args = training_args(tmp_path, max_steps=2, max_grad_norm=max_grad_norm)
    trainer = torch_trainer(model, args, optimizers=(opt, None))
    with pytest.raises((RuntimeError, ValueError), match="OffloadTrainer"):
        trainer.train()


@pytest.mark.cuda_form
def test_resume_from_checkpoint_is_bitwise(tmp_path: Path) -> None:
    args = {"save_strategy": "steps", "save_steps": 6, "save_only_model": False}
    whole = offload_trainer(tiny_gpt2(), training_args(tmp_path / "whole", **args))
    whole.train()
    checkpoint = tmp_path / "whole" / "checkpoint-6"
    saved = torch.load(checkpoint / "optimizer.pt", weights_only=True)
    assert "zero_offload" in saved and len(saved["state"]) == len(list(whole.model.parameters()))
    # A different initialisation: everything must come from the checkpoint.
    resumed = offload_trainer(tiny_gpt2(seed=1), training_args(tmp_path / "resumed", **args))
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert logged(resumed, "loss", after=6) == logged(whole, "loss")[6:]
    assert logged(resumed, "grad_norm", after=6) == logged(whole, "grad_norm")[6:]
    assert max_weight_diff(weights(resumed.model), weights(whole.model)) == 0.0


def test_state_on_nvme_checkpoints_by_streaming_and_resumes_bitwise(tmp_path: Path) -> None:
    """State past ``host_budget`` lives on NVMe and cannot be consolidated in host RAM:
    Trainer's save raised ``StateNotInHostRam`` at the first checkpoint. It streams to
    ``zero_offload_optimizer/`` in the checkpoint folder instead, and resumes bitwise."""
    args = {"save_strategy": "steps", "save_steps": 6, "save_only_model": False}

    def on_nvme(name: str, seed: int) -> OffloadTrainer:
        config = offload_config(nvme_dir=tmp_path / name / "nvme", host_budget=1)
        return offload_trainer(
            tiny_gpt2(seed=seed), training_args(tmp_path / name, **args), offload_config=config
        )

    whole = on_nvme("whole", 0)
    whole.train()
    checkpoint = tmp_path / "whole" / "checkpoint-6"
    assert not (checkpoint / "optimizer.pt").exists()
    assert (checkpoint / "zero_offload_optimizer" / "rank0").is_dir()
    resumed = on_nvme("resumed", 1)  # everything must come from the checkpoint
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert logged(resumed, "loss", after=6) == logged(whole, "loss")[6:]
    assert max_weight_diff(weights(resumed.model), weights(whole.model)) == 0.0


@pytest.mark.cuda_form
def test_a_torch_adamw_checkpoint_resumes_under_offload_trainer(tmp_path: Path) -> None:
    """Switching a running fine-tune over: Trainer's groups are ours, and a torch AdamW
    state dict loads (the fp32 master comes from the fp32 weights), so steps 7 to 12 are
    torch's to float rounding (measured 2.4e-7 in the losses, 1.6e-7 in the weights)."""
    args = {"save_strategy": "steps", "save_steps": 6}
    ref = torch_trainer(tiny_gpt2(), training_args(tmp_path / "torch", **args))
    ref.train()
    ours = offload_trainer(tiny_gpt2(seed=1), training_args(tmp_path / "offload", **args))
    ours.train(resume_from_checkpoint=str(tmp_path / "torch" / "checkpoint-6"))
    torch.testing.assert_close(
        logged(ours, "loss", after=6), logged(ref, "loss")[6:], rtol=0, atol=1e-6
    )
    assert max_weight_diff(weights(ours.model), weights(ref.model)) < 3e-6


@pytest.mark.cuda_form
def test_fp16_model_uses_the_optimizers_loss_scaler(tmp_path: Path) -> None:
    """Trainer's backward does not scale the loss; for an fp16 model OffloadTrainer does.
    A missing scale would show as a grad norm 2**10 times too small."""
    ref = torch_trainer(tiny_gpt2(), training_args(tmp_path / "torch", max_steps=3))
    ref.train()
    ours = offload_trainer(
        tiny_gpt2(dtype=torch.float16),
        training_args(tmp_path / "fp16", max_steps=3),
        offload_config=offload_config(loss_scaler=LossScalerConfig(initial_scale=2.0**10)),
    )
    ours.train()
    assert ours.offload_optimizer.loss_scale == 2.0**10
    assert ours.offload_optimizer.skipped_steps == 0
    torch.testing.assert_close(
        logged(ours, "grad_norm"), logged(ref, "grad_norm"), rtol=1e-3, atol=0
    )


@pytest.mark.cuda_form
def test_overflow_skips_hold_the_lr_schedule_back(tmp_path: Path) -> None:
    """fp16 model, a loss scale too large at first: the overflowing steps are skipped and,
    as with GradScaler, Trainer does not advance the schedule for them."""
    ref = torch_trainer(tiny_gpt2(), training_args(tmp_path / "torch", max_steps=5))
    ref.train()
    scaler = LossScalerConfig(initial_scale=2.0**20, hysteresis=1)
    ours = offload_trainer(
        tiny_gpt2(dtype=torch.float16),
        training_args(tmp_path / "fp16", max_steps=5),
        offload_config=offload_config(loss_scaler=scaler),
    )
    ours.train()
    skipped = ours.offload_optimizer.skipped_steps
    assert 1 <= skipped <= 3  # the scale halves on each overflow until the gradients fit
    lrs = logged(ref, "learning_rate")
    # Skipped steps log the rate they did not use; the schedule then resumes where it was.
    assert logged(ours, "learning_rate") == [lrs[0]] * (skipped + 1) + lrs[1 : 5 - skipped]


@pytest.mark.parametrize(
    ("overrides", "kwargs", "error", "match"),
    [
        ({"fp16": True}, {}, ValueError, "bf16"),
        ({"optim": "adafactor"}, {}, ValueError, "adamw_torch"),
        ({"optim_args": "foo=1"}, {}, ValueError, "offload_config"),
        ({}, {"offload_config": "big"}, TypeError, "OffloadConfig"),
        ({}, {"offload_config": offload_config(max_grad_norm=1.0)}, ValueError, "max_grad_norm"),
        ({}, {"optimizers": (torch.optim.SGD([torch.zeros(1)], lr=0.1), None)}, TypeError, "SGD"),
        (
            {},
            {"optimizer_cls_and_kwargs": (torch.optim.AdamW, {})},
            ValueError,
            "optimizer_cls_and_kwargs",
        ),
    ],
    ids=["fp16", "optim", "optim_args", "config-type", "config-clip", "sgd", "cls_and_kwargs"],
)
def test_refused_at_construction(
    tmp_path: Path, overrides: dict, kwargs: dict, error: type, match: str
) -> None:
    with pytest.raises(error, match=match):
        offload_trainer(tiny_gpt2(), training_args(tmp_path, **overrides), **kwargs)


def test_a_transformers_without_the_overridden_methods_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A renamed Trainer method would bypass the clipping route without a word."""
    monkeypatch.delattr(Trainer, "_get_grad_norm")
    with pytest.raises(RuntimeError, match="_get_grad_norm"):
        offload_trainer(tiny_gpt2(), training_args(tmp_path))


@pytest.mark.slow
def test_two_ranks_resume_from_checkpoint_is_bitwise(tmp_path: Path) -> None:
    """2 gloo ranks: every rank's shard goes into the consolidated optimizer.pt and comes
    back on resume; no DDP (OffloadAdamW reduce-scatters)."""
    ranks = run_trainer_ranks(2, tmp_path)
    for rank in ranks:
        whole, resumed = rank["whole"], rank["resumed"]
        assert len(whole["grad_norms"]) == 12
        assert resumed["grad_norms"] == whole["grad_norms"][6:]
        assert max_weight_diff(resumed["weights"], whole["weights"]) == 0.0
    # The ranks agree: same weights, same (all-reduced) norms.
    assert max_weight_diff(ranks[0]["whole"]["weights"], ranks[1]["whole"]["weights"]) == 0.0
    assert ranks[0]["whole"]["grad_norms"] == ranks[1]["whole"]["grad_norms"]


@pytest.mark.cuda_form
@pytest.mark.parametrize(
    ("max_grad_norm", "speculative", "failures", "checkpointing"),
    [
        (0.5, True, 12, False),
        (100.0, True, 0, False),
        (0.0, False, 0, False),
        (0.0, False, 0, True),
    ],
    ids=["speculation-rolls-back", "speculation-holds", "no-clip", "no-clip-checkpointing"],
)
def test_trainer_steps_during_backward_bitwise(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    max_grad_norm: float,
    speculative: bool,
    failures: int,
    checkpointing: bool,
) -> None:
    # Note [Trainer steps during backward]: the window's last micro-batch announces the
    # step; the result is bitwise the same run with every step taken in step(), logged
    # norms included.
    config = offload_config(speculative_step=speculative)
    args: dict[str, object] = {"max_grad_norm": max_grad_norm}
    if checkpointing:
        args["gradient_checkpointing"] = True
    with monkeypatch.context() as patch:  # the reference never announces
        patch.setattr(OffloadAdamW, "can_step_during_backward", lambda self: False)
        plain = offload_trainer(
            tiny_gpt2(), training_args(tmp_path / "plain", **args), offload_config=config
        )
        plain.train()
    assert plain.offload_optimizer.share_stepped_during_backward is None
    eager = offload_trainer(
        tiny_gpt2(), training_args(tmp_path / "eager", **args), offload_config=config
    )
    eager.train()
    opt = eager.offload_optimizer
    assert opt.share_stepped_during_backward is not None  # the steps were announced
    assert opt.speculation_failures == failures
    assert logged(eager, "grad_norm") == logged(plain, "grad_norm")
    assert logged(eager, "loss") == logged(plain, "loss")
    assert max_weight_diff(weights(eager.model), weights(plain.model)) == 0.0


@pytest.mark.cuda_form
@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "grad-checkpointing"])
def test_trainer_lands_overlap_weights_at_first_use_bitwise(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, checkpointing: bool
) -> None:
    # Note [weights landed at their first use]: under the Trainer's loop (its clipping,
    # logging, scheduler and zero_grad between step() and the next forward), each bucket
    # lands where the forward first reads it; losses, norms and weights are those of
    # overlap_landing="at_step".
    from zero_offload.optim.update.modes import DelayedUpdate

    landed: list[int] = []
    real = DelayedUpdate._land_one

    def land_one(self, bucket, events, gather, stream) -> None:
        landed.append(bucket.layout.index)
        real(self, bucket, events, gather, stream)

    monkeypatch.setattr(DelayedUpdate, "_land_one", land_one)
    runs = []
    for landing in ("at_step", "at_first_use"):
        args = {"gradient_checkpointing": True} if checkpointing else {}
        config = offload_config(overlap_step=True, overlap_shadow="off", overlap_landing=landing)
        trainer = offload_trainer(
            tiny_gpt2(), training_args(tmp_path / landing, **args), offload_config=config
        )
        trainer.train()
        runs.append(trainer)
    at_step, first_use = runs
    buckets = len(first_use.offload_optimizer.buckets)
    assert len(landed) >= buckets > 1  # landed at first use, from the second step on
    assert logged(first_use, "loss") == logged(at_step, "loss")
    assert logged(first_use, "grad_norm") == logged(at_step, "grad_norm")
    assert max_weight_diff(weights(first_use.model), weights(at_step.model)) == 0.0


def test_max_grad_norm_inf_logs_the_norm_and_clips_nothing(tmp_path: Path) -> None:
    # TrainingArguments(max_grad_norm=inf): Trainer logs grad_norm and clips nothing (its
    # clip_grad_norm_(inf) is the norm). Before, OffloadTrainer refused it at construction,
    # naming OffloadConfig.max_grad_norm, which the user never set.
    ref, ours = _run_pair(tmp_path, max_grad_norm=float("inf"))
    assert len(logged(ours, "grad_norm")) == 12
    torch.testing.assert_close(logged(ours, "loss"), logged(ref, "loss"), rtol=0, atol=1e-6)
    torch.testing.assert_close(
        logged(ours, "grad_norm"), logged(ref, "grad_norm"), rtol=1e-6, atol=0
    )
    assert max_weight_diff(weights(ours.model), weights(ref.model)) < 3e-6


def test_step_during_backward_false_never_announces(tmp_path: Path) -> None:
    # For a model whose backward reads a weight outside its gradient's path, which an
    # announced step refuses mid-backward (Note [a step moves the version counters]).
    trainer = offload_trainer(
        tiny_gpt2(), training_args(tmp_path, max_grad_norm=0.0), step_during_backward=False
    )
    trainer.train()
    assert trainer.offload_optimizer.share_stepped_during_backward is None
    with pytest.raises(TypeError, match="step_during_backward must be True or False, got int"):
        offload_trainer(tiny_gpt2(), training_args(tmp_path / "x"), step_during_backward=1)
