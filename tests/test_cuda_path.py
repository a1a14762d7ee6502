"""The CUDA path's logic, tested without a GPU where it is pure (budget, device index,
pinned buffers, the event clock), and on a GPU where it is not (marked ``cuda``)."""

from __future__ import annotations

import gc
import mmap

import pytest
import torch

from zero_offload.accelerator import HostAccelerator
from zero_offload.accelerator.cuda import (
    DEVICE_HEADROOM_MIN,
    default_device_budget,
    resolve_device_index,
)
from zero_offload.accelerator.cuda_events import ANCHOR_SECONDS, Anchor
from zero_offload.accelerator.pinned import (
    PAGE_SIZE,
    memlock_limit,
    page_aligned_buffer,
    registration_error,
)
from zero_offload.config import AcceleratorConfig

GiB = 1 << 30
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# -- the default budget: Note [the default device budget] -------------------------------


def test_budget_is_free_memory_less_headroom_not_total():
    total, free = 80 * GiB, 30 * GiB  # weights, context and activations hold the other 50
    budget, why = default_device_budget(free, total)
    assert budget == free - 4 * GiB  # headroom: 5% of 80 GiB
    assert "30.00 GiB free" in why and "headroom of 4.00 GiB" in why


def test_budget_counts_torchs_unused_cache_as_free_and_never_goes_negative():
    assert default_device_budget(2 * GiB, 16 * GiB, cached_unused=GiB)[0] == 2 * GiB
    assert default_device_budget(GiB // 2, 16 * GiB)[0] == 0  # less free than the headroom
    assert default_device_budget(8 * GiB, 8 * GiB)[0] == 8 * GiB - DEVICE_HEADROOM_MIN


def test_configured_budget_still_wins():
    config = AcceleratorConfig(device_budget="3GiB")
    assert config.resolved_device_budget(*default_device_budget(GiB, 80 * GiB)) == (
        3 * GiB,
        "config",
    )


# -- the device index: per rank, after set_device --------------------------------------


@pytest.mark.parametrize(
    ("index", "env", "count", "current", "expected"),
    [
        (None, {}, 4, 2, 2),  # the current device (the user called set_device)
        (None, {"LOCAL_RANK": "3"}, 4, 0, 3),  # torchrun's rank, before any set_device
        (None, {"LOCAL_RANK": "3"}, 1, 0, 0),  # one GPU visible per process
        (1, {"LOCAL_RANK": "3"}, 4, 0, 1),  # an explicit index wins
    ],
)
def test_device_index_per_rank(index, env, count, current, expected):
    assert resolve_device_index(index, env=env, device_count=count, current=current) == expected


def test_device_index_errors_name_the_value():
    with pytest.raises(ValueError, match=r"LOCAL_RANK='x' is not a device index"):
        resolve_device_index(None, env={"LOCAL_RANK": "x"}, device_count=2, current=0)
    with pytest.raises(ValueError, match=r"in \[0, 2\), got 5.*sees 2 GPU"):
        resolve_device_index(5, env={}, device_count=2, current=0)


# -- pinned buffers: Note [pinned buffers are page-aligned mmaps] -------------------------


class _FakeRuntime:
    """cudaHostRegister/Unregister stand-ins that refuse overlapping registrations."""

    def __init__(self) -> None:
        self.live: dict[int, int] = {}  # ptr -> length
        self.unregistered: list[int] = []

    def register(self, ptr: int, length: int) -> int:
        for start, size in self.live.items():
            pages = lambda p, n: set(range(p // PAGE_SIZE, -(-(p + n) // PAGE_SIZE)))  # noqa: E731
            if pages(ptr, length) & pages(start, size):
                return 712  # cudaErrorHostMemoryAlreadyRegistered
        self.live[ptr] = length
        return 0

    def unregister(self, ptr: int) -> None:
        del self.live[ptr]
        self.unregistered.append(ptr)


def test_small_pinned_buffers_are_page_aligned_and_never_share_a_page():
    runtime = _FakeRuntime()
    buffers = [
        page_aligned_buffer(512, register=runtime.register, unregister=runtime.unregister)
        for _ in range(8)  # np.empty(512) would put several in one page
    ]
    for buffer in buffers:
        assert buffer.numel() == 512 and buffer.data_ptr() % PAGE_SIZE == 0
        assert buffer.untyped_storage().nbytes() == PAGE_SIZE
    assert len(runtime.live) == 8


def test_pinned_buffer_is_unregistered_when_its_last_view_dies():
    runtime = _FakeRuntime()
    buffer = page_aligned_buffer(
        3 * PAGE_SIZE, register=runtime.register, unregister=runtime.unregister
    )
    ptr = buffer.data_ptr()
    view = buffer[PAGE_SIZE:].view(torch.float32)
    view.fill_(1.0)
    del buffer
    gc.collect()
    assert runtime.unregistered == []  # a view still uses the pages
    assert float(view.sum()) == view.numel()
    del view
    gc.collect()
    assert runtime.unregistered == [ptr]


def test_a_failed_registration_reports_the_memlock_limit_with_numbers():
    def refuse(ptr: int, length: int) -> int:
        return 2  # cudaErrorMemoryAllocation

    with pytest.raises(MemoryError) as info:
        page_aligned_buffer(10_000, register=refuse, unregister=lambda ptr: None)
    message = str(info.value)
    assert "cudaErrorMemoryAllocation (2)" in message
    assert "10000 bytes" in message and f"{-(-10_000 // PAGE_SIZE) * PAGE_SIZE} after" in message
    limit = memlock_limit()
    assert ("unlimited" if limit is None else str(limit)) in message


def test_already_registered_is_not_blamed_on_ulimit():
    message = registration_error(512, PAGE_SIZE, 712)
    assert "cudaErrorHostMemoryAlreadyRegistered" in message and "a bug" in message


def test_huge_pages_threshold_is_a_multiple_of_the_page():
    from zero_offload.accelerator.pinned import HUGE_PAGE_MIN

    assert HUGE_PAGE_MIN % mmap.PAGESIZE == 0


# -- event times: Note [cuda events: blocking, timed only when asked] -------------------


class _FakeEvent:
    """A timed event at ``at`` seconds on a device clock whose elapsed_time is float32."""

    def __init__(self, at: float, done: bool = True) -> None:
        self.at = at
        self.done = done

    def query(self) -> bool:
        return self.done

    def elapsed_time(self, end: _FakeEvent) -> float:
        return float(torch.tensor((end.at - self.at) * 1e3, dtype=torch.float32))


def test_anchor_chain_keeps_microseconds_after_hours():
    hours = 5 * 3600.0
    root = Anchor(_FakeEvent(0.0), prev=None, time_=100.0, recorded=100.0)
    anchor = root
    for k in range(1, int(hours / ANCHOR_SECONDS) + 1):
        anchor = Anchor(_FakeEvent(k * ANCHOR_SECONDS), prev=anchor, time_=None, recorded=0.0)
    event = _FakeEvent(hours + 1.234567)
    chained = anchor.time_of(event)
    single = root.time_of(event)  # one reference from the start: float32 milliseconds
    exact = 100.0 + hours + 1.234567
    assert chained is not None and single is not None
    assert abs(chained - exact) < 5e-4
    assert abs(single - exact) > 10 * abs(chained - exact)


def test_anchor_time_waits_for_pending_events():
    root = Anchor(_FakeEvent(0.0), prev=None, time_=0.0, recorded=0.0)
    pending = Anchor(_FakeEvent(1.0, done=False), prev=root, time_=None, recorded=0.0)
    assert pending.time() is None and pending.time_of(_FakeEvent(2.0)) is None
    pending.event.done = True
    assert pending.time_of(_FakeEvent(2.0)) == pytest.approx(2.0)


def test_timing_is_held_while_someone_listens():
    acc = HostAccelerator()
    assert acc.timing  # the host accelerator's events always know their time
    base = type(acc).__mro__[1]
    assert base.timing.fget(acc) is False  # the interface's answer with no holder
    release = acc.hold_timing()
    again = acc.hold_timing()
    assert base.timing.fget(acc) is True
    release()
    release()  # idempotent: one holder still there
    assert base.timing.fget(acc) is True
    again()
    assert base.timing.fget(acc) is False


# -- on a GPU -------------------------------------------------------------------------


@cuda
@pytest.mark.cuda
def test_cuda_budget_default_is_below_free_memory():
    from zero_offload.accelerator import CudaAccelerator

    acc = CudaAccelerator()
    free, _ = torch.cuda.mem_get_info(acc.device)
    cached = torch.cuda.memory_reserved(acc.device) - torch.cuda.memory_allocated(acc.device)
    assert acc.ledger.budget <= free + cached
    assert "mem_get_info" in acc.ledger.budget_source


@cuda
@pytest.mark.cuda
def test_cuda_events_are_timed_only_while_held_and_pinned_memory_is_aligned():
    from zero_offload.accelerator import CudaAccelerator

    acc = CudaAccelerator()
    stream = acc.new_stream("probe")
    untimed = stream.record_event()
    untimed.synchronize()
    assert untimed.completed_at() is None
    release = acc.hold_timing()
    timed = stream.record_event()
    timed.synchronize()
    release()
    assert timed.completed_at() is not None
    host = acc.allocate_host(512, pinned=True)
    assert host.data_ptr() % PAGE_SIZE == 0 and host.is_pinned()


def test_the_process_accelerator_follows_set_device(monkeypatch: pytest.MonkeyPatch):
    import zero_offload.accelerator as accelerators

    class FakeCuda:
        def __init__(self, config: AcceleratorConfig | None = None) -> None:
            self.config = config
            self.device = torch.device("cuda", torch.cuda.current_device())

    current = [0]
    monkeypatch.setattr(accelerators, "CudaAccelerator", FakeCuda)
    monkeypatch.setattr(accelerators, "choose_accelerator", lambda: ("cuda", "test"))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current[0])
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    accelerators.set_accelerator(None)
    try:
        config = AcceleratorConfig(device_budget="1GiB")
        first = accelerators.get_accelerator(config)  # built before set_device
        assert first.device.index == 0
        current[0] = 2  # torch.cuda.set_device(2)
        second = accelerators.get_accelerator()
        assert second.device.index == 2 and second.config is config
        assert accelerators.get_accelerator() is second
    finally:
        accelerators.set_accelerator(None)
