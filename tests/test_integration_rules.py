"""Every rule through the integrations (issue 37): Trainer picks the rule by
``TrainingArguments.optim`` (Note [Trainer's optim names] in
zero_offload/integrations/_optim_names.py), and accelerate, Lightning and Trainer take any
offload optimizer passed in.

1. Trainer by name, fp32, 12 steps of 2 micro-batches with ``max_grad_norm`` binding:
   ``optim="adagrad"`` (with ``optim_args``) against the same Trainer building torch's
   Adagrad itself; ``optim="lion_32bit"`` against Trainer with the paper's Lion
   (``LionReference`` of test_lion_adagrad.py) over Trainer's own groups; TRL's SFTTrainer
   with ``optim="adagrad"`` against TRL's.
2. Trainer with an ``OffloadAdafactor`` passed in ``optimizers=`` (what the ``adafactor``
   refusal points to) against Trainer with ``torch.optim.Adafactor``.
3. accelerate and Lightning with ``OffloadLion`` and ``OffloadAdafactor`` passed in, against
   the same loops with the paper's Lion and ``torch.optim.Adafactor``.
4. What each name builds (groups, hyper-parameters), and what is refused, by message.

Tolerances: the AdamW Trainer parity tests' (test_integration_transformers.py): losses
1e-6, logged grad norms 1e-6 relative, weights 3e-6 (Lightning: its own file's 1e-6).
Measured in the weights: Adagrad 5.6e-7, Adafactor 1.2e-7 to 2.4e-7, Lion 0 (its update is
a sign times the learning rate: a weight moves apart only where a clip coefficient that
differs in its last bits flips a sign, an lr-sized jump the bound would catch). Adagrad
moves a weight by about ``lr * g / (|g| + eps)`` at first: GPT-2's key biases, to which the
softmax is blind, get gradients of rounding noise (~1e-12), which torch's eps of 1e-10 turns
into jumps of 3e-5 that differ between any two runs; the Adagrad runs set ``eps=1e-8``
through ``optim_args`` (testing that key too), which keeps them near 1e-7.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from accelerate import Accelerator
from transformers import Trainer
from trl import SFTTrainer

from zero_offload import (
    OffloadAdafactor,
    OffloadAdagrad,
    OffloadAdamW,
    OffloadLion,
    OffloadOptimizer,
)
from zero_offload.integrations._optim_names import ACCEPTED, optimizer_cls_and_kwargs
from zero_offload.integrations.accelerate import OffloadAccelerator
from zero_offload.integrations.lightning import OffloadLightningModule
from zero_offload.integrations.transformers import OffloadTrainer
from zero_offload.integrations.trl import OffloadSFTTrainer

from .helpers.hf import (
    TokenDataset,
    accelerate_device,
    logged,
    max_weight_diff,
    offload_config,
    offload_trainer,
    tiny_gpt2,
    torch_trainer,
    training_args,
    weights,
)
from .helpers.models import host_accelerator
from .test_integration_accelerate import MAX_NORM, accelerate_loop, loader
from .test_integration_lightning import CLIP, STEPS, _Body, trainer
from .test_integration_lightning import max_diff as lightning_diff
from .test_integration_lightning import weights as lightning_weights
from .test_integration_trl import assert_parity, run
from .test_lion_adagrad import LionReference

MAX_GRAD_NORM = 0.5  # the norms of these runs are 1.2 to 1.7: clipping binds every step
#: TrainingArguments' Lion: bitsandbytes' Lion(lr, betas=(adam_beta1, adam_beta2)) over
#: Trainer's groups (training_args: lr 1e-3, adam_beta2 0.95, weight_decay 0.1).
LION = {"lr": 1e-3, "betas": (0.9, 0.95), "weight_decay": 0.1}
ADAFACTOR = {"lr": 1e-2, "weight_decay": 0.1}  # torch's default lr caps the relative step


def assert_trainer_parity(ours: Trainer, ref: Trainer) -> None:
    """The AdamW Trainer tests' bounds: losses, logged pre-clip norms, weights."""
    ref_norms, our_norms = logged(ref, "grad_norm"), logged(ours, "grad_norm")
    assert len(our_norms) == 12 and min(ref_norms) > MAX_GRAD_NORM  # clipping binds
    torch.testing.assert_close(logged(ours, "loss"), logged(ref, "loss"), rtol=0, atol=1e-6)
    torch.testing.assert_close(our_norms, ref_norms, rtol=1e-6, atol=0)
    assert logged(ours, "learning_rate") == logged(ref, "learning_rate")
    assert max_weight_diff(weights(ours.model), weights(ref.model)) < 3e-6


