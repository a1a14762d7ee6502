"""A rank whose peer died exits after its one clear error, without a traceback from every
finalizer at exit (Note [a quiet exit after a failed stream] in ``memory/quiet_exit.py``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from .helpers.dist import free_port

REPO = Path(__file__).resolve().parents[1]

_PREAMBLE = """
import os, sys, warnings
sys.path.insert(0, {repo!r})
warnings.simplefilter("ignore")
from datetime import timedelta
import torch, torch.distributed as dist
rank, world = {rank}, 2
torch.set_num_threads(1)
os.environ["ZERO_OFFLOAD_DEVICE_BUDGET"] = "256MiB"
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=rank,
                        world_size=world, timeout=timedelta(seconds=60))
from tests.helpers.dist import data, shard_batch
from tests.helpers.models import lm_loss, make_pair, offload_opt
from zero_offload.errors import CollectiveError, StreamError
"""

_PEER_DIES_AT_A_BARRIER = """
model, _ = make_pair()
opt = offload_opt(model, collective_timeout=5.0)
try:
    for step, (tokens, targets) in enumerate(data(4)):
        dist.barrier()
        if rank == 1 and step == 2:
            os._exit(3)  # the peer dies
        loss = lm_loss(model, shard_batch(tokens, rank, world), shard_batch(targets, rank, world))
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
except (CollectiveError, StreamError) as exc:
    print(f"rank {rank} stops: {type(exc).__name__}", file=sys.stderr, flush=True)
    sys.exit(1)  # the optimizer, its pools and streams are left to the finalizers at exit
"""

# Rank 1 dies inside its step: rank 0's all-gather fails, and its StepFailed names rank 1.
_PEER_DIES_IN_STEP = """
from zero_offload import StepFailed
model, _ = make_pair()
opt = offload_opt(model, collective_timeout=5.0)
if rank == 1:
    opt.buckets[1].store.update = lambda *a, **k: os._exit(3)
tokens, targets = data(1)[0]
opt.backward(lm_loss(model, shard_batch(tokens, rank, world), shard_batch(targets, rank, world)))
try:
    opt.step()
except StepFailed as exc:
    print("FIRST LINE:", str(exc).splitlines()[0], file=sys.stderr, flush=True)
    os._exit(1)
os._exit(0)
"""


def _two_ranks(body: str) -> tuple[list[subprocess.Popen[str]], list[str]]:
    """Run ``body`` after the preamble on two gloo ranks; the processes and their stderr."""
    port = free_port()
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", _PREAMBLE.format(repo=str(REPO), rank=rank, port=port) + body],
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    return ranks, [rank.communicate(timeout=240)[1] for rank in ranks]


def test_a_rank_whose_peer_died_exits_quietly_after_its_error() -> None:
    ranks, errs = _two_ranks(_PEER_DIES_AT_A_BARRIER)
    assert ranks[1].returncode == 3, errs[1]
    assert ranks[0].returncode == 1, errs[0]
    lines = [line for line in errs[0].splitlines() if line.strip()]
    # Its one error, and nothing from the finalizers (they printed a chained traceback of
    # the same CollectiveError once per pool and once for the optimizer).
    assert lines == ["rank 0 stops: CollectiveError"] or lines == ["rank 0 stops: StreamError"], (
        errs[0][-3000:]
    )


def test_step_failed_after_a_peer_died_mid_step_names_it_in_the_first_line() -> None:
    ranks, errs = _two_ranks(_PEER_DIES_IN_STEP)
    assert ranks[1].returncode == 3, errs[1][-3000:]
    assert ranks[0].returncode == 1, errs[0][-3000:]
    first = errs[0].split("FIRST LINE:", 1)[1].splitlines()[0].strip()
    assert first.startswith("rank 0/2: step() failed"), first
    assert "rank(s) 1 died or hung" in first
