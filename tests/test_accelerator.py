"""Stream, event, budget and link semantics, on every accelerator present.

See Note [stream semantics] and Note [stream errors are sticky] in
zero_offload/accelerator/base.py; the CUDA cases skip cleanly without a GPU.
"""

from __future__ import annotations

import time

import pytest
import torch

from zero_offload.accelerator import (
    ACCELERATOR_ENV,
    CudaAccelerator,
    HostAccelerator,
    choose_accelerator,
    get_accelerator,
    set_accelerator,
)
from zero_offload.config import AcceleratorConfig
from zero_offload.errors import DeviceBudgetExceeded, StreamError

from .conftest import make_accelerator


def _delay(kind: str, seconds: float) -> None:
    """Occupy the current stream for about ``seconds`` (a GPU spin on CUDA)."""
    if kind == "cuda":
        torch.cuda._sleep(int(seconds * 1.5e9))
    else:
        time.sleep(seconds)


def _after_current(acc, stream) -> None:
    """``stream`` waits for the work queued on the current stream so far: a tensor made
    there (``torch.zeros``) and written from ``stream`` races without it, which CUDA's
    sanitizer reports (issue 36)."""
    stream.wait_event(acc.current_stream().record_event())


def test_work_on_one_stream_runs_in_submission_order(accel_kind: str) -> None:
    acc = make_accelerator(accel_kind)
    stream = acc.new_stream("s")
    x = torch.zeros(1, device=acc.device)
    _after_current(acc, stream)  # x was zeroed on the current stream
    # ((0 + 1) * 3 - 2) * 5 = 5; any reordering gives another number.
    stream.submit(lambda: _delay(accel_kind, 0.05))
    stream.submit(lambda: x.add_(1))
    stream.submit(lambda: x.mul_(3))
    stream.submit(lambda: x.sub_(2))
    stream.submit(lambda: x.mul_(5))
    stream.synchronize()
    assert x.item() == 5


def test_event_completes_after_earlier_work_only(accel_kind: str) -> None:
    acc = make_accelerator(accel_kind)
    stream = acc.new_stream("s")
    stream.submit(lambda: _delay(accel_kind, 0.2))
    event = stream.record_event()
    assert not event.query()
    event.synchronize()
    assert event.query()


def test_stream_waits_on_another_streams_event(accel_kind: str) -> None:
    acc = make_accelerator(accel_kind)
    producer, consumer = acc.new_stream("producer"), acc.new_stream("consumer")
    src = torch.zeros(1000, device=acc.device)
    dst = torch.empty_like(src)
    _after_current(acc, producer)  # src was zeroed on the current stream
    producer.submit(lambda: _delay(accel_kind, 0.1))
    producer.submit(lambda: src.fill_(7))
    ready = producer.record_event()
    consumer.wait_event(ready)
    consumer.submit(lambda: dst.copy_(src))
    consumer.synchronize()
    assert torch.all(dst == 7)


def test_accelerator_synchronize_waits_for_all_streams(accel_kind: str) -> None:
    acc = make_accelerator(accel_kind)
    streams = [acc.new_stream(f"s{i}") for i in range(3)]
    values = torch.zeros(3, device=acc.device)
    for i, stream in enumerate(streams):
        _after_current(acc, stream)  # values was zeroed on the current stream
        stream.submit(lambda: _delay(accel_kind, 0.05))
        stream.submit(lambda i=i: values[i].fill_(i + 1))
    acc.synchronize()
    assert values.tolist() == [1, 2, 3]


def _explode() -> None:
    raise ValueError("boom from the worker")


def test_worker_exception_reaches_caller_with_its_traceback() -> None:
    acc = HostAccelerator()
    stream = acc.new_stream("copy")
    stream.submit(_explode)
    with pytest.raises(StreamError, match="copy") as info:
        stream.synchronize()
    cause = info.value.__cause__
    assert isinstance(cause, ValueError) and "boom" in str(cause)
    # The traceback as text: the stream keeps no frames (Note [a sticky error holds no
    # frames]).
    assert "in _explode" in str(info.value) and cause.__traceback__ is None


def test_failed_stream_refuses_more_work_and_fails_its_events() -> None:
    acc = HostAccelerator()
    stream = acc.new_stream("copy")
    ran: list[int] = []
    stream.submit(_explode)
    stream.submit(lambda: ran.append(1))  # queued before the failure is seen: dropped
    with pytest.raises(StreamError):
        stream.synchronize()
    assert ran == []
    with pytest.raises(StreamError, match="boom"):
        stream.submit(lambda: ran.append(2))
    with pytest.raises(StreamError):
        stream.record_event()
    with pytest.raises(StreamError):
        acc.synchronize()


def test_waiting_on_a_failed_event_fails_the_waiting_stream() -> None:
    acc = HostAccelerator()
    bad, waiter = acc.new_stream("bad"), acc.new_stream("waiter")
    bad.submit(_explode)
    event = bad.record_event()
    waiter.wait_event(event)
    with pytest.raises(StreamError, match="waiter"):
        waiter.synchronize()


