"""Strict mode of the host accelerator (``accelerator/strict.py``), on small synthetic cases:
each way it behaves as CUDA would where the plain simulator is blind."""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.nn.functional as F

from zero_offload.accelerator import HostAccelerator
from zero_offload.accelerator.strict import (
    COMPUTE_LATENCY,
    COPY_LATENCY,
    STRICT_DEVICE_INDEX,
    host_memory_name,
    strict_device_checks,
)
from zero_offload.accelerator.threads import ThreadStream
from zero_offload.config import AcceleratorConfig
from zero_offload.errors import StreamError
from zero_offload.memory.pool import BlockPool

pytestmark = pytest.mark.simulator_only  # strict mode is the host accelerator's

MISMATCH = r"Expected all tensors to be on the same device"


def _strict(**config: object) -> HostAccelerator:
    return HostAccelerator(AcceleratorConfig(strict=True, **config))  # type: ignore[arg-type]


def _in_thread(fn):
    """Run ``fn`` on a fresh thread (current device 0); its result or exception."""
    box: dict[str, object] = {}

    def run() -> None:
        try:
            box["result"] = fn()
        except BaseException as exc:  # handed back to the test
            box["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box.get("result")


def test_config_and_env_switch(monkeypatch):
    monkeypatch.setenv("ZERO_OFFLOAD_STRICT", "1")
    assert HostAccelerator().strict and not HostAccelerator(AcceleratorConfig(strict=False)).strict
    monkeypatch.setenv("ZERO_OFFLOAD_STRICT", "0")
    assert not HostAccelerator().strict
    monkeypatch.setenv("ZERO_OFFLOAD_STRICT", "maybe")
    with pytest.raises(ValueError, match=r"ZERO_OFFLOAD_STRICT='maybe' is not a switch"):
        HostAccelerator()
    with pytest.raises(TypeError, match=r"strict must be True, False or None.*int 1"):
        AcceleratorConfig(strict=1)  # type: ignore[arg-type]
    assert "device 1 of 2" in _strict().describe()["strict"]


# -- Note [strict: a copy lands when it ends] -----------------------------------------------


@pytest.mark.parametrize("strict", [False, True])
def test_a_copy_read_before_its_event_sees_the_old_bytes(strict):
    # A slow simulated link (1 s) so that the read below, 50 ms after the copy was queued,
    # surely comes before the copy ends however loaded the machine: the bytes land at the end
    # of the link's time, as on a GPU a reader that skipped the wait sees what was there.
    acc = HostAccelerator(AcceleratorConfig(strict=strict, link_latency=1.0))
    h2d = acc.new_stream("h2d")
    slot = acc.allocate_device(4096, what="slot")
    slot.tensor.zero_()
    home = acc.allocate_host(4096)
    home.fill_(7)
    acc.copy_(slot.tensor, home, stream=h2d, label="fetch")
    end = h2d.record_event()
    time.sleep(0.05)  # the stream has started the copy
    assert int(slot.tensor.max()) == 0  # no wait: the old bytes, all of them
    end.synchronize()
    assert int(slot.tensor.min()) == 7  # waited for: the copy's bytes
    slot.release()


def test_a_strict_copy_takes_the_copy_latency_without_a_link():
    acc = _strict()
    h2d = acc.new_stream("h2d")
    slot = acc.allocate_device(64, what="slot")
    began = time.perf_counter()
    acc.copy_(slot.tensor, acc.allocate_host(64), stream=h2d, label="fetch")
    h2d.record_event().synchronize()
    assert time.perf_counter() - began >= COPY_LATENCY  # a lower bound: the copy waited first
    slot.release()


# -- Note [strict: compute completes after its event] --------------------------------------


def test_plain_compute_events_are_born_complete():
    compute = HostAccelerator(AcceleratorConfig(strict=False)).current_stream()
    assert compute.record_event().query()  # the blind spot strict mode closes


def test_compute_event_is_pending_until_waited_for():
    compute = _strict().current_stream()
    event = compute.record_event()
    assert not event.query() and event.completed_at() is None
    event.synchronize()  # returns at once: the work ran inline
    assert event.query() and event.completed_at() is not None


def test_polling_a_compute_event_ends_after_the_latency():
    event = _strict().current_stream().record_event()
    began = time.perf_counter()
    while not event.query():
        time.sleep(0.001)
    assert time.perf_counter() - began >= COMPUTE_LATENCY / 2  # generous lower bound


def test_completing_an_event_completes_the_earlier_ones():
    compute = _strict().current_stream()
    first, second, third = (compute.record_event() for _ in range(3))
    second.synchronize()
    assert first.query() and second.query() and not third.query()
    compute.synchronize()
    assert third.query()


def test_another_stream_waiting_on_a_compute_event_never_deadlocks():
    acc = _strict()
    h2d = acc.new_stream("h2d")
    event = acc.current_stream().record_event()
    h2d.wait_event(event)
    h2d.synchronize()  # the simulated GPU reached the wait: the event is complete
    assert event.query()
    later = acc.current_stream().record_event()
    acc.synchronize()
    assert later.query()


@pytest.mark.parametrize("strict", [False, True])
def test_block_freed_with_a_compute_event_is_reused_through_a_stream_wait(strict):
    # A compute kernel writes a device block, the block is freed with the compute event, and
    # the h2d stream asks for a block. On a GPU the kernel may still run: h2d must wait.
    acc = HostAccelerator(AcceleratorConfig(strict=strict, check_races=True))
    compute, h2d = acc.current_stream(), acc.new_stream("h2d")
    pool = BlockPool.device(acc, 4096, name="grads")
    block = pool.alloc(4096, owner="gradient")
    acc.declare_access(block.view(torch.uint8), stream=compute, write=True, what="backward")
    block.record_event(compute.record_event())
    block.free()
    reused = pool.alloc(4096, owner="next gradient", stream=h2d)
    # Plain: the event was born done, so the block came back with no wait at all; strict:
    # it is in flight, and h2d waits for it on the stream, as the caching allocator does.
    assert pool.stats()["stream_reuses"] == (1 if strict else 0)
    acc.copy_(reused.view(torch.uint8), acc.allocate_host(4096), stream=h2d, label="in")
    h2d.synchronize()
    reused.free()
    pool.close()


# -- Note [strict: host memory is not device memory] ---------------------------------------


def test_op_mixing_host_and_device_memory_raises_naming_both():
    acc = _strict()
    host = acc.allocate_host(64).view(torch.float32)
    device = acc.allocate_device(64, what="weights").tensor.view(torch.float32)
    with strict_device_checks():
        with pytest.raises(RuntimeError, match=MISMATCH + r".*pinned host buffer.*'weights'"):
            torch.add(device, host)
        scaled = device * 2  # computed from device memory: device memory
        with pytest.raises(RuntimeError, match=MISMATCH + r".*computed from device buffer"):
            scaled.sub_(host[:4].repeat(4))
        with pytest.raises(RuntimeError, match=MISMATCH):
            host.float().mul(scaled)  # computed from host memory alone: host memory


def test_copies_scalars_and_unknown_tensors_mix_freely():
    acc = _strict()
    host = acc.allocate_host(64).view(torch.float32)
    device = acc.allocate_device(64, what="weights").tensor.view(torch.float32)
    host.copy_(torch.arange(16.0))  # fresh pinned memory holds whatever it held (NaN, say)
    reference = torch.ones(16)  # made without saying where: mixes with both
    with strict_device_checks():
        device.copy_(host)  # copies cross devices on CUDA too
        compute, h2d = acc.current_stream(), acc.new_stream("h2d")
        acc.copy_(host, device, stream=compute, label="d2h")
        h2d.wait_event(compute.record_event())  # the d2h reads device: it lands first
        acc.copy_(device, host, stream=h2d, label="h2d")
        acc.synchronize()
        device.add_(host.sum())  # a 0-dim CPU tensor mixes with device tensors on CUDA
        assert torch.equal(host + reference, host + 1) and torch.equal(device * reference, device)
        assert host_memory_name(host.double()) is not None  # a copy stays where it was
        moved = host.to(device="cpu", dtype=torch.float64)  # "cpu" or the device: unknown
        assert host_memory_name(moved) is None and torch.equal(moved, host.double())
        device.to(device="cpu", dtype=torch.float64).add_(host.double())  # unknown + host
    assert host_memory_name(host[3:]) is not None and host_memory_name(device) is None


def test_a_parameter_left_on_its_host_home_fails_the_forward():
    acc = _strict()
    layer, head = torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)
    for module in (layer, head):  # parameters fetched into device blocks
        for param in module.parameters():
            block = acc.allocate_device(param.numel() * 4, what="unit 0").tensor
            param.data = block.view(torch.float32).view_as(param).copy_(param)
    home = acc.allocate_host(head.weight.numel() * 4).view(torch.float32).view_as(head.weight)
    x = torch.randn(3, 4)
    with strict_device_checks():
        head(layer(x))  # all on the device: fine
        head.weight.data = home  # released to its pinned home, as user code would then see
        assert host_memory_name(next(head.parameters())) is not None
        with pytest.raises(RuntimeError, match=MISMATCH + r".*pinned host buffer"):
            head(layer(x))
        with pytest.raises(RuntimeError, match=MISMATCH):
            head(layer(x)).sum().backward()


