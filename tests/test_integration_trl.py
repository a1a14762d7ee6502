"""OffloadSFTTrainer against TRL's SFTTrainer with torch's AdamW: tiny GPT-2 built from its
config and a word-level tokenizer built here (nothing is downloaded), CPU, fp32.

Tolerances as in test_integration_transformers.py (torch's fused and for-loop AdamW
differ by 6e-7 in the weights after a few steps): losses 1e-6, logged grad norms 1e-6
relative, weights 3e-6.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from transformers import PreTrainedTokenizerFast, Trainer
from trl import DPOConfig, DPOTrainer, GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer

from zero_offload import OffloadAdamW
from zero_offload.integrations.transformers import OffloadTrainer
from zero_offload.integrations.trl import OffloadDPOTrainer, OffloadGRPOTrainer, OffloadSFTTrainer

from .helpers.device import run_kind
from .helpers.hf import (
    VOCAB,
    logged,
    max_weight_diff,
    offload_config,
    tiny_gpt2,
    training_args,
    weights,
)
from .helpers.models import host_accelerator

MAX_GRAD_NORM = 0.5  # full fine-tuning: the norms are above 1, clipping binds every step
STEPS = 6
DPO_MAX_GRAD_NORM = 0.5


def tokenizer() -> PreTrainedTokenizerFast:
    """Whitespace-separated words ``w3`` .. ``w63``; ``<eos>`` is id 0 (GPT-2's config)."""
    vocab = {"<eos>": 0, "<pad>": 1, "<unk>": 2} | {f"w{i}": i for i in range(3, VOCAB)}
    words = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    words.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=words, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"
    )


def dataset(n: int = 48) -> Dataset:
    """``n`` texts of 6 to 12 random words (a different length each: padding is exercised)."""
    gen = torch.Generator().manual_seed(0)
    texts = []
    for _ in range(n):
        length = int(torch.randint(6, 13, (1,), generator=gen))  # host: text
        ids = torch.randint(3, VOCAB, (length,), generator=gen).tolist()  # host: text
        texts.append(" ".join(f"w{i}" for i in ids))
    return Dataset.from_dict({"text": texts})


def trl_config(kind: type, out: Path, **overrides: Any) -> Any:
    """``training_args`` (the Trainer tests' run, 6 steps) as a TRL config of ``kind``."""
    args = training_args(out, max_steps=STEPS, **overrides)
    fields = args.to_dict() | {"hub_token": args.hub_token}  # to_dict hides the token
    # TRL's own defaults differ: bf16 and gradient checkpointing on, 1024 tokens.
    fields |= {"bf16": args.bf16, "gradient_checkpointing": False, "max_length": 16}
    return kind(**fields)


def preferences(n: int = 24) -> Dataset:
    """``n`` prompts of 4 words, each with a chosen and a rejected 4-word answer."""
    gen = torch.Generator().manual_seed(1)
    words = torch.randint(3, VOCAB, (n, 3, 4), generator=gen).tolist()  # host: text
    prompt, chosen, rejected = (
        [" ".join(f"w{i}" for i in row[part]) for row in words] for part in range(3)
    )
    return Dataset.from_dict({"prompt": prompt, "chosen": chosen, "rejected": rejected})


def run(cls: type, out: Path, *, model: torch.nn.Module | None = None, **kwargs: Any) -> Trainer:
    """Train ``cls`` (a TRL trainer or ours) on the shared data; ``resume`` resumes from
    that checkpoint."""
    resume = kwargs.pop("resume", None)
    overrides = kwargs.pop("overrides", {})
    if issubclass(cls, OffloadTrainer):
        kwargs.setdefault("offload_config", offload_config())
        kwargs.setdefault("offload_device", host_accelerator())
    dpo = issubclass(cls, DPOTrainer)
    if dpo:
        kwargs.setdefault("ref_model", tiny_gpt2())  # TRL would load it by the model's name
    trainer = cls(
        model=tiny_gpt2() if model is None else model,
        args=trl_config(DPOConfig if dpo else SFTConfig, out, **overrides),
        train_dataset=preferences() if dpo else dataset(),
        processing_class=tokenizer(),
        **kwargs,
    )
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def assert_parity(ours: Trainer, ref: Trainer) -> None:
    assert len(logged(ours, "loss")) == STEPS
    torch.testing.assert_close(logged(ours, "loss"), logged(ref, "loss"), rtol=0, atol=1e-6)
    torch.testing.assert_close(
        logged(ours, "grad_norm"), logged(ref, "grad_norm"), rtol=1e-6, atol=0
    )
    assert max_weight_diff(weights(ours.model), weights(ref.model)) < 3e-6


@pytest.fixture(scope="module")
def _sft_pairs() -> Iterator[dict[str, tuple[Trainer, Trainer, Path]]]:
    """``sft_pair``'s runs by kind, kept for the module's tests."""
    pairs: dict[str, tuple[Trainer, Trainer, Path]] = {}
    yield pairs
    pairs.clear()


