"""Streamed checkpoints of several ranks belong to one save (Note [one save across the
ranks] in ``optim/checkpoint/streaming.py``): files of another save on some rank are refused on
every rank, naming that rank, before anything loads."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
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


def _padding_rank_entry(rank: int, world: int, port: int, out: str, nvme: bool) -> None:
    join_gloo(rank, world, port)
    root = Path(out)
    model, _ = make_pair()
    extra = {"nvme_dir": root / f"nvme{rank}", "host_budget": 1} if nvme else {}
    opt = offload_opt(model, bucket_bytes=1024, **extra)  # small parameters alone
    padding_only = [
        b.layout.index for b in opt.buckets if b.layout.real_in(*b.layout.shard_range(rank)) == 0
    ]
    pairs = data(3)
    train_steps(model, opt, pairs[:2], rank, world)
    opt.save_streaming(root / "saved")
    saved = {k: v.clone() for k, v in model.state_dict().items()}  # the weights go apart
    train_steps(model, opt, pairs[2:], rank, world)
    want = [p.detach().clone() for p in model.parameters()]
    error = None
    try:
        model.load_state_dict(saved)  # the model first, then the optimizer, as a resume does
        opt.load_streaming(root / "saved")
        train_steps(model, opt, pairs[2:], rank, world)
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    got = [p.detach().clone() for p in model.parameters()]
    same = error is None and all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    opt.close()
    torch.save({"padding_only": padding_only, "error": error, "same": same}, root / f"r{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.parametrize("nvme", [False, True], ids=["host", "nvme"])
def test_a_shard_of_padding_only_loads_back(tmp_path: Path, nvme: bool) -> None:
    """A bucket whose shard on a rank is padding only (a small parameter alone in a bucket,
    split over two ranks): its tiles hold no element, and ``load_streaming`` crashed on it
    with "self.stride(-1) must be 1 to view Byte as Float", half-loaded."""
    mp.spawn(_padding_rank_entry, args=(2, free_port(), str(tmp_path), nvme), nprocs=2)
    results = [torch.load(tmp_path / f"r{rank}.pt", weights_only=True) for rank in range(2)]
    assert any(r["padding_only"] for r in results)  # the case is there
    for rank, result in enumerate(results):
        assert result["error"] is None, (rank, result["error"])
        assert result["same"], rank  # the resumed step is the uninterrupted one, bitwise
