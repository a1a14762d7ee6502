"""OffloadAccelerator: an accelerate loop with clipping against the same loop with torch's
AdamW (tiny GPT-2, CPU). Tolerances as in test_integration_transformers.py (fp32: 1e-6
in the losses and relative in the norms, 3e-6 in the weights)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import safetensors.torch
import torch
import torch.multiprocessing as mp
from accelerate import Accelerator
from torch.utils.data import DataLoader

from zero_offload import OffloadAdamW
from zero_offload.integrations.accelerate import OffloadAcceleratedOptimizer, OffloadAccelerator

from .helpers.device import on_device, run_device
from .helpers.dist import free_port
from .helpers.hf import (
    TokenDataset,
    accelerate_device,
    as_torchrun_rank,
    count_state_io,
    max_weight_diff,
    offload_config,
    tiny_gpt2,
    weights,
)
from .helpers.models import host_accelerator

MAX_NORM = 0.5  # the norms here are 1.2 to 1.7: clipping binds
STEPS = 6  # optimizer steps of 2 micro-batches


def offload_adamw(model: torch.nn.Module, **config: object) -> OffloadAdamW:
    return OffloadAdamW(
        model.parameters(),
        lr=1e-3,
        betas=(0.9, 0.95),
        weight_decay=0.1,
        config=offload_config(**config),
        accelerator=host_accelerator(),
    )


def torch_adamw(model: torch.nn.Module) -> torch.optim.AdamW:
    return torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)


def loader(batch: int = 2) -> DataLoader:
    """STEPS x 2 micro-batches of 2 sequences (with several processes: ``batch`` per rank,
    accelerate deals the sequences out in turn, so the micro-batches stay the same)."""
    return DataLoader(TokenDataset(n=4 * STEPS), batch_size=batch, shuffle=False)


def first_batch() -> dict[str, torch.Tensor]:
    """The loader's first micro-batch on the running test's device, for a test that feeds
    the model by hand (accelerate moves only the batches of a prepared loader)."""
    return {name: on_device(t) for name, t in next(iter(loader())).items()}


def accelerate_loop(accelerator: Accelerator, model, opt, data) -> dict[str, list[float]]:
    """accelerate's documented loop: accumulate, backward, clip on sync steps, step."""
    model, opt, data = accelerator.prepare(model, opt, data)
    losses, norms = [], []
    for batch in data:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            losses.append(loss.item())
            if accelerator.sync_gradients:
                norms.append(accelerator.clip_grad_norm_(model.parameters(), MAX_NORM).item())
            opt.step()
            opt.zero_grad()
    return {"losses": losses, "norms": norms, "opt": opt, "accelerator": accelerator}


@pytest.mark.cuda_form
def test_loop_with_clipping_matches_torch() -> None:
    ref_model, model = tiny_gpt2(), tiny_gpt2()
    device = accelerate_device()  # cpu=True on the host, cuda:0 in a CUDA form
    ref = accelerate_loop(
        Accelerator(**device, gradient_accumulation_steps=2),
        ref_model,
        torch_adamw(ref_model),
        loader(),
    )
    ours = accelerate_loop(
        OffloadAccelerator(**device, gradient_accumulation_steps=2),
        model,
        offload_adamw(model),
        loader(),
    )
    assert len(ours["norms"]) == STEPS and min(ref["norms"]) > MAX_NORM
    torch.testing.assert_close(ours["losses"], ref["losses"], rtol=0, atol=1e-6)
    torch.testing.assert_close(ours["norms"], ref["norms"], rtol=1e-6, atol=0)
    assert max_weight_diff(weights(model), weights(ref_model)) < 3e-6
    assert isinstance(ours["opt"], OffloadAcceleratedOptimizer)
    # Note [offload metrics in the framework's logs]: per optimizer step since the last call.
    metrics = ours["accelerator"].offload_metrics()
    assert ours["opt"].optimizer_steps == STEPS
    assert metrics["offload/cpu_adam_ms"] > 0 and metrics["offload/host_bytes"] > 0
    assert "offload/exposed_transfer_ms" in metrics
    assert ours["accelerator"].offload_metrics()["offload/cpu_adam_ms"] == 0  # nothing since


