"""The estimator's shapes from transformers configs: every parameter counted as the real
model registers it (on the meta device: no memory, no download), for each family."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from zero_offload.estimate import (  # noqa: E402  (after the importorskip)
    KNOWN_MODELS,
    ModelShape,
    estimate,
    load_config,
    shape_from_config,
)

GiB = 2**30

# Small members of each family, with the knobs that change the count: GQA, an MLP width
# that is not 4x, tied and untied heads, experts, a shared expert.
SMALL_CONFIGS: dict[str, Any] = {
    "gpt2": lambda: transformers.GPT2Config(
        n_embd=64, n_layer=2, n_head=4, n_positions=48, vocab_size=101
    ),
    "gpt2-inner-untied": lambda: transformers.GPT2Config(
        n_embd=64, n_layer=3, n_head=4, n_inner=96, vocab_size=101, tie_word_embeddings=False
    ),
    "llama-gqa": lambda: transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        vocab_size=103,
    ),
    "llama-tied-head-dim": lambda: transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=32,
        vocab_size=103,
        tie_word_embeddings=True,
    ),
    "mistral": lambda: transformers.MistralConfig(
        hidden_size=64,
        intermediate_size=112,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=97,
    ),
    "qwen2": lambda: transformers.Qwen2Config(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=107,
    ),
    "mixtral": lambda: transformers.MixtralConfig(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        vocab_size=97,
    ),
    "qwen2-moe": lambda: transformers.Qwen2MoeConfig(
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=48,
        shared_expert_intermediate_size=80,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        vocab_size=109,
    ),
}

# Parameter totals the model cards publish (the same as the meta-device count below).
PUBLISHED = {
    "gpt2": 124_439_808,
    "llama-2-7b": 6_738_415_616,
    "llama-3-8b": 8_030_261_248,
    "llama-3-70b": 70_553_706_496,
    "mistral-7b": 7_241_732_096,
    "mixtral-8x7b": 46_702_792_704,
    "qwen2-7b": 7_615_616_512,
    "qwen1.5-moe-a2.7b": 14_315_784_192,
}


def _meta_model(config: Any) -> torch.nn.Module:
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config)


def _numels(model: torch.nn.Module) -> list[int]:
    # parameters() yields a tied weight once, as the optimizer sees it.
    return sorted(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", list(SMALL_CONFIGS))
def test_small_config_counts_every_parameter(name: str) -> None:
    config = SMALL_CONFIGS[name]()
    shape = shape_from_config(config, seq_len=16)
    model = _meta_model(config)
    assert shape.params == sum(_numels(model))
    # Not only the sum: the same tensors (a Conv1D's are transposed; the sizes agree).
    assert sorted(math.prod(s) for s in shape.parameter_shapes()) == _numels(model)
    assert shape.tied == bool(getattr(config, "tie_word_embeddings", False))


@pytest.mark.parametrize("name", list(KNOWN_MODELS))
def test_known_model_counts_the_real_model(name: str) -> None:
    fields = KNOWN_MODELS[name]
    shape = shape_from_config(load_config(name), seq_len=1024)
    assert shape.params == PUBLISHED[name]
    config = transformers.AutoConfig.for_model(**fields)
    assert sum(_numels(_meta_model(config))) == shape.params


def test_llama_3_8b_from_flags_matches_its_config() -> None:
    flags = ModelShape(
        arch="llama",
        layers=32,
        hidden=4096,
        heads=32,
        kv_heads=8,
        ffn=14336,
        vocab=128256,
        seq_len=8192,
    )
    assert flags == shape_from_config(KNOWN_MODELS["llama-3-8b"], seq_len=8192)
    assert flags.params == 8_030_261_248  # not 7.51 B: GQA and the SwiGLU width counted


def test_config_json_path_and_folder(tmp_path: Path) -> None:
    config = SMALL_CONFIGS["llama-gqa"]()
    config.save_pretrained(tmp_path)  # writes tmp_path/config.json, nothing else
    expected = shape_from_config(config, seq_len=64)
    for source in (tmp_path, tmp_path / "config.json", str(tmp_path)):
        assert estimate(source, seq_len=64, device_memory=GiB, host_memory=4 * GiB).shape == (
            expected
        )


def test_estimate_takes_a_config_object_and_a_transformers_model() -> None:
    config = SMALL_CONFIGS["qwen2"]()
    by_config = estimate(config, seq_len=32, device_memory=GiB, host_memory=4 * GiB)
    model = transformers.AutoModelForCausalLM.from_config(config)  # real, tiny
    by_model = estimate(model, seq_len=32, device_memory=GiB, host_memory=4 * GiB)
    assert by_model.shape == by_config.shape  # the model's config gives the shape
    assert by_model.params == sum(p.numel() for p in model.parameters())
    assert by_model.rows[0].device_activations > 0  # so activations are counted


def test_a_model_whose_trainables_differ_from_its_config_uses_its_tensors() -> None:
    model = transformers.AutoModelForCausalLM.from_config(SMALL_CONFIGS["qwen2"]())
    model.model.embed_tokens.weight.requires_grad_(False)  # frozen: not trained
    result = estimate(model, device_memory=GiB, host_memory=4 * GiB)
    assert result.shape is None
    assert result.params == sum(p.numel() for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize(
    ("config", "needle"),
    [
        ({"model_type": "bert", "hidden_size": 8}, "model_type='bert'"),
        ({"model_type": "llama", "hidden_size": 8}, "'num_attention_heads'"),
        ({**KNOWN_MODELS["llama-3-8b"], "attention_bias": True}, "attention_bias"),
        ({**KNOWN_MODELS["qwen1.5-moe-a2.7b"], "decoder_sparse_step": 2}, "decoder_sparse_step"),
    ],
)
def test_unreadable_configs_are_refused(config: dict[str, Any], needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        shape_from_config(config, seq_len=8)


def test_unknown_name_and_bad_file_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="nothing is downloaded"):
        load_config("meta-llama/Meta-Llama-3-8B")  # a Hub id: not fetched
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="cannot read"):
        load_config(bad)
    bad.write_text(json.dumps([1, 2]))
    with pytest.raises(ValueError, match="no JSON object"):
        load_config(tmp_path)