# -- Trainer: the rule by name -----------------------------------------------------------


@pytest.mark.cuda_form
def test_trainer_adagrad_matches_trainers_torch_adagrad(tmp_path: Path) -> None:
    """Trainer itself builds torch.optim.Adagrad for optim="adagrad" (lr, and lr_decay and
    eps from optim_args) over its two groups: the reference is that very run."""
    named = {"optim": "adagrad", "optim_args": "lr_decay=0.05, eps=1e-8"}
    ref = torch_trainer(tiny_gpt2(), training_args(tmp_path / "torch", **named))
    ref.train()
    ours = offload_trainer(tiny_gpt2(), training_args(tmp_path / "offload", **named))
    ours.train()
    assert type(ref.optimizer.optimizer) is torch.optim.Adagrad  # accelerate's wrapper
    assert isinstance(ours.offload_optimizer, OffloadAdagrad)
    assert_trainer_parity(ours, ref)
    keys = ("weight_decay", "lr_decay", "eps", "initial_accumulator_value")
    for group, ref_group in zip(
        ours.offload_optimizer.param_groups, ref.optimizer.param_groups, strict=True
    ):
        assert {k: group[k] for k in keys} == {k: ref_group[k] for k in keys}


@pytest.mark.cuda_form
@pytest.mark.parametrize("optim", ["lion_32bit", "paged_lion_32bit"])
def test_trainer_lion_matches_the_paper_rule(tmp_path: Path, optim: str) -> None:
    """bitsandbytes is not installed here: the reference Trainer builds the paper's Lion
    over its own groups (optimizer_cls_and_kwargs) with the hyper-parameters Trainer gives
    bitsandbytes' Lion."""
    ref = torch_trainer(
        tiny_gpt2(),
        training_args(tmp_path / "torch"),
        optimizer_cls_and_kwargs=(LionReference, LION),
    )
    ref.train()
    ours = offload_trainer(tiny_gpt2(), training_args(tmp_path / "offload", optim=optim))
    ours.train()
    assert isinstance(ours.offload_optimizer, OffloadLion)
    assert_trainer_parity(ours, ref)


@pytest.mark.cuda_form
def test_trl_sft_adagrad_matches_trl(tmp_path: Path) -> None:
    """TRL's trainers take the name through OffloadTrainer: SFTTrainer builds torch's
    Adagrad, OffloadSFTTrainer OffloadAdagrad."""
    named = {"overrides": {"optim": "adagrad", "optim_args": "eps=1e-8"}}
    ref = run(SFTTrainer, tmp_path / "trl", **named)
    ours = run(OffloadSFTTrainer, tmp_path / "offload", **named)
    assert isinstance(ours.offload_optimizer, OffloadAdagrad)
    assert_parity(ours, ref)


# -- Trainer: what each name builds, and what is refused ---------------------------------

