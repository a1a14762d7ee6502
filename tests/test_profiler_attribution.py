"""What the profiler attributes to each row: the pools' true peak over the recording, and
exposed time that belongs to the row's own copies (Note [exposed versus hidden time] in
``profiling/summary.py``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from zero_offload.accelerator import HostAccelerator
from zero_offload.config import AcceleratorConfig
from zero_offload.memory.manager import Tier, TieredMemoryManager
from zero_offload.memory.traffic import Category, Direction
from zero_offload.profiling import profile

LATENCY = 0.05  # seconds per simulated copy
KIB = 1024


@pytest.fixture
def manager() -> Iterator[TieredMemoryManager]:
    manager = TieredMemoryManager(HostAccelerator(AcceleratorConfig(link_latency=LATENCY)))
    yield manager
    manager.close()


def test_pool_peaks_count_blocks_freed_between_steps(manager: TieredMemoryManager) -> None:
    dev_a = manager.create_pool(Tier.DEVICE, 16 * KIB, name="dev_a")
    dev_b = manager.create_pool(Tier.DEVICE, 16 * KIB, name="dev_b")
    host_a = manager.create_pool(Tier.HOST, 16 * KIB, name="host_a")
    kept = host_a.alloc(2 * KIB)  # in use across the whole recording
    with profile(manager, link_bandwidth=1e9) as prof:
        dev_a.alloc(4 * KIB).free()
        dev_b.alloc(8 * KIB).free()  # after dev_a's: the peak of the sum is 8 KiB, not 12
        prof.step()
        host_b = manager.create_pool(Tier.HOST, 16 * KIB, name="host_b")  # built while recording
        prof.step()
        both = host_a.alloc(4 * KIB), host_b.alloc(4 * KIB)
        for block in both:
            block.free()
        prof.step()
    memory = prof.to_dict()["memory"]
    # Nothing was in use at any prof.step() but ``kept``: a sample would have seen 0 and 2 KiB.
    assert memory["device_pools_peak_bytes"] == 8 * KIB
    assert memory["host_pools_peak_bytes"] == 10 * KIB
    # The pools' own peaks are theirs, untouched by the profiler's windows.
    assert [p.stats()["peak_bytes_in_use"] for p in (dev_a, dev_b)] == [4 * KIB, 8 * KIB]
    kept.free()


def test_a_pools_peak_window_is_the_peak_of_the_sum(manager: TieredMemoryManager) -> None:
    from zero_offload.profiling.pool_peaks import PoolsPeakWindow  # here: the others run without

    pools = [manager.create_pool(Tier.HOST, 16 * KIB, name=f"p{i}") for i in range(2)]
    held = pools[0].alloc(KIB)
    window = PoolsPeakWindow()
    for pool in pools:
        window.watch(pool)
        window.watch(pool)  # once only
    assert window.take() == KIB
    a = pools[0].alloc(4 * KIB)
    b = pools[1].alloc(2 * KIB)
    a.free()
    b.free()
    assert window.take() == 7 * KIB  # 1 + 4 + 2, all at once before the frees
    assert window.take() == KIB  # the next window starts from the use then
    window.close()
    pools[1].alloc(8 * KIB).free()
    assert window.take() == KIB  # closed: no longer told
    held.free()


def _copy(manager: TieredMemoryManager, category: Category) -> object:
    dev = manager.create_pool(Tier.DEVICE, 4 * KIB, name=f"dev {category.value}")
    host = manager.create_pool(Tier.HOST, 4 * KIB, name=f"host {category.value}")
    dst, src = dev.alloc(4 * KIB), host.alloc(4 * KIB)
    end = manager.copy(
        dst.view(torch.uint8), src.view(torch.uint8), direction=Direction.H2D, category=category
    )
    return end, (dst, src)


def test_exposed_time_is_the_rows_own_copies(manager: TieredMemoryManager) -> None:
    """Compute waits for an activation reload queued on h2d behind a weight copy: it waits
    for both, but only the reload's own time is the activations' exposed time."""
    with profile(manager, link_bandwidth=1e9) as prof:
        _, weights_blocks = _copy(manager, Category.WEIGHTS)
        reload, activation_blocks = _copy(manager, Category.ACTIVATIONS)
        manager.wait_for([reload], category=Category.ACTIVATIONS)  # blocks: the host's compute
        prof.step()
    rows = {row["name"]: row for row in prof.to_dict()["transfers"]}
    act, weights = rows["activations in"], rows["weights H2D"]
    assert act["count"] == weights["count"] == 1
    assert 0.5 * act["seconds"] <= act["exposed_seconds"] <= act["seconds"]
    assert act["waited_seconds"] >= act["seconds"] + weights["seconds"] * 0.9  # behind both
    assert act["hidden_seconds"] == pytest.approx(act["seconds"] - act["exposed_seconds"])
    assert weights["exposed_seconds"] == weights["waited_seconds"] == 0.0  # nobody waited on it
    for block in (*weights_blocks, *activation_blocks):
        block.free()
