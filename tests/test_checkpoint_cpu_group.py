"""Consolidated checkpoints gather over a CPU (gloo) group, never through the GPU: Note
[checkpoints are gathered on the CPU] in checkpoint_io.py. One process, a gloo world of
one, and a backend reported as NCCL to exercise the twin group."""

from __future__ import annotations

import socket

import pytest
import torch.distributed as dist

from zero_offload import checkpoint_io
from zero_offload.collectives import Comm


@pytest.fixture
def gloo_world():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    checkpoint_io._cpu_groups.clear()
    yield
    checkpoint_io._cpu_groups.clear()
    dist.destroy_process_group()


def test_a_gloo_group_is_used_as_it_is(gloo_world):
    comm = Comm(group=None, rank=0, world_size=1, timeout=60.0)
    assert checkpoint_io.cpu_group(comm) is None  # the default group, gloo already


def test_an_nccl_group_gets_one_gloo_twin_with_its_ranks(gloo_world, monkeypatch):
    real_get_backend = dist.get_backend
    nccl = dist.new_group(ranks=[0], backend="gloo")  # stands in for an NCCL group
    monkeypatch.setattr(
        dist, "get_backend", lambda g=None: "nccl" if g is nccl else real_get_backend(g)
    )
    comm = Comm(group=nccl, rank=0, world_size=1, timeout=60.0)
    twin = checkpoint_io.cpu_group(comm)
    assert twin is not None and twin is not nccl
    assert "gloo" in str(real_get_backend(twin))
    assert dist.get_process_group_ranks(twin) == dist.get_process_group_ranks(nccl)
    assert checkpoint_io.cpu_group(comm) is twin  # made once, kept
    gathered = [None]
    dist.gather_object({"shard": 0}, gathered, dst=0, group=twin)
    assert gathered == [{"shard": 0}]