@pytest.fixture
def sft_pair(
    _sft_pairs: dict[str, tuple[Trainer, Trainer, Path]], tmp_path_factory: pytest.TempPathFactory
) -> tuple[Trainer, Trainer, Path]:
    """TRL with torch's AdamW, and ours saving a checkpoint at step 3: trained once per
    kind, by the first test that asks. Function-scoped, so that it trains on the test's
    device: a module-scoped fixture is set up before the per-test device switch
    (tests/conftest.py's ``_run_device``) and would train on the host in a CUDA form."""
    kind = run_kind()
    if kind not in _sft_pairs:
        out = tmp_path_factory.mktemp("sft")
        ref = run(SFTTrainer, out / "torch")
        saving = {"save_strategy": "steps", "save_steps": STEPS // 2}
        ours = run(OffloadSFTTrainer, out / "offload", overrides=saving)
        _sft_pairs[kind] = (ref, ours, out)
    return _sft_pairs[kind]


@pytest.mark.cuda_form
def test_sft_parity_with_torch_adamw(sft_pair: tuple[Trainer, Trainer, Path]) -> None:
    ref, ours, _ = sft_pair
    assert min(logged(ref, "grad_norm")) > MAX_GRAD_NORM  # clipping binds every step
    assert_parity(ours, ref)
    assert isinstance(ours.offload_optimizer, OffloadAdamW)


@pytest.mark.cuda_form
def test_sft_resume_is_bitwise(sft_pair: tuple[Trainer, Trainer, Path]) -> None:
    _, whole, out = sft_pair
    checkpoint = out / "offload" / f"checkpoint-{STEPS // 2}"
    resumed = run(
        OffloadSFTTrainer, out / "resumed", model=tiny_gpt2(seed=1), resume=str(checkpoint)
    )
    after = STEPS // 2
    assert logged(resumed, "loss", after=after) == logged(whole, "loss")[after:]
    assert logged(resumed, "grad_norm", after=after) == logged(whole, "grad_norm")[after:]
    assert max_weight_diff(weights(resumed.model), weights(whole.model)) == 0.0


@pytest.mark.cuda_form
def test_sft_lora_parity_with_torch_adamw(tmp_path: Path) -> None:
    """SFTTrainer applies the peft_config itself; OffloadAdamW trains the adapters only."""

    def lora() -> LoraConfig:
        return LoraConfig(
            r=4, lora_alpha=8, target_modules=["c_attn"], fan_in_fan_out=True,
            task_type="CAUSAL_LM",
        )  # fmt: skip

    clip = {"overrides": {"max_grad_norm": 0.02}}  # the adapters' norms are small
    ref = run(SFTTrainer, tmp_path / "torch", peft_config=lora(), **clip)
    ours = run(OffloadSFTTrainer, tmp_path / "offload", peft_config=lora(), **clip)
    trained = [p for p in ours.model.parameters() if p.requires_grad]
    assert trained and len(trained) < len(list(ours.model.parameters()))
    assert sum(p.numel() for g in ours.offload_optimizer.param_groups for p in g["params"]) == sum(
        p.numel() for p in trained
    )
    assert_parity(ours, ref)


@pytest.mark.cuda_form
def test_dpo_parity_with_torch_adamw(tmp_path: Path) -> None:
    """DPO: the policy trains, the reference model (passed in) does not."""
    clip = {"overrides": {"max_grad_norm": DPO_MAX_GRAD_NORM}}
    ref = run(DPOTrainer, tmp_path / "torch", **clip)
    ours = run(OffloadDPOTrainer, tmp_path / "offload", **clip)
    assert min(logged(ref, "grad_norm")) > DPO_MAX_GRAD_NORM  # clipping binds every step
    assert_parity(ours, ref)
    policy = {id(p) for p in ours.model.parameters()}
    trained = [p for g in ours.offload_optimizer.param_groups for p in g["params"]]
    assert {id(p) for p in trained} == policy
    assert max_weight_diff(weights(ours.ref_model), weights(tiny_gpt2())) == 0.0


def test_a_trl_that_overrides_a_replaced_route_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """OffloadTrainer's overrides come first in the MRO: a TRL version that clipped its own
    way would be skipped without a word, so construction refuses it."""
    mro = OffloadSFTTrainer.__mro__
    assert mro.index(OffloadTrainer) < mro.index(SFTTrainer)
    monkeypatch.setattr(SFTTrainer, "_clip_grad_norm", Trainer._clip_grad_norm, raising=False)
    with pytest.raises(RuntimeError, match=r"SFTTrainer\._clip_grad_norm"):
        run(OffloadSFTTrainer, tmp_path)


def prompts(n: int = 16) -> Dataset:
    """``n`` prompts of 4 words, for GRPO to complete."""
    gen = torch.Generator().manual_seed(2)
    words = torch.randint(3, VOCAB, (n, 4), generator=gen).tolist()  # host: text
    return Dataset.from_dict({"prompt": [" ".join(f"w{i}" for i in row) for row in words]})


def word_lengths(completions: list[str], **_: Any) -> list[float]:
    """A reward that differs within a group: the completion's letters, over 10."""
    return [sum(len(w) for w in c.split()) / 10 for c in completions]


def run_grpo(
    cls: type,
    out: Path,
    *,
    resume: str | None = None,
    grpo: dict[str, Any] | None = None,
    **overrides: Any,
) -> Trainer:
    """4 steps of 2 micro-batches of 4 completions (groups of 4) of up to 6 tokens, clipped
    at 0.5 (the norms are about 2); ``grpo`` has GRPOConfig's own fields; ``resume`` resumes
    from that checkpoint."""
    fields = {"max_steps": 4, "gradient_accumulation_steps": 2, "max_grad_norm": 0.5}
    args = training_args(out, **fields | overrides)
    fields = args.to_dict() | {"hub_token": args.hub_token}
    fields |= {"bf16": args.bf16, "gradient_checkpointing": False}
    fields |= {"per_device_train_batch_size": 4, "num_generations": 4, "max_completion_length": 6}
    fields |= grpo or {}
    kwargs: dict[str, Any] = {}
    if issubclass(cls, OffloadTrainer):
        kwargs = {"offload_config": offload_config(), "offload_device": host_accelerator()}
    trainer = cls(
        model=tiny_gpt2(),
        args=GRPOConfig(**fields),
        reward_funcs=word_lengths,
        train_dataset=prompts(),
        processing_class=tokenizer(),
        **kwargs,
    )
    trainer.train(resume_from_checkpoint=resume)
    return trainer


@pytest.mark.cuda_form
def test_grpo_parity_with_torch_adamw(tmp_path: Path) -> None:
    """GRPO: TRL samples and scores completions with the policy, which OffloadAdamW trains."""
    ref = run_grpo(GRPOTrainer, tmp_path / "torch")
    ours = run_grpo(OffloadGRPOTrainer, tmp_path / "offload")
    assert min(logged(ref, "grad_norm")) > 0.5  # clipping binds every step
    assert len(logged(ours, "loss")) == 4
    assert logged(ours, "reward") == logged(ref, "reward")  # the same completions
    torch.testing.assert_close(logged(ours, "loss"), logged(ref, "loss"), rtol=0, atol=1e-6)
    torch.testing.assert_close(
        logged(ours, "grad_norm"), logged(ref, "grad_norm"), rtol=1e-6, atol=0
    )
    assert max_weight_diff(weights(ours.model), weights(ref.model)) < 3e-6
    assert isinstance(ours.offload_optimizer, OffloadAdamW)


@pytest.mark.cuda_form
def test_grpo_resume_restores_the_optimizer_and_the_entropy_controller(tmp_path: Path) -> None:
    """Resumed at step 2, GRPO's adaptive entropy coefficient (raised each step: the entropy
    stays under the target) comes back from its checkpoint with the optimizer, so the run is
    bitwise the uninterrupted one (Note [a TRL trainer that extends a replaced route])."""
    adaptive = {
        "use_adaptive_entropy": True, "entropy_coef": 0.1, "entropy_coef_delta": 0.05,
        "entropy_target": 10.0,
    }  # fmt: skip
    saving = {"save_strategy": "steps", "save_steps": 2}
    whole = run_grpo(OffloadGRPOTrainer, tmp_path / "whole", grpo=adaptive, **saving)
    assert whole.entropy_coef == pytest.approx(0.1 + 4 * 0.05)
    resumed = run_grpo(
        OffloadGRPOTrainer,
        tmp_path / "resumed",
        grpo=adaptive,
        resume=str(tmp_path / "whole" / "checkpoint-2"),
    )
    assert resumed.entropy_coef == whole.entropy_coef
    assert logged(resumed, "loss", after=2) == logged(whole, "loss")[2:]
    assert logged(resumed, "grad_norm", after=2) == logged(whole, "grad_norm")[2:]
    assert max_weight_diff(weights(resumed.model), weights(whole.model)) == 0.0


def test_a_trl_override_of_a_replaced_route_runs_after_ours_only_where_declared(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """GRPOTrainer's _load_optimizer_and_scheduler is declared (it runs after
    OffloadTrainer's); another replaced route of GRPOTrainer's would still be refused."""
    mro = OffloadGRPOTrainer.__mro__
    assert mro.index(OffloadTrainer) < mro.index(GRPOTrainer) < mro.index(Trainer)
    monkeypatch.setattr(
        GRPOTrainer,
        "_save_optimizer_and_scheduler",
        Trainer._save_optimizer_and_scheduler,
        raising=False,
    )
    with pytest.raises(RuntimeError, match=r"GRPOTrainer\._save_optimizer_and_scheduler"):
        OffloadGRPOTrainer(model=tiny_gpt2())


def test_plain_sft_trainer_with_offload_adamw_names_the_integration(tmp_path: Path) -> None:
    model = tiny_gpt2()
    opt = OffloadAdamW(model.parameters(), lr=1e-3, accelerator=host_accelerator())
    with pytest.raises(RuntimeError, match="OffloadSFTTrainer"):
        run(SFTTrainer, tmp_path, model=model, optimizers=(opt, None))
