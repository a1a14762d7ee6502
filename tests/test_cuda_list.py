"""Issue 22's CUDA list: each fix, with a check that fails without it under strict mode
(``accelerator/strict.py``), the race checker, or a counter of what a GPU would pay for
(host syncs, device-to-host reads, stream waits). Items a CPU cannot see are named in the
docstrings of the nearest test."""

from __future__ import annotations

import gc
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
import torch._dynamo.utils as dynamo_utils
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes

import zero_offload
from tests.helpers.models import batches, lm_loss, make_pair, offload_opt
from zero_offload.accelerator import Event, HostAccelerator, latest_per_stream
from zero_offload.accelerator.cuda import LibraryRanges, foreign_device_tensors
from zero_offload.accelerator.host import StrictCallerStream
from zero_offload.accelerator.strict import MEMORY, MemoryKind, strict_device_checks
from zero_offload.accelerator.threads import ThreadEvent
from zero_offload.activations import ActivationOffloadConfig, ActivationOffloader, checkpoint
from zero_offload.activations.record import ActivationState
from zero_offload.config import AcceleratorConfig
from zero_offload.errors import CaptureRefused, DefragmentationRefused, PoolExhausted
from zero_offload.memory.pool import BlockPool
from zero_offload.memory.traffic import Category, StallRecord

KiB = 1 << 10
DIM, SEQ, BATCH = 64, 32, 4
LAYER_BYTES = BATCH * SEQ * DIM * 4  # one checkpointed layer input, fp32


def strict(**config: object) -> HostAccelerator:
    config.setdefault("device_budget", "256MiB")
    return HostAccelerator(AcceleratorConfig(strict=True, check_races=True, **config))  # type: ignore[arg-type]


class Layers(nn.Module):
    """An MLP stack whose every layer runs under our ``checkpoint``."""

    def __init__(self, layers: int = 6) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))
            for _ in range(layers)
        )

    def forward(self, x: torch.Tensor, offloader: ActivationOffloader | None = None):
        for block in self.blocks:
            x = x + (block(x) if offloader is None else checkpoint(block, x, offloader=offloader))
        return x


def offloader_for(acc: HostAccelerator, **config: object) -> ActivationOffloader:
    config.setdefault("min_bytes", 0)
    config.setdefault("host_pool_bytes", 1 << 20)
    config.setdefault("device_pool_bytes", 3 * (LAYER_BYTES + 512))
    return ActivationOffloader(accelerator=acc, config=ActivationOffloadConfig(**config))  # type: ignore[arg-type]


@contextmanager
def host_syncs(thread: threading.Thread) -> Iterator[list[str]]:
    """Every host synchronisation on ``thread`` that could block on a GPU: a stream's, or
    an event's that was not complete when asked (a completed one returns at once)."""
    seen: list[str] = []
    event_sync, compute_sync = ThreadEvent.synchronize, StrictCallerStream.synchronize

    def on_event(self: ThreadEvent) -> None:
        if threading.current_thread() is thread and not self._done.is_set():
            seen.append(f"event of {self.stream_name!r}")
        event_sync(self)

    def on_compute(self: StrictCallerStream) -> None:
        if threading.current_thread() is thread:
            seen.append(f"stream {self.name!r}")
        compute_sync(self)

    ThreadEvent.synchronize = on_event  # type: ignore[method-assign]
    StrictCallerStream.synchronize = on_compute  # type: ignore[method-assign]
    try:
        yield seen
    finally:
        ThreadEvent.synchronize = event_sync  # type: ignore[method-assign]
        StrictCallerStream.synchronize = compute_sync  # type: ignore[method-assign]


# -- 1. reloads never make the CPU wait inside backward -------------------------------------


