"""Where a profiled copy begins, and what the profiler's cheaper path keeps (issue 39).

Note [a copy's start is its end event's] (memory/manager.py): on a thread stream the copy's
end event carries when the worker began the copy, so no start event is queued; a copy that
waited (for ``after``, or for a wait someone else queued on the stream) starts after the
wait. Note [appending to the profiler takes no lock] (profiling/timeline.py): the profiler
keeps a copy's fields with ``list.extend`` and settles at the manager's ticks; every copy is
still counted once, by direction, category and stream.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from itertools import pairwise

import pytest
import torch

from zero_offload.accelerator import HostAccelerator, event_times
from zero_offload.config import AcceleratorConfig
from zero_offload.memory.manager import TICK_EVERY, TieredMemoryManager
from zero_offload.memory.traffic import Category, CopyRecord, Direction
from zero_offload.profiling import profile

LATENCY = 0.004  # seconds per simulated copy: long beside the worker's own overhead
SLACK = 0.02  # how far a start may trail a stamp queued just before it (a loaded 2-core VM)


@pytest.fixture
def manager() -> Iterator[TieredMemoryManager]:
    manager = TieredMemoryManager(HostAccelerator(AcceleratorConfig(link_latency=LATENCY)))
    yield manager
    manager.close()


def _tensors() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty(256), torch.ones(256)


def _listen(manager: TieredMemoryManager) -> tuple[list[CopyRecord], object]:
    records: list[CopyRecord] = []
    unsubscribe = manager.subscribe(
        lambda r: records.append(r) if isinstance(r, CopyRecord) else None
    )
    return records, unsubscribe


def test_the_end_event_carries_the_start_a_timestamp_would_have_measured(
    manager: TieredMemoryManager,
) -> None:
    """A FIFO stream, busy: the derived start equals a timestamp queued just before the
    copy, to within the worker's step from one item to the next."""
    records, unsubscribe = _listen(manager)
    dst, src = _tensors()
    stamps = []
    for _ in range(8):
        stamps.append(manager.d2h.record_timestamp())  # queued right before the copy
        manager.copy(dst, src, direction=Direction.D2H, category=Category.GRADIENTS)
    manager.synchronize()
    unsubscribe()
    assert len(records) == 8
    previous_end = 0.0
    gaps = []
    for stamp, record in zip(stamps, records, strict=True):
        assert record.start is None  # no start event on a thread stream
        began, ended = record.began(), record.ended()
        measured = stamp.completed_at()
        assert began is not None and ended is not None and measured is not None
        assert measured <= began <= measured + SLACK
        gaps.append(began - measured)
        assert ended - began >= LATENCY * 0.9  # the span is the copy, simulated link and all
        assert began >= previous_end  # FIFO: a copy starts after the one before it ended
        previous_end = ended
    assert sorted(gaps)[len(gaps) // 2] < 0.001  # the worker's step from stamp to copy


def test_a_copy_after_a_wait_starts_when_the_wait_ends(manager: TieredMemoryManager) -> None:
    """``after`` events and waits queued on the stream by others (a pool's reuse wait) hold
    the copy back; its start is after them, not when it was issued."""
    records, unsubscribe = _listen(manager)
    dst, src = _tensors()
    other = manager.accelerator.new_stream("other")
    for how in ("after", "wait queued by someone else"):
        gate = threading.Event()
        other.submit(gate.wait)
        gated = other.record_event()
        if how == "after":
            manager.copy(
                dst, src, direction=Direction.H2D, category=Category.WEIGHTS, after=[gated]
            )
        else:
            manager.h2d.wait_event(gated)
            manager.copy(dst, src, direction=Direction.H2D, category=Category.WEIGHTS)
        time.sleep(0.05)
        gate.set()
        manager.synchronize()
        record = records[-1]
        began, ended, released = record.began(), record.ended(), gated.completed_at()
        assert began is not None and ended is not None and released is not None
        assert began >= released, how  # not the issue time, 50 ms earlier
        assert began - record.issued_at >= 0.04, how
        assert LATENCY * 0.9 <= ended - began < 0.04, how  # the copy alone, not the wait
    unsubscribe()
    other.synchronize()


def test_a_stream_whose_end_cannot_tell_records_a_start_event() -> None:
    """The host's compute stream runs copies inline; like CUDA's, its events carry no start
    (``end_carries_start`` is False), so the copy records a start event."""
    acc = HostAccelerator(AcceleratorConfig(strict=False))
    manager = TieredMemoryManager(acc)
    compute = acc.current_stream()
    assert not compute.end_carries_start and manager.d2h.end_carries_start
    records, unsubscribe = _listen(manager)
    dst, src = _tensors()
    manager.copy(dst, src, direction=Direction.D2H, category=Category.GRADIENTS, stream=compute)
    unsubscribe()
    (record,) = records
    assert record.start is not None
    began, ended = record.began(), record.ended()
    assert began is not None and ended is not None and began <= ended
    manager.close()


def test_event_times_reads_starts_after_completions_and_fills_idle_events() -> None:
    acc = HostAccelerator()
    stream = acc.new_stream("s")
    idle = stream.record_event()  # no task before it: it started when it completed
    stream.submit(lambda: time.sleep(0.01))
    busy = stream.record_event()
    gate = threading.Event()
    stream.submit(gate.wait)
    pending = stream.record_event()
    busy.synchronize()
    started, completed = event_times([idle, busy, pending])
    assert started[0] == completed[0] is not None
    assert started[1] is not None and completed[1] is not None
    assert completed[1] - started[1] >= 0.009
    assert started[2] is None and completed[2] is None  # a pending event has no times
    gate.set()
    stream.synchronize()


def test_fields_listeners_get_plain_tuples_and_ticks_come_every_tick_every() -> None:
    manager = TieredMemoryManager(HostAccelerator())  # no simulated link: 128 quick copies
    kept: list = []
    ticks = []
    unsubscribe = manager.subscribe(
        kept.extend, fields=True, tick=lambda: ticks.append(len(kept) // 9)
    )
    records, unlisten = _listen(manager)  # a record listener beside it still gets records
    dst, src = _tensors()
    for _ in range(2 * TICK_EVERY):
        manager.copy(dst, src, direction=Direction.D2H, category=Category.GRADIENTS, label="x")
    manager.synchronize()
    unsubscribe()
    unlisten()
    assert len(kept) == 9 * 2 * TICK_EVERY  # CopyRecord's nine fields per copy, flat
    assert kept[1] is Direction.D2H and kept[8] == "x"
    assert len(ticks) == 2 and ticks[1] - ticks[0] == TICK_EVERY
    assert [tuple(r) for r in records] == [tuple(kept[i : i + 9]) for i in range(0, len(kept), 9)]
    manager.close()


def test_profiled_totals_match_the_counters_by_direction_category_and_stream() -> None:
    """Every copy counted once, whichever thread issued it and while settles ran."""
    manager = TieredMemoryManager(HostAccelerator())
    extra = manager.accelerator.new_stream("extra")
    before = manager.counters.snapshot()
    dst, src = _tensors()
    threads_n, per_thread = 4, 300

    def issue(index: int) -> None:
        manager.accelerator.bind_thread()  # as a user's thread must (strict mode checks)
        for i in range(per_thread):
            if i % 3 == 0:
                manager.copy(dst, src, direction=Direction.D2H, category=Category.GRADIENTS)
            elif i % 3 == 1:
                manager.copy(dst, src, direction=Direction.H2D, category=Category.WEIGHTS)
            else:
                manager.copy(
                    dst, src, direction=Direction.D2H, category=Category.ACTIVATIONS, stream=extra
                )

    with profile(manager, link_bandwidth=1e9) as prof:
        workers = [threading.Thread(target=issue, args=(n,)) for n in range(threads_n)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        extra.synchronize()  # not one of the manager's streams: stop() waits for those
    assert before == {}
    spans = list(prof.data.copies)
    total = threads_n * per_thread
    assert len(spans) == total and prof.data.copies.pending == 0
    assert len({span.seq for span in spans}) == total  # none lost, none twice
    by_kind: dict[tuple, int] = {}
    for span in spans:
        key = (span.direction, span.category, span.stream)
        by_kind[key] = by_kind.get(key, 0) + span.nbytes
        assert span.began is not None and span.ended is not None
        assert span.issued_at <= span.began <= span.ended
    per_kind = total // 3 * src.nbytes
    assert by_kind == {
        (Direction.D2H, Category.GRADIENTS, "d2h"): per_kind,
        (Direction.H2D, Category.WEIGHTS, "h2d"): per_kind,
        (Direction.D2H, Category.ACTIVATIONS, "extra"): per_kind,
    }
    counted = manager.counters.snapshot()
    assert sum(row["bytes"] for row in counted.values()) == sum(by_kind.values())
    assert prof.to_dict()["totals"]["copies"] == total
    for stream in ("d2h", "h2d", "extra"):  # FIFO: one stream's spans never overlap
        mine = sorted((s.began, s.ended) for s in spans if s.stream == stream)
        assert all(a[1] <= b[0] for a, b in pairwise(mine))
    manager.close()


def test_settling_keeps_pending_records_and_rows_the_rest(manager: TieredMemoryManager) -> None:
    """A copy held back on one stream does not hold back the rows of another's."""
    dst, src = _tensors()
    gate = threading.Event()
    with profile(manager, link_bandwidth=1e9) as prof:
        manager.h2d.submit(gate.wait)
        manager.copy(dst, src, direction=Direction.H2D, category=Category.WEIGHTS)
        for _ in range(3):
            manager.copy(dst, src, direction=Direction.D2H, category=Category.GRADIENTS)
        manager.d2h.synchronize()
        prof.data.copies.settle()
        assert prof.data.copies.pending == 1  # the gated H2D copy
        pending = [span for span in prof.data.copies if span.ended is None]
        assert [span.direction for span in pending] == [Direction.H2D]
        gate.set()
    assert prof.data.copies.pending == 0 and len(prof.data.copies) == 4


def test_several_listeners_of_each_kind_each_hear_every_copy_in_order(
    manager: TieredMemoryManager,
) -> None:
    """Note [one call per kind of listener]: two record listeners and two field listeners
    each hear every copy, fields first, each kind in subscription order, and the four ticks
    come every TICK_EVERY copies in subscription order (the fan-outs); after one of each
    unsubscribes, the others still hear and tick (a listener and a tick alone: no fan-out),
    and after all do, nobody is called."""
    heard: list[tuple[str, int]] = []
    ticks: list[str] = []

    def subscribe(name: str, *, fields: bool) -> object:
        def listen(item: object) -> None:
            if isinstance(item, tuple) and not isinstance(item, CopyRecord) and not fields:
                raise AssertionError(f"{name} wanted records, got fields")
            heard.append((name, item[0]))  # the copy's seq, first in both forms

        return manager.subscribe(listen, fields=fields, tick=lambda: ticks.append(name))

    unsubscribe = [
        subscribe("records 1", fields=False),
        subscribe("fields 1", fields=True),
        subscribe("records 2", fields=False),
        subscribe("fields 2", fields=True),
    ]
    dst, src = _tensors()
    for _ in range(TICK_EVERY):  # one tick
        manager.copy(dst, src, direction=Direction.D2H, category=Category.GRADIENTS)
    seqs = sorted({seq for _, seq in heard})
    assert len(seqs) == TICK_EVERY
    for seq in seqs:  # fields listeners before record listeners, each kind in order
        names = [name for name, s in heard if s == seq]
        assert names == ["fields 1", "fields 2", "records 1", "records 2"]
    assert ticks == ["records 1", "fields 1", "records 2", "fields 2"]
    unsubscribe[0]()
    unsubscribe[1]()
    heard.clear()
    manager.copy(dst, src, direction=Direction.D2H, category=Category.GRADIENTS)
    assert [name for name, _ in heard] == ["fields 2", "records 2"]
    assert ticks[4:] == ["records 2", "fields 2"]  # the copy numbered TICK_EVERY ticked
    unsubscribe[2]()
    unsubscribe[3]()
    heard.clear()
    manager.copy(dst, src, direction=Direction.D2H, category=Category.GRADIENTS)
    manager.synchronize()
    assert heard == []
