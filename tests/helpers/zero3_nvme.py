"""Spawned gloo ranks for tests/test_zero3_nvme.py: ZeRO-3 with parameter offload and
``nvme_dir`` (each rank's home shards beyond ``host_budget`` in its own weight files, Note
[sharded homes on NVMe] in params/sharded_fetch.py). Run with ``_zero3.run(world, <the
function>, out, ...)``."""

from __future__ import annotations

import gc
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from zero_offload import CollectiveError, OffloadAdamW, OffloadConfig
from zero_offload.demo.model import GPTConfig, TinyGPT
from zero_offload.errors import StorageError, StorageFull
from zero_offload.memory.traffic import Category, Direction
from zero_offload.optim.state.nvme import NvmeState
from zero_offload.optim.state.nvme_weights import NvmeHomeState

from .models import host_accelerator
from .zero3 import batches, gpt, make_opt, rank_loss, share

#: The disk traffic a step is measured by: (direction, category) -> a short name.
DISK = {
    "weights_read": (Direction.NVME_READ, Category.WEIGHTS),
    "weights_written": (Direction.NVME_WRITE, Category.WEIGHTS),
    "state_read": (Direction.NVME_READ, Category.OPTIMIZER_STATE),
    "state_written": (Direction.NVME_WRITE, Category.OPTIMIZER_STATE),
}


