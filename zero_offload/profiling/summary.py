"""Turn a profiler's records into the report's numbers: pure functions over ``ProfileData``.

Units: bytes, seconds, and GB/s in decimal gigabytes (1e9 bytes) per second.

Note [exposed versus hidden time]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A copy's *time* is from when it began on its stream to when it ended (it includes the
simulated link on the host accelerator). Compute's *waits* are the manager's stalls
(``wait_for``, Note [exposed time is measured on the compute stream]): how long the compute
stream stood still for copies of one category. A wait is longer than the copies it waits
for whenever they had not begun when it started: queued on their stream behind other
copies (another category's too), behind the stream's own waits (a reload follows its copy
out, a block's reuse follows its last copy), or for the stream's worker to be scheduled.
So a row's figures are, over the stalls of its category while recording:
- *exposed*: the stall time during which one of the row's own copies was running, the part
  of its copies' time compute did not hide. At most the row's time by construction.
- *hidden*: ``time - exposed``.
- *waited*: the whole stall time put on the row, at least *exposed*; ``waited - exposed``
  is compute waiting on the row's copies before they ran.
A stall is shared between its category's rows (activations go both ways) by how long each
row's copies ran inside it, the time both ran counted once; a stall in which none ran is
waited time of the category's busiest row. Exposed time is thus attributable, row by row,
to the copies it is reported for; the totals' ``waited_seconds`` is compute's whole stall
on copies (the managers' ``exposed_seconds`` over the same window: the same stall records).
"""

from __future__ import annotations

import time
from bisect import bisect_right
from collections import Counter
from collections.abc import Iterable, Sequence
from itertools import accumulate
from typing import Any

from ..accelerator.host_syncs import SyncKey, SyncKind, training_thread
from ..memory.traffic import Category, Direction
from .data import PhaseSpan, ProfileData
from .gc_pauses import EMPTY, GcWindow

__all__ = ["COLLECTIVE_PHASES", "TRANSFER_ROWS", "summarize"]

#: The report's copy rows, in order: (row name, direction, category).
TRANSFER_ROWS: tuple[tuple[str, Direction, Category], ...] = (
    ("gradients D2H", Direction.D2H, Category.GRADIENTS),
    ("weights H2D", Direction.H2D, Category.WEIGHTS),
    ("activations out", Direction.D2H, Category.ACTIVATIONS),
    ("activations in", Direction.H2D, Category.ACTIVATIONS),
    ("optimizer state D2H", Direction.D2H, Category.OPTIMIZER_STATE),
    ("optimizer state H2D", Direction.H2D, Category.OPTIMIZER_STATE),
    ("gradients H2D", Direction.H2D, Category.GRADIENTS),
    ("weights D2H", Direction.D2H, Category.WEIGHTS),
    # The NVMe tier (memory/storage.py): measured against the disk, not the device link.
    ("optimizer state NVMe read", Direction.NVME_READ, Category.OPTIMIZER_STATE),
    ("optimizer state NVMe write", Direction.NVME_WRITE, Category.OPTIMIZER_STATE),
)
#: Rows that appear even with no copies (the ones every user of the library cares about).
_ALWAYS_SHOWN = ("gradients D2H", "weights H2D", "activations out", "activations in")
#: Phase names that are collectives (timed by ``tracing.phase`` on the comm track).
COLLECTIVE_PHASES = (("reduce-scatter", "reduce_scatter"), ("all-gather", "all_gather"))


class _Union:
    """The union of some time intervals, for the length of its overlap with another."""

    def __init__(self, intervals: Iterable[tuple[float, float]]) -> None:
        starts: list[float] = []
        ends: list[float] = []
        for start, end in sorted(intervals):
            if starts and start <= ends[-1]:
                ends[-1] = max(ends[-1], end)
            else:
                starts.append(start)
                ends.append(end)
        self._starts = starts
        self._ends = ends
        # _before[i]: the covered seconds of the intervals before the i-th
        self._before = [0.0, *accumulate(e - s for s, e in zip(starts, ends, strict=True))]

    def _covered_to(self, t: float) -> float:
        i = bisect_right(self._starts, t)
        if i == 0:
            return 0.0
        return self._before[i - 1] + min(t, self._ends[i - 1]) - self._starts[i - 1]

    def overlap(self, start: float, end: float) -> float:
        """Seconds of ``[start, end]`` the union covers."""
        return self._covered_to(end) - self._covered_to(start)