ADAM = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-7}
ADAGRAD_DEFAULTS = {"lr": 1e-3, "eps": 1e-10, "lr_decay": 0.0, "initial_accumulator_value": 0.0}
BUILT = {
    "adamw_torch": (OffloadAdamW, ADAM),
    "adamw_torch_fused": (OffloadAdamW, ADAM),
    # torch's eps (1e-10), not adam_epsilon, as Trainer builds torch's Adagrad
    "adagrad": (OffloadAdagrad, ADAGRAD_DEFAULTS),
    "lion_32bit": (OffloadLion, {"lr": 1e-3, "betas": (0.9, 0.95)}),
    "paged_lion_32bit": (OffloadLion, {"lr": 1e-3, "betas": (0.9, 0.95)}),
}


@pytest.mark.parametrize("optim", list(BUILT))
def test_each_name_builds_its_rule_over_trainers_groups(tmp_path: Path, optim: str) -> None:
    trainer = offload_trainer(tiny_gpt2(), training_args(tmp_path, optim=optim, adam_epsilon=1e-7))
    trainer.create_optimizer()
    opt = trainer.offload_optimizer
    cls, hyper = BUILT[optim]
    assert type(opt) is cls
    decay, no_decay = opt.param_groups
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all("bias" in names[id(p)] or "ln_" in names[id(p)] for p in no_decay["params"])
    for group in opt.param_groups:
        assert {key: group[key] for key in hyper} == hyper
    assert opt.config.max_grad_norm == MAX_GRAD_NORM


