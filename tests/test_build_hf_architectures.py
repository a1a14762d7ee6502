"""Building from anywhere and exporting back, as users do it with real Hugging Face
architectures (Llama with tied embeddings under ``accelerate.init_empty_weights``, BERT's and
Llama's non-persistent buffers under ``torch.device("meta")``) and an export into a directory
that already holds one, failing half-way."""

from __future__ import annotations

import errno
from pathlib import Path

import accelerate
import pytest
import torch
from transformers import BertConfig, BertModel, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from zero_offload import OffloadAdamW, fileio, load_pretrained, save_pretrained
from zero_offload.errors import StorageFull
from zero_offload.weights import has_source

from .helpers.models import host_accelerator
from .test_build_anywhere import batches, make_opt, on_meta, saved


def llama_config(*, tied: bool) -> LlamaConfig:
    return LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
    )


def bert_config() -> BertConfig:
    return BertConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        vocab_size=128,
        max_position_embeddings=64,
    )


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("offload", [False, True], ids=["resident-weights", "param-offload"])
def test_llama_built_under_init_empty_weights_loads_and_matches_from_pretrained(
    tmp_path: Path, tied: bool, offload: bool
) -> None:
    torch.manual_seed(0)
    LlamaForCausalLM(llama_config(tied=tied)).save_pretrained(tmp_path, max_shard_size="50KB")
    reference = LlamaForCausalLM.from_pretrained(tmp_path).eval()
    # init_empty_weights re-creates each parameter as it is registered, so the model's own
    # tying (post_init) leaves lm_head a separate meta parameter; the checkpoint has no key
    # for it (transformers saves a tied weight once). from_pretrained ties after building.
    with accelerate.init_empty_weights():
        model = LlamaForCausalLM(llama_config(tied=tied))
    load_pretrained(model, tmp_path)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    opt = make_opt(model, offload_parameters=offload)
    model.eval()
    tokens = batches(1)[0]
    with torch.no_grad():
        assert torch.equal(model(tokens).logits, reference(tokens).logits)
    opt.close()


@pytest.mark.parametrize(
    ("build", "names"),
    [
        (lambda: BertModel(bert_config()), r"'embeddings\.position_ids'"),
        (lambda: LlamaForCausalLM(llama_config(tied=False)), r"'model\.rotary_emb\.inv_freq'"),
    ],
    ids=["bert", "llama"],
)
def test_non_persistent_buffers_on_meta_are_refused_by_name(
    tmp_path: Path, build: object, names: str
) -> None:
    torch.manual_seed(0)
    build().save_pretrained(tmp_path)  # type: ignore[operator]
    with torch.device("meta"):
        model = build()  # type: ignore[operator]
    # Not in any checkpoint: left on meta, BERT's forward silently gives NaN and Llama's
    # fails with "Cannot copy out of meta tensor". Refused up front, by name.
    with pytest.raises(ValueError, match=rf"non-persistent buffer.*{names}.*init_empty_weights"):
        load_pretrained(model, tmp_path)
    assert all(p.is_meta and not has_source(p) for p in model.parameters())
    # Under init_empty_weights the buffers are real, and BERT matches from_pretrained.
    if isinstance(model, BertModel):
        with accelerate.init_empty_weights():
            model = build()  # type: ignore[operator]
        load_pretrained(model, tmp_path)
        opt = make_opt(model)
        model.eval()
        reference = BertModel.from_pretrained(tmp_path).eval()
        tokens = batches(1)[0]
        with torch.no_grad():
            assert torch.equal(model(tokens)[0], reference(tokens)[0])
        opt.close()


