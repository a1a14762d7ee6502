"""Chrome trace export: one track per stream, events named ``zero_offload::<phase>``.

The file is the Trace Event Format's JSON object form (``{"traceEvents": [...]}``) that
Perfetto and chrome://tracing open. Times are microseconds since the profile started.
Copies appear on the track of the stream that ran them (``d2h``, ``h2d``, ...), from their
start event to their end event; ``tracing.phase`` spans on their own track (``compute``,
``cpu_optimizer``, ``comm``); ``prof.step()`` marks as instant events on ``compute``; and
library-owned memory as counter tracks.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..fileio import write_text
from ..memory.traffic import Direction
from .data import ProfileData

__all__ = ["STANDARD_TRACKS", "chrome_trace_events", "write_chrome_trace"]

#: Tracks every trace has, in display order; others (more streams, more managers) follow.
STANDARD_TRACKS = ("compute", "d2h", "h2d", "host_worker", "cpu_optimizer", "comm")
_PID = 1


def chrome_trace_events(data: ProfileData) -> list[dict[str, Any]]:
    """The trace's events: metadata, copies, compute stalls, phases, step marks, memory."""
    origin = data.started_at
    tids: dict[str, int] = {name: index + 1 for index, name in enumerate(STANDARD_TRACKS)}

    def tid(track: str) -> int:
        return tids.setdefault(track, len(tids) + 1)

    def micros(at: float) -> float:
        return round((at - origin) * 1e6, 3)

    events: list[dict[str, Any]] = []
    for record in data.copies:
        began, ended = record.began, record.ended
        if began is None or ended is None:
            continue
        track = record.stream if record.manager == 0 else f"{record.stream} ({record.manager})"
        direction = {
            Direction.D2H: "d2h",
            Direction.H2D: "h2d",
            Direction.NVME_READ: "nvme_read",
            Direction.NVME_WRITE: "nvme_write",
        }[record.direction]
        events.append(
            {
                "name": f"zero_offload::{record.category.value}_{direction}",
                "cat": "copy",
                "ph": "X",
                "pid": _PID,
                "tid": tid(track),
                "ts": micros(began),
                "dur": round(max(0.0, ended - began) * 1e6, 3),
                "args": {
                    "bytes": record.nbytes,
                    "label": record.label,
                    "seq": record.seq,
                    "queued_us": micros(record.issued_at),
                },
            }
        )
    for stall in data.stalls:
        seconds = stall.seconds()
        if not seconds:
            continue
        track = stall.stream if stall.manager == 0 else f"{stall.stream} ({stall.manager})"
        events.append(
            {
                "name": f"zero_offload::stall_{stall.category.value}",
                "cat": "stall",
                "ph": "X",
                "pid": _PID,
                "tid": tid(track),
                "ts": micros(stall.began or origin),
                "dur": round(seconds * 1e6, 3),
                "args": {"waited_for": stall.waited_for, "seq": stall.seq},
            }
        )
    for span in data.phases:
        events.append(
            {
                "name": f"zero_offload::{span.name}",
                "cat": "phase",
                "ph": "X",
                "pid": _PID,
                "tid": tid(span.track),
                "ts": micros(span.start),
                "dur": round((span.end - span.start) * 1e6, 3),
            }
        )
    for number, at in enumerate(data.step_marks, start=1):
        events.append(
            {
                "name": "zero_offload::step",
                "cat": "step",
                "ph": "i",
                "s": "p",
                "pid": _PID,
                "tid": tids["compute"],
                "ts": micros(at),
                "args": {"step": number},
            }
        )
    for sample in data.memory:
        events.append(
            {
                "name": "zero_offload::device_bytes",
                "ph": "C",
                "pid": _PID,
                "ts": micros(sample.at),
                "args": {"library": sample.device},
            }
        )
        if sample.host_pools is not None:
            events.append(
                {
                    "name": "zero_offload::host_pool_bytes",
                    "ph": "C",
                    "pid": _PID,
                    "ts": micros(sample.at),
                    "args": {"in_use": sample.host_pools},
                }
            )
    metadata: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": _PID, "args": {"name": "zero-offload"}}
    ]
    for track, number in tids.items():
        metadata.append(
            {"name": "thread_name", "ph": "M", "pid": _PID, "tid": number, "args": {"name": track}}
        )
        metadata.append(
            {
                "name": "thread_sort_index",
                "ph": "M",
                "pid": _PID,
                "tid": number,
                "args": {"sort_index": number},
            }
        )
    return metadata + sorted(events, key=lambda event: event["ts"])


def write_chrome_trace(data: ProfileData, path: Path) -> Path:
    """Write the trace JSON to ``path`` (parent folders created); returns ``path``."""
    trace = {"traceEvents": chrome_trace_events(data), "displayTimeUnit": "ms"}
    write_text(path, json.dumps(trace), what="write_chrome_trace")  # atomically, see fileio
    return path