@pytest.mark.parametrize(
    ("optim", "optim_args"),
    [("adamw_torch", None), ("adamw_torch_fused", None), ("adagrad", None),
     ("adagrad", "lr_decay=0.1,eps=1e-6")],
)  # fmt: skip
def test_keywords_are_those_transformers_gives_torch(
    tmp_path: Path, optim: str, optim_args: str | None
) -> None:
    """Trainer's own handler for the name (trainer_optimizer.py) against ours: every keyword
    it passes torch's optimizer is ours too (``fused`` picks torch's kernel only)."""
    args = training_args(tmp_path, optim=optim, optim_args=optim_args, adam_epsilon=1e-7)
    _, theirs = Trainer.get_optimizer_cls_and_kwargs(args)
    _, ours = optimizer_cls_and_kwargs(args)
    assert {k: v for k, v in theirs.items() if k != "fused"}.items() <= ours.items()


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"optim": "adafactor"}, "transformers' own Adafactor.*optimizers=.OffloadAdafactor"),
        ({"optim": "lion_8bit"}, "8-bit blockwise.*optim='lion_32bit'"),
        ({"optim": "paged_lion_8bit"}, "8-bit blockwise"),
        ({"optim": "sgd"}, re.escape(f"optim in {ACCEPTED}")),
        ({"optim": "adagrad", "optim_args": "initial_accumulator_value=0.1"},
         "'initial_accumulator_value' is not read.*only \\('lr_decay', 'eps'\\)"),
        ({"optim": "adagrad", "optim_args": "weight_decay=0.1"},
         "set TrainingArguments.weight_decay"),
        ({"optim": "lion_32bit", "optim_args": "beta1=0.8"}, "not read for optim='lion_32bit'"),
        ({"optim": "adagrad", "optim_args": "eps"}, "'eps' is not key=value"),
        ({"optim": "adagrad", "optim_args": "eps=small"}, "eps='small' is not a number"),
    ],
    ids=["adafactor", "lion-8bit", "paged-lion-8bit", "sgd", "adagrad-unread-key",
         "adagrad-weight-decay", "lion-optim-args", "not-key-value", "not-a-number"],
)  # fmt: skip
def test_refused_at_construction_with_the_reason(
    tmp_path: Path, overrides: dict, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        offload_trainer(tiny_gpt2(), training_args(tmp_path, **overrides))


# -- Trainer: a rule passed in -----------------------------------------------------------


@pytest.mark.cuda_form
def test_trainer_with_offload_adafactor_passed_in_matches_torch(tmp_path: Path) -> None:
    """What the refusal of optim="adafactor" points to: torch's Adafactor rule, given."""
    ref = torch_trainer(
        tiny_gpt2(),
        training_args(tmp_path / "torch"),
        optimizer_cls_and_kwargs=(torch.optim.Adafactor, {**ADAFACTOR, "foreach": False}),
    )
    ref.train()
    model = tiny_gpt2()
    decay = set(ref.get_decay_parameter_names(model))
    named = list(model.named_parameters())
    opt = OffloadAdafactor(
        [
            {"params": [p for n, p in named if n in decay], "weight_decay": 0.1},
            {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
        ],
        lr=ADAFACTOR["lr"],
        config=offload_config(),
        accelerator=host_accelerator(),
    )
    ours = OffloadTrainer(
        model=model,
        args=training_args(tmp_path / "offload"),
        train_dataset=TokenDataset(),
        optimizers=(opt, None),
    )
    ours.train()
    assert ours.offload_optimizer is opt
    assert_trainer_parity(ours, ref)


# -- accelerate and Lightning: a rule passed in ------------------------------------------


def _rule(rule: str, params: Any, *, ours: bool) -> torch.optim.Optimizer:
    """The rule under test (``ours``) or its torch reference, over ``params``."""
    if rule == "lion":
        if ours:
            return OffloadLion(params, **LION, config=offload_config(),
                               accelerator=host_accelerator())  # fmt: skip
        return LionReference(params, **LION)
    if ours:
        return OffloadAdafactor(params, **ADAFACTOR, config=offload_config(),
                                accelerator=host_accelerator())  # fmt: skip
    return torch.optim.Adafactor(params, **ADAFACTOR, foreach=False)


@pytest.mark.cuda_form
@pytest.mark.parametrize("rule", ["lion", "adafactor"])
def test_accelerate_loop_matches_torch(rule: str) -> None:
    ref_model, model = tiny_gpt2(), tiny_gpt2()
    device = accelerate_device()
    ref = accelerate_loop(
        Accelerator(**device, gradient_accumulation_steps=2),
        ref_model,
        _rule(rule, ref_model.parameters(), ours=False),
        loader(),
    )
    ours = accelerate_loop(
        OffloadAccelerator(**device, gradient_accumulation_steps=2),
        model,
        _rule(rule, model.parameters(), ours=True),
        loader(),
    )
    assert min(ref["norms"]) > MAX_NORM  # clipping binds
    torch.testing.assert_close(ours["losses"], ref["losses"], rtol=0, atol=1e-6)
    torch.testing.assert_close(ours["norms"], ref["norms"], rtol=1e-6, atol=0)
    assert max_weight_diff(weights(model), weights(ref_model)) < 3e-6


class _RuleBody(_Body):
    """test_integration_lightning's module, with ``kind`` = (rule, ours)."""

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        if isinstance(optimizer, OffloadOptimizer):
            self.norms.append(optimizer.grad_norm().item())
        else:
            super().on_before_optimizer_step(optimizer)

    def configure_optimizers(self) -> Any:
        rule, ours = self.kind
        opt = _rule(rule, self.parameters(), ours=ours)
        schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


class OffloadRuleNet(_RuleBody, OffloadLightningModule):
    pass


class TorchRuleNet(_RuleBody, pl.LightningModule):
    pass


@pytest.mark.cuda_form
@pytest.mark.parametrize("rule", ["lion", "adafactor"])
def test_lightning_clip_and_accumulate_match_torch(rule: str) -> None:
    ref, ours = TorchRuleNet((rule, False)), OffloadRuleNet((rule, True))
    trainer().fit(ref)
    trainer().fit(ours)
    assert len(ref.norms) == STEPS and min(ref.norms) > CLIP  # clipping binds every step
    torch.testing.assert_close(ours.losses, ref.losses, rtol=0, atol=1e-6)
    torch.testing.assert_close(ours.norms, ref.norms, rtol=1e-6, atol=0)
    assert lightning_diff(lightning_weights(ours), lightning_weights(ref)) < 1e-6
