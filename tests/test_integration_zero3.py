"""OffloadTrainer and OffloadAccelerator on two gloo ranks with ZeRO-3
(``OffloadConfig(offload_parameters=True)`` on several ranks, Note [a sharded unit] in
params/sharded_fetch.py; and, under Trainer, ``partition_parameters=True``, the shards on the
device, bitwise equal to it): a tiny GPT-2 from its config, gradient accumulation, clipping that
binds every step, Trainer's evaluation between steps, a Trainer checkpoint saved and resumed,
and a model built on meta loaded from a checkpoint path.

Tolerances. Stage 3 and stage 2 on the same two ranks are bitwise equal (test_zero3.py says
why: the same reduce-scatters, norms and CPU Adam over the same shards), losses, norms,
evaluation losses, checkpoint files and weights alike. Against one process on the global
batch (Trainer or accelerate with torch's AdamW) each gradient differs by a few ulp (each
rank's mean, then the mean over ranks, and CPU Adam against torch's fused AdamW), as in
test_integration_accelerate.py's two-process test: norms within 1e-6 relative, fp32
weights within 3e-6, losses and evaluation losses (~3.9) within 1e-6. Measured for the
Trainer: 8e-8 relative in the norms, 3.4e-7 in the weights, 2.4e-7 (one ulp) in the losses,
0 in the evaluation losses.
"""

from __future__ import annotations

import faulthandler
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
import torch.multiprocessing as mp
from accelerate import Accelerator
from transformers import GPT2LMHeadModel

from zero_offload import OffloadAdamW, load_pretrained
from zero_offload.integrations.accelerate import OffloadAccelerator
from zero_offload.params import ShardedParamOffloader