@pytest.mark.parametrize("fail_at", [3, 17], ids=["second-shard", "index"])
def test_a_sharded_export_that_fails_half_way_leaves_the_previous_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fail_at: int
) -> None:
    model = GPT2LMHeadModel.from_pretrained(saved(tmp_path, sharded=False))
    out = tmp_path / "export"
    save_pretrained(model, out, max_shard_size="20KB")
    previous = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for param in model.parameters():
            param.add_(1.0)
    # The same shard names again (eight of them); the disk fills up while the second shard,
    # or the index after all eight, is made durable (two fsyncs a file: it, its directory).
    synced = []
    real = fileio._fsync

    def fills_up(fd: int) -> None:
        synced.append(fd)
        if len(synced) == fail_at:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd)

    monkeypatch.setattr(fileio, "_fsync", fills_up)
    with pytest.raises(StorageFull):
        save_pretrained(model, out, max_shard_size="20KB")
    monkeypatch.undo()
    loaded = GPT2LMHeadModel.from_pretrained(out).state_dict()
    for key, value in previous.items():
        assert torch.equal(loaded[key], value), key
    assert len(list(out.glob("model-*-of-00008.safetensors"))) == 8
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")]  # no temporaries


class _WithEmpty(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)
        self.empty = torch.nn.Parameter(torch.zeros(0, 8))  # trainable, no elements

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) + torch.cat([self.empty, x]).sum(0)


def test_an_empty_trainable_parameter_on_meta_is_loaded_at_once(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    torch.manual_seed(0)
    reference = _WithEmpty()
    save_file({k: v.contiguous() for k, v in reference.state_dict().items()}, tmp_path / "w.st")
    with torch.device("meta"):
        model = _WithEmpty()
    load_pretrained(model, tmp_path / "w.st")
    # The optimizer skips parameters without elements (as torch does): read now, it is
    # not left on meta, where the forward would fail on it.
    assert not model.empty.is_meta and model.fc.weight.is_meta
    opt = make_opt(model)
    x = torch.randn(3, 8)
    assert torch.equal(model(x), reference(x))
    opt.close()


@pytest.mark.parametrize("offload", [False, True], ids=["resident-weights", "param-offload"])
def test_adapters_on_a_base_frozen_then_loaded_train_like_a_normal_load(
    tmp_path: Path, offload: bool
) -> None:
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    LlamaForCausalLM(llama_config(tied=True)).save_pretrained(tmp_path)
    lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    runs = []
    for from_meta in (False, True):  # the recipe of docs/big-models.md, and a plain load
        if from_meta:
            with accelerate.init_empty_weights():
                base = LlamaForCausalLM(llama_config(tied=True))
            base.requires_grad_(False)
            load_pretrained(base, tmp_path)  # the frozen base is read now
        else:
            base = LlamaForCausalLM.from_pretrained(tmp_path)
        torch.manual_seed(1)
        model = get_peft_model(base, lora)
        assert not any(p.is_meta for p in model.parameters())
        opt = make_opt(model, offload_parameters=offload and from_meta)
        losses = []
        for tokens in batches(2):
            loss = model(input_ids=tokens, labels=tokens).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        runs.append((losses, {n: p.detach().clone() for n, p in model.named_parameters()}))
        opt.close()
    assert runs[0][0] == runs[1][0]
    for name, value in runs[0][1].items():
        assert torch.equal(runs[1][1][name], value), name


def test_a_forward_before_the_optimizer_read_the_weights_names_them(tmp_path: Path) -> None:
    path = saved(tmp_path, sharded=False)
    tokens = batches(1)[0]
    # The optimizer over a subset: the others wait on meta.
    model = load_pretrained(on_meta(), path)
    opt = OffloadAdamW(
        [p for n, p in model.named_parameters() if ".h.0." in n], accelerator=host_accelerator()
    )
    with pytest.raises(ValueError, match=r"'transformer\.wte\.weight'.* still wait on the meta"):
        model(tokens)
    opt.close()
    # Frozen after load_pretrained: never read (freeze before it, docs/big-models.md).
    model = load_pretrained(on_meta(), path)
    model.transformer.h[1].requires_grad_(False)
    opt = make_opt(model)
    with pytest.raises(ValueError, match=r"'transformer\.h\.1\.ln_1\.weight'.*freeze before"):
        model(tokens)
    opt.close()
    # Built over all: the checks go with the first forward.
    model = load_pretrained(on_meta(), path)
    opt = make_opt(model)
    model(tokens)
    assert not any(m._forward_pre_hooks for m in model.modules())
    opt.close()
