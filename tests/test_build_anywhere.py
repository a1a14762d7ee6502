"""Build from anywhere: OffloadAdamW over CPU weights and over a model on the meta device
loaded from a safetensors checkpoint (zero_offload.load_pretrained); peaks against a formula;
bad checkpoints refused before anything changes.

CUDA form (``cuda_form``, docs/gpu.md): the accelerator and the batches come from
tests/helpers/device.py, so under ``--accelerator=cuda`` the weights built from the CPU, from
the meta device or from the caller's device weights go to ``cuda:0``. "The caller's model on
the GPU" is then ``model.to("cuda:0")`` (``on_simulated_gpu``), a real device original; on
the host accelerator it is host memory registered as device memory. The construction peaks
are the library's own counts (the ledger, the host pools, the originals), the same on either
kind. Host only: the checkpoint-file refusals (no accelerator) and the Trainer run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import GPT2Config, GPT2LMHeadModel

from zero_offload import OffloadAdamW, OffloadConfig, load_pretrained
from zero_offload.accelerator.strict import MEMORY, MemoryKind
from zero_offload.weights import has_source, source
from zero_offload.weights.source import on_device as in_device_memory

from .helpers.device import on_device, run_accelerator, run_device, run_kind

VOCAB = 128
SEQ = 16
GPU = "the caller's model on the GPU"  # the name of its simulated device memory


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
    return [on_device(torch.randint(0, VOCAB, (2, SEQ), generator=gen)) for _ in range(n)]


def make_opt(model: torch.nn.Module, **config: object) -> OffloadAdamW:
    config.setdefault("bucket_bytes", 16384)
    config.setdefault("tile_elements", 1024)
    kwargs: dict[str, object] = {}
    if config.get("offload_parameters"):
        kwargs = {"model": model}
    return OffloadAdamW(
        model.parameters(),
        lr=1e-2,
        accelerator=run_accelerator(),
        config=OffloadConfig(**config),  # type: ignore[arg-type]
        **kwargs,  # type: ignore[arg-type]
    )


def train(model: torch.nn.Module, opt: OffloadAdamW) -> None:
    for tokens in batches():
        model(input_ids=tokens, labels=tokens).loss.backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.cuda_form
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


@pytest.mark.cuda_form
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


@pytest.mark.cuda_form
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
        # Host: each tensor is read into its unit's slot beside the pools of the units
        # built before it (Note [homes are pinned unit by unit]): at most the final
        # footprint plus the one tensor being read.
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


@pytest.mark.cuda_form
def test_meta_parameters_without_a_source_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"meta device .*load_pretrained"):
        OffloadAdamW(on_meta().named_parameters(), accelerator=run_accelerator())


def test_a_missing_checkpoint_names_what_would_work(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"model\.safetensors\.index\.json"):
        load_pretrained(on_meta(), tmp_path)


@pytest.mark.cuda_form
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

    from .helpers.hf import TokenDataset, training_args

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
            offload_device=run_accelerator(),
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


@pytest.mark.cuda_form
def test_a_failed_construction_leaves_the_model_loadable_again(tmp_path: Path) -> None:
    path = saved(tmp_path, sharded=True)
    reference = GPT2LMHeadModel.from_pretrained(path)
    model = load_pretrained(on_meta(), path)
    with pytest.raises(MemoryError):  # the device pool does not fit: nothing was read
        OffloadAdamW(model.parameters(), accelerator=run_accelerator(device_budget=4096))
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
        if not param.is_meta:  # the reference is a CPU model
            assert torch.equal(param, expected[name].to(param.device)), name
    opt = make_opt(model)  # and the rest loads now
    for name, param in model.named_parameters():
        assert torch.equal(param, expected[name].to(param.device)), name
    opt.close()


# -- weights already on the device: Note [originals on the device leave first] ----------


def on_simulated_gpu(model: torch.nn.Module) -> torch.nn.Module:
    """Each parameter's weights moved into memory registered as device memory, as the
    caller's ``model.to("cuda")`` would leave them (the caller's: the ledger does not count
    it). In a CUDA form, the model moved to ``cuda:0``: real device memory."""
    if run_kind() == "cuda":
        return model.to(run_device())
    for param in model.parameters():  # a tied weight once
        memory = torch.empty(param.shape, dtype=param.dtype)  # host: simulated device memory
        MEMORY.register(memory, MemoryKind.DEVICE, GPU)
        memory.copy_(param.detach())
        param.data = memory
    return model


def gpt2(dtype: torch.dtype) -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(gpt2_config()).to(dtype)


@pytest.mark.cuda_form
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("offload", [False, True], ids=["resident-weights", "param-offload"])
def test_device_weights_build_within_the_final_footprint_and_train_bitwise(
    offload: bool, dtype: torch.dtype
) -> None:
    reference = gpt2(dtype)  # the same weights, built from the CPU
    ref_opt = make_opt(reference, offload_parameters=offload)
    model = on_simulated_gpu(gpt2(dtype))
    assert all(in_device_memory(p) for p in model.parameters())
    originals = sum(p.numel() * p.element_size() for p in model.parameters())
    opt = make_opt(model, offload_parameters=offload)
    peaks = opt.construction_peaks
    final_device, final_host = _device_pool_bytes(opt), _host_pool_bytes(opt)
    # Device: the caller's model is on the device when the call starts (the first sample);
    # each original leaves for the host before any pool is allocated, so the pools (the
    # final footprint) never meet it. Nothing else.
    assert peaks.device == max(originals, final_device)
    # The doubling is gone: the old build held the pools and the model at once.
    assert peaks.device < final_device + originals
    if offload:
        # Host: each unit's pool is pinned after its host copies moved into its window slot
        # and were released, and holds at least their bytes (every home in RAM), so the
        # final footprint (Note [homes are pinned unit by unit]); it was final + the model.
        assert originals <= final_host
        assert peaks.host == final_host
    else:
        # Host: the host copies are released bucket by bucket before the host pool is
        # pinned, so max(the model, the final footprint); every bucket's fp32 master is in
        # RAM, which is at least the model: the final host footprint, as before.
        assert originals <= final_host
        assert peaks.host == final_host
    # No parameter views the caller's device memory any more (each is in its slot).
    assert all(MEMORY.lookup(p) is None or MEMORY.lookup(p)[1] != GPU for p in model.parameters())
    train(reference, ref_opt)
    train(model, opt)
    ref_opt.flush_pending_update()
    opt.flush_pending_update()
    for (name, param), ref in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert torch.equal(
            param.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
            ref.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
        ), name
    ref_opt.close()
    opt.close()


def _values(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.cuda_form
@pytest.mark.parametrize("offload", [False, True], ids=["resident-weights", "param-offload"])
def test_a_failed_build_from_device_weights_puts_them_back_on_the_device(
    offload: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = on_simulated_gpu(gpt2(torch.float32))
    before = _values(model)
    config = OffloadConfig(offload_parameters=offload, bucket_bytes=16384)
    kwargs = {"model": model} if offload else {}
    with pytest.raises(MemoryError):  # the device pool does not fit, after the move
        OffloadAdamW(
            model.parameters(),
            accelerator=run_accelerator(device_budget=4096),
            config=config,
            **kwargs,  # type: ignore[arg-type]
        )
    for name, param in model.named_parameters():
        assert in_device_memory(param) and torch.equal(param, before[name]), name
    # A failure half-way through the buckets: some built (then unbound), the rest not.
    calls = {"n": 0}
    real = source.fill

    def failing(param: torch.Tensor, out: torch.Tensor) -> None:
        calls["n"] += 1
        if calls["n"] == 6:
            raise RuntimeError("injected read failure")
        real(param, out)

    monkeypatch.setattr(source, "fill", failing)
    with pytest.raises(RuntimeError, match="injected"):
        make_opt(model, offload_parameters=offload)
    assert calls["n"] == 6
    monkeypatch.setattr(source, "fill", real)
    for name, param in model.named_parameters():
        assert in_device_memory(param) and torch.equal(param, before[name]), name
    # And the model builds and trains as one that never failed.
    reference = gpt2(torch.float32)
    ref_opt = make_opt(reference, offload_parameters=offload)
    opt = make_opt(model, offload_parameters=offload)
    train(reference, ref_opt)
    train(model, opt)
    ref_opt.flush_pending_update()
    opt.flush_pending_update()
    for (name, param), ref in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert torch.equal(param, ref), name
    ref_opt.close()
    opt.close()


@pytest.mark.cuda_form
def test_device_weights_the_caller_still_references_are_reported_and_counted() -> None:
    model = on_simulated_gpu(gpt2(torch.float32))
    originals = sum(p.numel() * p.element_size() for p in model.parameters())
    kept = model.transformer.h[0].mlp.c_fc.weight.detach()  # the caller's view of it
    held = kept.untyped_storage().nbytes()
    with pytest.warns(UserWarning, match=rf"1 device storages .*\({held} bytes\) are still"):
        opt = make_opt(model)
    # Device: the model at the call, or the pools plus the storage the caller kept alive.
    assert opt.construction_peaks.device == max(originals, _device_pool_bytes(opt) + held)
    assert torch.equal(kept, model.transformer.h[0].mlp.c_fc.weight)
    opt.close()
