"""``prof.plot(path)``: transfers per stream over time, and memory over time, as a PNG.

Needs matplotlib (the ``plot`` extra). Draws on a bare ``Figure`` with the Agg canvas, so it
touches no global pyplot state and needs no display.
"""

from __future__ import annotations

from pathlib import Path

from .chrome_trace import STANDARD_TRACKS
from .recorder import ProfileData

__all__ = ["plot_profile"]

_MISSING = (
    "prof.plot() needs matplotlib, which is not installed: pip install zero-offload[plot] "
    "(or pip install matplotlib)"
)
_MIB = 2**20


def _spans(data: ProfileData) -> dict[str, list[tuple[float, float]]]:
    """``track -> [(start, width)]`` in seconds since the profile started."""
    origin = data.started_at
    tracks: dict[str, list[tuple[float, float]]] = {}
    for manager_index, record in data.copies:
        began, ended = record.start.completed_at(), record.end.completed_at()
        if began is None or ended is None:
            continue
        track = record.stream if manager_index == 0 else f"{record.stream} ({manager_index})"
        tracks.setdefault(track, []).append((began - origin, max(ended - began, 1e-6)))
    for span in data.phases:
        tracks.setdefault(span.track, []).append(
            (span.start - origin, max(span.end - span.start, 1e-6))
        )
    order = {name: index for index, name in enumerate(STANDARD_TRACKS)}
    return dict(sorted(tracks.items(), key=lambda item: order.get(item[0], len(order))))


def plot_profile(data: ProfileData, path: Path) -> Path:
    """Write the PNG to ``path`` (parent folders created); returns ``path``."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ImportError(_MISSING) from exc
    figure = Figure(figsize=(11, 6.5), layout="constrained")
    FigureCanvasAgg(figure)
    timeline, memory = figure.subplots(2, 1, sharex=True, height_ratios=(3, 2))
    tracks = _spans(data)
    for row, spans in enumerate(tracks.values()):
        timeline.broken_barh(spans, (row - 0.4, 0.8), color=f"C{row % 10}")
    timeline.set_yticks(range(len(tracks)), list(tracks))
    timeline.invert_yaxis()
    for at in data.step_marks:
        timeline.axvline(at - data.started_at, color="0.7", linewidth=0.6, zorder=0)
    timeline.set_title("zero-offload: copies and phases per stream (grey lines: prof.step())")
    samples = sorted(data.memory, key=lambda s: s.at)
    times = [s.at - data.started_at for s in samples]
    memory.step(times, [s.device / _MIB for s in samples], where="post", label="device (library)")
    series = (
        ("device pool blocks", [s for s in samples if s.device_pools is not None], "device_pools"),
        ("host pool blocks", [s for s in samples if s.host_pools is not None], "host_pools"),
        ("device (torch, all)", [s for s in samples if s.device_torch is not None], "device_torch"),
    )
    for label, chosen, attr in series:
        if chosen:
            memory.step(
                [s.at - data.started_at for s in chosen],
                [getattr(s, attr) / _MIB for s in chosen],
                where="post",
                label=label,
            )
    memory.set_ylabel("MiB")
    memory.set_xlabel("seconds since profile start")
    memory.legend(loc="upper left", fontsize="small")
    memory.set_title("memory over time")
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    return path
