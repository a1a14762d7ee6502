"""The traffic report as text: aligned tables over ``summarize()``'s output."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..config import format_bytes

__all__ = ["format_report", "format_table"]


def format_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Columns padded to their widest cell; the first left-aligned, the rest right-aligned."""
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        parts = [str(cells[0]).ljust(widths[0])]
        parts += [str(cell).rjust(width) for cell, width in zip(cells[1:], widths[1:], strict=True)]
        return "  ".join(parts).rstrip()

    return "\n".join([line(header), *(line(row) for row in rows)])


def _seconds(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value * 1e3:.1f} ms" if value < 1 else f"{value:.2f} s"


def _size(value: float | None) -> str:
    return "-" if value is None else format_bytes(value)


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value / 1e9:.2f} GB/s"


def _header(summary: dict[str, Any]) -> str:
    link = summary["link"]
    steps = summary["steps"]
    head = f"zero-offload traffic profile: {_seconds(summary['duration_seconds'])}"
    if steps:
        per_step = summary["per_step"]["seconds"]
        head += f", {steps} steps ({_seconds(per_step)}/step, from {summary['step_source']})"
    if link["h2d_bytes_per_s"] is None and link["d2h_bytes_per_s"] is None:
        return head + f"\nlink: {link['source']}"
    probe = f", {format_bytes(link['probe_bytes'])} probe" if link["probe_bytes"] else ""
    return (
        f"{head}\nlink: H2D {_rate(link['h2d_bytes_per_s'])}, "
        f"D2H {_rate(link['d2h_bytes_per_s'])} ({link['source']}{probe})"
    )


def _transfer_table(summary: dict[str, Any]) -> str:
    rows = []
    for row in summary["transfers"]:
        share = row["link_share"]
        rows.append(
            [
                row["name"],
                str(row["count"]) + (f" ({row['pending']} pending)" if row["pending"] else ""),
                _size(row["bytes"]),
                _seconds(row["seconds"]),
                "-" if row["gb_per_s"] is None else f"{row['gb_per_s']:.2f}",
                "-" if share is None else f"{share:.0%}",
                _seconds(row["exposed_seconds"]),
                _seconds(row["hidden_seconds"]),
                _seconds(row["waited_seconds"]),
            ]
        )
    for row in summary["collectives"]:
        nbytes = _size(row["bytes"]) if row["bytes"] else "-"
        rows.append([row["name"], str(row["count"]), nbytes, _seconds(row["seconds"]), *"-----"])
    defrag = summary["defragmentation"]
    rows.append(["defragmentation", str(defrag["count"]), _size(defrag["bytes"]), *"------"])
    totals = summary["totals"]
    rows.append(
        [
            "total copies",
            str(totals["copies"]),
            _size(totals["bytes"]),
            _seconds(totals["seconds"]),
            "",
            "",
            _seconds(totals["exposed_seconds"]),
            _seconds(totals["hidden_seconds"]),
            _seconds(totals["waited_seconds"]),
        ]
    )
    header = [
        *("transfer", "count", "bytes", "time", "GB/s", "of link"),
        *("exposed", "hidden", "waited"),
    ]
    return format_table(header, rows)


def _phase_table(summary: dict[str, Any]) -> str:
    steps = summary["steps"] or None
    rows = [
        [
            f"zero_offload::{row['name']}",
            row["track"],
            str(row["count"]),
            _seconds(row["seconds"]),
            _seconds(row["seconds"] / row["count"]),
            _seconds(row["max_seconds"]),
            _seconds(row["seconds"] / steps) if steps else "-",
        ]
        for row in summary["phases"]
    ]
    if not rows:
        return "phases: none recorded"
    return format_table(["phase", "track", "count", "total", "mean", "max", "per step"], rows)