def test_ops_on_other_threads_are_not_checked():
    acc = _strict()
    host = acc.allocate_host(16).view(torch.float32)
    device = acc.allocate_device(16, what="w").tensor.view(torch.float32)
    with strict_device_checks():
        _in_thread(lambda: torch.add(host, device))  # the host worker's CPU work, say
    with strict_device_checks(), pytest.raises(RuntimeError, match=MISMATCH):
        F.relu(host) + device


# -- Note [strict: a thread's current device] ----------------------------------------------


def test_an_unbound_thread_touching_a_stream_or_event_raises():
    acc = _strict()
    compute, h2d = acc.current_stream(), acc.new_stream("h2d")
    event = h2d.record_event()
    for touch, what in [
        (compute.record_event, "stream 'compute'"),
        (lambda: h2d.submit(lambda: None), "stream 'h2d'"),
        (h2d.synchronize, "stream 'h2d'"),
        (event.query, "an event of stream 'h2d'"),
        (acc.synchronize, "stream"),
    ]:
        pattern = rf"touched {what}.* of device {STRICT_DEVICE_INDEX} while its current device is 0"
        with pytest.raises(RuntimeError, match=pattern):
            _in_thread(touch)

    def bound() -> bool:
        acc.bind_thread()
        compute.record_event().synchronize()
        return event.query() or h2d.synchronize() is None

    assert _in_thread(bound)


def test_a_thread_stream_binds_its_device_before_its_first_task():
    acc = _strict()
    compute = acc.current_stream()

    def start_worker(**kwargs: object) -> ThreadStream:
        return _in_thread(lambda: ThreadStream("worker", **kwargs))  # made on device 0

    told = start_worker(bind=acc.bind_thread)  # the accelerator's device, whoever made it
    told.submit(lambda: compute.record_event().synchronize())
    told.synchronize()
    told.close()
    inherited = ThreadStream("worker")  # made on a bound thread: it takes that device
    inherited.submit(lambda: compute.record_event().synchronize())
    inherited.synchronize()
    inherited.close()
    unbound = start_worker()  # made on device 0, told nothing: device 0, as on CUDA
    unbound.submit(lambda: compute.record_event())
    with pytest.raises(StreamError, match=r"current device is 0"):
        unbound.synchronize()
