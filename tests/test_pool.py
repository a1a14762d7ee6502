"""BlockPool: best fit, event-safe reuse, views, host RAM check, exhaustion, bad input.

Defragmentation and the randomized model check live in test_pool_defrag.py. See the Notes in
zero_offload/memory/pool.py.
"""

from __future__ import annotations

import pathlib
import threading
import time
from collections import namedtuple

import pytest
import torch

from zero_offload.accelerator import Accelerator, HostAccelerator
from zero_offload.config import AcceleratorConfig
from zero_offload.errors import DeviceBudgetExceeded, PoolExhausted
from zero_offload.memory import host_ram
from zero_offload.memory.pool import Block, BlockPool, BlockState

from .conftest import make_accelerator

KiB = 1024
MiB = 1024 * KiB


@pytest.fixture
def acc() -> HostAccelerator:
    return HostAccelerator()


def make_pool(acc: Accelerator, capacity: int, **kwargs: object) -> BlockPool:
    return BlockPool.host(acc, capacity, name="test", **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("where", ["host", "device"])
def test_alloc_rounds_aligns_and_best_fits(accel_kind: str, where: str) -> None:
    acc = make_accelerator(accel_kind)
    build = BlockPool.host if where == "host" else BlockPool.device
    pool = build(acc, 64 * KiB, name="p", alignment=512)
    blocks = [pool.alloc(n, owner=f"b{i}") for i, n in enumerate([100, 3000, 512, 5000])]
    assert [b.size for b in blocks] == [512, 3072, 512, 5120]  # rounded up to 512
    assert [b.offset for b in blocks] == [0, 512, 3584, 4096]  # packed in address order
    # Free a 3 KiB hole and a 5 KiB hole; a 2 KiB request takes the smaller (best fit).
    blocks[1].free()
    blocks[3].free()
    small = pool.alloc(2000)
    assert small.offset == 512
    big = pool.alloc(4 * KiB, align=4096)
    assert big.offset % 4096 == 0
    assert pool.stats()["bytes_in_use"] == 512 + 2048 + 512 + 4096
    for block in (blocks[0], blocks[2], small, big):
        block.free()
    assert pool.stats()["free_blocks"] == 1  # everything coalesced back into one range
    pool.close()


def test_aligned_request_uses_a_range_that_fits_only_with_padding(acc: HostAccelerator) -> None:
    """Free ranges [1280, 2048) and [2304, 4096): 512 bytes at align 1024 fit only at 3072."""
    pool = make_pool(acc, 32 * KiB, alignment=256)
    pool.alloc(1025)
    pool.alloc(1, align=4096)
    pool.alloc(1, align=1024)
    assert pool.alloc(257, align=1024).offset == 3072


def test_views_alias_the_pool_and_respect_size(acc: HostAccelerator) -> None:
    pool = make_pool(acc, 8 * KiB)
    block = pool.alloc(1000)
    block.on_move(lambda b: None)
    floats = block.view(torch.float32, (10, 25))
    floats.fill_(2.5)
    assert torch.all(block.view(torch.float32)[:250] == 2.5)
    assert block.view(torch.uint8).numel() == 1000  # the requested bytes, not the rounding
    with pytest.raises(ValueError, match="needs 1024 bytes"):
        block.view(torch.float32, (256,))


def test_device_pool_counts_against_the_budget() -> None:
    acc = HostAccelerator(AcceleratorConfig(device_budget=1 * MiB))
    pool = BlockPool.device(acc, 768 * KiB, name="dev")
    assert acc.memory_stats()["in_use"] == 768 * KiB  # exactly the capacity, no rounding
    with pytest.raises(DeviceBudgetExceeded):
        BlockPool.device(acc, 512 * KiB, name="too-big")
    pool.close()
    assert acc.memory_stats()["in_use"] == 0


# -------------------------------------------------------- Note [block reuse waits on events]


def test_block_freed_during_slow_copy_is_not_reused_until_the_copy_is_done() -> None:
    """The copy into A lands ~0.1 s after A is freed; the next owner's data must survive."""
    nbytes = 1 * MiB
    acc = HostAccelerator(AcceleratorConfig(link_bandwidth=10e6))  # 1 MiB takes ~0.1 s
    stream = acc.new_stream("h2d")  # the copy stream whose late write we race against
    pool = make_pool(acc, 2 * nbytes)
    first = pool.alloc(nbytes, owner="first")
    pool.alloc(nbytes, owner="other")  # the pool is now full: only first's bytes can come back
    source = torch.full((nbytes,), 7, dtype=torch.uint8)
    acc.copy_(first.view(torch.uint8), source, stream=stream)
    first.record_event(stream.record_event())

    start = time.perf_counter()
    first.free()
    # Freeing never blocks: the block is still in flight (the copy lands ~0.1 s later), and
    # free returned before the copy could have ended (a bound generous to a loaded machine).
    assert time.perf_counter() - start < 0.09
    assert first.state is BlockState.IN_FLIGHT
    assert pool.stats()["bytes_in_flight"] == nbytes

    second = pool.alloc(nbytes, owner="second")  # must wait for the copy (last resort)
    assert second.offset == first.offset
    assert first.state is BlockState.FREE
    second.view(torch.uint8).fill_(9)
    acc.synchronize()
    assert torch.all(second.view(torch.uint8) == 9)  # the late copy did not clobber it
    assert pool.stats()["event_waits"] == 1


def test_in_flight_block_is_skipped_when_other_space_fits() -> None:
    acc = HostAccelerator(AcceleratorConfig(link_bandwidth=10e6))
    stream = acc.new_stream("h2d")
    pool = make_pool(acc, 3 * MiB)
    first = pool.alloc(1 * MiB)
    acc.copy_(first.view(torch.uint8), torch.ones(MiB, dtype=torch.uint8), stream=stream)
    first.record_event(stream.record_event())
    first.free()
    second = pool.alloc(1 * MiB)
    assert second.offset != first.offset  # no overlap with the pending copy, and no wait
    assert pool.stats()["event_waits"] == 0
    stream.synchronize()
    second.free()  # the next alloc/free notices the copy is done and reclaims the bytes
    assert first.state is BlockState.FREE
    assert pool.stats()["bytes_in_flight"] == 0
    assert pool.stats()["free_blocks"] == 1


def test_threads_free_while_others_allocate(acc: HostAccelerator) -> None:
    """Copy-stream workers free blocks while the main thread allocates: counts stay exact."""
    pool = make_pool(acc, 4 * MiB, alignment=256)
    streams = [acc.new_stream(f"worker{i}") for i in range(3)]
    for step in range(600):
        block = pool.alloc(256 + (step * 97) % 8000, owner=f"s{step}")
        block.view(torch.uint8).fill_(step % 256)
        streams[step % 3].submit(block.free)
    acc.synchronize()
    stats = pool.stats()
    assert (stats["allocations"], stats["frees"], stats["live_blocks"]) == (600, 600, 0)
    assert stats["bytes_free"] == stats["largest_free_block"] == 4 * MiB


# ------------------------------------------------------------------- host RAM check


def test_host_pool_larger_than_available_ram_is_refused_before_allocating(
    acc: HostAccelerator, monkeypatch: pytest.MonkeyPatch
) -> None:
    Memory = namedtuple("Memory", "total available")
    monkeypatch.setattr(host_ram.psutil, "virtual_memory", lambda: Memory(16 * 2**30, 2 * 2**30))
    monkeypatch.setattr(host_ram, "cgroup_memory", lambda: None)  # no container limit

    def must_not_allocate(nbytes: int, *, pinned: bool = True) -> torch.Tensor:
        raise AssertionError("allocated before checking host RAM")

    monkeypatch.setattr(acc, "allocate_host", must_not_allocate)
    # Margin: max(5% of 16 GiB, 1 GiB) = 1 GiB, so 2 GiB available leaves 1 GiB.
    with pytest.raises(PoolExhausted) as info:
        BlockPool.host(acc, 3 * 2**29, name="grads", sized_by="OffloadConfig.host_pool_bytes")
    message = str(info.value)
    for expected in ("'grads'", "1.50 GiB", "host RAM available is only 2.00 GiB", "margin"):
        assert expected in message
    assert "Lower OffloadConfig.host_pool_bytes" in message


def test_host_pool_larger_than_total_ram_is_refused(acc: HostAccelerator) -> None:
    total = host_ram.psutil.virtual_memory().total
    with pytest.raises(PoolExhausted, match="refusing to allocate host pool 'huge'"):
        BlockPool.host(acc, total + 2**30, name="huge")


def _fake_cgroup(tmp_path: pathlib.Path, files: dict[str, str], own: str) -> tuple[str, str]:
    # A /sys/fs/cgroup tree and a /proc/self/cgroup naming the process's own cgroup.
    for rel, text in files.items():
        (tmp_path / "cg" / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "cg" / rel).write_text(text)
    (tmp_path / "proc_cgroup").write_text(own)
    return str(tmp_path / "cg"), str(tmp_path / "proc_cgroup")


def test_cgroup_v2_limit_is_the_headroom(tmp_path: pathlib.Path) -> None:
    root, proc = _fake_cgroup(
        tmp_path,
        {"job/memory.max": str(8 << 30), "job/memory.current": str(3 << 30)},
        "0::/job\n",
    )
    assert host_ram.cgroup_headroom(root, proc) == 5 << 30


def test_cgroup_v1_limit_at_the_mount_root(tmp_path: pathlib.Path) -> None:
    # A container sees its own cgroup at the mount's root, not under the path it is named by.
    root, proc = _fake_cgroup(
        tmp_path,
        {"memory/memory.limit_in_bytes": str(4 << 30), "memory/memory.usage_in_bytes": "1024"},
        "4:memory:/outer/job\n0::/\n",
    )
    assert host_ram.cgroup_headroom(root, proc) == (4 << 30) - 1024


def test_cgroup_v2_limit_on_a_parent_binds(tmp_path: pathlib.Path) -> None:
    # A SLURM job: the limit is on the job's cgroup, the step and task below it say "max".
    root, proc = _fake_cgroup(
        tmp_path,
        {
            "job_7/memory.max": str(8 << 30),
            "job_7/memory.current": str(2 << 30),
            "job_7/step_0/memory.max": "max",
            "job_7/step_0/memory.current": str(1 << 30),
            "job_7/step_0/task_0/memory.max": "max",
            "job_7/step_0/task_0/memory.current": str(1 << 30),
        },
        "0::/job_7/step_0/task_0\n",
    )
    assert host_ram.cgroup_memory(root, proc) == (8 << 30, 2 << 30)
    assert host_ram.cgroup_headroom(root, proc) == 6 << 30


def test_cgroup_v1_hierarchical_limit_binds(tmp_path: pathlib.Path) -> None:
    # v1 reports the parents' limit in memory.stat; the process's own looks unlimited.
    root, proc = _fake_cgroup(
        tmp_path,
        {
            "memory/job/memory.limit_in_bytes": str(2**63 - 4096),
            "memory/job/memory.usage_in_bytes": str(3 << 30),
            "memory/job/memory.stat": f"cache 5\nhierarchical_memory_limit {8 << 30}\n",
        },
        "4:memory:/job\n",
    )
    assert host_ram.cgroup_memory(root, proc) == (8 << 30, 3 << 30)


@pytest.mark.parametrize("v2", [True, False], ids=["v2", "v1"])
def test_cgroup_usage_leaves_out_the_inactive_page_cache(tmp_path: pathlib.Path, v2: bool) -> None:
    # A dataset read through the page cache: the kernel reclaims it before any OOM kill.
    if v2:
        files = {
            "job/memory.max": str(16 << 30),
            "job/memory.current": str(10 << 30),
            "job/memory.stat": f"anon {4 << 30}\ninactive_file {5 << 30}\nactive_file 9\n",
        }
        own = "0::/job\n"
    else:
        files = {
            "memory/job/memory.limit_in_bytes": str(16 << 30),
            "memory/job/memory.usage_in_bytes": str(10 << 30),
            "memory/job/memory.stat": f"total_inactive_file {5 << 30}\n",
        }
        own = "4:memory:/job\n"
    root, proc = _fake_cgroup(tmp_path, files, own)
    assert host_ram.cgroup_memory(root, proc) == (16 << 30, 5 << 30)


def test_cgroup_without_a_limit_is_none(tmp_path: pathlib.Path) -> None:
    root, proc = _fake_cgroup(tmp_path, {"memory.max": "max", "memory.current": "123"}, "0::/\n")
    assert host_ram.cgroup_headroom(root, proc) is None
    assert host_ram.cgroup_headroom(str(tmp_path / "none"), proc) is None


def test_container_limit_below_host_ram_refuses_the_pool(
    acc: HostAccelerator, monkeypatch: pytest.MonkeyPatch
) -> None:
    Memory = namedtuple("Memory", "total available")
    monkeypatch.setattr(host_ram.psutil, "virtual_memory", lambda: Memory(64 * 2**30, 60 * 2**30))
    # A container limited to 16 GiB, 12 GiB of it in use: 4 GiB of headroom.
    monkeypatch.setattr(host_ram, "cgroup_memory", lambda: (16 * 2**30, 12 * 2**30))
    monkeypatch.setattr(acc, "allocate_host", lambda *a, **k: pytest.fail("allocated first"))
    # Margin: max(5% of the 16 GiB limit, 1 GiB) = 1 GiB, so the 4 GiB headroom leaves 3 GiB.
    with pytest.raises(PoolExhausted, match=r"container's memory limit \(cgroup\) leaves only"):
        BlockPool.host(acc, 3 * 2**30 + 2**20, name="state")


def test_the_margin_is_a_share_of_the_containers_limit_not_of_the_node(
    acc: HostAccelerator, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A 64 GiB job on a 1 TiB node: 5% of the node (51 GiB) would be most of the job.
    Memory = namedtuple("Memory", "total available")
    monkeypatch.setattr(host_ram.psutil, "virtual_memory", lambda: Memory(2**40, 2**39))
    monkeypatch.setattr(host_ram, "cgroup_memory", lambda: (64 * 2**30, 4 * 2**30))
    ram = host_ram.host_ram()
    assert (ram.total, ram.available, ram.limited) == (64 * 2**30, 60 * 2**30, True)
    checked: list[int] = []
    monkeypatch.setattr(acc, "allocate_host", lambda n, **k: checked.append(n) or pytest.fail())
    # Margin: max(5% of 64 GiB, 1 GiB) = 3.2 GiB, so 60 GiB of headroom leaves 56.8 GiB.
    with pytest.raises(pytest.fail.Exception):
        BlockPool.host(acc, 56 * 2**30, name="state")  # passed the check, then "allocated"
    assert checked
    with pytest.raises(PoolExhausted, match=r"container limit 64\.00 GiB"):
        BlockPool.host(acc, 57 * 2**30, name="state")


def test_cgroup_headroom_is_limit_less_usage(tmp_path: pathlib.Path) -> None:
    root, proc = _fake_cgroup(
        tmp_path,
        {"job/memory.max": str(8 << 30), "job/memory.current": str(9 << 30)},
        "0::/job\n",
    )
    assert host_ram.cgroup_memory(root, proc) == (8 << 30, 9 << 30)
    assert host_ram.cgroup_headroom(root, proc) == 0  # over its limit: none, not negative


# ---------------------------------------------------------------------- exhaustion


def test_exhaustion_message_names_request_capacity_free_and_setting(acc: HostAccelerator) -> None:
    pool = BlockPool.host(acc, 4 * KiB, name="acts", sized_by="ActivationConfig.pool_bytes")
    blocks = [pool.alloc(512, owner=f"b{i}") for i in range(8)]
    for block in blocks[::2]:
        block.free()
    for block in blocks[1::2]:
        block.view(torch.uint8)  # a view without a callback pins each survivor in place
    with pytest.raises(PoolExhausted) as info:
        pool.alloc(1024, owner="layer3")
    message = str(info.value)
    for expected in (
        "pool 'acts'",
        "(1024 bytes",
        "owner 'layer3'",
        "(4096 bytes)",
        "2048 bytes free in 4 ranges",
        "largest free block after defragmentation 512 bytes",
        "2048 of them pinned in place",
        "Raise ActivationConfig.pool_bytes (now 4096 bytes)",
    ):
        assert expected in message
    assert isinstance(info.value, MemoryError)
    assert pool.stats()["defragmentations"] == 1  # it tried before giving up


def test_request_larger_than_free_bytes_does_not_defragment(acc: HostAccelerator) -> None:
    pool = make_pool(acc, 4 * KiB)
    pool.alloc(3 * KiB)
    with pytest.raises(PoolExhausted, match="defragmentation cannot help"):
        pool.alloc(2 * KiB)
    assert pool.stats()["defragmentations"] == 0


# ---------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("nbytes", "error", "match"),
    [
        (0, ValueError, "nbytes must be > 0, got 0"),
        (-5, ValueError, "got -5"),
        (1.5, TypeError, "float 1.5"),
        ("10", TypeError, "str '10'"),
        (True, TypeError, "bool True"),
    ],
)
def test_bad_nbytes(acc: HostAccelerator, nbytes: object, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        make_pool(acc, 4 * KiB).alloc(nbytes)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("alignment", "error"), [(3, ValueError), (0, ValueError), (2.0, TypeError)]
)
def test_bad_alignment(acc: HostAccelerator, alignment: object, error: type) -> None:
    with pytest.raises(error, match=f"alignment must be .*{alignment}"):
        make_pool(acc, 4 * KiB, alignment=alignment)
    with pytest.raises(error, match=f"align must be .*{alignment}"):
        make_pool(acc, 4 * KiB).alloc(16, align=alignment)  # type: ignore[arg-type]


def test_double_free_foreign_block_and_use_after_free(acc: HostAccelerator) -> None:
    pool, other = make_pool(acc, 4 * KiB), BlockPool.host(acc, 4 * KiB, name="other")
    block = pool.alloc(100, owner="x")
    with pytest.raises(ValueError, match="belongs to pool 'test', not to pool 'other'"):
        other.free(block)
    with pytest.raises(TypeError, match="takes a Block, got Tensor"):
        pool.free(torch.empty(3))  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="1 blocks are still in use"):
        pool.close()
    block.free()
    with pytest.raises(ValueError, match=r"double free of Block\(pool='test', offset=0"):
        pool.free(block)
    with pytest.raises(ValueError, match="it was freed"):
        block.view(torch.uint8)
    with pytest.raises(ValueError, match="record the copy's event before freeing"):
        block.record_event(acc.current_stream().record_event())
    with pytest.raises(TypeError, match="callable"):
        pool.alloc(8).on_move("not a function")  # type: ignore[arg-type]