def test_backward_reloads_never_wait_on_the_host() -> None:
    """The device pool holds three reloads; six layers come back through it, so most reuse
    bytes freed with a compute event that strict mode keeps pending. Before the fix the
    reload allocated without a stream and the pool waited for that event on the host."""
    acc = strict()
    torch.manual_seed(0)
    model = Layers()
    offloader = offloader_for(acc, prefetch_depth=2)
    x = torch.randn(BATCH, SEQ, DIM, requires_grad=True)
    expected = torch.autograd.grad(model(x).square().mean(), [x, *model.parameters()])
    for _ in range(2):
        loss = model(x, offloader).square().mean()
        with host_syncs(threading.current_thread()) as seen:
            grads = torch.autograd.grad(loss, [x, *model.parameters()])
        assert seen == []
        for got, want in zip(grads, expected, strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    stats = offloader.stats()
    assert stats["reloads"] == 2 * 5  # every layer input but the leaf x, two iterations
    assert offloader.device_pool.stats()["stream_reuses"] > 0  # the path under test ran
    assert offloader.device_pool.stats()["event_waits"] == 0
    offloader.close()


def test_a_prefetch_skips_instead_of_waiting() -> None:
    acc = strict()
    pool = BlockPool.device(acc, 4 * KiB, name="reloads")
    held = pool.alloc(4 * KiB)
    held.record_event(acc.current_stream().record_event())  # pending: compute still uses it
    held.free()
    h2d = acc.new_stream("h2d")
    with pytest.raises(PoolExhausted):
        pool.alloc(KiB, wait=False)  # no stream to wait on: skip, do not block
    assert pool.stats()["event_waits"] == 0
    block = pool.alloc(KiB, stream=h2d, wait=False)  # stream-ordered reuse needs no wait
    assert pool.stats()["stream_reuses"] == 1 and pool.stats()["event_waits"] == 0
    block.free()
    with pytest.raises(TypeError, match="wait must be True or False"):
        pool.alloc(KiB, wait=1)  # type: ignore[arg-type]


# -- 2. a block reclaimed on query() is then synchronized (CSAN sees a host sync) -----------


class CountingEvent(Event):
    """Done or pending by hand; counts ``synchronize`` calls."""

    def __init__(self, done: bool) -> None:
        self.done, self.syncs = done, 0

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.syncs += 1
        self.done = True

    def completed_at(self) -> float | None:
        return 0.0 if self.done else None


def test_blocks_reclaimed_on_query_synchronize_their_completed_events() -> None:
    """On CUDA, CSAN counts ``cudaEventSynchronize`` as ordering and ``query`` as nothing;
    here the spy event shows the synchronize happens (free: it was complete)."""
    pool = BlockPool.host(HostAccelerator(), 4 * KiB, name="csan")
    done = CountingEvent(done=True)
    block = pool.alloc(KiB)
    block.record_event(done)
    block.free()  # complete at free: reclaimed at once
    assert done.syncs == 1
    late = CountingEvent(done=False)
    block = pool.alloc(4 * KiB)
    block.record_event(late)
    block.free()
    assert late.syncs == 0 and pool.stats()["in_flight_blocks"] == 1
    late.done = True
    pool.alloc(4 * KiB).free()  # reclaimed by query(), then synchronized
    assert late.syncs == 1 and pool.stats()["event_waits"] == 0


# -- 3. ON_HOST only once the host saw the copy out end --------------------------------------


def test_an_activation_is_on_host_only_when_the_host_saw_its_copy() -> None:
    """``max_offloads_in_flight=0`` makes compute wait for each copy out (a stream wait):
    before the fix the record became ON_HOST then, and reading its host block on the CPU
    raced with the copy (the race checker says so)."""
    acc = strict(link_bandwidth=200e6)
    model = Layers(layers=3)
    offloader = offloader_for(acc, max_offloads_in_flight=0, prefetch_depth=0)
    x = torch.randn(BATCH, SEQ, DIM, requires_grad=True)
    loss = model(x, offloader).square().mean()
    records = list(offloader._groups.records())
    assert records
    for record in records:
        # the last copy out is still pending (nothing packed after it to bound it)
        assert record.state is not ActivationState.MOVING_IN
        if record.state is ActivationState.ON_HOST:
            acc.declare_access(record.host_view, stream=None, write=False, what="a host read")
    offloader.synchronize()
    assert all(r.state is ActivationState.ON_HOST for r in records)
    loss.backward()
    del loss, records
    offloader.close()


# -- 4. no compaction while a backward runs ---------------------------------------------------


def fragmented_pool() -> BlockPool:
    pool = BlockPool.host(HostAccelerator(), 8 * KiB, name="weights")
    blocks = [pool.alloc(KiB) for _ in range(8)]
    for block in blocks:
        block.on_move(lambda b: None)  # movable, with views re-taken by the owner
    for block in blocks[::2]:
        block.free()
    return pool


def test_compaction_is_refused_inside_backward() -> None:
    pool = fragmented_pool()
    errors: list[BaseException] = []

    def hook(grad: torch.Tensor) -> torch.Tensor:
        for attempt in (pool.defragment, lambda: pool.alloc(2 * KiB)):
            try:
                attempt()
            except DefragmentationRefused as exc:
                errors.append(exc)
        return grad

    w = torch.ones(3, requires_grad=True)
    y = w * 2
    y.register_hook(hook)
    y.sum().backward()
    assert len(errors) == 2 and all(isinstance(e, PoolExhausted) for e in errors)
    assert "backward" in str(errors[0]) and "capacity_bytes" in str(errors[1])
    assert pool.stats()["defragmentations"] == 0
    assert pool.defragment() > 0  # outside backward it compacts


# -- 5. torch.compile: our hooks run eagerly; copies refuse capture ---------------------------


def test_a_compiled_model_runs_our_checkpoint_eagerly_and_matches() -> None:
    """Dynamo graph-breaks at our ``checkpoint`` and compiles none of the library's frames
    (before the fix it traced into ``checkpoint`` and ``offload_hooks`` and compiled resume
    frames there); gradients equal eager ones bitwise."""
    acc = HostAccelerator(AcceleratorConfig(device_budget="256MiB"))
    torch.manual_seed(0)
    model = Layers(layers=3)
    offloader = offloader_for(acc)
    x = torch.randn(BATCH, SEQ, DIM, requires_grad=True)
    expected = torch.autograd.grad(model(x).square().mean(), [x, *model.parameters()])
    torch._dynamo.reset()
    dynamo_utils.clear_compilation_metrics()
    compiled = torch.compile(model, backend="eager")
    # Dynamo compiles nothing under a dispatch mode (strict mode's device check, on under
    # ZERO_OFFLOAD_STRICT=1); this test is about compilation, so it runs without it.
    with _disable_current_modes():
        loss = compiled(x, offloader).square().mean()
        got = torch.autograd.grad(loss, [x, *model.parameters()])
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert offloader.stats()["offloaded_tensors"] == 2  # the inputs of layers 1 and 2
    frames = {(m.co_filename, m.co_name) for m in dynamo_utils.get_compilation_metrics()}
    assert any(name == "forward" for _, name in frames)  # the model itself was compiled
    package = os.path.dirname(zero_offload.__file__)
    assert [f for f in frames if f[0].startswith(package)] == []
    offloader.close()


def test_a_copy_issued_while_tracing_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    acc = HostAccelerator()
    stream = acc.new_stream("h2d")
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    with pytest.raises(CaptureRefused, match=r"torch\.compile is tracing"):
        acc.copy_(torch.zeros(4), torch.ones(4), stream=stream, label="weights")


# -- 6. the gradient norm reads resident buckets once ----------------------------------------


def test_grad_norm_reads_all_resident_buckets_in_one_device_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Counts reads of device values on the host (``tolist``/``item``/``cpu`` of strict
    device memory, plus ``read_to_host``): one per step, not one per resident bucket.
    (``numpy()`` is left out: the simulator's kernels run on its "device" memory through
    numpy, where CUDA takes torch paths.)"""
    model, _ = make_pair()
    acc = strict()
    opt = offload_opt(model, accelerator=acc, offload_fraction=0.0, max_grad_norm=0.5)
    assert sum(b.resident for b in opt.buckets) >= 3
    reads: list[str] = []
    for name in ("tolist", "item", "cpu"):
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _name=name, _original=original, **kwargs):
            entry = MEMORY.lookup(self)
            if entry is not None and entry[0] is MemoryKind.DEVICE:
                reads.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    tokens, targets = batches(1)[0]
    with strict_device_checks():
        lm_loss(model, tokens, targets).backward()
        before = acc.blocking_reads
        opt.step()
    assert reads == [] and acc.blocking_reads - before == 1
    opt.close()


# -- 7. landing the weights waits once per stream ---------------------------------------------


def test_landing_waits_on_the_last_copy_of_each_stream() -> None:
    model, _ = make_pair()
    opt = offload_opt(model)  # 8 KiB buckets, 1024-element tiles: many weight copies
    stalls: list[StallRecord] = []
    copies = []

    def listen(record: object) -> None:
        if isinstance(record, StallRecord):
            if record.category is Category.WEIGHTS:
                stalls.append(record)
        elif record.category is Category.WEIGHTS:  # type: ignore[attr-defined]
            copies.append(record)

    unsubscribe = opt.manager.subscribe(listen)
    tokens, targets = batches(1)[0]
    lm_loss(model, tokens, targets).backward()
    opt.step()
    unsubscribe()
    assert len(copies) > 4
    landing = stalls[-1]
    assert landing.waited_for == len({c.stream for c in copies}) == 1
    opt.close()


def test_latest_per_stream_keeps_the_last_of_each_stream_and_every_loose_event() -> None:
    acc = strict()
    a, b = acc.new_stream("a"), acc.new_stream("b")
    a1, b1, a2, b2 = a.record_event(), b.record_event(), a.record_event(), b.record_event()
    loose = CountingEvent(done=True)
    assert latest_per_stream([a2, b1, a1, loose, b2]) == [a2, b2, loose]
    c1, c2 = acc.current_stream().record_event(), acc.current_stream().record_event()
    assert latest_per_stream([c2, c1]) == [c2]
    for event in (a1, a2, b1, b2, c2):
        event.synchronize()


# -- 8. no full garbage collection on the forward path ----------------------------------------


def test_a_full_host_pool_runs_no_full_gc_in_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    acc = HostAccelerator(AcceleratorConfig(device_budget="256MiB"))
    offloader = offloader_for(acc, host_pool_bytes=LAYER_BYTES + 512)
    generations: list[int] = []
    collect = gc.collect

    def spy(generation: int = 2) -> int:
        generations.append(generation)
        return collect(generation)

    monkeypatch.setattr(gc, "collect", spy)
    model = Layers(layers=3)
    x = torch.randn(BATCH, SEQ, DIM, requires_grad=True)
    with pytest.raises(PoolExhausted, match=r"host_pool_bytes.*gc\.collect"):
        model(x, offloader)
    assert generations and all(g == 0 for g in generations)
    monkeypatch.undo()
    offloader.close()


# -- 9. record_stream only for what the caching allocator owns --------------------------------


class FakeCudaTensor:
    """What ``foreign_device_tensors`` reads of a tensor: ``is_cuda`` and its storage."""

    def __init__(self, ptr: int, is_cuda: bool = True) -> None:
        self.is_cuda, self._ptr = is_cuda, ptr

    def untyped_storage(self) -> FakeCudaTensor:
        return self

    def data_ptr(self) -> int:
        return self._ptr


def test_library_storages_are_recognised_by_address_range() -> None:
    """A reloaded activation's storage starts *inside* a pool buffer: matched by start
    address it was taken for the allocator's, and ``record_stream`` on it asserts under
    ``backend:cudaMallocAsync`` (a GPU shows it; here the range logic is checked)."""
    ranges = LibraryRanges()
    ranges.add(0x10000, 0x1000)
    inside, edge, autograds = FakeCudaTensor(0x10800), FakeCudaTensor(0x11000), FakeCudaTensor(5)
    host = FakeCudaTensor(0x10800, is_cuda=False)
    found = foreign_device_tensors((inside, edge, autograds, host), ranges)  # type: ignore[arg-type]
    assert found == [edge, autograds]
    ranges.discard(0x10000)
    assert not ranges.owns(0x10800)