def test_prepare_costs_no_state_round_trip(monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_gpt2()
    opt = offload_adamw(model)
    calls = count_state_io(monkeypatch)
    Accelerator(**accelerate_device()).prepare(opt)  # accelerate's own: the full round trip
    assert calls == ["state_dict", "load_state_dict"]
    calls.clear()
    accelerator = OffloadAccelerator(**accelerate_device())
    _, prepared = accelerator.prepare(model, opt)
    assert calls == []
    assert accelerator._optimizers == [prepared] and prepared.optimizer is opt


@pytest.mark.cuda_form
def test_fp16_model_backward_applies_the_loss_scale() -> None:
    """accelerate's backward does not scale; for an fp16 model OffloadAccelerator does. A
    missing scale would give a norm 2**16 times too small."""
    ref_model, model = tiny_gpt2(), tiny_gpt2(dtype=torch.float16)
    batch = first_batch()
    ref_model(**batch).loss.backward()
    expected = torch.nn.utils.clip_grad_norm_(ref_model.parameters(), float("inf")).item()
    accelerator = OffloadAccelerator(**accelerate_device())
    model, opt = accelerator.prepare(model, offload_adamw(model))
    assert opt.optimizer.loss_scale == 2.0**16
    accelerator.backward(model(**batch).loss)
    norm = accelerator.clip_grad_norm_(model.parameters(), float("inf")).item()
    assert norm == pytest.approx(expected, rel=1e-3)


@pytest.mark.cuda_form
def test_skipped_step_is_reported() -> None:
    """A step OffloadAdamW skips (non-finite gradients) is what accelerate's
    optimizer_step_was_skipped says, as with AMP; Trainer then holds the LR schedule."""
    model = tiny_gpt2()
    accelerator = OffloadAccelerator(**accelerate_device())
    model, opt = accelerator.prepare(model, offload_adamw(model, skip_nonfinite=True))
    batch = first_batch()
    accelerator.backward(model(**batch).loss * float("nan"))
    opt.step()
    assert accelerator.optimizer_step_was_skipped
    opt.zero_grad()
    accelerator.backward(model(**batch).loss)
    opt.step()
    assert not accelerator.optimizer_step_was_skipped


@pytest.mark.cuda_form
def test_clipping_other_parameter_sets_is_refused() -> None:
    model = tiny_gpt2()
    other = torch.nn.Linear(2, 2).to(run_device())
    accelerator = OffloadAccelerator(**accelerate_device())
    model, _ = accelerator.prepare(model, offload_adamw(model))
    accelerator.backward(model(**first_batch()).loss)
    some = list(model.parameters())[:3]
    with pytest.raises(ValueError, match="pass exactly its parameters"):
        accelerator.clip_grad_norm_(some, 1.0)
    with pytest.raises(ValueError, match="pass exactly its parameters"):
        accelerator.clip_grad_norm_([*model.parameters(), *other.parameters()], 1.0)
    with pytest.raises(ValueError, match="clip_grad_norm_"):
        accelerator.clip_grad_value_(model.parameters(), 0.1)
    # Parameters no OffloadAdamW owns go to accelerate's (torch's) clipping as before.
    other(on_device(torch.ones(1, 2))).sum().backward()
    assert accelerator.clip_grad_norm_(other.parameters(), 1.0).item() > 0


@pytest.mark.cuda_form
def test_save_model_writes_every_parameter(tmp_path: Path) -> None:
    """The parameters share their buckets' storage, and accelerate's safetensors save keeps
    one tensor per storage: without Note [state dicts the savers can write] it wrote one
    parameter of 28 and dropped the rest with a logged warning."""
    model = tiny_gpt2()
    accelerator = OffloadAccelerator(**accelerate_device())
    accelerate_loop(accelerator, model, offload_adamw(model), loader())
    accelerator.save_model(model, tmp_path)
    saved = safetensors.torch.load_file(tmp_path / "model.safetensors")  # host: loaded there
    trained = weights(model)  # named_parameters: the tied wte / lm_head once
    assert saved.keys() == trained.keys()
    assert all(torch.equal(saved[name], trained[name].to(saved[name].device)) for name in trained)


def _train_steps(accelerator: OffloadAccelerator, model, opt, batches: list) -> None:
    """One step per batch; ``opt`` is one optimizer or a list of them."""
    opts = opt if isinstance(opt, list) else [opt]
    for batch in batches:
        accelerator.backward(model(**batch).loss)
        accelerator.clip_grad_norm_(model.parameters(), MAX_NORM)
        for each in opts:
            each.step()
            each.zero_grad()


def test_save_state_then_load_state_resumes_bitwise(tmp_path: Path) -> None:
    """accelerate's pair with its defaults (the model in safetensors): a run saved after 3
    steps and loaded into a fresh model, optimizer and accelerator ends bitwise where the
    uninterrupted run does. safetensors' own loader refused the bucket views (Note [loading
    into bucket views] in integrations/accelerate.py); every parameter is written, the
    tied wte / lm_head pair once."""
    batches = [{k: on_device(v) for k, v in b.items()} for b in loader()]
    runs = []
    for resumed in (False, True):
        model = tiny_gpt2()
        accelerator = OffloadAccelerator(**accelerate_device())
        model, opt = accelerator.prepare(model, offload_adamw(model))
        if resumed:
            for p in model.parameters():  # nothing of the first run survives but the files
                p.data.add_(1.0)
            accelerator.load_state(tmp_path)
        else:
            _train_steps(accelerator, model, opt, batches[:3])
            accelerator.save_state(tmp_path)
        assert (tmp_path / "model.safetensors").exists()
        _train_steps(accelerator, model, opt, batches[3:6])
        runs.append(weights(model))
    assert runs[0].keys() == runs[1].keys()
    assert all(torch.equal(runs[0][name], runs[1][name]) for name in runs[0])


def _offload_halves(
    model: torch.nn.Module, nvme: list[Path | None], **config: object
) -> list[OffloadAdamW]:
    """One offload optimizer per entry of ``nvme``, over every len(nvme)-th parameter; an
    entry that is a path keeps that optimizer's state on NVMe there (``host_budget=1``: no
    bucket fits host RAM)."""
    params = list(model.parameters())
    return [
        OffloadAdamW(
            params[index :: len(nvme)],
            lr=1e-3,
            betas=(0.9, 0.95),
            weight_decay=0.1,
            config=offload_config(**config)
            if where is None
            else offload_config(nvme_dir=where, host_budget=1, **config),
            accelerator=host_accelerator(),
        )
        for index, where in enumerate(nvme)
    ]


@pytest.mark.parametrize("layout", ["nvme", "host+nvme", "nvme, resumed in host RAM"])
def test_state_on_nvme_saves_by_streaming_and_resumes_bitwise(tmp_path: Path, layout: str) -> None:
    """State past ``host_budget`` lives on NVMe: accelerate's ``save_state`` took its
    ``state_dict()`` and raised ``StateNotInHostRam``. Each process streams it to
    ``zero_offload_optimizer{_i}/rank{r}/`` in the checkpoint folder (Note [optimizer state
    on NVMe in save_state]), and a fresh model (another seed), optimizer and accelerator
    that ``load_state`` it end bitwise where the uninterrupted run does. With a second
    optimizer in host RAM ahead of it, that one is accelerate's ``optimizer.bin`` as
    before, and the streamed one keeps its index (``optimizer_1.bin``, ``..._1/``). The
    checkpoint decides the load: a streamed one loads into state in host RAM too."""
    batches = [{k: on_device(v) for k, v in b.items()} for b in loader()]
    checkpoint = tmp_path / "checkpoint"
    streamed = "zero_offload_optimizer" + "_1" * (layout == "host+nvme")
    runs = []
    for seed, name in enumerate(("whole", "resumed")):
        model = tiny_gpt2(seed=seed)  # everything of the resumed run comes from the files
        in_ram = name == "resumed" and layout == "nvme, resumed in host RAM"
        nvme = [None] * (layout == "host+nvme") + [None if in_ram else tmp_path / name / "nvme"]
        accelerator = OffloadAccelerator(**accelerate_device())
        model, *opts = accelerator.prepare(model, *_offload_halves(model, nvme))
        assert (opts[-1].optimizer.placement.nvme > 0) != in_ram
        if name == "resumed":
            accelerator.load_state(checkpoint)
        else:
            _train_steps(accelerator, model, opts, batches[:3])
            accelerator.save_state(checkpoint)
            assert (checkpoint / streamed / "rank0" / "meta.pt").is_file()
            marker = checkpoint / ("optimizer_1.bin" if layout == "host+nvme" else "optimizer.bin")
            assert torch.load(marker, weights_only=True) == {"zero_offload_streamed": streamed}
            if layout == "host+nvme":  # accelerate's own file, a state dict as before
                state = torch.load(checkpoint / "optimizer.bin", weights_only=True)
                assert state["state"] and not (checkpoint / "zero_offload_optimizer").exists()
        _train_steps(accelerator, model, opts, batches[3:6])
        runs.append(weights(model))
    assert runs[0].keys() == runs[1].keys()
    assert all(torch.equal(runs[0][name], runs[1][name]) for name in runs[0])


def test_load_state_refuses_what_cannot_load_and_changes_nothing(tmp_path: Path) -> None:
    """A checkpoint whose optimizer state is a state dict (saved without ``nvme_dir``) into
    state on NVMe, and a marker whose streamed folder was not copied along: refused with a
    ``ValueError`` saying why, before anything is loaded (the model keeps its weights)."""
    model = tiny_gpt2()
    accelerator = OffloadAccelerator(**accelerate_device())
    model, opt = accelerator.prepare(model, offload_adamw(model))
    _train_steps(accelerator, model, opt, [first_batch()])
    accelerator.save_state(tmp_path / "in_host_ram")

    model = tiny_gpt2(seed=1)
    accelerator = OffloadAccelerator(**accelerate_device())
    model, opt = accelerator.prepare(model, *_offload_halves(model, [tmp_path / "nvme"]))
    before = {name: w.clone() for name, w in weights(model).items()}
    with pytest.raises(ValueError, match=r"nvme_dir=.*optimizer.bin is a state dict"):
        accelerator.load_state(tmp_path / "in_host_ram")
    assert all(torch.equal(before[name], w) for name, w in weights(model).items())
    assert accelerator._optimizers == [opt]  # accelerate's list is its own again

    accelerator.save_state(tmp_path / "streamed")
    shutil.rmtree(tmp_path / "streamed" / "zero_offload_optimizer")
    model = tiny_gpt2(seed=2)
    accelerator = OffloadAccelerator(**accelerate_device())
    model, opt = accelerator.prepare(model, offload_adamw(model))  # in host RAM
    before = {name: w.clone() for name, w in weights(model).items()}
    with pytest.raises(ValueError, match="which is missing: copy the checkpoint folder whole"):
        accelerator.load_state(tmp_path / "streamed")
    assert all(torch.equal(before[name], w) for name, w in weights(model).items())


def test_optimizer_bin_decides_the_load_not_a_stale_folder(tmp_path: Path) -> None:
    """A streamed save, then a state-dict save to the same folder: the first's
    ``zero_offload_optimizer/`` stays behind, and ``optimizer.bin`` (a state dict now)
    decides: the load is the second save's, bitwise, and nothing streams (the stale folder,
    of other buckets, would be refused: it read the folder's presence before)."""
    model = tiny_gpt2()
    accelerator = OffloadAccelerator(**accelerate_device())
    stale = _offload_halves(model, [tmp_path / "nvme"], bucket_bytes=16384)
    model, opt = accelerator.prepare(model, *stale)
    _train_steps(accelerator, model, opt, [first_batch()])
    accelerator.save_state(tmp_path / "ckpt")  # streamed
    model = tiny_gpt2()
    accelerator = OffloadAccelerator(**accelerate_device())
    model, opt = accelerator.prepare(model, offload_adamw(model))  # in host RAM
    _train_steps(accelerator, model, opt, [first_batch()] * 2)
    accelerator.save_state(tmp_path / "ckpt")  # a state dict, over the same folder
    assert (tmp_path / "ckpt" / "zero_offload_optimizer").is_dir()  # the stale one
    want = opt.state_dict()
    fresh = tiny_gpt2(seed=1)
    accelerator = OffloadAccelerator(**accelerate_device())
    fresh, again = accelerator.prepare(fresh, offload_adamw(fresh))
    accelerator.load_state(tmp_path / "ckpt")
    got = again.state_dict()
    for index, fields in want["state"].items():
        for name, value in fields.items():
            assert torch.equal(torch.as_tensor(got["state"][index][name]), torch.as_tensor(value))


def test_two_offload_optimizers_clip_by_the_norm_of_all() -> None:
    """accelerator.clip_grad_norm_(model.parameters()) where two offload optimizers train
    the model clips it by the norm of all its gradients (Note [clipping by a total norm]),
    as torch's clip over one AdamW does: the same norms and weights."""
    ref_model, model = tiny_gpt2(), tiny_gpt2()
    params = list(model.parameters())
    accelerator = OffloadAccelerator(**accelerate_device())
    halves = [
        OffloadAdamW(part, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1,
                     config=offload_config(), accelerator=host_accelerator())
        for part in (params[::2], params[1::2])
    ]  # fmt: skip
    model, first, second = accelerator.prepare(model, *halves)
    ref_opt = torch_adamw(ref_model)
    for batch in list(loader())[:3]:
        batch = {k: on_device(v) for k, v in batch.items()}
        accelerator.backward(model(**batch).loss)
        ref_model(**batch).loss.backward()
        norm = accelerator.clip_grad_norm_(model.parameters(), MAX_NORM)
        want = torch.nn.utils.clip_grad_norm_(ref_model.parameters(), MAX_NORM)
        assert float(want) > MAX_NORM  # clipping binds
        torch.testing.assert_close(norm, want, rtol=1e-6, atol=0)
        for opt in (first, second, ref_opt):
            opt.step()
            opt.zero_grad()
    assert max_weight_diff(weights(model), weights(ref_model)) < 3e-6


def test_fp16_mixed_precision_is_refused() -> None:
    with pytest.raises(ValueError, match="GradScaler"):
        OffloadAccelerator(mixed_precision="fp16")


# -- several processes ---------------------------------------------------------------


def _accelerate_rank(rank: int, world: int, port: int, out: str) -> None:
    """One rank of the loop under the environment accelerate launch / torchrun would set."""
    as_torchrun_rank(rank, world, port)
    accelerator = OffloadAccelerator(cpu=True, gradient_accumulation_steps=2)
    model = tiny_gpt2()
    result = accelerate_loop(accelerator, model, offload_adamw(model), loader(batch=2 // world))
    torch.save(
        {
            "norms": result["norms"],
            "weights": weights(model),
            "ddp": isinstance(accelerator._models[0], torch.nn.parallel.DistributedDataParallel),
        },
        Path(out) / f"rank{rank}.pt",
    )
    torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_two_processes_match_one_on_the_global_batch(tmp_path: Path) -> None:
    """The supported multi-process loop: the same code, no DDP wrapper (OffloadAdamW
    reduce-scatters), each rank half of every batch; the result is one process's."""
    mp.spawn(_accelerate_rank, args=(2, free_port(), str(tmp_path)), nprocs=2)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    ref_model = tiny_gpt2()
    ref = accelerate_loop(
        Accelerator(gradient_accumulation_steps=2), ref_model, torch_adamw(ref_model), loader()
    )
    for rank in ranks:
        assert not rank["ddp"]
        torch.testing.assert_close(rank["norms"], ref["norms"], rtol=1e-6, atol=0)
        assert max_weight_diff(rank["weights"], weights(ref_model)) < 3e-6  # measured 7e-7
    assert max_weight_diff(ranks[0]["weights"], ranks[1]["weights"]) == 0.0


def _nvme_checkpoint_rank(rank: int, world: int, port: int, out: str) -> None:
    """One rank: 3 steps, save_state, 3 more; then a fresh model (another seed), optimizer
    and accelerator load_state and take the same 3 (each rank sequence ``rank`` of every
    batch of 2)."""
    as_torchrun_rank(rank, world, port)
    batches = [{k: v[rank : rank + 1] for k, v in b.items()} for b in loader()][:6]
    checkpoint, runs = Path(out) / "checkpoint", []
    for seed in (0, 1):
        model = tiny_gpt2(seed=seed)
        accelerator = OffloadAccelerator(cpu=True)
        # Buckets of 8 KiB: some of rank 1's shards hold only padding (their streamed load
        # crashed in bucket_file.load_bucket once).
        opts = _offload_halves(model, [Path(out) / "nvme"], bucket_bytes=8192)
        model, opt = accelerator.prepare(model, *opts)
        if seed == 1:
            accelerator.load_state(checkpoint)
        else:
            _train_steps(accelerator, model, opt, batches[:3])
            accelerator.save_state(checkpoint)
        _train_steps(accelerator, model, opt, batches[3:])
        runs.append(weights(model))
    torch.save(runs, Path(out) / f"rank{rank}.pt")
    torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_two_processes_stream_nvme_state_and_resume_bitwise(tmp_path: Path) -> None:
    """Two processes with state on NVMe: each streams its own shard (``rank0/``,
    ``rank1/``) and resumes bitwise. One process loads it too (Note [a streamed checkpoint
    on another world size] in optim/checkpoint/reshard.py)."""
    mp.spawn(_nvme_checkpoint_rank, args=(2, free_port(), str(tmp_path)), nprocs=2)
    for rank in range(2):
        whole, resumed = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        assert all(torch.equal(whole[name], resumed[name]) for name in whole)
        assert (tmp_path / "checkpoint" / "zero_offload_optimizer" / f"rank{rank}").is_dir()
    model = tiny_gpt2(seed=1)
    accelerator = OffloadAccelerator(**accelerate_device())
    opts = _offload_halves(model, [tmp_path / "nvme1"], bucket_bytes=8192)
    model, opt = accelerator.prepare(model, *opts)
    accelerator.load_state(tmp_path / "checkpoint")
    assert all((bucket.steps == 3).all() for bucket in opt.optimizer.buckets)  # 3 saved steps


def _configs_differ_rank(rank: int, world: int, port: int, out: str) -> None:
    """One rank of two whose configs differ where ranks may (``nvme_dir`` on rank 0 only,
    then ``host_budget``): the save streams on both, the refusal comes on both."""
    as_torchrun_rank(rank, world, port)
    root = Path(out)
    batches = [{k: v[rank : rank + 1] for k, v in b.items()} for b in loader()][:2]
    result: dict[str, object] = {}
    model = tiny_gpt2()
    accelerator = OffloadAccelerator(cpu=True)
    nvme = [root / "nvme0"] if rank == 0 else [None]
    model, opt = accelerator.prepare(model, *_offload_halves(model, nvme))
    _train_steps(accelerator, model, opt, batches[:1])
    accelerator.save_state(root / "streamed")  # rank 1 has no nvme_dir: it streams too
    accelerator.save_state(root / "dict")  # the same, into another folder
    opt.optimizer.close()
    # A state-dict checkpoint (saved without nvme_dir on any rank) into state on NVMe on
    # rank 1 only (rank 0's budget holds it all): refused on both.
    model = tiny_gpt2()
    accelerator = OffloadAccelerator(cpu=True)
    plain = OffloadAdamW(
        model.parameters(), lr=1e-3, config=offload_config(), accelerator=host_accelerator()
    )
    model, plain_opt = accelerator.prepare(model, plain)
    _train_steps(accelerator, model, plain_opt, batches[:1])
    accelerator.save_state(root / "state_dict")
    plain_opt.optimizer.close()
    model = tiny_gpt2(seed=1)
    accelerator = OffloadAccelerator(cpu=True)
    budget = 1 << 40 if rank == 0 else 1
    cfg = offload_config(nvme_dir=root / f"nvme_{rank}", host_budget=budget)
    opt = OffloadAdamW(model.parameters(), lr=1e-3, config=cfg, accelerator=host_accelerator())
    model, opt = accelerator.prepare(model, opt)
    before = {name: w.clone() for name, w in weights(model).items()}
    try:
        accelerator.load_state(root / "state_dict")
        result["load"] = "loaded"
    except Exception as exc:
        result["load"] = f"{type(exc).__name__}: {exc}"
    result["unchanged"] = all(torch.equal(before[n], w) for n, w in weights(model).items())
    opt.optimizer.close()
    torch.save(result, root / f"rank{rank}.pt")
    torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_ranks_whose_configs_differ_stream_and_refuse_together(tmp_path: Path) -> None:
    """``nvme_dir`` and ``host_budget`` may differ between ranks: a save where one rank sets
    ``nvme_dir`` streams on every rank (before, rank 0 streamed alone and its collective
    failed, rank 1 wrote a state dict), and a load one rank must refuse is refused on
    every rank, the model untouched (before, the other rank went on into accelerate's
    load)."""
    mp.spawn(_configs_differ_rank, args=(2, free_port(), str(tmp_path)), nprocs=2)
    for rank in range(2):
        result = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        assert (tmp_path / "streamed" / "zero_offload_optimizer" / f"rank{rank}").is_dir()
        assert result["unchanged"], rank
        if rank == 1:  # its own refusal
            assert "optimizer.bin is a state dict" in result["load"], result["load"]
        else:  # told of rank 1's
            assert result["load"].startswith("CollectiveError") and "rank 1" in result["load"]
