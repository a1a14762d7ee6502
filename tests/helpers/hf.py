"""Tiny Hugging Face models and Trainer runs shared by the integration tests (no downloads).

The frameworks follow the running test's kind (tests/helpers/device.py): on the host, as
always, the Trainer and accelerate run on the CPU (``use_cpu``, ``cpu=True``) and Lightning
on ``accelerator="cpu"``, with the host accelerator under OffloadAdamW; in a declared CUDA
form under ``--accelerator=cuda`` they run on ``cuda:0`` (``use_cpu=False``, ``cpu=False``,
``accelerator="gpu"``), the model is built there, and OffloadAdamW gets the
``CudaAccelerator`` of ``cuda:0`` (``run_accelerator``). Data sets stay host memory, as a
user's do: each framework moves its batches to its device.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from accelerate.state import AcceleratorState, PartialState
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from zero_offload import OffloadAdamW, OffloadConfig
from zero_offload.integrations.transformers import OffloadTrainer

from .device import CUDA_INDEX, run_accelerator, run_device, run_kind
from .dist import spawn_ranks

VOCAB = 64
SEQ = 16


def tiny_gpt2(seed: int = 0, dtype: torch.dtype = torch.float32) -> GPT2LMHeadModel:
    """Two layers of width 32, tied lm_head/wte, no dropout (so runs are deterministic); on
    the running test's device."""
    torch.manual_seed(seed)
    config = GPT2Config(
        n_layer=2,
        n_embd=32,
        n_head=4,
        vocab_size=VOCAB,
        n_positions=SEQ,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = GPT2LMHeadModel(config).to(dtype)
    # Built under a ``torch.device("meta")`` context (a caller that wants only the config),
    # it stays there: a meta tensor has no data to move.
    return model if model.device.type == "meta" else model.to(run_device())


class TokenDataset(torch.utils.data.Dataset):
    """``n`` random sequences; each is its own label (causal LM)."""

    def __init__(self, n: int = 48, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        # host: a data set; the framework moves each batch to its device
        self.tokens = torch.randint(0, VOCAB, (n, SEQ), generator=gen)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


def training_args(out: Path, **overrides: Any) -> TrainingArguments:
    """12 steps of 2 micro-batches of 2, clipping binding (norms are ~1.3), a linear
    schedule with warmup; every step logged."""
    kwargs: dict[str, Any] = {
        "output_dir": str(out),
        "max_steps": 12,
        "per_device_train_batch_size": 2,
        "gradient_accumulation_steps": 2,
        "learning_rate": 1e-3,
        "weight_decay": 0.1,
        "adam_beta2": 0.95,
        "max_grad_norm": 0.5,
        "lr_scheduler_type": "linear",
        "warmup_steps": 2,
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": [],
        "disable_tqdm": True,
        "seed": 0,
        "dataloader_num_workers": 0,
        # On the host, the host accelerator keeps "device" tensors in CPU memory; in a CUDA
        # form the Trainer runs on cuda:0.
        "use_cpu": run_kind() != "cuda",
    }
    kwargs.update(overrides)
    return TrainingArguments(**kwargs)


def accelerate_device() -> dict[str, Any]:
    """``Accelerator(...)``'s device arguments for the running test's kind: ``cpu=True`` on
    the host, ``cpu=False`` (``cuda:0``, one GPU) in a CUDA form.

    accelerate keeps one process-wide state and refuses ``cpu=True`` once it was set up on
    a GPU; a state set up for the other kind (a CUDA form before a host test in a cuda run)
    is reset first, as ``TrainingArguments`` does for every Trainer. A host run never
    resets: its state is always the CPU's.
    """
    cpu = run_kind() != "cuda"
    built = PartialState._shared_state.get("device")
    if built is not None and (built.type == "cpu") != cpu:
        AcceleratorState._reset_state(reset_partial_state=True)
    return {"cpu": cpu}


def lightning_device() -> dict[str, Any]:
    """``lightning.pytorch.Trainer(...)``'s device arguments for the running test's kind:
    the CPU on the host, ``cuda:0`` in a CUDA form."""
    if run_kind() == "cuda":
        return {"accelerator": "gpu", "devices": [CUDA_INDEX]}
    return {"accelerator": "cpu", "devices": 1}


def offload_config(**fields: Any) -> OffloadConfig:
    """Small buckets and tiles, so a tiny model crosses several of each."""
    fields.setdefault("bucket_bytes", 8192)
    fields.setdefault("tile_elements", 1024)
    return OffloadConfig(**fields)


def offload_trainer(model: torch.nn.Module, args: TrainingArguments, **kwargs: Any) -> Trainer:
    kwargs.setdefault("train_dataset", TokenDataset())
    kwargs.setdefault("offload_config", offload_config())
    kwargs.setdefault("offload_device", run_accelerator())
    return OffloadTrainer(model=model, args=args, **kwargs)


def torch_trainer(model: torch.nn.Module, args: TrainingArguments, **kwargs: Any) -> Trainer:
    """The reference: the same Trainer with its own torch AdamW (fused on CPU)."""
    kwargs.setdefault("train_dataset", TokenDataset())
    return Trainer(model=model, args=args, **kwargs)


def logged(trainer: Trainer, key: str, *, after: int = 0) -> list[float]:
    """``key`` from the per-step log entries of the steps after ``after``, in order (a
    resumed run's history starts with the checkpoint's)."""
    return [
        entry[key]
        for entry in trainer.state.log_history
        if key in entry and entry.get("step", 0) > after
    ]


def count_state_io(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the OffloadAdamW state_dict / load_state_dict calls from now on."""
    calls: list[str] = []
    for name in ("state_dict", "load_state_dict"):
        original = getattr(OffloadAdamW, name)

        def counted(self, *args, _name=name, _original=original, **kwargs):
            calls.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(OffloadAdamW, name, counted)
    return calls


def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def max_weight_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


# -- several ranks: Trainer under spawned gloo processes --------------------------------


def as_torchrun_rank(rank: int, world: int, port: int) -> None:
    """Make this spawned process rank ``rank`` of ``world`` as torchrun would (accelerate
    builds its gloo group from these variables)."""
    torch.set_num_threads(1)  # several ranks share two cores
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
    )


def _trainer_rank(rank: int, world: int, port: int, out: str) -> None:
    """One rank: train 12 steps saving at step 6, then resume a fresh model from that
    checkpoint to step 12. Saves both runs' grad norms and weights to ``out/rank<r>.pt``."""
    as_torchrun_rank(rank, world, port)
    result = {}
    for run, seed, resume in (("whole", 0, None), ("resumed", 1, "whole/checkpoint-6")):
        args = training_args(
            Path(out) / run,
            per_device_train_batch_size=1,  # 2 ranks x 1 x 2 micro-batches: a batch of 4
            save_strategy="steps",
            save_steps=6,
        )
        trainer = offload_trainer(tiny_gpt2(seed=seed), args)  # resumed: all from the files
        trainer.train(resume_from_checkpoint=None if resume is None else str(Path(out) / resume))
        result[run] = {
            "grad_norms": logged(trainer, "grad_norm", after=0 if resume is None else 6),
            "weights": weights(trainer.model),
        }
    torch.save(result, Path(out) / f"rank{rank}.pt")
    torch.distributed.destroy_process_group()


def run_trainer_ranks(world: int, out: Path) -> list[dict]:
    """``_trainer_rank`` on ``world`` spawned gloo ranks; each rank's results, in order."""
    spawn_ranks(_trainer_rank, world, str(out))
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]