from .helpers.dist import free_port
from .helpers.hf import (
    TokenDataset,
    as_torchrun_rank,
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
from .test_integration_accelerate import accelerate_loop, loader, torch_adamw

WORLD = 2
STEPS = 6  # optimizer steps of 2 micro-batches
SAVE_AT = 3  # the checkpoint the resumed run starts from
MAX_GRAD_NORM = 0.5  # the norms here are 1.3 to 1.7: clipping binds every step
#: A rank still running after this long is hung (a collective only some ranks made): it
#: prints its stacks and exits, so the test fails with them instead of blocking the suite.
HANG_SECONDS = 300


def _args(out: Path, *, ranks: int) -> Any:
    """STEPS steps of 2 micro-batches of 2 sequences (one per rank on two ranks), clipped,
    evaluated every 2 steps on 8 sequences, a checkpoint at SAVE_AT with the optimizer
    state."""
    return training_args(
        out,
        max_steps=STEPS,
        per_device_train_batch_size=2 // ranks,
        per_device_eval_batch_size=4 // ranks,
        max_grad_norm=MAX_GRAD_NORM,
        eval_strategy="steps",
        eval_steps=2,
        save_strategy="steps",
        save_steps=SAVE_AT,
        save_only_model=False,
    )


def _eval_data() -> TokenDataset:
    return TokenDataset(n=8, seed=1)


def _on_meta() -> GPT2LMHeadModel:
    with torch.device("meta"):
        return GPT2LMHeadModel(tiny_gpt2().config)


def _trainer_run(
    out: Path,
    name: str,
    *,
    stage3: bool,
    partition: bool = False,
    model: torch.nn.Module | None = None,
    seed: int = 0,
    resume: str | None = None,
    pretrained: str | None = None,
) -> dict[str, Any]:
    """One OffloadTrainer run on this rank (of ``model``, else ``tiny_gpt2(seed)``); what it
    logged and the weights it ends with."""
    trainer = offload_trainer(
        tiny_gpt2(seed=seed) if model is None else model,
        _args(out / name, ranks=WORLD),
        eval_dataset=_eval_data(),
        offload_config=offload_config(offload_parameters=stage3, partition_parameters=partition),
        weights=pretrained,
    )
    trainer.train(resume_from_checkpoint=resume)
    opt = trainer.offload_optimizer
    after = SAVE_AT if resume is not None else 0
    result = {
        "loss": logged(trainer, "loss", after=after),
        "grad_norm": logged(trainer, "grad_norm", after=after),
        "eval_loss": logged(trainer, "eval_loss", after=after),
        "sharded": isinstance(opt.param_offloader, ShardedParamOffloader),
        "wrapped": trainer.model_wrapped is not trainer.model,
        # Reading released parameters gathers their units: every rank reads, in one order.
        "weights": weights(trainer.model),
    }
    opt.close()  # collective under ZeRO-3
    return result


def _trainer_rank(rank: int, world: int, port: int, out: str, pretrained: str) -> None:
    """Stage 3, stage 2, stage 3 resumed from stage 3's checkpoint (a different
    initialisation: all from the files), and stage 3 on a meta model read from
    ``pretrained`` (tiny_gpt2() saved by save_pretrained)."""
    as_torchrun_rank(rank, world, port)
    faulthandler.dump_traceback_later(HANG_SECONDS, exit=True)
    out_dir = Path(out)
    result = {
        "stage3": _trainer_run(out_dir, "stage3", stage3=True),
        "stage2": _trainer_run(out_dir, "stage2", stage3=False),
        # ZeRO-3 with the shards on the device (partition_parameters): the same math.
        "device": _trainer_run(out_dir, "device", stage3=False, partition=True),
        "resumed": _trainer_run(
            out_dir,
            "resumed",
            stage3=True,
            seed=1,
            resume=str(out_dir / "stage3" / f"checkpoint-{SAVE_AT}"),
        ),
        "meta": _trainer_run(out_dir, "meta", stage3=True, model=_on_meta(), pretrained=pretrained),
    }
    torch.save(result, out_dir / f"trainer.rank{rank}.pt")
    torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def trainer_ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    out = tmp_path_factory.mktemp("trainer_zero3")
    pretrained = out / "pretrained"
    tiny_gpt2().save_pretrained(pretrained)
    mp.spawn(_trainer_rank, args=(WORLD, free_port(), str(out), str(pretrained)), nprocs=WORLD)
    ranks = [torch.load(out / f"trainer.rank{r}.pt", weights_only=False) for r in range(WORLD)]
    return out, ranks


def _assert_equal_runs(a: dict, b: dict) -> None:
    for key in ("loss", "grad_norm", "eval_loss"):
        assert a[key] == b[key], key
    assert max_weight_diff(a["weights"], b["weights"]) == 0.0


@pytest.mark.slow
def test_trainer_stage3_equals_stage2_bitwise_and_one_process(
    trainer_ranks: tuple[Path, list[dict]], tmp_path: Path
) -> None:
    """Trainer's loop (accumulation, clipping, the logged pre-clip norm, evaluation every 2
    steps) on two ranks with ZeRO-3: no DDP wrapper, stage 2's run bitwise, and Trainer with
    torch's AdamW on one process on the global batch to float rounding."""
    _, ranks = trainer_ranks
    ref = torch_trainer(tiny_gpt2(), _args(tmp_path, ranks=1), eval_dataset=_eval_data())
    ref.train()
    for rank in ranks:
        stage3, stage2 = rank["stage3"], rank["stage2"]
        assert stage3["sharded"] and not stage2["sharded"]
        assert not stage3["wrapped"]  # no DDP: OffloadAdamW reduce-scatters
        assert len(stage3["grad_norm"]) == STEPS and len(stage3["eval_loss"]) == STEPS // 2
        _assert_equal_runs(stage3, stage2)
        assert rank["device"]["sharded"] and not rank["device"]["wrapped"]
        _assert_equal_runs(rank["device"], stage3)
        assert min(logged(ref, "grad_norm")) > MAX_GRAD_NORM  # clipping binds every step
        torch.testing.assert_close(stage3["loss"], logged(ref, "loss"), rtol=0, atol=1e-6)
        torch.testing.assert_close(stage3["eval_loss"], logged(ref, "eval_loss"), rtol=0, atol=1e-6)
        torch.testing.assert_close(stage3["grad_norm"], logged(ref, "grad_norm"), rtol=1e-6, atol=0)
        assert max_weight_diff(stage3["weights"], weights(ref.model)) < 3e-6
    _assert_equal_runs(ranks[0]["stage3"], ranks[1]["stage3"])


@pytest.mark.slow
def test_trainer_stage3_checkpoint_is_stage2s_and_resumes_bitwise(
    trainer_ranks: tuple[Path, list[dict]],
) -> None:
    """Every rank took the state dict (Note [the model is saved on every rank under
    ZeRO-3]); rank 0 wrote the gathered weights, the same bytes as stage 2's, and the
    consolidated optimizer state; a fresh model resumes from them bitwise."""
    out, ranks = trainer_ranks
    ours, theirs = (out / run / f"checkpoint-{SAVE_AT}" for run in ("stage3", "stage2"))
    model3 = safetensors.torch.load_file(ours / "model.safetensors")
    model2 = safetensors.torch.load_file(theirs / "model.safetensors")
    assert model3.keys() == model2.keys() and len(model3) > 0
    assert all(torch.equal(model3[key], model2[key]) for key in model2)
    opt3 = torch.load(ours / "optimizer.pt", weights_only=True)
    opt2 = torch.load(theirs / "optimizer.pt", weights_only=True)
    assert opt3["state"].keys() == opt2["state"].keys()
    for index, entry in opt2["state"].items():
        for name, value in entry.items():
            assert torch.equal(torch.as_tensor(opt3["state"][index][name]), torch.as_tensor(value))
    for rank in ranks:
        whole, resumed = rank["stage3"], rank["resumed"]
        assert len(resumed["grad_norm"]) == STEPS - SAVE_AT
        for key in ("loss", "grad_norm"):
            assert resumed[key] == whole[key][SAVE_AT:], key
        assert resumed["eval_loss"] == whole["eval_loss"][SAVE_AT // 2 :]
        assert max_weight_diff(resumed["weights"], whole["weights"]) == 0.0


@pytest.mark.slow
def test_trainer_stage3_from_a_meta_model_and_a_checkpoint_path(
    trainer_ranks: tuple[Path, list[dict]],
) -> None:
    """OffloadTrainer(weights=path) on a model built on meta: each rank reads its weights
    at the optimizer's construction and keeps its shards; the run is the one from the
    same weights in memory, bitwise."""
    _, ranks = trainer_ranks
    for rank in ranks:
        assert rank["meta"]["sharded"]
        _assert_equal_runs(rank["meta"], rank["stage3"])


# -- accelerate ------------------------------------------------------------------------


def _accelerate_run(out: Path, name: str, world: int) -> dict[str, Any]:
    """``name``: "stage3", "stage2", or "meta" (stage 3 on a model built on meta and read
    from ``out/pretrained`` by the optimizer)."""
    stage3 = name != "stage2"
    accelerator = OffloadAccelerator(cpu=True, gradient_accumulation_steps=2)
    if name == "meta":
        model = load_pretrained(_on_meta(), out / "pretrained", accelerator=host_accelerator())
    else:
        model = tiny_gpt2()
    opt = OffloadAdamW(
        model.parameters(),
        lr=1e-3,
        betas=(0.9, 0.95),
        weight_decay=0.1,
        config=offload_config(offload_parameters=stage3),
        accelerator=host_accelerator(),
        model=model if stage3 else None,  # parameter offload fetches the model's blocks
    )
    run = accelerate_loop(accelerator, model, opt, loader(batch=2 // world))
    result = {
        "losses": run["losses"],
        "norms": run["norms"],
        "sharded": isinstance(opt.param_offloader, ShardedParamOffloader),
        "ddp": isinstance(accelerator._models[0], torch.nn.parallel.DistributedDataParallel),
        "weights": weights(model),  # collective under ZeRO-3: every rank reads
    }
    accelerator.save_model(model, out / name)  # every rank takes the state dict
    opt.close()
    return result


def _accelerate_rank(rank: int, world: int, port: int, out: str) -> None:
    as_torchrun_rank(rank, world, port)
    faulthandler.dump_traceback_later(HANG_SECONDS, exit=True)
    runs = ("stage3", "stage2", "meta")
    result = {name: _accelerate_run(Path(out), name, world) for name in runs}
    torch.save(result, Path(out) / f"accelerate.rank{rank}.pt")
    torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_accelerate_stage3_equals_stage2_bitwise_and_one_process(tmp_path: Path) -> None:
    """accelerate's documented loop (accumulate, backward, clip_grad_norm_ on sync steps,
    step) on two ranks with ZeRO-3: no DDP wrapper, stage 2's result bitwise, one process's
    on the global batch to float rounding; then accelerator.save_model on every rank. And
    the same loop on a model built on meta, loaded from a checkpoint path
    (``load_pretrained``, then ``OffloadAdamW(model=model)``): bitwise the run from memory."""
    tiny_gpt2().save_pretrained(tmp_path / "pretrained")
    mp.spawn(_accelerate_rank, args=(WORLD, free_port(), str(tmp_path)), nprocs=WORLD)
    ranks = [torch.load(tmp_path / f"accelerate.rank{r}.pt", weights_only=False) for r in range(2)]
    ref_model = tiny_gpt2()
    ref = accelerate_loop(
        Accelerator(gradient_accumulation_steps=2),
        ref_model,
        torch_adamw(ref_model),
        loader(),
    )
    assert min(ref["norms"]) > MAX_GRAD_NORM  # clipping binds
    for rank in ranks:
        stage3, stage2 = rank["stage3"], rank["stage2"]
        assert stage3["sharded"] and not stage2["sharded"] and not stage3["ddp"]
        assert stage3["norms"] == stage2["norms"] and stage3["losses"] == stage2["losses"]
        assert max_weight_diff(stage3["weights"], stage2["weights"]) == 0.0
        # Built on meta, read from the checkpoint path: the same run as from memory.
        meta = rank["meta"]
        assert meta["sharded"] and meta["norms"] == stage3["norms"]
        assert max_weight_diff(meta["weights"], stage3["weights"]) == 0.0
        torch.testing.assert_close(stage3["norms"], ref["norms"], rtol=1e-6, atol=0)
        assert max_weight_diff(stage3["weights"], weights(ref_model)) < 3e-6
    assert max_weight_diff(ranks[0]["stage3"]["weights"], ranks[1]["stage3"]["weights"]) == 0.0
    # accelerator.save_model writes every parameter (the tied one once) with its trained
    # values: Note [state dicts the savers can write].
    saved = {
        name: safetensors.torch.load_file(tmp_path / name / "model.safetensors")
        for name in ("stage3", "stage2")
    }
    for name, state in saved.items():
        trained = ranks[0][name]["weights"]  # named_parameters: the tied weight once
        assert state.keys() == trained.keys(), name
        assert all(torch.equal(state[key], trained[key]) for key in trained), name
