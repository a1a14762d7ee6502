"""Streamed checkpoints of several ranks belong to one save (Note [one save across the
ranks] in ``optim/checkpoint/streaming.py``): files of another save on some rank are refused on
every rank, naming that rank, before anything loads."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .helpers.dist import data, free_port, join_gloo, train_steps
from .helpers.models import make_pair, offload_opt


def _rank_entry(rank: int, world: int, port: int, out: str) -> None:
    join_gloo(rank, world, port)
    root = Path(out)
    model, _ = make_pair()
    opt = offload_opt(model)
    pairs = data(2)
    train_steps(model, opt, pairs[:1], rank, world)
    opt.save_streaming(root / "first")
    train_steps(model, opt, pairs[1:], rank, world)
    opt.save_streaming(root / "second")
    dist.barrier()
    if rank == 0:  # rank 0's files of the second save, rank 1's of the first
        (root / "mixed").mkdir()
        shutil.copytree(root / "second" / "rank0", root / "mixed" / "rank0")
        shutil.copytree(root / "first" / "rank1", root / "mixed" / "rank1")
    dist.barrier()
    errors = {}
    for name in ("mixed", "first"):
        try:
            opt.load_streaming(root / name)
        except ValueError as exc:
            errors[name] = str(exc)
    opt.close()
    torch.save(errors, root / f"rank{rank}.pt")
    dist.destroy_process_group()


def test_files_of_another_save_on_one_rank_are_refused_on_every_rank(tmp_path: Path) -> None:
    mp.spawn(_rank_entry, args=(2, free_port(), str(tmp_path)), nprocs=2)
    for rank in range(2):
        errors = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        assert list(errors) == ["mixed"], errors  # the whole first save loads
        message = errors["mixed"]
        assert f"rank {rank}/2" in message and "rank(s) [1]" in message
        assert "another save" in message and "nothing was loaded" in message
