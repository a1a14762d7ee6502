"""What the traffic profiler reads, and how often: memory per step or phase, never per copy.

Note [the profiler reads memory per step, never per copy] (profiling/recorder.py). On CUDA
a memory read rebuilds the allocator's stats; at every copy it made profiled steps about a
second slower on an H200 (issue 39). These tests count the reads; they time nothing.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import nn

from zero_offload.accelerator import HostAccelerator
from zero_offload.config import AcceleratorConfig, OffloadConfig
from zero_offload.memory.manager import TieredMemoryManager
from zero_offload.memory.traffic import Category, Direction
from zero_offload.optim import OffloadAdamW
from zero_offload.profiling import profile

COPIES = 200
STEPS = 3


class _Reads:
    """Counts the profiler's memory reads: the accelerator's ledger and torch.cuda's stats."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, acc: HostAccelerator) -> None:
        self.ledger = 0
        self.torch = 0
        real_stats = acc.memory_stats

        def memory_stats() -> dict[str, int]:
            self.ledger += 1
            return real_stats()

        def torch_read(*args: object, **kwargs: object) -> int:
            self.torch += 1
            return 0

        monkeypatch.setattr(acc, "memory_stats", memory_stats)
        for name in ("memory_allocated", "max_memory_allocated", "reset_peak_memory_stats"):
            monkeypatch.setattr(torch.cuda, name, torch_read)

    def total(self) -> int:
        return self.ledger + self.torch


@pytest.fixture
def manager() -> Iterator[TieredMemoryManager]:
    manager = TieredMemoryManager(HostAccelerator(AcceleratorConfig(device_budget="16MiB")))
    yield manager
    manager.close()


def _as_if_cuda(prof: object) -> None:
    # The CUDA branch, on a machine without one: torch's reads are patched by _Reads, and
    # the profiler is told it has one CUDA device to read them for.
    prof._cuda_devices = [torch.device("cuda", 0)]  # type: ignore[attr-defined]


def test_a_copy_reads_no_memory(
    manager: TieredMemoryManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    src, dst = torch.ones(64), torch.empty(64)
    with profile(manager, link_bandwidth=1e9) as prof:
        reads = _Reads(monkeypatch, manager.accelerator)  # type: ignore[arg-type]
        _as_if_cuda(prof)
        for _ in range(COPIES):
            manager.copy(dst, src, direction=Direction.D2H, category=Category.GRADIENTS)
        copy_reads = reads.total()
        manager.synchronize()
    assert len(prof.data.copies) == COPIES  # every copy was heard ...
    assert copy_reads == 0  # ... and none read memory (the old profiler read it 200 times)


def test_memory_is_read_per_step_and_per_phase(monkeypatch: pytest.MonkeyPatch) -> None:
    acc = HostAccelerator(AcceleratorConfig(device_budget="64MiB"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))
    opt = OffloadAdamW(
        model.parameters(), lr=1e-2, accelerator=acc, config=OffloadConfig(bucket_bytes="16KiB")
    )
    try:
        prof = profile(opt, link_bandwidth=1e9)
        _as_if_cuda(prof)
        reads = _Reads(monkeypatch, acc)
        with prof:
            for _ in range(STEPS):
                model(torch.randn(16, 64)).square().mean().backward()
                opt.step()
                opt.zero_grad()
                prof.step()
    finally:
        opt.close()
    samples = STEPS + 2  # start, each prof.step(), stop
    copies, phases = len(prof.data.copies), len(prof.data.phases)
    assert copies >= 2 * STEPS * 3  # every bucket down and up each step: many copies ...
    # ... yet torch is read twice per step sample (max_memory_allocated, then the reset),
    # plus once at start to open the first window: never per copy, never per phase.
    assert reads.torch == 2 * (samples + 1)
    # The ledger: once per step sample, once per phase, once for the budget at start.
    assert reads.ledger == samples + phases + 1


def test_the_peak_between_samples_is_seen(manager: TieredMemoryManager) -> None:
    acc = manager.accelerator
    before = acc.memory_stats()
    acc.ledger.reset_peak()
    with profile(manager, link_bandwidth=1e9) as prof:
        buffer = acc.allocate_device(1 << 20, what="a transient buffer")  # no copy, no phase
        buffer.release()
        prof.step()
        prof.step()  # a later window, after the buffer: its peak is back to the use
    peaks = [m.device_peak for m in prof.data.memory if m.device_peak is not None]
    assert peaks[1] == before["in_use"] + (1 << 20)  # the window the buffer lived in
    assert peaks[2] == before["in_use"]
    assert prof.to_dict()["memory"]["device_peak_bytes"] == before["in_use"] + (1 << 20)
    # The ledger's own peak is the user's: the profiler's windows leave it alone.
    assert acc.memory_stats()["peak"] == before["in_use"] + (1 << 20)
    assert acc.ledger._windows == []  # closed at stop


def test_the_link_probe_leaves_the_ledgers_peak(manager: TieredMemoryManager) -> None:
    """The profiler's link probe takes a scratch device buffer (up to 8 MiB) at the first
    profile: the ledger's peak, the user's ``memory_stats()['peak']``, showed the probe on
    top of training's use (5.05 MB against 1.72 MB in a probe's run)."""
    acc = manager.accelerator
    buffer = acc.allocate_device(1 << 20, what="what training holds")
    before = acc.memory_stats()
    assert before["peak"] == before["in_use"]
    with profile(manager) as prof:  # measures the link: no link_bandwidth given
        prof.step()
    assert prof.to_dict()["link"]["probe_bytes"] > 0  # type: ignore[index]
    assert acc.memory_stats()["peak"] == before["peak"]
    buffer.release()