def _attribute_stalls(data: ProfileData, rows: dict[tuple[Direction, Category], dict]) -> None:
    """Each row's ``exposed_seconds`` and ``waited_seconds``: Note [exposed versus hidden
    time]."""
    spans: dict[tuple[Direction, Category], list[tuple[float, float]]] = {}
    for record in data.copies:
        if record.began is not None and record.ended is not None:
            spans.setdefault((record.direction, record.category), []).append(
                (record.began, record.ended)
            )
    for row in rows.values():
        row["exposed_seconds"] = row["waited_seconds"] = 0.0
    unions: dict[Category, tuple[_Union, list[tuple[dict, _Union]], dict]] = {}
    for stall in data.stalls:
        start, end = stall.began, stall.ended
        if start is None or end is None or end <= start:  # pending, or no wait at all
            continue
        seconds = end - start
        category = stall.category
        if category not in unions:
            mine = [(key, row) for key, row in rows.items() if key[1] is category]
            busiest = max((row for _, row in mine), key=lambda row: row["seconds"])
            every = _Union(span for key, _ in mine for span in spans.get(key, ()))
            each = [(row, _Union(spans.get(key, ()))) for key, row in mine]
            unions[category] = (every, each, busiest)
        every, by_row, busiest = unions[category]
        ran = [(row, union.overlap(start, end)) for row, union in by_row]
        shares = sum(seconds_ran for _, seconds_ran in ran)
        if shares <= 0.0:
            busiest["waited_seconds"] += seconds
            continue
        exposed = every.overlap(start, end)  # both rows running counts once
        for row, seconds_ran in ran:
            row["exposed_seconds"] += exposed * seconds_ran / shares
            row["waited_seconds"] += seconds * seconds_ran / shares
    for row in rows.values():
        # A row's exposed time is a part of its copies' time; the union's differences and the
        # copies' own (ended - began) sums round apart by an ulp, never by more.
        row["exposed_seconds"] = min(row["exposed_seconds"], row["seconds"])


def _transfer_rows(data: ProfileData) -> list[dict[str, Any]]:
    link = {Direction.H2D: data.link.h2d, Direction.D2H: data.link.d2h}
    rows: dict[tuple[Direction, Category], dict[str, Any]] = {}
    for name, direction, category in TRANSFER_ROWS:
        rows[(direction, category)] = {
            "name": name,
            "direction": direction.value,
            "category": category.value,
            "count": 0,
            "bytes": 0,
            "seconds": 0.0,
            "pending": 0,
        }
    for record in data.copies:
        row = rows.get((record.direction, record.category))
        if row is None:  # a pair no row names: counted under its own name
            name = f"{record.category.value} {record.direction.value}"
            row = rows[(record.direction, record.category)] = {
                "name": name,
                "direction": record.direction.value,
                "category": record.category.value,
                "count": 0,
                "bytes": 0,
                "seconds": 0.0,
                "pending": 0,
            }
        row["count"] += 1
        row["bytes"] += record.nbytes
        seconds = record.seconds()
        if seconds is None:
            row["pending"] += 1
        else:
            row["seconds"] += seconds
    _attribute_stalls(data, rows)
    shown = []
    for (direction, _), row in rows.items():
        if row["count"] == 0 and row["waited_seconds"] == 0.0 and row["name"] not in _ALWAYS_SHOWN:
            continue
        row["hidden_seconds"] = max(0.0, row["seconds"] - row["exposed_seconds"])
        rate = row["bytes"] / row["seconds"] if row["seconds"] > 0 else None
        row["gb_per_s"] = None if rate is None else rate / 1e9
        bandwidth = link.get(direction)  # None for the disk: no device link applies
        row["link_share"] = None if rate is None or not bandwidth else rate / bandwidth
        shown.append(row)
    return shown


def _collective_bytes(data: ProfileData, op: str) -> int:
    """Bytes the collectives of kind ``op`` moved while recording, over every target's
    counters (each call counts its whole flat buffer, ``collectives.CommCounters``)."""
    end = data.comm_end
    if end is None:
        end = [counters.snapshot() for counters in data.comm_counters]
    total = 0
    for before, after in zip(data.comm_start, end, strict=True):
        total += after.get(op, {}).get("bytes", 0) - before.get(op, {}).get("bytes", 0)
    return total


def _collective_rows(data: ProfileData) -> list[dict[str, Any]]:
    rows = []
    for label, phase_name in COLLECTIVE_PHASES:
        spans = [p for p in data.phases if p.name == phase_name]
        rows.append(
            {
                "name": label,
                "count": len(spans),
                "seconds": sum(p.end - p.start for p in spans),
                "bytes": _collective_bytes(data, phase_name),
            }
        )
    return rows


def _pool_rows(data: ProfileData) -> list[dict[str, Any]]:
    end = data.pools_end if data.pools_end is not None else {}
    rows = []
    for name, stats in end.items():
        start = data.pools_start.get(name, {})

        def delta(key: str, stats: dict[str, Any] = stats, start: dict[str, Any] = start) -> int:
            return int(stats[key]) - int(start.get(key, 0))

        rows.append(
            {
                "name": name,
                "kind": stats["kind"],
                "capacity_bytes": int(stats["capacity_bytes"]),
                "bytes_in_use": int(stats["bytes_in_use"]),
                "peak_bytes_in_use": int(stats["peak_bytes_in_use"]),
                "fragmentation": float(stats["fragmentation"]),
                "defragmentations": delta("defragmentations"),
                "bytes_moved": delta("bytes_moved"),
                "event_waits": delta("event_waits"),
            }
        )
    return rows


