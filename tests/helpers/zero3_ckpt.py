"""Spawned gloo ranks for tests/test_zero3_checkpoints.py: checkpoints saved under ZeRO-3
(parameter offload on several ranks), stage 2 and one process, loaded into each other.

Every run trains the same tiny GPT on the same global batches (tests/helpers/zero3.py), saves at
step ``SAVED_AT`` and goes on to ``STEPS``; a resume builds a fresh model and optimizer
(their weights zeroed, so nothing of the fresh build survives a load that works), loads
a checkpoint and trains the same remaining steps. ``run(world, out)`` runs every scenario
of one world size in one spawn (a world is the expensive part).
"""

from __future__ import annotations

import faulthandler
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from zero_offload import hf_export, load_pretrained, save_pretrained
from zero_offload.checkpoint_io import load_consolidated, save_consolidated

from .dist import free_port, join_gloo
from .zero3 import HANG_SECONDS, batches, gpt, make_opt, share

LAYERS = 2
FP32 = torch.float32
SAVED_AT = 2  # steps before the checkpoint
STEPS = 4  # steps in all
#: The checkpoints the 2-rank world saves (and the one-process run, "one").
TAGS = ("s3", "s2")


def train(model: torch.nn.Module, opt: Any, steps: range, rank: int, world: int) -> None:
    pairs = batches(STEPS)
    for step in steps:
        ids, targets = pairs[step]
        model(share(ids, rank, world), share(targets, rank, world)).backward()
        opt.step()
        opt.zero_grad()