def _memory_lines(summary: dict[str, Any]) -> str:
    memory = summary["memory"]
    lines = [
        f"device: peak {_size(memory['device_peak_bytes'])} library-owned of a "
        f"{_size(memory['device_budget'])} budget; pool blocks peak "
        f"{_size(memory['device_pools_peak_bytes'])}"
    ]
    if memory["device_torch_peak_bytes"] is not None:
        lines[0] += f"; torch allocated peak {_size(memory['device_torch_peak_bytes'])}"
    lines.append(
        f"host: pools {_size(memory['host_reserved_bytes'])} reserved, blocks peak "
        f"{_size(memory['host_pools_peak_bytes'])}; process RSS peak "
        f"{_size(memory['process_rss_peak_bytes'])}"
    )
    return "\n".join(lines)


def _pool_table(summary: dict[str, Any]) -> str:
    rows = [
        [
            pool["name"],
            pool["kind"],
            _size(pool["capacity_bytes"]),
            _size(pool["bytes_in_use"]),
            f"{pool['fragmentation']:.0%}",
            str(pool["defragmentations"]),
            str(pool["event_waits"]),
        ]
        for pool in summary["pools"]
    ]
    if not rows:
        return "pools: none"
    header = ["pool", "kind", "capacity", "in use", "fragmented", "defrags", "event waits"]
    return format_table(header, rows)


def _gc_line(gc: dict[str, Any] | None) -> str | None:
    """The collector's pauses (Note [GC pauses per step] in gc_pauses.py), per step when
    there are steps."""
    if gc is None:
        return None
    per_step = gc["per_step"]
    if per_step is None:
        return (
            f"gc: {gc['collections']} collections ({gc['by_generation'][2]} full), "
            f"{_seconds(gc['seconds'])} paused, longest {_seconds(gc['longest_seconds'])}"
        )
    return (
        f"gc: {per_step['collections']:.1f} collections per step "
        f"({per_step['full_collections']:.2f} full), {_seconds(per_step['seconds'])} paused "
        f"per step, longest {_seconds(gc['longest_seconds'])}"
    )


def _sync_line(syncs: dict[str, Any] | None) -> str | None:
    """The training threads' host synchronisations (Note [host syncs are counted where they
    can block] in accelerator/host_syncs.py), per step when there are steps."""
    if syncs is None:
        return None
    per_step = syncs["per_step"]
    counts = per_step if per_step is not None else syncs["by_kind"]
    waits = per_step["waits_by_stream"] if per_step is not None else syncs["waits_by_stream"]
    streams = ", ".join(f"{name} {n:g}" for name, n in sorted(waits.items()))
    return (
        f"host syncs (training threads){' per step' if per_step is not None else ''}: "
        f"{counts['wait']:g} waits"
        + (f" ({streams})" if streams else "")
        + f", {counts['input']:g} CPU-optimizer input waits, {counts['completed']:g} found done"
    )


def format_report(summary: dict[str, Any]) -> str:
    """The whole report: header, transfers, phases, memory, pools, per-step averages."""
    parts = [_header(summary), _transfer_table(summary), _phase_table(summary)]
    parts += [_memory_lines(summary), _pool_table(summary)]
    per_step = summary["per_step"]
    if per_step is not None:
        parts.append(
            f"per step: {_size(per_step['bytes'])} moved, {_seconds(per_step['copy_seconds'])} "
            f"copying, {_seconds(per_step['exposed_seconds'])} exposed, "
            f"{_seconds(per_step['waited_seconds'])} waited, {_seconds(per_step['seconds'])} wall"
        )
    gc_line = _gc_line(summary.get("gc"))
    if gc_line:
        parts.append(gc_line)
    sync_line = _sync_line(summary.get("host_syncs"))
    if sync_line:
        parts.append(sync_line)
    notes = summary.get("step_notes") or {}
    if notes:
        parts.append(
            "optimizer: "
            + ", ".join(f"{name.replace('_', ' ')} {value:g}" for name, value in notes.items())
        )
    return "\n\n".join(parts)
