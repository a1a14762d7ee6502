"""Turn a profiler's records into the report's numbers: pure functions over ``ProfileData``.

Units: bytes, seconds, and GB/s in decimal gigabytes (1e9 bytes) per second.

Note [exposed versus hidden time]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A copy's *time* is from its start event to its end event on its stream (it includes the
simulated link on the host accelerator). Its *exposed* time is what compute actually spent
waiting for it: the growth of ``TieredMemoryManager.exposed_seconds`` while recording, which
the manager counts per category in ``wait_for`` as the compute stream's stall on its own clock
(Note [exposed time is measured on the compute stream]). *Hidden* is the rest: ``time - exposed``,
never below zero. Exposed time is kept per category, not per direction, so a category with
copies both ways (activations) shows it on its busier row.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
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


def _exposed_by_category(data: ProfileData) -> dict[Category, float]:
    end = data.exposed_end or [dict(m.exposed_seconds) for m in data.managers]
    totals: dict[Category, float] = {}
    for before, after in zip(data.exposed_start, end, strict=True):
        for category, seconds in after.items():
            totals[category] = totals.get(category, 0.0) + seconds - before.get(category, 0.0)
    return totals


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
    exposed = _exposed_by_category(data)
    for category, seconds in exposed.items():
        busiest = max(
            (row for (_, c), row in rows.items() if c is category),
            key=lambda row: row["seconds"],
        )
        busiest["exposed_seconds"] = busiest.get("exposed_seconds", 0.0) + seconds
    shown = []
    for (direction, _), row in rows.items():
        if row["count"] == 0 and row["name"] not in _ALWAYS_SHOWN:
            continue
        row.setdefault("exposed_seconds", 0.0)
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
    per_step = None
    if steps:
        per_step = {
            "seconds": duration / steps,
            "bytes": total_bytes / steps,
            "copy_seconds": total_seconds / steps,
            "exposed_seconds": total_exposed / steps,
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
        },
        "per_step": per_step,
        "phases": _phase_rows(data.phases),
        "memory": {
            "device_budget": data.device_budget,
            "device_peak_bytes": _peak([m.device for m in data.memory] + peaks),
            "device_pools_peak_bytes": _peak([m.device_pools for m in data.memory]),
            "device_torch_peak_bytes": _peak([m.device_torch_peak for m in data.memory]),
            "host_pools_peak_bytes": _peak([m.host_pools for m in data.memory]),
            "host_reserved_bytes": sum(p["capacity_bytes"] for p in host_pools),
            "process_rss_peak_bytes": data.rss_peak or None,
        },
        "pools": pools,
        "gc": _gc_summary(data.gc_steps, steps),
        "host_syncs": _sync_summary(data.host_syncs, steps),
        # The managers' owners' step notes (TieredMemoryManager.step_notes), merged.
        "step_notes": {k: v for m in data.managers for k, v in m.step_notes.items()},
    }
