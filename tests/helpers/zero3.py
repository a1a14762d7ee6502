"""Spawned gloo ranks for the ZeRO-3 tests (tests/test_zero3.py): stage 3 with parameter
offload (``OffloadConfig(offload_parameters=True)`` on several ranks), stage 2 on the same
ranks, and one process, on the same global batch.

``run(world, scenario, out, **kwargs)`` starts ``world`` ranks (``_dist.join_gloo``), each
runs ``SCENARIOS[scenario]`` and saves what it returns; the results come back in rank order.
"""

from __future__ import annotations

import faulthandler
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.utils.checkpoint as torch_checkpoint

from zero_offload import CollectiveError, OffloadAdamW, OffloadConfig, profile
from zero_offload.activations import checkpoint as offload_checkpoint
from zero_offload.demo.model import GPTConfig, TinyGPT
from zero_offload.params import ShardedParamOffloader

from .dist import free_port, join_gloo
from .models import host_accelerator

VOCAB, SEQ = 64, 16
#: Global batch: 6 sequences, so 2 and 3 ranks get equal shares.
GLOBAL_BATCH = 6
#: A rank still running after this long is hung (a run takes well under a minute).
HANG_SECONDS = 300


def _torch_checkpoint(block: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return torch_checkpoint.checkpoint(block, x, use_reentrant=False)


#: How each block runs (``ckpt=``): recomputed in backward by torch's checkpointing, or by
#: ours with its input offloaded to the host (the estimator's "activation offload").
RUNNERS = {None: None, "torch": _torch_checkpoint, "offload": offload_checkpoint}


def gpt(
    dtype: torch.dtype,
    *,
    layers: int,
    hidden: int = 32,
    tied: bool = False,
    ckpt: str | None = None,
) -> TinyGPT:
    torch.manual_seed(0)
    model = TinyGPT(
        GPTConfig(vocab_size=VOCAB, seq_len=SEQ, layers=layers, hidden=hidden, heads=4),
        runner=RUNNERS[ckpt],
    ).to(dtype)
    if tied:
        model.head.weight = model.tokens.weight
    return model


def batches(
    steps: int, global_batch: int = GLOBAL_BATCH
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (global_batch, SEQ), generator=gen)
        out.append((ids, (ids * 7 + 3) % VOCAB))
    return out


def share(tensor: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    per = tensor.shape[0] // world
    return tensor[rank * per : (rank + 1) * per]


def skipped(step: int, rank: int, layers: int) -> set[int]:
    """Blocks rank ``rank`` leaves out at ``step`` (a router): the ranks disagree at most
    steps, and at step 2 every rank leaves block 1 out."""
    if step == 2:
        return {1}
    which = (step + rank) % (layers + 1)
    return {which} if which < layers else set()


def loss_without(model: TinyGPT, ids: torch.Tensor, targets: torch.Tensor, skip: set[int]):
    """TinyGPT's loss with the blocks in ``skip`` not run at all."""
    positions = torch.arange(ids.shape[1], device=ids.device)
    x = model.tokens(ids) + model.positions(positions)
    for i, block in enumerate(model.blocks):
        if i not in skip:
            x = model.runner(block, x)
    logits = model.head(model.norm(x))
    return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def make_opt(model: TinyGPT, *, offload: bool, **config: Any) -> OffloadAdamW:
    config.setdefault("bucket_bytes", 8192)
    config.setdefault("tile_elements", 1024)
    extra = {"model": model} if offload else {}
    return OffloadAdamW(
        model.parameters(),
        lr=1e-3,
        betas=(0.9, 0.95),
        weight_decay=0.1,
        config=OffloadConfig(offload_parameters=offload, **config),
        accelerator=host_accelerator(),
        **extra,
    )


def rank_loss(
    model: TinyGPT,
    step: int,
    ids: torch.Tensor,
    targets: torch.Tensor,
    rank: int,
    world: int,
    *,
    uneven: bool,
) -> torch.Tensor:
    """This rank's loss on its share of step ``step``'s global batch; ``uneven``: without
    the blocks it leaves out then (``skipped``)."""
    ids, targets = share(ids, rank, world), share(targets, rank, world)
    if uneven:
        return loss_without(model, ids, targets, skipped(step, rank, len(model.blocks)))
    return model(ids, targets)  # through the root module's hooks


def train(
    model: TinyGPT,
    opt: OffloadAdamW,
    steps: int,
    rank: int,
    world: int,
    *,
    clip: float | None = None,
    uneven: bool = False,
    global_batch: int = GLOBAL_BATCH,
    norms: list[float],
) -> list[dict[str, dict[str, int]]]:
    """Train on this rank's share of each global batch; the collective counters after each
    step (the first entry: before the first). ``norms`` gets each step's gradient norm."""
    counters = [] if opt.comm is None else [opt.comm.counters.snapshot()]
    for step, (ids, targets) in enumerate(batches(steps, global_batch)):
        loss = rank_loss(model, step, ids, targets, rank, world, uneven=uneven)
        loss.backward()
        if clip is not None:
            opt.clip_grad_norm_(clip)
        opt.step()
        norms.append(opt.last_grad_norm)
        opt.zero_grad()
        if opt.comm is not None:
            counters.append(opt.comm.counters.snapshot())
    return counters


def pool_capacity(opt: OffloadAdamW) -> dict[str, int]:
    """The capacity of the optimizer's pools by the last part of their names, summed: under
    parameter offload or ZeRO-3 each unit has a host pool of its own (Note [homes are pinned
    unit by unit] in ``optim/unit_pools.py``), all named ``....host``."""
    capacity: dict[str, int] = {}
    for name, stats in opt.manager.pool_stats().items():
        kind = name.rsplit(".", 1)[-1]
        capacity[kind] = capacity.get(kind, 0) + stats["capacity_bytes"]
    return capacity


def host_pool_bytes(opt: OffloadAdamW) -> int:
    return sum(p.capacity for p in opt.manager.pools if p.name.endswith(".host"))


def scenario_train(
    rank: int,
    world: int,
    out: Path,
    *,
    dtype: torch.dtype,
    steps: int,
    offload: bool = True,
    layers: int = 4,
    clip: float | None = None,
    ckpt: str | None = None,
    tied: bool = False,
    uneven: bool = False,
    prefetch: int = 1,
    global_batch: int = GLOBAL_BATCH,
    host_budget: int | None = None,
) -> dict:
    """``host_budget``: the homes and state beyond it on NVMe under ``out/nvme/rank{r}``."""
    model = gpt(dtype, layers=layers, tied=tied, ckpt=ckpt)
    config: dict[str, Any] = {"prefetch_layers": prefetch} if offload else {}
    if host_budget is not None:
        config.update(nvme_dir=str(out / "nvme"), host_budget=host_budget)
    opt = make_opt(model, offload=offload, **config)
    offloader = opt.param_offloader
    norms: list[float] = []
    # The profiler counts the collectives' bytes by kind (given a link: nothing to measure).
    with profile(opt, link_bandwidth=1e9) as prof:
        counters = train(
            model,
            opt,
            steps,
            rank,
            world,
            clip=clip,
            uneven=uneven,
            global_batch=global_batch,
            norms=norms,
        )
    result: dict[str, Any] = {
        "counters": counters,
        "profiled": {row["name"]: row["bytes"] for row in prof.to_dict()["collectives"]},
        "norms": norms,
        "host_pool": host_pool_bytes(opt),
        "kinds": [type(b.store).__name__ for b in opt.buckets],
        # the device ledger's peak since construction began (library-owned device bytes)
        "device_peak": opt.manager.accelerator.memory_stats()["peak"],
        "buckets": [
            (b.layout.padded_numel, b.layout.shard_numel, b.views.dtype.itemsize)
            for b in opt.buckets
        ],
        "numel": sum(p.numel() for p in model.parameters()),
        "gathers": offloader.gather.gathers
        if isinstance(offloader, ShardedParamOffloader)
        else None,
        # per unit in registration order: its buckets' padded bytes (the gathered bytes)
        "unit_bytes": []
        if offloader is None
        else [
            sum(v.layout.padded_numel * v.dtype.itemsize for v in unit.views)
            for unit in offloader.units
        ],
        "ring": None
        if offloader is None or offloader.window is None
        else len({unit.slot.index for unit in offloader.units if not unit.spec.tied}),
    }
    opt.close()  # collective with several ranks: every parameter gets its gathered weights
    result["weights"] = [p.detach().clone() for p in model.parameters()]
    return result


def scenario_pools(
    rank: int, world: int, out: Path, *, dtype: torch.dtype, hidden: int, bucket_bytes: int
) -> dict:
    """The capacity of the optimizer's pools (``pool_capacity``)."""
    model = gpt(dtype, layers=4, hidden=hidden)
    opt = make_opt(model, offload=True, bucket_bytes=bucket_bytes)
    capacity = pool_capacity(opt)
    opt.close()
    return {"capacity": capacity}


def scenario_killed(rank: int, world: int, out: Path, *, timeout: float) -> dict:
    """Rank 1 dies in the middle of the second step's forward (its process exits), while the
    others gather the next units."""
    model = gpt(torch.float32, layers=4)
    opt = make_opt(model, offload=True, collective_timeout=timeout, prefetch_layers=1)
    pairs = batches(3)
    dist.barrier()  # line the ranks up: the clock measures the failure alone

    def die(module: torch.nn.Module, args: Any) -> None:
        if state["step"] == 1:
            torch.save({"died": True}, out / f"killed.rank{rank}.pt")
            os._exit(0)  # killed: no collective of ours follows, the sockets close

    state = {"step": 0}
    if rank == 1:
        model.blocks[2].register_forward_pre_hook(die)
    began = time.perf_counter()
    try:
        for state["step"], (ids, targets) in enumerate(pairs):
            began = time.perf_counter()
            loss = loss_without(model, share(ids, rank, world), share(targets, rank, world), set())
            loss.backward()
            opt.step()
            opt.zero_grad()
    except CollectiveError as exc:
        return {"type": "CollectiveError", "error": str(exc), "seconds": _since(began)}
    except Exception as exc:  # reported, so the test says what went wrong instead
        return {"type": type(exc).__name__, "error": str(exc), "seconds": _since(began)}
    return {"type": None}


def _since(began: float) -> float:
    return time.perf_counter() - began


SCENARIOS = {"train": scenario_train, "killed": scenario_killed, "pools": scenario_pools}


def _entry(
    rank: int, world: int, port: int, scenario: str | Callable, out: str, kwargs: dict
) -> None:
    join_gloo(rank, world, port)
    # A rank that hangs (mismatched collectives) prints its stacks and exits, so the test
    # fails with them instead of blocking the suite.
    faulthandler.dump_traceback_later(HANG_SECONDS, exit=True)
    fn = SCENARIOS[scenario] if isinstance(scenario, str) else scenario
    name = _name(scenario)
    result = fn(rank, world, Path(out), **kwargs)
    torch.save(result, Path(out) / f"{name}.rank{rank}.pt")
    if name == "killed" or result.get("exit_now"):
        os._exit(0)  # a failed collective leaves a thread blocked in the backend
    dist.destroy_process_group()


def _name(scenario: str | Callable) -> str:
    return scenario if isinstance(scenario, str) else scenario.__name__


def run(world: int, scenario: str | Callable, out: Path, **kwargs: Any) -> list[dict]:
    """Run ``scenario`` (a name in ``SCENARIOS``, or a module-level function of the same
    signature) on ``world`` spawned gloo ranks; their results in rank order. A rank whose
    result says ``exit_now`` ends its process at once (a collective failed)."""
    mp.spawn(_entry, args=(world, free_port(), scenario, str(out), kwargs), nprocs=world)
    name = _name(scenario)
    return [torch.load(out / f"{name}.rank{r}.pt", weights_only=False) for r in range(world)]


def one_process(**kwargs: Any) -> dict:
    """``scenario_train`` without torch.distributed: one rank on the global batch."""
    return scenario_train(0, 1, Path("."), **kwargs)