def _disk(opt: Any) -> dict[str, int]:
    counters = opt.manager.counters
    return {name: counters.bytes(*key) for name, key in DISK.items()}


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def nvme_train(
    rank: int,
    world: int,
    out: Path,
    *,
    dtype: torch.dtype,
    steps: int,
    host_budget: int | list[int] | None,
    release: str = "close",
    uneven: bool = False,
) -> dict:
    """Stage 3 with parameter offload, trained ``steps`` steps on this rank's share of the
    global batch; with ``host_budget`` the homes and state beyond it are on NVMe under
    ``out/nvme/rank{r}`` (None: every home in RAM, no ``nvme_dir``; a list: each rank's
    own). ``release``: how the optimizer ends, ``"close"`` or ``"gc"`` (dropped and
    collected). ``uneven``: the ranks leave different blocks out (``_zero3.skipped``)."""
    model = gpt(dtype, layers=4)
    root = out / "nvme"
    config: dict[str, Any] = {"prefetch_layers": 1}
    if isinstance(host_budget, list):
        host_budget = host_budget[rank]
    if host_budget is not None:
        config.update(nvme_dir=str(root), host_budget=host_budget)
    opt = make_opt(model, offload=True, **config)
    offloader = opt.param_offloader
    homes = [b for b in opt.buckets if isinstance(b.store, NvmeHomeState)]
    result: dict[str, Any] = {
        "kinds": [type(b.store).__name__ for b in opt.buckets],
        # per unit in registration order: the real elements of each of its buckets' home
        # shards on NVMe (this rank's), and its weight files' bytes
        "unit_homes": [
            [v.nvme_home.real for v in unit.views if v.nvme_home is not None]
            for unit in offloader.units
        ],
        "unit_disk": [
            sum(v.nvme_home.file.nbytes for v in unit.views if v.nvme_home is not None)
            for unit in offloader.units
        ],
        "itemsize": dtype.itemsize,
        "home_disk": sum(b.store.home.file.nbytes for b in homes),
        "state_disk": sum(
            b.store.file.nbytes for b in opt.buckets if isinstance(b.store, NvmeState)
        ),
        "ring": len({unit.slot.index for unit in offloader.units if not unit.spec.tied}),
        "dir": str(root / f"rank{rank}"),
        "weight_files": [b.store.home.path for b in homes],
    }
    disk, losses = [_disk(opt)], []
    for step, (ids, targets) in enumerate(batches(steps)):
        loss = rank_loss(model, step, ids, targets, rank, world, uneven=uneven)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        disk.append(_disk(opt))
    # Collective (every rank, in the same order): each entry a copy of the gathered
    # parameter, its shards read from disk (Note [a sharded unit]).
    result["state_dict"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    result["files_before_close"] = _files(root) if root.exists() else []
    result["disk"] = disk
    result["losses"] = losses
    result["gathers"] = offloader.gather.gathers
    if release == "close":
        opt.close()  # collective: every parameter gets its gathered weights, read from disk
    else:
        del opt, offloader, homes  # collected: the same, on every rank alike
        gc.collect()
    result["weights"] = [p.detach().clone() for p in model.parameters()]
    result["names"] = [name for name, _ in model.named_parameters()]
    result["files_after_close"] = _files(root) if root.exists() else []
    return result


def _corrupt(path: str, offset: int) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(fd, np.full(8, 0x7F, dtype=np.uint8).tobytes(), offset + 8)
        os.fsync(fd)
    finally:
        os.close(fd)


def nvme_corrupted(rank: int, world: int, out: Path, *, timeout: float) -> dict:
    """One step with every home on NVMe; then rank 1 corrupts record 1 of its largest
    weight file, and both ranks run a forward (which fetches every unit from disk). Rank 1
    must raise the StorageError; rank 0 must not hang in the gather rank 1 never issues."""
    model = gpt(torch.float32, layers=2)
    opt = make_opt(
        model,
        offload=True,
        nvme_dir=str(out / "nvme"),
        host_budget=1,
        bucket_bytes=32768,  # shards of several 1024-element tiles
        prefetch_layers=1,
        collective_timeout=timeout,
    )
    ids, targets = batches(1)[0]
    ids, targets = share(ids, rank, world), share(targets, rank, world)
    model(ids, targets).backward()
    opt.step()
    opt.zero_grad()
    result: dict[str, Any] = {"exit_now": True, "type": None}
    if rank == 1:
        victim = max(opt.buckets, key=lambda b: b.store.home.tiles)
        home = victim.store.home
        unit = next(u for u in opt.param_offloader.units if victim.views in u.views)
        result.update(
            path=home.path,
            tiles=home.tiles,
            unit=f"unit {unit.index} ({unit.spec.name}) bucket {victim.layout.index}",
        )
        _corrupt(home.path, home.file.offset(1))
    torch.distributed.barrier()  # the file is bad before either rank reads it
    began = time.perf_counter()
    try:
        model(ids, targets)
    except (StorageError, CollectiveError) as exc:
        result.update(type=type(exc).__name__, error=str(exc))
    result["seconds"] = time.perf_counter() - began
    return result


def nvme_full(rank: int, world: int, out: Path, *, timeout: float) -> dict:
    """Rank 1's disk is full (its free bytes reported as 0): its construction is refused
    naming the rank and its directory, leaving nothing there; rank 0, built, does not hang
    in its first gather."""
    if rank == 1:
        from zero_offload.memory.state_dir import StateDirectory

        StateDirectory.free_bytes = lambda self: 0  # type: ignore[method-assign]
    model = gpt(torch.float32, layers=2)
    root = out / "nvme"
    result: dict[str, Any] = {"exit_now": True, "type": None}
    began = time.perf_counter()
    try:
        opt = make_opt(
            model,
            offload=True,
            nvme_dir=str(root),
            host_budget=1,
            prefetch_layers=1,
            collective_timeout=timeout,
        )
        began = time.perf_counter()
        ids, targets = batches(1)[0]
        model(share(ids, rank, world), share(targets, rank, world)).backward()
        opt.step()
    except (StorageFull, CollectiveError) as exc:
        result.update(type=type(exc).__name__, error=str(exc))
    result["seconds"] = time.perf_counter() - began
    result["files"] = _files(root / f"rank{rank}") if (root / f"rank{rank}").exists() else []
    return result


def nvme_pools(
    rank: int, world: int, out: Path, *, dtype: torch.dtype, budget: int, bucket_bytes: int
) -> dict:
    """A TinyGPT (3 blocks, hidden 64) built with parameter offload, ``nvme_dir`` and
    ``host_budget=budget`` per rank: its host pools (the host pool and the bounce ring's)
    and the bytes on disk in this rank's directory, before anything trains."""
    model = TinyGPT(GPTConfig(vocab_size=50, seq_len=32, layers=3, hidden=64, heads=4)).to(dtype)
    root = out / "nvme"
    config = OffloadConfig(
        bucket_bytes=bucket_bytes, nvme_dir=root, host_budget=budget, offload_parameters=True
    )
    opt = OffloadAdamW(
        model.parameters(),
        accelerator=host_accelerator(),
        config=config,
        model=model,
        layers=model.blocks,
    )
    pools = opt.manager.pool_stats()
    mine = root / f"rank{rank}"
    result = {
        "host": sum(
            p["capacity_bytes"] for name, p in pools.items() if name.endswith((".host", ".bounce"))
        ),
        "disk": sum(f.stat().st_size for f in mine.rglob("*") if f.is_file()),
        "homes_on_disk": sum(isinstance(b.store, NvmeHomeState) for b in opt.buckets),
    }
    opt.close()
    return result
