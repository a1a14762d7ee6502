"""Ranks that run different numbers of backwards before a step (docs/multi-rank.md, "Ranks
in lockstep"): the ranks' collectives no longer pair up. Rank 0's second backward
reduce-scatters a bucket while rank 1's step all-reduces the norms; gloo aborts the process
(SIGABRT) on the size mismatch, NCCL waits until its timeout. The docs name the diagnosis:
under ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` torch checks each collective against the other
ranks' before it runs, and every rank raises, naming both ranks' collectives. This test
holds the docs to that.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from .helpers.dist import data, join_gloo, shard_batch, spawn_ranks
from .helpers.models import lm_loss, make_pair, offload_opt


def _entry(rank: int, world: int, port: int, out: str) -> None:
    join_gloo(rank, world, port)
    model, _ = make_pair()
    opt = offload_opt(model)
    said = "stepped"
    try:
        for tokens, targets in data(2)[: 2 if rank == 0 else 1]:  # rank 0: one too many
            opt.backward(lm_loss(model, *(shard_batch(t, rank, world) for t in (tokens, targets))))
        opt.step()
    except Exception as exc:  # the message is what is checked
        said = f"{type(exc).__name__}: {exc}"
    Path(out, f"rank{rank}.txt").write_text(said)
    # The group is broken; its destructor would wait on the other rank's half-done
    # collective, so leave at once, as a launcher would.
    os._exit(0)


def test_debug_detail_names_the_mismatched_collectives(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "DETAIL")  # read as the ranks import torch
    spawn_ranks(_entry, 2, str(tmp_path))
    for rank in range(2):
        said = (tmp_path / f"rank{rank}.txt").read_text()
        assert "Detected mismatch between collectives on ranks" in said, (rank, said[:400])
