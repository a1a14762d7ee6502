"""Spawned gloo ranks for tests/test_zero3_device.py: ZeRO-3 with the shards on the device
(``OffloadConfig(partition_parameters=True)`` on several ranks) and ZeRO-3 with parameter
offload (``offload_parameters=True``) on the same ranks, and one process, on the same
global batch (tests/helpers/zero3.py's model, batches and shares).

``run(world, scenario, out, **kwargs)`` starts ``world`` ranks, each runs
``SCENARIOS[scenario]``; the results come back in rank order.
"""

from __future__ import annotations

import contextlib
import faulthandler
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from zero_offload import OffloadAdamW, OffloadConfig, profile
from zero_offload.memory.traffic import Category, Direction

from .dist import free_port, join_gloo
from .models import host_accelerator
from .zero3 import HANG_SECONDS, batches, gpt, pool_capacity, share

#: Device budget of each rank (the host accelerator's ledger counts the library's bytes).
BUDGET = "256MiB"
#: The host accelerator as CUDA would behave, with every stream access checked.
CHECKED = {"check_races": True, "strict": True, "link_bandwidth": 2e8}


def make_opt(
    model: torch.nn.Module, *, mode: str, checked: bool = False, **config: Any
) -> OffloadAdamW:
    """``mode``: "device" (partition_parameters), "offload" (offload_parameters) or
    "stage2" (neither: no model given). ``checked``: the race checker and strict mode on, and
    a slow simulated link, so a missing wait between streams raises."""
    config.setdefault("bucket_bytes", 8192)
    config.setdefault("tile_elements", 1024)
    switches = {
        "device": {"partition_parameters": True},
        "offload": {"offload_parameters": True},
        "both": {"partition_parameters": True, "offload_parameters": True},
        "stage2": {},
    }[mode]
    return OffloadAdamW(
        model.parameters(),
        lr=1e-3,
        betas=(0.9, 0.95),
        weight_decay=0.1,
        config=OffloadConfig(**switches, **config),
        accelerator=host_accelerator(device_budget=BUDGET, **(CHECKED if checked else {})),
        **({} if mode == "stage2" else {"model": model}),
    )


def _step(
    model: torch.nn.Module,
    opt: OffloadAdamW,
    step_batches: list[tuple[torch.Tensor, torch.Tensor]],
    rank: int,
    world: int,
    *,
    micro: int,
    clip: float | None,
) -> float:
    """One optimizer step over this rank's share of each global batch in ``step_batches``,
    split into ``micro`` micro-batches (the loss divided so the gradient is the mean)."""
    for ids, targets in step_batches:
        ids, targets = share(ids, rank, world), share(targets, rank, world)
        per, rest = divmod(ids.shape[0], micro)
        if rest:
            raise ValueError(f"micro={micro} does not divide this rank's {ids.shape[0]} sequences")
        for m in range(micro):
            piece = slice(m * per, (m + 1) * per)
            loss = model(ids[piece], targets[piece]) / micro
            loss.backward()
    if clip is not None:
        opt.clip_grad_norm_(clip)
    opt.step()
    opt.zero_grad()
    return opt.last_grad_norm


