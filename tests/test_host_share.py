"""Ranks that share a host's RAM split ``host_budget="auto"`` (Note [ranks that share a host's
RAM] in ``memory/host_ram.py``, Note [what "auto" leaves each rank] in
``optim/state/nvme_plan.py``): before, each of N ranks on one node took all the RAM it saw
free, N times what is there."""

from __future__ import annotations

import os
from collections import namedtuple
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from zero_offload import OffloadConfig
from zero_offload.memory import host_ram
from zero_offload.memory.host_ram import HostRam, HostShare
from zero_offload.optim.state.nvme import NvmeState
from zero_offload.optim.state.nvme_plan import resolve_host_budget

from .helpers.dist import free_port, join_gloo
from .helpers.models import make_pair, offload_opt

GiB = 1 << 30
#: Free RAM above the reserve in the two-rank test: this model's state (about 130 KiB a rank
#: in master and moments) and its buffers (about 140 KiB) fit once in it, not twice.
ABOVE = 400 << 10


def test_auto_is_split_between_the_ranks_on_one_host(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    Memory = namedtuple("Memory", "total available")
    monkeypatch.setattr(host_ram.psutil, "virtual_memory", lambda: Memory(512 * GiB, 200 * GiB))
    monkeypatch.setattr(host_ram, "cgroup_memory", lambda: None)
    config = OffloadConfig(nvme_dir=tmp_path)
    reserve = int(512 * GiB * 0.10)  # kept once for the host, above the 2 GiB floor
    alone = resolve_host_budget(config, other_host_bytes=GiB)
    assert alone == 200 * GiB - reserve - GiB
    # 8 ranks; the most any saw available was 240 GiB (this one reads 200 now: its
    # neighbours allocated since the exchange, which must not be counted twice).
    eighth = resolve_host_budget(config, other_host_bytes=GiB, share=HostShare(8, 240 * GiB))
    assert eighth == (240 * GiB - reserve) // 8 - GiB
    # One rank on the host: the exchange's figure, nothing split.
    one = resolve_host_budget(config, other_host_bytes=GiB, share=HostShare(1, 200 * GiB))
    assert one == alone
    # A fixed budget is each rank's own, whatever the share.
    fixed = OffloadConfig(nvme_dir=tmp_path, host_budget=5 * GiB)
    assert resolve_host_budget(fixed, other_host_bytes=GiB, share=HostShare(8, GiB)) == 5 * GiB


def _rank_entry(rank: int, world: int, port: int, out: str, apart: bool, local: int) -> None:
    """Build an optimizer with ``host_budget="auto"`` on a host that appears to have ABOVE
    bytes free past the reserve; record what each "auto" resolved to and where the state
    went."""
    join_gloo(rank, world, port)
    if local:  # the launcher says this node runs ``local`` processes (torchrun's variable)
        os.environ["LOCAL_WORLD_SIZE"] = str(local)
    from zero_offload.optim import ranks
    from zero_offload.optim.state import nvme_plan

    # A host with 4 GiB (so a 2 GiB reserve) and ABOVE more than that free, this rank's own
    # reading a little lower on rank 1 (the exchange takes the largest).
    total, free = 4 * GiB, 2 * GiB + ABOVE
    fake = lambda: HostRam(free - rank * 4096, total, "host RAM available is", False)  # noqa: E731
    ranks.host_ram = fake
    nvme_plan.host_ram = fake
    if apart:  # two hosts: each rank names its RAM differently
        ranks.host_identity = lambda: f"host{rank}"
    seen = []
    real = nvme_plan.resolve_host_budget

    def spy(config, *, other_host_bytes, share=None):
        budget = real(config, other_host_bytes=other_host_bytes, share=share)
        seen.append((share, other_host_bytes, budget))
        return budget

    nvme_plan.resolve_host_budget = spy
    model, _ = make_pair()
    opt = offload_opt(model, nvme_dir=Path(out) / f"nvme{rank}", host_budget="auto")
    on_nvme = sum(isinstance(b.store, NvmeState) for b in opt.buckets)
    state = sum(3 * 4 * b.layout.shard_numel for b in opt.buckets)  # master and moments
    result = {"seen": seen, "on_nvme": on_nvme, "buckets": len(opt.buckets), "state": state}
    opt.close()
    torch.save(result, Path(out) / f"rank{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.parametrize(
    ("apart", "local"),
    [(False, 0), (True, 0), (True, 4)],
    ids=["one host", "two hosts", "two hosts, 4 processes a node by the launcher"],
)
def test_two_ranks_on_one_host_each_take_half_of_auto(
    tmp_path: Path, apart: bool, local: int
) -> None:
    mp.spawn(_rank_entry, args=(2, free_port(), str(tmp_path), apart, local), nprocs=2)
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    reserve = 2 * GiB  # max(10% of 4 GiB, 2 GiB)
    for rank, result in enumerate(results):
        assert result["seen"], "host_budget='auto' was never resolved"
        for share, other, budget in result["seen"]:
            if local:  # the optimizer's group has one rank a node; the node runs 4
                assert share == HostShare(4, 2 * GiB + ABOVE - rank * 4096)
                assert budget == max(0, (share.available - reserve) // 4 - other)
            elif apart:  # each rank alone on its RAM, with its own reading
                assert share == HostShare(1, 2 * GiB + ABOVE - rank * 4096)
                assert budget == max(0, share.available - reserve - other)
            else:  # both on one RAM: rank 0's reading, the larger, split in two
                assert share == HostShare(2, 2 * GiB + ABOVE)
                assert budget == max(0, ABOVE // 2 - other)
    # ABOVE holds every rank's state where each rank is alone on its RAM; two ranks on one
    # host put part of theirs on NVMe (before, each took all of ABOVE and none did).
    if apart and not local:
        assert all(r["on_nvme"] == 0 for r in results), results
    else:
        assert all(0 < r["on_nvme"] <= r["buckets"] for r in results), results


def test_the_launchers_count_splits_auto_without_a_group(monkeypatch: pytest.MonkeyPatch) -> None:
    """Processes that build before joining a group (or a group of one) still split "auto"
    by the launcher's count of processes on the node."""
    from zero_offload.optim.ranks import share_host

    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.delenv("SLURM_NTASKS_PER_NODE", raising=False)
    assert share_host(None) is None
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "8")
    assert share_host(None).ranks == 8  # type: ignore[union-attr]
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # torchrun's, first
    assert share_host(None).ranks == 4  # type: ignore[union-attr]
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert share_host(None) is None
