"""A ``ModelShape`` from a transformers config: a ``config.json`` (a path, or the folder that
holds it), a config object or dict, or the name of a well-known model. Nothing here touches
the network or imports torch or transformers: a config is plain JSON."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from .shape import ModelShape

__all__ = ["KNOWN_MODELS", "SUPPORTED_MODEL_TYPES", "load_config", "shape_from_config"]

# The dimensions of well-known models, written down from their public config.json files on
# the Hugging Face Hub (the repository named in each comment); only the fields the shape needs.
KNOWN_MODELS: dict[str, dict[str, Any]] = {
    # openai-community/gpt2 (124M)
    "gpt2": {
        "model_type": "gpt2",
        "n_embd": 768,
        "n_layer": 12,
        "n_head": 12,
        "n_positions": 1024,
        "n_inner": None,
        "vocab_size": 50257,
        "tie_word_embeddings": True,
    },
    # meta-llama/Llama-2-7b-hf
    "llama-2-7b": {
        "model_type": "llama",
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "vocab_size": 32000,
        "tie_word_embeddings": False,
    },
    # meta-llama/Meta-Llama-3-8B
    "llama-3-8b": {
        "model_type": "llama",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "tie_word_embeddings": False,
    },
    # meta-llama/Meta-Llama-3-70B
    "llama-3-70b": {
        "model_type": "llama",
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "tie_word_embeddings": False,
    },
    # mistralai/Mistral-7B-v0.1
    "mistral-7b": {
        "model_type": "mistral",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 32000,
        "tie_word_embeddings": False,
    },
    # mistralai/Mixtral-8x7B-v0.1
    "mixtral-8x7b": {
        "model_type": "mixtral",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "vocab_size": 32000,
        "tie_word_embeddings": False,
    },
    # Qwen/Qwen2-7B
    "qwen2-7b": {
        "model_type": "qwen2",
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "vocab_size": 152064,
        "tie_word_embeddings": False,
    },
    # Qwen/Qwen1.5-MoE-A2.7B (model_type qwen2_moe)
    "qwen1.5-moe-a2.7b": {
        "model_type": "qwen2_moe",
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "moe_intermediate_size": 1408,
        "shared_expert_intermediate_size": 5632,
        "num_hidden_layers": 24,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "num_experts": 60,
        "num_experts_per_tok": 4,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "vocab_size": 151936,
        "tie_word_embeddings": False,
    },
}


def _get(config: Mapping[str, Any], key: str, default: Any = ...) -> Any:
    value = config.get(key, default)
    if value is ...:
        raise ValueError(
            f"the {config.get('model_type')!r} config has no {key!r}; a transformers "
            "config.json of that model type has it"
        )
    return value


def _decoder(config: Mapping[str, Any], arch: str, **extra: Any) -> dict[str, Any]:
    """The fields of a Llama-style config (Llama, Mistral, Qwen2 and their MoE kin)."""
    for key in ("attention_bias", "mlp_bias"):
        if config.get(key):
            raise ValueError(
                f"the {config.get('model_type')!r} config sets {key}=True; the estimator "
                "knows the unbiased layout only"
            )
    heads = _get(config, "num_attention_heads")
    return {
        "arch": arch,
        "layers": _get(config, "num_hidden_layers"),
        "hidden": _get(config, "hidden_size"),
        "heads": heads,
        "kv_heads": config.get("num_key_value_heads") or heads,
        "head_dim": config.get("head_dim"),
        "ffn": _get(config, "intermediate_size"),
        "vocab": _get(config, "vocab_size"),
        "tied": bool(config.get("tie_word_embeddings", False)),
        **extra,
    }


def _gpt2(config: Mapping[str, Any]) -> dict[str, Any]:
    hidden = _get(config, "n_embd")
    return {
        "arch": "gpt",
        "layers": _get(config, "n_layer"),
        "hidden": hidden,
        "heads": _get(config, "n_head"),
        "ffn": config.get("n_inner") or 4 * hidden,
        "vocab": _get(config, "vocab_size"),
        "positions": _get(config, "n_positions"),
        "tied": bool(config.get("tie_word_embeddings", True)),
    }


def _mixtral(config: Mapping[str, Any]) -> dict[str, Any]:
    return _decoder(
        config,
        "llama",
        experts=_get(config, "num_local_experts"),
        experts_per_token=_get(config, "num_experts_per_tok"),
    )


def _qwen2_moe(config: Mapping[str, Any]) -> dict[str, Any]:
    step, dense = config.get("decoder_sparse_step", 1), config.get("mlp_only_layers") or []
    if step != 1 or dense:
        raise ValueError(
            f"the qwen2_moe config mixes dense and sparse layers (decoder_sparse_step={step}, "
            f"mlp_only_layers={dense}); the estimator knows blocks that are all alike: "
            "decoder_sparse_step=1, mlp_only_layers=[]"
        )
    fields = _decoder(
        config,
        "qwen2",
        experts=_get(config, "num_experts"),
        experts_per_token=_get(config, "num_experts_per_tok"),
        shared_ffn=_get(config, "shared_expert_intermediate_size"),
    )
    fields["ffn"] = _get(config, "moe_intermediate_size")
    return fields


_CONVERTERS: dict[str, Callable[[Mapping[str, Any]], dict[str, Any]]] = {
    "gpt2": _gpt2,
    "llama": lambda c: _decoder(c, "llama"),
    "mistral": lambda c: _decoder(c, "llama"),
    "mixtral": _mixtral,
    "qwen2": lambda c: _decoder(c, "qwen2"),
    "qwen2_moe": _qwen2_moe,
}
#: ``model_type`` values ``shape_from_config`` reads.
SUPPORTED_MODEL_TYPES = tuple(_CONVERTERS)


def shape_from_config(
    config: Mapping[str, Any] | Any, *, seq_len: int, micro_batch: int = 1
) -> ModelShape:
    """The ``ModelShape`` of a transformers config (a dict as in ``config.json``, or a
    ``PretrainedConfig``): every width from the config, ``seq_len`` and ``micro_batch``
    from the caller."""
    if not isinstance(config, Mapping):
        to_dict = getattr(config, "to_dict", None)
        if not callable(to_dict):
            raise TypeError(
                f"config must be a transformers config or a dict, got {type(config).__name__}"
            )
        config = to_dict()
    model_type = config.get("model_type")
    if model_type not in _CONVERTERS:
        raise ValueError(
            f"config model_type={model_type!r} is not one the estimator reads; supported: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)} (or give the widths as a ModelShape)"
        )
    return ModelShape(**_CONVERTERS[model_type](config), seq_len=seq_len, micro_batch=micro_batch)


def load_config(source: str | Path) -> dict[str, Any]:
    """A config as a dict: ``source`` is a ``config.json``, a folder holding one, or a name
    in ``KNOWN_MODELS``. Reads local files only."""
    if not isinstance(source, (str, Path)) or not str(source):
        raise TypeError(f"hf_config must be a path or a model name, got {source!r}")
    path = Path(source)
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        try:
            loaded = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(
                f"hf_config={str(source)!r}: cannot read {path} as JSON: {exc}"
            ) from exc
        if not isinstance(loaded, dict):
            raise ValueError(f"hf_config={str(source)!r}: {path} holds no JSON object")
        return loaded
    name = str(source).strip().lower()
    if name in KNOWN_MODELS:
        return dict(KNOWN_MODELS[name])
    raise ValueError(
        f"hf_config={str(source)!r} is neither a config.json, a folder holding one, nor a "
        f"known model ({', '.join(KNOWN_MODELS)}); nothing is downloaded: save the model's "
        "config.json and pass its path"
    )