def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole weights; under ZeRO-3 a collective (each unit is gathered)."""
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


def origin(
    out: Path, tag: str, rank: int, world: int, *, offload: bool, dtype: torch.dtype = FP32
) -> dict:
    """Train from scratch; at ``SAVED_AT`` save the model (rank 0) and the consolidated
    optimizer as ``tag``, and a streamed checkpoint; go on to ``STEPS``."""
    model = gpt(dtype, layers=LAYERS)
    opt = make_opt(model, offload=offload)
    train(model, opt, range(SAVED_AT), rank, world)
    at_save = weights(model)
    if rank == 0:
        torch.save(at_save, out / f"{tag}.model.pt")
    save_consolidated(opt, out / f"{tag}.opt.pt")  # ends with a barrier: both files are there
    opt.save_streaming(out / f"{tag}.stream")
    train(model, opt, range(SAVED_AT, STEPS), rank, world)
    final = weights(model)
    opt.close()
    return {"at_save": at_save, "final": final}


def fresh(*, offload: bool, dtype: torch.dtype) -> tuple[torch.nn.Module, Any]:
    model = gpt(dtype, layers=LAYERS)
    with torch.no_grad():
        for param in model.parameters():
            param.zero_()
    return model, make_opt(model, offload=offload)


def resume(
    out: Path,
    tag: str,
    rank: int,
    world: int,
    *,
    offload: bool,
    dtype: torch.dtype = FP32,
    optimizer_first: bool = False,
) -> dict:
    """Load ``tag`` (the model and the consolidated optimizer, in either order) and train
    to ``STEPS``."""
    model, opt = fresh(offload=offload, dtype=dtype)
    if optimizer_first:
        load_consolidated(opt, out / f"{tag}.opt.pt")
    model.load_state_dict(torch.load(out / f"{tag}.model.pt", weights_only=True))
    if not optimizer_first:
        load_consolidated(opt, out / f"{tag}.opt.pt")
    loaded = weights(model)
    train(model, opt, range(SAVED_AT, STEPS), rank, world)
    final = weights(model)
    opt.close()
    return {"loaded": loaded, "final": final}


def resume_streaming(
    out: Path, tag: str, rank: int, world: int, *, dtype: torch.dtype = FP32
) -> dict:
    """Load ``tag``'s streamed checkpoint (and its model) under ZeRO-3: the result, or the
    error each rank raised."""
    model, opt = fresh(offload=True, dtype=dtype)
    model.load_state_dict(torch.load(out / f"{tag}.model.pt", weights_only=True))
    try:
        opt.load_streaming(out / f"{tag}.stream")
    except ValueError as exc:
        opt.close()
        return {"error": str(exc)}
    train(model, opt, range(SAVED_AT, STEPS), rank, world)
    final = weights(model)
    opt.close()
    return {"final": final}


def export(out: Path, rank: int, world: int) -> dict:
    """A tiny GPT-2 trained under ZeRO-3, exported by ``save_pretrained`` from the sharded
    homes (collective), then loaded back by ``load_pretrained`` on meta and by a normal
    load under ZeRO-3, and trained the same steps by both."""
    from ..test_build_anywhere import batches as token_batches
    from ..test_build_anywhere import make_opt as make_hf_opt
    from ..test_build_anywhere import on_meta, saved

    source = saved(out, sharded=False) if rank == 0 else out / "single"
    dist.barrier()  # rank 0 wrote the source checkpoint
    model = load_pretrained(on_meta(), source)
    opt = make_hf_opt(model, offload_parameters=True)

    def hf_train(model: torch.nn.Module, opt: Any) -> None:
        for tokens in token_batches():
            tokens = share(tokens.repeat(world, 1), rank, world)
            model(input_ids=tokens, labels=tokens).loss.backward()
            opt.step()
            opt.zero_grad()

    hf_train(model, opt)
    files = save_pretrained(model, out / "export", optimizer=opt, max_shard_size="20KB")
    failure = failed_export(model, opt, out / "export", rank)
    trained = {name: p.detach().clone() for name, p in model.named_parameters()}
    opt.close()
    runs = {}
    for how in ("meta", "normal"):
        if how == "meta":
            model = load_pretrained(on_meta(), out / "export")
        else:
            from transformers import GPT2LMHeadModel

            model = GPT2LMHeadModel.from_pretrained(out / "export")
        opt = make_hf_opt(model, offload_parameters=True)
        hf_train(model, opt)
        runs[how] = {name: p.detach().clone() for name, p in model.named_parameters()}
        opt.close()
    return {"files": [f.name for f in files], "trained": trained, "runs": runs, "failure": failure}


def failed_export(model: torch.nn.Module, opt: Any, directory: Path, rank: int) -> str:
    """Export again into ``directory`` with rank 0's disk full after its first shard: the
    error each rank raises (the ranks must stay in step: the caller gathers next)."""
    real = hf_export._write_shard
    written = []

    def full_disk(path: Path, entries: list) -> None:
        if written:
            raise OSError(28, "No space left on device (test)")
        real(path, entries)
        written.append(path)

    if rank == 0:
        hf_export._write_shard = full_disk
    try:
        save_pretrained(model, directory, optimizer=opt, max_shard_size="20KB")
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        hf_export._write_shard = real
    return "no error"


def scenario_two(rank: int, world: int, out: Path) -> dict:
    """Two ranks: save under ZeRO-3 and stage 2; load each into the other and itself,
    the one-process checkpoint into ZeRO-3; the streamed checkpoint; the export."""
    result = {tag: origin(out, tag, rank, world, offload=tag == "s3") for tag in TAGS}
    result["s3<-s3"] = resume(out, "s3", rank, world, offload=True)
    result["s3<-stream"] = resume_streaming(out, "s3", rank, world)
    result["s2<-s3"] = resume(out, "s3", rank, world, offload=False)
    result["s3<-s2"] = resume(out, "s2", rank, world, offload=True)
    result["s3<-one"] = resume(out, "one", rank, world, offload=True)
    # bf16 (the homes apart from the fp32 master), the optimizer loaded first
    bf16 = torch.bfloat16
    result["b3"] = origin(out, "b3", rank, world, offload=True, dtype=bf16)
    result["b3<-b3"] = resume(
        out, "b3", rank, world, offload=True, dtype=bf16, optimizer_first=True
    )
    result["b3<-stream"] = resume_streaming(out, "b3", rank, world, dtype=bf16)
    result["export"] = export(out, rank, world)
    return result


def scenario_three(rank: int, world: int, out: Path) -> dict:
    """Three ranks under ZeRO-3: the 2-rank and one-process checkpoints, and the 2-rank
    streamed one."""
    result = {f"s3<-{tag}": resume(out, tag, rank, world, offload=True) for tag in (*TAGS, "one")}
    result["s3<-stream"] = resume_streaming(out, "s3", rank, world)
    return result


SCENARIOS = {"two": scenario_two, "three": scenario_three}


def _entry(rank: int, world: int, port: int, scenario: str, out: str) -> None:
    join_gloo(rank, world, port)
    faulthandler.dump_traceback_later(HANG_SECONDS, exit=True)  # a hang fails with stacks
    result = SCENARIOS[scenario](rank, world, Path(out))
    torch.save(result, Path(out) / f"{scenario}.rank{rank}.pt")
    dist.destroy_process_group()


def run(world: int, scenario: str, out: Path) -> list[dict]:
    """``scenario`` on ``world`` spawned gloo ranks; their results in rank order."""
    mp.spawn(_entry, args=(world, free_port(), scenario, str(out)), nprocs=world)
    return [torch.load(out / f"{scenario}.rank{r}.pt", weights_only=False) for r in range(world)]


def one_process(out: Path) -> dict:
    """Without torch.distributed: the one-process origin ("one"), then resumes of the
    2-rank ZeRO-3 checkpoint with and without parameter offload (after ``run(2, ...)``)."""
    return {"one": origin(out, "one", 0, 1, offload=False)}


def one_process_resumes(out: Path) -> dict:
    return {
        f"{name}<-s3": resume(out, "s3", 0, 1, offload=offload)
        for name, offload in (("one", False), ("one-offload", True))
    }
