"""The host accelerator's race checker: each test with a deliberate missing wait shows the
checker naming it; the same code with the wait (or a host synchronisation) passes."""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch

from zero_offload.accelerator import HostAccelerator
from zero_offload.accelerator.race_checker import CHECK_RACES_ENV, races_enabled_by_env
from zero_offload.config import AcceleratorConfig
from zero_offload.errors import StreamError, StreamRaceError
from zero_offload.memory.manager import Tier, TieredMemoryManager
from zero_offload.memory.traffic import Category, Direction

pytestmark = pytest.mark.simulator_only  # the race checker is the host accelerator's

NBYTES = 4096


@pytest.fixture
def manager() -> TieredMemoryManager:
    mgr = TieredMemoryManager(HostAccelerator(AcceleratorConfig(check_races=True)))
    yield mgr
    with contextlib.suppress(StreamError):  # a test's deliberate race failed the worker
        mgr.close()


def _buffers(manager: TieredMemoryManager) -> tuple[torch.Tensor, torch.Tensor]:
    """A device block and a host block of NBYTES, as float32 views."""
    dev = manager.create_pool(Tier.DEVICE, NBYTES, name="dev").alloc(NBYTES, owner="weights")
    host = manager.create_pool(Tier.HOST, NBYTES, name="host").alloc(NBYTES, owner="staging")
    return dev.view(torch.float32), host.view(torch.float32)


def _h2d(manager: TieredMemoryManager, dst: torch.Tensor, src: torch.Tensor, **kw: object):
    return manager.copy(
        dst, src, direction=Direction.H2D, category=Category.WEIGHTS, label="tile", **kw
    )


def _d2h(manager: TieredMemoryManager, dst: torch.Tensor, src: torch.Tensor, **kw: object):
    return manager.copy(
        dst, src, direction=Direction.D2H, category=Category.GRADIENTS, label="grad", **kw
    )


def _compute_reads(manager: TieredMemoryManager, tensor: torch.Tensor) -> None:
    acc = manager.accelerator
    acc.declare_access(tensor, stream=acc.current_stream(), write=False, what="forward")


def test_compute_read_without_waiting_for_the_h2d_copy_is_named(manager):
    dev, host = _buffers(manager)
    _h2d(manager, dev, host)
    with pytest.raises(StreamRaceError) as info:
        _compute_reads(manager, dev)  # missing: manager.wait_for([end])
    message = str(info.value)
    for part in (
        "pool 'dev'",
        "block weights",
        "forward (read, on stream 'compute'",
        "h2d copy 'tile' writing its destination (write",
        "on stream 'h2d'",
        "test_race_checker.py",
        "wait_event",
    ):
        assert part in message, (part, message)


@pytest.mark.parametrize("order", ["stream wait", "host sync", "transitive"])
def test_ordered_compute_read_passes(manager, order):
    dev, host = _buffers(manager)
    end = _h2d(manager, dev, host)
    if order == "stream wait":
        manager.wait_for([end], category=Category.WEIGHTS)
    elif order == "host sync":
        end.synchronize()
    else:  # h2d -> d2h (waits on it) -> compute (waits on d2h)
        manager.d2h.wait_event(end)
        manager.wait_for([manager.d2h.record_event()], category=Category.WEIGHTS)
    _compute_reads(manager, dev)


def test_a_query_that_returns_true_does_not_order(manager):
    # On the host accelerator the copy is done almost at once; on a GPU it might not be.
    dev, host = _buffers(manager)
    end = _h2d(manager, dev, host)
    manager.h2d.synchronize()
    assert end.query()
    _compute_reads(manager, dev)  # ordered by the stream synchronize above
    end2 = _h2d(manager, dev, host, after=[manager.compute_ready()])
    while not end2.query():
        pass
    with pytest.raises(StreamRaceError):
        _compute_reads(manager, dev)


def test_h2d_overwrite_of_weights_compute_still_reads_is_named(manager):
    # Write-after-read: the h2d copy must wait for compute (after=[compute_ready()]).
    dev, host = _buffers(manager)
    end = _h2d(manager, dev, host)
    manager.wait_for([end], category=Category.WEIGHTS)
    _compute_reads(manager, dev)  # e.g. a teacher forward queued after the last flush
    with pytest.raises(StreamRaceError, match=r"h2d copy 'tile' writing.*forward \(read"):
        _h2d(manager, dev, host)
    _h2d(manager, dev, host, after=[manager.compute_ready()])  # the fix


def test_reads_on_two_streams_do_not_conflict(manager):
    dev, host = _buffers(manager)
    manager.h2d.synchronize()
    _compute_reads(manager, dev)
    _d2h(manager, host, dev, after=[manager.compute_ready()])
    _compute_reads(manager, dev)  # compute and d2h both only read dev


def test_host_write_into_staging_while_d2h_still_writes_it_is_named(manager):
    dev, host = _buffers(manager)
    acc = manager.accelerator
    _d2h(manager, host, dev, after=[manager.compute_ready()])
    with pytest.raises(StreamRaceError, match=r"CPU thread 'MainThread'.*stream 'd2h'"):
        acc.declare_access(host, stream=None, write=True, what="CPU Adam")
    manager.d2h.synchronize()
    acc.declare_access(host, stream=None, write=True, what="CPU Adam")