def test_device_budget_accounting(accel_kind: str) -> None:
    acc = make_accelerator(accel_kind, device_budget=4096)
    a = acc.allocate_device(1000, what="a")
    b = acc.allocate_device(3000, what="b")
    assert a.tensor.numel() == 1000 and a.tensor.device.type == acc.device.type
    assert acc.memory_stats() == {"budget": 4096, "in_use": 4000, "peak": 4000}
    with pytest.raises(DeviceBudgetExceeded) as info:
        acc.allocate_device(200, what="gradient bucket 3")
    message = str(info.value)
    for needle in ("gradient bucket 3", "200 bytes", "4.00 KiB", "3.91 KiB", "device_budget"):
        assert needle in message
    assert isinstance(info.value, MemoryError)
    assert acc.memory_stats()["in_use"] == 4000  # the failed call counted nothing
    a.release()
    assert acc.memory_stats() == {"budget": 4096, "in_use": 3000, "peak": 4000}
    with pytest.raises(RuntimeError, match="released twice"):
        a.release()
    b.release()
    c = acc.allocate_device(4096, what="c")
    c.release()


def test_bad_allocation_sizes_are_rejected() -> None:
    acc = HostAccelerator(AcceleratorConfig(device_budget=100))
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="nbytes"):
            acc.allocate_device(bad, what="x")  # type: ignore[arg-type]


def test_simulated_link_slows_a_copy_by_at_least_the_configured_time() -> None:
    nbytes = 4_000_000
    acc = HostAccelerator(AcceleratorConfig(link_bandwidth=40e6, link_latency=0.02))
    expected = 0.02 + nbytes / 40e6  # 0.12 s
    stream = acc.new_stream("h2d")
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.zeros_like(src)
    start = time.perf_counter()
    acc.copy_(dst, src, stream=stream)
    stream.synchronize()
    elapsed = time.perf_counter() - start
    assert elapsed >= expected * 0.95
    assert torch.equal(dst, src)


def test_copies_on_two_streams_overlap() -> None:
    """Two copies on two streams take about one copy's time, not two: measured against the
    same two copies queued on one stream in the same test, so a loaded machine (or the race
    checker's bookkeeping, a fixed cost per copy) slows both sides alike; no absolute upper
    bound on time."""
    nbytes = 4_000_000
    acc = HostAccelerator(AcceleratorConfig(link_bandwidth=10e6))
    one_copy = nbytes / 10e6  # 0.4 s each on the simulated link
    src = torch.ones(nbytes, dtype=torch.uint8)

    def run(streams: list) -> float:
        dsts = [torch.zeros_like(src) for _ in streams]
        start = time.perf_counter()
        for dst, stream in zip(dsts, streams, strict=True):
            acc.copy_(dst, src, stream=stream)
        acc.synchronize()
        assert all(torch.equal(dst, src) for dst in dsts)
        return time.perf_counter() - start

    queued = acc.new_stream("d2h")
    serial = run([queued, queued])
    overlapped = run([acc.new_stream("d2h"), acc.new_stream("h2d")])
    assert serial >= 2 * one_copy * 0.95  # one stream runs its copies in order
    assert overlapped >= one_copy * 0.95
    # Overlapped: the link time of one copy saved (0.4 s), less than half of it allowed.
    assert overlapped < serial - one_copy / 2


def test_copy_on_the_caller_stream_is_synchronous() -> None:
    acc = HostAccelerator(AcceleratorConfig(link_latency=0.05))
    src, dst = torch.ones(10), torch.zeros(10)
    start = time.perf_counter()
    acc.copy_(dst, src, stream=acc.current_stream())
    assert time.perf_counter() - start >= 0.045
    assert torch.equal(dst, src)


def test_get_accelerator_respects_the_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ACCELERATOR_ENV, "host")
    set_accelerator(None)
    try:
        assert isinstance(get_accelerator(), HostAccelerator)
        assert choose_accelerator() == ("host", f"forced by {ACCELERATOR_ENV}=host")
        monkeypatch.setenv(ACCELERATOR_ENV, "tpu")
        with pytest.raises(ValueError, match="'tpu'"):
            choose_accelerator()
    finally:
        set_accelerator(None)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error")
def test_forcing_cuda_without_a_gpu_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ACCELERATOR_ENV, "cuda")
    with pytest.raises(RuntimeError, match="sees no CUDA GPU"):
        choose_accelerator()
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        CudaAccelerator()


def test_close_joins_the_stream_worker() -> None:
    """``close()`` returns after the worker thread has ended (the old code only queued its
    stop, and the thread left later)."""
    import threading

    acc = HostAccelerator()
    stream = acc.new_stream("joined")
    stream.submit(lambda: None)
    stream.synchronize()
    workers = [t for t in threading.enumerate() if t.name.endswith("joined")]
    assert len(workers) == 1
    stream.close()
    assert not workers[0].is_alive()


def test_closed_stream_refuses_work_instead_of_hanging() -> None:
    acc = HostAccelerator()
    stream = acc.new_stream("worker")
    ran: list[int] = []
    stream.submit(lambda: ran.append(1))
    stream.close()
    assert ran == [1]  # close finished the queued work first
    stream.close()  # idempotent
    for call in (lambda: stream.submit(lambda: None), stream.record_event, stream.synchronize):
        with pytest.raises(RuntimeError, match="'worker' is closed"):
            call()
