"""What profiling leaves for the cyclic GC, and the GC pauses it reports (issue 39).

Note [the profiler keeps numbers, not events] (profiling/timeline.py): records become rows
of plain numbers once their events complete, so what the profiler keeps alive no longer grows
by a few tracked objects per copy. Note [GC pauses per step] (profiling/gc_pauses.py): the
collector's pauses, counted through ``gc.callbacks``. These tests count objects and
collections; they time nothing.
"""

from __future__ import annotations

import enum
import gc
import threading
import types
from collections.abc import Iterator

import pytest
import torch

from zero_offload.accelerator import Event, HostAccelerator
from zero_offload.config import AcceleratorConfig
from zero_offload.memory.manager import TieredMemoryManager
from zero_offload.memory.traffic import Category, Direction
from zero_offload.profiling import profile
from zero_offload.profiling.gc_pauses import GcPauses
from zero_offload.profiling.timeline import SETTLE_EVERY

COPIES = 2000
BATCH = 100  # copies between synchronisations: the most in flight at once


@pytest.fixture
def manager() -> Iterator[TieredMemoryManager]:
    manager = TieredMemoryManager(HostAccelerator(AcceleratorConfig(device_budget="16MiB")))
    yield manager
    manager.close()


def _copies(manager: TieredMemoryManager, count: int) -> None:
    src, dst = torch.ones(64), torch.empty(64)
    for index in range(count):
        manager.copy(dst, src, direction=Direction.D2H, category=Category.GRADIENTS)
        if index % BATCH == BATCH - 1:
            manager.synchronize()
    manager.synchronize()


def _reachable(roots: list[object]) -> list[object]:
    """Every GC-tracked object reachable from ``roots`` (the roots included), short of
    classes, modules, functions and enum members (shared, not kept per record)."""
    shared = (type, types.ModuleType, types.FunctionType, enum.Enum)
    seen: dict[int, object] = {}
    stack = list(roots)
    while stack:
        obj = stack.pop()
        if id(obj) in seen or not gc.is_tracked(obj) or isinstance(obj, shared):
            continue
        seen[id(obj)] = obj
        stack.extend(gc.get_referents(obj))
    return list(seen.values())


def test_records_settled_at_step_hold_no_events(manager: TieredMemoryManager) -> None:
    with profile(manager, link_bandwidth=1e9) as prof:
        _copies(manager, 300)
        prof.step()
        data = prof.data
        assert data.copies.pending == 0  # every record became a row at the step ...
        held = _reachable([data.copies, data.stalls])
        assert not [obj for obj in held if isinstance(obj, Event)]  # ... and let its events go
        # Per timeline its columns, its inbox and held lists, the kinds: not a few per copy.
        assert len(held) < 40
        assert len(data.copies) == 300
    assert prof.to_dict()["totals"]["copies"] == 300  # the report still counts every one
    trace = [e for e in _trace_events(prof) if e.get("cat") == "copy"]
    assert len(trace) == 300 and all(e["dur"] >= 0 for e in trace)


def _trace_events(prof: object) -> list[dict]:
    from zero_offload.profiling.chrome_trace import chrome_trace_events

    return chrome_trace_events(prof.data)  # type: ignore[attr-defined]


def test_what_profiling_keeps_alive_does_not_grow_with_copies(
    manager: TieredMemoryManager,
) -> None:
    _copies(manager, BATCH)  # warm: the streams' first records, the pools' first stats
    gc.collect()
    gc.disable()  # no collection may hide what is kept
    try:
        before = len(gc.get_objects())
        with profile(manager, link_bandwidth=1e9) as prof:
            _copies(manager, COPIES)  # no prof.step(): the timeline settles by itself
            recording = len(gc.get_objects()) - before
            prof.step()
            stepped = len(gc.get_objects()) - before
    finally:
        gc.enable()
    # Before: about 18 tracked objects kept per copy (a record, two events of eight
    # objects each), 36,000 here. Now the pending records (at most SETTLE_EVERY plus the
    # copies in flight, one or two objects each: the end event, and its race stamp under
    # the race checker) and, after a step, a constant.
    assert recording < 4 * (SETTLE_EVERY + BATCH) + 500
    assert stepped < COPIES // 10
    assert len(prof.data.copies) == COPIES


def test_a_thread_event_is_a_lock_not_a_threading_event() -> None:
    # Note [a thread event is a held lock]: two tracked objects per pending event, not ten.
    # The race checker and strict mode off whatever the environment says (CI's race pass):
    # a race stamp reaches the checker, which is shared, not kept per event.
    acc = HostAccelerator(AcceleratorConfig(check_races=False, strict=False))
    stream = acc.new_stream("d2h")
    gate = threading.Event()
    stream.submit(gate.wait)
    event = stream.record_event()
    parts = _reachable([event])
    assert not any(isinstance(obj, threading.Event) for obj in parts)
    assert not hasattr(event, "__dict__")
    assert len(parts) <= 3  # the event, its lock (and at most a race stamp)
    waiter = threading.Thread(target=event.synchronize)
    waiter.start()
    assert not event.query() and event.completed_at() is None
    gate.set()
    waiter.join(timeout=10)
    assert not waiter.is_alive() and event.query() and event.completed_at() is not None
    stream.synchronize()


def test_a_timestamp_orders_on_its_stream_and_cannot_be_waited_for() -> None:
    acc = HostAccelerator()
    stream = acc.new_stream("h2d")
    first = stream.record_event()
    stamp = stream.record_timestamp()
    last = stream.record_event()
    stream.synchronize()
    assert first.completed_at() <= stamp.completed_at() <= last.completed_at()  # type: ignore[operator]
    with pytest.raises(RuntimeError, match="timestamp"):
        stamp.synchronize()


def test_gc_pauses_counts_and_times_collections() -> None:
    callbacks = len(gc.callbacks)
    with GcPauses() as pauses:
        assert len(gc.callbacks) == callbacks + 1
        gc.collect()
        gc.collect(1)
        window = pauses.take()
        assert window.gen2 >= 1 and window.gen1 >= 1
        assert 0 < window.longest <= window.seconds
        assert window.collections >= 2
    assert len(gc.callbacks) == callbacks  # closed: the callback is gone


def test_the_profile_reports_gc_pauses_per_step(manager: TieredMemoryManager) -> None:
    callbacks = len(gc.callbacks)
    with profile(manager, link_bandwidth=1e9) as prof:
        _copies(manager, BATCH)
        gc.collect()  # one full collection in the first step
        prof.step()
        _copies(manager, BATCH)
        prof.step()
    assert len(gc.callbacks) == callbacks  # the profiler stopped listening at stop
    windows = prof.data.gc_steps
    assert len(windows) == 3  # one per prof.step(), then the last step to stop
    assert windows[0].gen2 >= 1 and windows[0].seconds > 0
    summary = prof.to_dict()["gc"]
    assert summary["by_generation"][2] >= 1
    assert summary["per_step"]["full_collections"] >= 0.5  # at least 1 in 2 steps
    assert summary["seconds"] >= windows[0].seconds
    assert "gc: " in prof.report() and "collections per step" in prof.report()