def test_host_worker_task_and_the_next_flush(manager):
    # The host worker reads staging; the next D2H into staging must wait for that read.
    dev, host = _buffers(manager)
    acc, worker = manager.accelerator, manager.host_worker
    done = _d2h(manager, host, dev, after=[manager.compute_ready()])
    worker.wait_event(done)
    worker.submit(lambda: acc.declare_access(host, stream=None, write=False, what="accumulate"))
    consumed = worker.record_event()
    consumed.wait_unobserved()  # the task has run, but the host has not synchronised it
    with pytest.raises(StreamRaceError, match=r"'d2h'.*accumulate \(read of .*'host_worker'"):
        _d2h(manager, host, dev, after=[manager.compute_ready()])
    consumed.synchronize()  # Note [staging is reused only once consumed]
    _d2h(manager, host, dev, after=[manager.compute_ready()])


def test_host_worker_without_wait_event_is_named(manager):
    dev, host = _buffers(manager)
    acc, worker = manager.accelerator, manager.host_worker
    _d2h(manager, host, dev, after=[manager.compute_ready()])
    worker.submit(lambda: acc.declare_access(host, stream=None, write=False, what="accumulate"))
    with pytest.raises(StreamError) as info:  # raised on the worker, surfaced here
        worker.synchronize()
    assert isinstance(info.value.__cause__, StreamRaceError)
    assert "accumulate (read, on stream 'host_worker'" in str(info.value.__cause__)


def test_host_worker_tasks_queued_before_a_wait_are_not_ordered_by_it(manager):
    # Note [when a thread stream's clock moves]: the wait orders only work queued after it.
    dev, host = _buffers(manager)
    acc, worker = manager.accelerator, manager.host_worker
    gate = threading.Event()
    worker.submit(gate.wait)
    worker.submit(lambda: acc.declare_access(host, stream=None, write=False, what="early read"))
    done = _d2h(manager, host, dev, after=[manager.compute_ready()])
    worker.wait_event(done)
    worker.submit(lambda: acc.declare_access(host, stream=None, write=False, what="late read"))
    gate.set()
    with pytest.raises(StreamError) as info:
        worker.synchronize()
    assert "d2h copy 'grad' writing" in str(info.value.__cause__)
    assert "early read (read" in str(info.value.__cause__)  # the d2h write raced the early read


def test_disjoint_ranges_do_not_conflict(manager):
    dev, host = _buffers(manager)
    half = dev.numel() // 2
    _h2d(manager, dev[:half], host[:half])
    _compute_reads(manager, dev[half:])
    with pytest.raises(StreamRaceError):
        _compute_reads(manager, dev[half - 1 : half + 1])


def test_untracked_tensors_are_ignored(manager):
    acc = manager.accelerator
    mine = torch.zeros(64)
    acc.copy_(mine, torch.ones(64), stream=manager.h2d)
    acc.declare_access(mine, stream=acc.current_stream(), write=True, what="user tensor")
    assert acc.race_checker is not None and acc.race_checker.accesses_checked == 0


def test_off_by_default_and_on_by_env(monkeypatch):
    monkeypatch.delenv(CHECK_RACES_ENV, raising=False)
    assert HostAccelerator().race_checker is None
    monkeypatch.setenv(CHECK_RACES_ENV, "1")
    assert races_enabled_by_env()
    assert HostAccelerator().race_checker is not None
    assert HostAccelerator(AcceleratorConfig(check_races=False)).race_checker is None
    monkeypatch.setenv(CHECK_RACES_ENV, "maybe")
    with pytest.raises(ValueError, match=r"ZERO_OFFLOAD_CHECK_RACES='maybe'.*use 1"):
        HostAccelerator()


def test_check_races_must_be_a_bool():
    with pytest.raises(TypeError, match=r"check_races must be True, False or None.*'yes'"):
        AcceleratorConfig(check_races="yes")  # type: ignore[arg-type]


@pytest.mark.parametrize("overlap_step", [False, True])
def test_weight_copies_wait_for_a_kernel_reading_the_weights_after_step(overlap_step):
    # Write-after-read on the weights: an EMA update (or a teacher forward) queued on compute
    # after step() reads the parameters, which are views of the device weight block; the
    # host-to-device copies of the next update overwrite them and must wait for compute.
    # Without after=[compute_ready()] on those copies the checker names the pair.
    from zero_offload import OffloadAdamW, OffloadConfig

    from .helpers.models import TinyTransformer, batches, lm_loss

    acc = HostAccelerator(AcceleratorConfig(check_races=True))
    compute = acc.current_stream()
    model = TinyTransformer().to(torch.bfloat16)
    config = OffloadConfig(bucket_bytes=4096, tile_elements=1024, overlap_step=overlap_step)
    opt = OffloadAdamW(model.parameters(), lr=1e-3, accelerator=acc, config=config)

    def read_weights(what: str) -> None:
        for param in model.parameters():
            acc.declare_access(param.data, stream=compute, write=False, what=what)

    for tokens, targets in batches(4):
        read_weights("forward")
        lm_loss(model, tokens, targets).backward()
        opt.step()
        opt.zero_grad()
        read_weights("EMA after step")
    opt.close()
    assert acc.race_checker is not None and acc.race_checker.accesses_checked > 0
