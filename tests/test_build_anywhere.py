"""Build from anywhere: OffloadAdamW over CPU weights and over a model on the meta device
loaded from a safetensors checkpoint (zero_offload.load_pretrained); peaks against a formula;
bad checkpoints refused before anything changes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import GPT2Config, GPT2LMHeadModel

from zero_offload import OffloadAdamW, OffloadConfig, load_pretrained
from zero_offload.weights import has_source

from ._models import host_accelerator

VOCAB = 128
SEQ = 16


def gpt2_config() -> GPT2Config:
    return GPT2Config(
        n_layer=2,
        n_embd=32,
        n_head=2,
        vocab_size=VOCAB,
        n_positions=64,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )


def saved(tmp_path: Path, *, sharded: bool) -> Path:
    """A tiny GPT-2 written by transformers' save_pretrained (several shards if asked)."""
    torch.manual_seed(0)
    model = GPT2LMHeadModel(gpt2_config())
    out = tmp_path / ("sharded" if sharded else "single")
    model.save_pretrained(out, max_shard_size="20KB" if sharded else "5GB")
    return out


def on_meta() -> GPT2LMHeadModel:
    with torch.device("meta"):
        return GPT2LMHeadModel(gpt2_config())


def batches(n: int = 3) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (2, SEQ), generator=gen) for _ in range(n)]


def make_opt(model: torch.nn.Module, **config: object) -> OffloadAdamW:
    config.setdefault("bucket_bytes", 16384)
    config.setdefault("tile_elements", 1024)
    kwargs: dict[str, object] = {}
    if config.get("offload_parameters"):
        kwargs = {"model": model}
    return OffloadAdamW(
        model.parameters(),
        lr=1e-2,
        accelerator=host_accelerator(),
        config=OffloadConfig(**config),  # type: ignore[arg-type]
        **kwargs,  # type: ignore[arg-type]
    )


def train(model: torch.nn.Module, opt: OffloadAdamW) -> None:
    for tokens in batches():
        model(input_ids=tokens, labels=tokens).loss.backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("sharded", [False, True], ids=["one-file", "sharded"])
@pytest.mark.parametrize(
    "config",
    [{}, {"offload_parameters": True}, {"nvme_dir": "NVME"}],
    ids=["resident-weights", "param-offload", "nvme-state"],
)
def test_meta_checkpoint_trains_bitwise_like_a_normal_load(
    tmp_path: Path, sharded: bool, config: dict[str, object]
) -> None:
    path = saved(tmp_path, sharded=sharded)
    if sharded:
        assert (path / "model.safetensors.index.json").is_file()
    config = {k: (str(tmp_path / v) if k == "nvme_dir" else v) for k, v in config.items()}
    if "nvme_dir" in config:
        config["host_budget"] = 0  # every bucket's state on NVMe
    reference = GPT2LMHeadModel.from_pretrained(path)
    ref_opt = make_opt(reference, **config)
    model = load_pretrained(on_meta(), path)
    assert all(p.is_meta and has_source(p) for p in model.parameters())
    opt = make_opt(model, **config)
    assert not any(p.is_meta for p in model.parameters())
    assert model.lm_head.weight is model.transformer.wte.weight  # still tied
    for name, param in model.named_parameters():  # loaded exactly, before training
        assert torch.equal(param, dict(reference.named_parameters())[name]), name
    train(reference, ref_opt)
    train(model, opt)
    ref_opt.flush_pending_update()
    for name, param in model.named_parameters():
        assert torch.equal(param, dict(reference.named_parameters())[name]), name
    ref_opt.close()
    opt.close()


def _host_pool_bytes(opt: OffloadAdamW) -> int:
    pools = sum(p.capacity for p in opt.manager.pools if p.kind != "device")
    return pools + sum(len(t.buffers) * t.buffer_bytes for t in opt.manager.storage)


def _device_pool_bytes(opt: OffloadAdamW) -> int:
    return sum(p.capacity for p in opt.manager.pools if p.kind == "device")


def test_cpu_weights_construction_peaks_follow_the_formula() -> None:
    torch.manual_seed(0)
    model = GPT2LMHeadModel(gpt2_config())
    originals = sum(p.numel() * p.element_size() for p in model.parameters())
    opt = make_opt(model)
    peaks = opt.construction_peaks
    bucket = max(b.layout.padded_numel * 4 for b in opt.buckets)  # fp32 weights, bytes
    # Device: the pools, allocated whole before any weight moves (the final footprint); the
    # originals are host memory (Note [construction peaks]), so nothing else.
    assert peaks.device == _device_pool_bytes(opt)
    # Host: before anything moves, the user's CPU originals; every one is released (moved
    # into its device slot) before the host pool is pinned, so after that the final host
    # footprint (state pool, gradient staging) alone. Never both at once.
    final_host = _host_pool_bytes(opt)
    assert peaks.host == max(originals, final_host)
    # The rule of the issue: final footprint plus one bucket at most, on each tier.
    assert peaks.device <= _device_pool_bytes(opt) + bucket
    assert peaks.host <= final_host + bucket
    opt.close()