def test_live_blocks_and_peak(acc: HostAccelerator) -> None:
    pool = make_pool(acc, 8 * KiB)
    a, b = pool.alloc(1024, owner="a"), pool.alloc(2048, owner="b")
    assert [blk.owner for blk in pool.live_blocks()] == ["a", "b"]
    assert all(isinstance(blk, Block) for blk in pool.live_blocks())
    a.free()
    assert pool.stats()["peak_bytes_in_use"] == 3072
    pool.reset_peak()
    assert pool.stats()["peak_bytes_in_use"] == 2048
    b.free()


def test_concurrent_alloc_from_many_threads(acc: HostAccelerator) -> None:
    pool = make_pool(acc, 2 * MiB)
    errors: list[BaseException] = []

    def churn(seed: int) -> None:
        try:
            mine = []
            for i in range(300):
                mine.append(pool.alloc(512 + (seed * 131 + i * 17) % 4096))
                if len(mine) > 20:
                    mine.pop(0).free()
            for block in mine:
                block.free()
        except BaseException as exc:  # surfaced by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=churn, args=(s,)) for s in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert pool.stats()["bytes_in_use"] == 0
    assert pool.stats()["free_blocks"] == 1


def test_only_the_block_touches_its_events_and_callbacks() -> None:
    """The pool, its compaction and its in-flight set use ``Block``'s methods for the
    block's events, callbacks and pin (issue 35): no module but block.py names the fields."""
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parents[1] / "zero_offload"
    fields = re.compile(r"\b\w+\.(_events|_callbacks|_pinned_in_place)\b")
    found = [
        f"{path.relative_to(root)}:{n}: {line.strip()}"
        for path in sorted((root / "memory").glob("*.py"))
        if path.name != "block.py"
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if fields.search(line) and "self._events" not in line
    ]
    assert not found, "\n".join(found)
