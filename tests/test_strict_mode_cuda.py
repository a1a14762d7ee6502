"""The CUDA-only fixes that issue 22's strict mode pointed at, tested with a fake
``torch.cuda`` (a per-thread current device and a fake runtime) where a CPU cannot show them:
Note [every library thread binds its device], the runtime's last error, pinned mappings
and fork, an explicit ``set_device`` against ``LOCAL_RANK``, and a stale device budget."""

from __future__ import annotations

import gc
import mmap
import threading

import pytest
import torch

from zero_offload.accelerator import CudaAccelerator, HostAccelerator
from zero_offload.accelerator.cuda import (
    HostRegistration,
    check_device_free,
    resolve_device_index,
)
from zero_offload.accelerator.pinned import page_aligned_buffer
from zero_offload.accelerator.threads import ThreadStream
from zero_offload.config import AcceleratorConfig
from zero_offload.errors import DeviceBudgetExceeded

GiB = 1 << 30


class FakeCuda:
    """torch.cuda's current device, per thread (0 in each new thread), as on CUDA."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self._local = threading.local()
        self.set_calls: list[int] = []
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", self.current_device)
        monkeypatch.setattr(torch.cuda, "set_device", self.set_device)

    def current_device(self) -> int:
        return getattr(self._local, "index", 0)

    def set_device(self, device: int | torch.device) -> None:
        index = device.index if isinstance(device, torch.device) else device
        self.set_calls.append(index)
        self._local.index = index


class FakeRuntime:
    """cudaHostRegister/Unregister that record the device current at each call."""

    def __init__(self, cuda: FakeCuda, status: int = 0) -> None:
        self.cuda, self.status = cuda, status
        self.registered_on: list[int] = []
        self.unregistered_on: list[int] = []

    def cudaHostRegister(self, ptr: int, nbytes: int, flags: int) -> int:
        self.registered_on.append(self.cuda.current_device())
        return self.status

    def cudaHostUnregister(self, ptr: int) -> int:
        self.unregistered_on.append(self.cuda.current_device())
        return 0


def _run_in_thread(fn) -> None:
    thread = threading.Thread(target=fn)
    thread.start()
    thread.join()


def test_pinning_runs_on_the_accelerators_device_from_any_thread(monkeypatch):
    cuda = FakeCuda(monkeypatch)
    runtime = FakeRuntime(cuda)
    registration = HostRegistration(1, cudart=runtime, clear_error=lambda: None)
    buffers = []

    def pin_on_a_fresh_thread() -> None:  # current device 0, as every new thread
        buffers.append(
            page_aligned_buffer(
                4096, register=registration.register, unregister=registration.unregister
            )
        )
        assert cuda.current_device() == 0  # restored: the caller's device is its own

    _run_in_thread(pin_on_a_fresh_thread)
    assert runtime.registered_on == [1]  # not a context on GPU 0

    def drop_on_another_thread() -> None:  # a finalizer runs wherever the last ref dies
        buffers.clear()
        gc.collect()

    _run_in_thread(drop_on_another_thread)
    assert runtime.unregistered_on == [1]


def test_a_failed_registration_clears_the_runtimes_last_error(monkeypatch):
    cuda = FakeCuda(monkeypatch)
    cleared: list[bool] = []
    registration = HostRegistration(
        0, cudart=FakeRuntime(cuda, status=2), clear_error=lambda: cleared.append(True)
    )
    with pytest.raises(MemoryError, match=r"cudaErrorMemoryAllocation \(2\)"):
        page_aligned_buffer(
            4096, register=registration.register, unregister=registration.unregister
        )
    assert cleared == [True]  # else torch's next kernel-launch check reports it as its own


def test_pinned_mappings_are_not_inherited_by_forked_children():
    buffer = page_aligned_buffer(3 * mmap.PAGESIZE, register=lambda p, n: 0, unregister=id)
    start = buffer.data_ptr()
    with open("/proc/self/smaps") as smaps:
        text = smaps.read()
    flags = None
    current = None
    for line in text.splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            current = lo <= start < hi
        elif head == "VmFlags:" and current:
            flags = line.split()[1:]
    assert flags is not None and "dc" in flags  # dc: "do not copy area on fork"


def test_thread_stream_worker_starts_on_its_creators_cuda_device(monkeypatch):
    cuda = FakeCuda(monkeypatch)
    seen: list[int] = []
    cuda.set_device(1)  # the rank's thread, bound by CudaAccelerator
    worker = ThreadStream("host_worker")
    worker.submit(lambda: seen.append(cuda.current_device()))
    worker.synchronize()
    worker.close()
    assert seen == [1]  # a new thread starts on 0: the worker bound its creator's device


def test_cuda_accelerator_binds_only_when_the_device_differs(monkeypatch):
    cuda = FakeCuda(monkeypatch)
    acc = object.__new__(CudaAccelerator)  # bind_thread needs only the device
    acc.device = torch.device("cuda", 1)
    acc.bind_thread()
    acc.bind_thread()
    assert cuda.set_calls == [1] and cuda.current_device() == 1


@pytest.mark.parametrize(
    ("env", "count", "current", "expected"),
    [
        ({"LOCAL_RANK": "1"}, 4, 2, 2),  # the user's set_device(2) wins over torchrun's rank
        ({"LOCAL_RANK": "1"}, 4, 0, 1),  # nothing set: the rank's device
    ],
)
def test_an_explicit_set_device_wins_over_local_rank(env, count, current, expected):
    assert resolve_device_index(None, env=env, device_count=count, current=current) == expected


def test_device_out_of_memory_within_the_budget_is_a_budget_error(monkeypatch):
    acc = HostAccelerator(AcceleratorConfig(device_budget="1MiB"))

    def out_of_memory(nbytes: int, *, what: str) -> torch.Tensor:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.00 KiB")

    monkeypatch.setattr(acc, "_device_empty", out_of_memory)
    with pytest.raises(DeviceBudgetExceeded, match=r"'bucket 3'.*within the budget.*out of memory"):
        acc.allocate_device(4096, what="bucket 3")
    assert acc.memory_stats()["in_use"] == 0  # a failed call leaves the ledger as it was


def test_a_request_beyond_what_the_device_has_now_is_refused():
    check_device_free(GiB, free=GiB // 2, cached_unused=GiB // 2, what="pool")  # fits
    with pytest.raises(DeviceBudgetExceeded, match=r"'pool'.*only 1.00 GiB is free there now"):
        check_device_free(2 * GiB, free=GiB // 2, cached_unused=GiB // 2, what="pool")
