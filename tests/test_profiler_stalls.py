"""Exposed time is the compute stream's stall, measured on its own clock: Note [exposed time
is measured on the compute stream]. A compute stream that, like a GPU's, does not block the
caller in ``wait_event`` shows why timing the host call measures nothing."""

from __future__ import annotations

import time

import pytest
import torch

from zero_offload.accelerator import HostAccelerator
from zero_offload.config import AcceleratorConfig
from zero_offload.memory.manager import Tier, TieredMemoryManager
from zero_offload.memory.traffic import Category, Direction, StallRecord

LATENCY = 0.3  # seconds per simulated copy


@pytest.fixture
def gpu_like(monkeypatch: pytest.MonkeyPatch):
    """A manager whose compute stream is a worker thread: waits queue, the caller runs on."""
    acc = HostAccelerator(AcceleratorConfig(link_latency=LATENCY))
    compute = acc.new_stream("compute")
    monkeypatch.setattr(acc, "current_stream", lambda: compute)
    manager = TieredMemoryManager(acc)
    yield manager, compute
    manager.close()


def _slow_h2d(manager: TieredMemoryManager):
    dev = manager.create_pool(Tier.DEVICE, 4096, name="dev").alloc(4096).view(torch.uint8)
    host = manager.create_pool(Tier.HOST, 4096, name="host").alloc(4096).view(torch.uint8)
    return manager.copy(dev, host, direction=Direction.H2D, category=Category.WEIGHTS)


def test_the_stall_is_measured_on_the_compute_stream_not_the_host_call(gpu_like):
    manager, compute = gpu_like
    end = _slow_h2d(manager)
    began = time.perf_counter()
    manager.wait_for([end], category=Category.WEIGHTS)
    assert time.perf_counter() - began < LATENCY / 4  # the caller did not wait
    compute.synchronize()
    exposed = manager.exposed_seconds[Category.WEIGHTS]
    assert LATENCY / 2 < exposed < 3 * LATENCY


def test_stalls_count_only_once_complete(gpu_like):
    manager, compute = gpu_like
    manager.wait_for([_slow_h2d(manager)], category=Category.WEIGHTS)
    assert manager.exposed_seconds.get(Category.WEIGHTS, 0.0) == 0.0  # still waiting
    compute.synchronize()
    assert manager.exposed_seconds[Category.WEIGHTS] > 0.0


def test_listeners_hear_each_stall(gpu_like):
    manager, compute = gpu_like
    heard: list[StallRecord] = []
    unsubscribe = manager.subscribe(
        lambda r: heard.append(r) if isinstance(r, StallRecord) else None
    )
    manager.wait_for([_slow_h2d(manager)], category=Category.WEIGHTS)
    unsubscribe()
    compute.synchronize()
    assert len(heard) == 1 and heard[0].waited_for == 1 and heard[0].stream == "compute"
    assert heard[0].seconds() == pytest.approx(manager.exposed_seconds[Category.WEIGHTS])