@pytest.mark.parametrize("offload", [False, True], ids=["resident-weights", "param-offload"])
def test_meta_checkpoint_construction_peaks_follow_the_formula(
    tmp_path: Path, offload: bool
) -> None:
    path = saved(tmp_path, sharded=True)
    tensors = {}
    for shard in path.glob("*.safetensors"):
        tensors.update(load_file(shard))
    largest = max(t.numel() * t.element_size() for t in tensors.values())
    model = load_pretrained(on_meta(), path)
    opt = make_opt(model, offload_parameters=offload)
    peaks = opt.construction_peaks
    final_host = _host_pool_bytes(opt)
    # Device: the pools (and with parameter offload, the window), whole, nothing else: no
    # original was ever on the device.
    assert peaks.device == _device_pool_bytes(opt)
    if offload:
        # Host: the host pool (the homes) comes first and each tensor is read into its
        # unit's slot while it exists: the final footprint plus the one tensor being read.
        assert peaks.host <= final_host + largest
        assert peaks.host > final_host - largest  # it is measured, not zero
    else:
        # Host: the tensors are read (one at a time) before the host pool is pinned: the
        # largest single tensor, or the final footprint, whichever is more.
        assert peaks.host == max(largest, final_host)
    opt.close()


def _rewrite(path: Path, edit: object) -> None:
    file = path / "model.safetensors"
    tensors = load_file(file)
    edit(tensors)  # type: ignore[operator]
    save_file(tensors, file, metadata={"format": "pt"})


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (
            lambda t: t.pop("transformer.h.1.mlp.c_fc.weight"),
            r"'transformer\.h\.1\.mlp\.c_fc\.weight' \(shape \(32, 128\)\)",
        ),
        (
            lambda t: t.update(extra=torch.zeros(3)),
            r"'extra' \(shape \(3,\), in model\.safetensors\)",
        ),
        (
            lambda t: t.update({"transformer.ln_f.bias": torch.zeros(31)}),
            r"'transformer\.ln_f\.bias' in .*model\.safetensors has shape \(31,\).* \(32,\)",
        ),
    ],
    ids=["missing", "unexpected", "mis-shaped"],
)
def test_bad_checkpoints_are_refused_and_leave_the_model_untouched(
    tmp_path: Path, edit: object, match: str
) -> None:
    path = saved(tmp_path, sharded=False)
    _rewrite(path, edit)
    model = on_meta()
    with pytest.raises(ValueError, match=match):
        load_pretrained(model, path)
    assert all(p.is_meta and not has_source(p) for p in model.parameters())


def test_meta_parameters_without_a_source_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"meta device .*load_pretrained"):
        OffloadAdamW(on_meta().named_parameters(), accelerator=host_accelerator())


def test_a_missing_checkpoint_names_what_would_work(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"model\.safetensors\.index\.json"):
        load_pretrained(on_meta(), tmp_path)


def test_frozen_parameters_on_meta_are_loaded_at_once(tmp_path: Path) -> None:
    path = saved(tmp_path, sharded=True)
    reference = GPT2LMHeadModel.from_pretrained(path)
    model = on_meta()
    model.transformer.wpe.weight.requires_grad_(False)
    load_pretrained(model, path)
    frozen = model.transformer.wpe.weight
    assert not frozen.is_meta and not frozen.requires_grad
    assert torch.equal(frozen, reference.transformer.wpe.weight)
    assert model.transformer.h[0].attn.c_attn.weight.is_meta  # trainable: read at build
    opt = make_opt(model)
    assert frozen not in {p for b in opt.buckets for p in b.params}
    opt.close()


def test_offload_trainer_loads_a_meta_model_from_a_checkpoint_path(tmp_path: Path) -> None:
    from zero_offload.integrations.transformers import OffloadTrainer

    from ._hf import TokenDataset, training_args

    path = saved(tmp_path, sharded=True)
    runs = {}
    for name, model, weights, config in (
        ("reference", GPT2LMHeadModel.from_pretrained(path), None, OffloadConfig()),
        ("meta", on_meta(), path, OffloadConfig(offload_parameters=True)),
    ):
        trainer = OffloadTrainer(
            model=model,
            args=training_args(tmp_path / name, max_steps=3),
            train_dataset=TokenDataset(n=24),
            offload_config=config,
            offload_device=host_accelerator(),
            weights=weights,
        )
        trainer.train()
        # Copies (unknown memory to strict mode): between steps a parameter-offloaded
        # weight is a view of its pinned home today.
        runs[name] = {n: p.detach().to("cpu", copy=True) for n, p in model.named_parameters()}
        # Parameter offload: the optimizer was given the model and found its blocks.
        assert (trainer.offload_optimizer.param_offloader is not None) == (name == "meta")
        trainer.offload_optimizer.close()
    for name, value in runs["reference"].items():
        assert torch.equal(runs["meta"][name], value), name


def test_a_failed_construction_leaves_the_model_loadable_again(tmp_path: Path) -> None:
    path = saved(tmp_path, sharded=True)
    reference = GPT2LMHeadModel.from_pretrained(path)
    model = load_pretrained(on_meta(), path)
    with pytest.raises(MemoryError):  # the device pool does not fit: nothing was read
        OffloadAdamW(model.parameters(), accelerator=host_accelerator(device_budget=4096))
    assert all(p.is_meta and has_source(p) for p in model.parameters())
    # A shard that went missing half-way: the buckets read so far keep their values.
    shards = sorted(path.glob("model-*.safetensors"))
    shards[0].rename(shards[0].with_suffix(".gone"))
    with pytest.raises(ValueError, match=rf"cannot (open|read) .*{shards[0].name}"):
        make_opt(model)
    shards[0].with_suffix(".gone").rename(shards[0])
    meta = [p.is_meta for p in model.parameters()]
    assert any(meta) and not all(meta)  # half-way: some buckets were read
    expected = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        if not param.is_meta:
            assert torch.equal(param, expected[name]), name
    opt = make_opt(model)  # and the rest loads now
    for name, param in model.named_parameters():
        assert torch.equal(param, expected[name]), name
    opt.close()