def _phase_rows(phases: Sequence[PhaseSpan]) -> list[dict[str, Any]]:
    grouped: dict[tuple[str, str], list[float]] = {}
    for span in phases:
        grouped.setdefault((span.name, span.track), []).append(span.end - span.start)
    return [
        {
            "name": name,
            "track": track,
            "count": len(times),
            "seconds": sum(times),
            "max_seconds": max(times),
        }
        for (name, track), times in sorted(grouped.items(), key=lambda kv: -sum(kv[1]))
    ]


def _gc_summary(windows: Sequence[GcWindow], steps: int) -> dict[str, Any]:
    """The collector's pauses while recording (Note [GC pauses per step] in gc_pauses.py):
    totals, and per step over ``steps``."""
    total = sum(windows, EMPTY)
    summary: dict[str, Any] = {
        "collections": total.collections,
        "by_generation": [total.gen0, total.gen1, total.gen2],
        "seconds": total.seconds,
        "longest_seconds": total.longest,
        "collected": total.collected,
        "per_step": None,
    }
    if steps:
        summary["per_step"] = {
            "collections": total.collections / steps,
            "full_collections": total.gen2 / steps,
            "seconds": total.seconds / steps,
        }
    return summary


def _sync_summary(counts: Counter[SyncKey], steps: int) -> dict[str, Any]:
    """The host synchronisations of the training loop's threads (Note [host syncs are
    counted where they can block] in accelerator/host_syncs.py): by kind, the waits by
    stream, and per step over ``steps``."""
    by_kind = {kind.value: 0 for kind in SyncKind}
    waits: dict[str, int] = {}
    for key, n in counts.items():
        if not training_thread(key.thread):
            continue
        by_kind[key.kind.value] += n
        if key.kind is SyncKind.WAIT:
            waits[key.stream] = waits.get(key.stream, 0) + n
    per_step = None
    if steps:
        per_step = {kind: n / steps for kind, n in by_kind.items()}
        per_step["waits_by_stream"] = {name: n / steps for name, n in waits.items()}
    return {"by_kind": by_kind, "waits_by_stream": waits, "per_step": per_step}


def _peak(values: Sequence[int | None]) -> int | None:
    present = [v for v in values if v is not None]
    return max(present) if present else None


def summarize(data: ProfileData) -> dict[str, Any]:
    """The report's numbers as JSON-friendly data; see the module docstring for units."""
    stopped = data.stopped_at if data.stopped_at is not None else time.perf_counter()
    duration = max(0.0, stopped - data.started_at)
    if data.step_marks:
        steps, step_source = len(data.step_marks), "prof.step() calls"
    else:
        steps = sum(1 for p in data.phases if p.name == "cpu_adam")
        step_source = "optimizer steps (cpu_adam phases)"
    transfers = _transfer_rows(data)
    pools = _pool_rows(data)
    defrag = {
        "name": "defragmentation",
        "count": sum(p["defragmentations"] for p in pools),
        "bytes": sum(p["bytes_moved"] for p in pools),
    }
    total_bytes = sum(row["bytes"] for row in transfers)
    total_seconds = sum(row["seconds"] for row in transfers)
    total_exposed = sum(row["exposed_seconds"] for row in transfers)
    total_waited = sum(row["waited_seconds"] for row in transfers)
    per_step = None
    if steps:
        per_step = {
            "seconds": duration / steps,
            "bytes": total_bytes / steps,
            "copy_seconds": total_seconds / steps,
            "exposed_seconds": total_exposed / steps,
            "waited_seconds": total_waited / steps,
        }
    host_pools = [p for p in pools if p["kind"] != "device"]
    peaks = [m.device_peak for m in data.memory]  # exact, from the step samples' windows
    return {
        "duration_seconds": duration,
        "steps": steps,
        "step_source": step_source,
        "link": {
            "h2d_bytes_per_s": data.link.h2d,
            "d2h_bytes_per_s": data.link.d2h,
            "probe_bytes": data.link.probe_bytes,
            "source": data.link.source,
        },
        "transfers": transfers,
        "collectives": _collective_rows(data),
        "defragmentation": defrag,
        "totals": {
            "copies": sum(row["count"] for row in transfers),
            "bytes": total_bytes,
            "seconds": total_seconds,
            "exposed_seconds": total_exposed,
            "hidden_seconds": max(0.0, total_seconds - total_exposed),
            "waited_seconds": total_waited,
        },
        "per_step": per_step,
        "phases": _phase_rows(data.phases),
        "memory": {
            "device_budget": data.device_budget,
            "device_peak_bytes": _peak([m.device for m in data.memory] + peaks),
            "device_pools_peak_bytes": _peak([m.device_pools_peak for m in data.memory]),
            "device_torch_peak_bytes": _peak([m.device_torch_peak for m in data.memory]),
            "host_pools_peak_bytes": _peak([m.host_pools_peak for m in data.memory]),
            "host_reserved_bytes": sum(p["capacity_bytes"] for p in host_pools),
            "process_rss_peak_bytes": data.rss_peak or None,
        },
        "pools": pools,
        "gc": _gc_summary(data.gc_steps, steps),
        "host_syncs": _sync_summary(data.host_syncs, steps),
        # The managers' owners' step notes (TieredMemoryManager.step_notes), merged.
        "step_notes": {k: v for m in data.managers for k, v in m.step_notes.items()},
    }