def scenario_train(
    rank: int,
    world: int,
    out: Path,
    *,
    mode: str,
    dtype: torch.dtype,
    steps: int,
    micro: int = 1,
    clip: float | None = None,
    ckpt: str | None = None,
    resume_at: int | None = None,
    prefetch: int = 1,
    checked: bool = False,
) -> dict:
    """Train ``steps`` steps; with ``resume_at``, save the model's and the optimizer's state
    dicts after that many steps, build a fresh model and optimizer, load both and go on."""
    model = gpt(dtype, layers=4, ckpt=ckpt)
    config: dict[str, Any] = {"prefetch_layers": prefetch, "checked": checked}
    opt = make_opt(model, mode=mode, **config)
    accelerator = opt.accelerator
    construction = accelerator.memory_stats()
    accelerator.ledger.reset_peak()
    h2d_before = opt.manager.counters.bytes(Direction.H2D, Category.WEIGHTS)
    comm = opt.comm
    counters = [] if comm is None else [comm.counters.snapshot()]
    norms: list[float] = []
    pairs = batches(steps)
    # The profiler listens to one optimizer: not across a resume, which replaces it.
    watch = profile(opt, link_bandwidth=1e9) if resume_at is None else contextlib.nullcontext()
    with watch as prof:
        for step, pair in enumerate(pairs):
            if step == resume_at:
                saved = (model.state_dict(), opt.state_dict())  # collective: every rank
                saved = torch.load(_roundtrip(saved, out, rank), weights_only=False)
                opt.close()
                model = gpt(dtype, layers=4, ckpt=ckpt)
                torch.manual_seed(123)  # the fresh model's weights differ: the load must win
                for p in model.parameters():
                    p.data.add_(torch.randn_like(p))
                opt = make_opt(model, mode=mode, **config)
                model.load_state_dict(saved[0])  # through the parameters: collective
                opt.load_state_dict(saved[1])
            norms.append(_step(model, opt, [pair], rank, world, micro=micro, clip=clip))
            if comm is not None and resume_at is None:
                counters.append(comm.counters.snapshot())
    stats = accelerator.memory_stats()
    h2d = opt.manager.counters.bytes(Direction.H2D, Category.WEIGHTS) - h2d_before
    offloader = opt.param_offloader
    result: dict[str, Any] = {
        "counters": counters,
        "profiled": None
        if prof is None
        else {row["name"]: row["bytes"] for row in prof.to_dict()["collectives"]},
        "norms": norms,
        "peak": stats["peak"],
        "construction_peak": construction["peak"],
        "capacity": pool_capacity(opt),
        "buckets": [
            (b.layout.padded_numel, b.layout.shard_numel, b.views.dtype.itemsize)
            for b in opt.buckets
        ],
        # Micro-batches summed on the device (Note [micro-batches add up on the device]):
        # whether every bucket took its accumulator.
        "device_sums": all(getattr(b.gradients, "device_sum", None) for b in opt.buckets),
        "offloader": None if offloader is None else type(offloader).__name__,
        # per unit in registration order: its buckets' padded bytes (the gathered bytes)
        "unit_buckets": []
        if offloader is None
        else [
            [v.layout.padded_numel * v.dtype.itemsize for v in unit.views]
            for unit in offloader.units
        ],
        "slot_of_unit": [] if offloader is None else [unit.slot.index for unit in offloader.units],
        "h2d_weights": h2d,  # H2D weight bytes after construction (fetches, publications)
        "param_numel": [b.layout.param_numel for b in opt.buckets],
    }
    opt.close()  # collective with several ranks: every parameter gets its gathered weights
    result["weights"] = [p.detach().clone() for p in model.parameters()]
    return result


def _roundtrip(saved: Any, out: Path, rank: int) -> Path:
    path = out / f"resume.rank{rank}.pt"
    torch.save(saved, path)
    return path


SCENARIOS = {"train": scenario_train}


def _entry(rank: int, world: int, port: int, scenario: str, out: str, kwargs: dict) -> None:
    join_gloo(rank, world, port)
    faulthandler.dump_traceback_later(HANG_SECONDS, exit=True)
    result = SCENARIOS[scenario](rank, world, Path(out), **kwargs)
    torch.save(result, Path(out) / f"{scenario}.rank{rank}.pt")
    dist.destroy_process_group()


def run(world: int, scenario: str, out: Path, **kwargs: Any) -> list[dict]:
    """Run ``scenario`` on ``world`` spawned gloo ranks; their results in rank order."""
    mp.spawn(_entry, args=(world, free_port(), scenario, str(out), kwargs), nprocs=world)
    return [torch.load(out / f"{scenario}.rank{r}.pt", weights_only=False) for r in range(world)]


def one_process(out: Path, **kwargs: Any) -> dict:
    """``scenario_train`` without torch.distributed: one rank on the global batch."""
    return scenario_train(0, 1, out, **kwargs)
