"""``prof.plot(path)``: one representative step zoomed, the time of every step, memory by tier.

Three panels, each answering one question:

1. *What happens inside a step?* The median step (by wall time, after the first, which
   warms up), zoomed: one row per stream and track, each copy coloured by what it carries,
   each phase drawn on its track, and every stall of the compute stream (``StallRecord``:
   compute waiting for a copy) hatched in red on the compute row.
2. *Where does each step's time go?* Stacked bars per step: compute, exposed transfer (the
   step's stalls) and optimizer (``cpu_optimizer`` phases), with the step's wall time
   marked; under ``overlap_step`` the optimizer runs beside compute, so its bar rises above
   the mark.
3. *How full is each tier?* For the device and the host: the budget or capacity, what the
   library's pools reserve, and the peak bytes of blocks in use, side by side.

Needs matplotlib (the ``plot`` extra). Draws on a bare ``Figure`` with the Agg canvas, so it
touches no global pyplot state and needs no display.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..fileio import atomic_file
from ..memory.traffic import Category
from .chrome_trace import STANDARD_TRACKS
from .data import ProfileData

__all__ = ["StepTime", "plot_profile", "representative_step", "step_times"]

_MISSING = (
    "prof.plot() needs matplotlib, which is not installed: pip install zero-offload[plot] "
    "(or pip install matplotlib)"
)
_MIB = 2**20
_CATEGORY_COLOURS = {
    Category.GRADIENTS: "tab:orange",
    Category.WEIGHTS: "tab:blue",
    Category.ACTIVATIONS: "tab:green",
    Category.OPTIMIZER_STATE: "tab:purple",
}
_PHASE_COLOUR = "0.55"
_STALL_COLOUR = "tab:red"
_STALL_FILL = "#f6c4c4"  # under red hatching: compute stalled


@dataclass(frozen=True)
class StepTime:
    """One step's window and where its time went, in seconds (``perf_counter`` clock)."""

    index: int  # 0-based step number
    start: float
    end: float
    exposed: float  # compute stalled waiting for copies (the step's StallRecords)
    optimizer: float  # cpu_optimizer phases inside the window

    @property
    def wall(self) -> float:
        return self.end - self.start

    @property
    def compute(self) -> float:
        """The rest of the wall time: forward, backward and everything else on compute."""
        return max(self.wall - self.exposed - self.optimizer, 0.0)


def _overlap(start: float, end: float, lo: float, hi: float) -> float:
    return max(0.0, min(end, hi) - max(start, lo))


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Overlapping ``(start, end)`` spans merged: a phase nested in another on the same
    track (a wait inside CPU Adam) counts once."""
    merged: list[tuple[float, float]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def step_times(data: ProfileData) -> list[StepTime]:
    """Each ``prof.step()`` window with its exposed and optimizer seconds."""
    stalls = []
    for stall in data.stalls:
        if stall.began is not None and stall.ended is not None:
            stalls.append((stall.began, stall.ended))
    optimizer = _union([(s.start, s.end) for s in data.phases if s.track == "cpu_optimizer"])
    steps = []
    start = data.started_at
    for index, end in enumerate(data.step_marks):
        steps.append(
            StepTime(
                index=index,
                start=start,
                end=end,
                exposed=sum(_overlap(a, b, start, end) for a, b in stalls),
                optimizer=sum(_overlap(a, b, start, end) for a, b in optimizer),
            )
        )
        start = end
    return steps


def representative_step(steps: list[StepTime]) -> StepTime | None:
    """The step of median wall time, leaving out the first (it warms up) when others exist."""
    if not steps:
        return None
    pool = steps[1:] if len(steps) > 1 else steps
    median = statistics.median_low([s.wall for s in pool])
    return next(s for s in pool if s.wall == median)


def _timeline_rows(data: ProfileData, lo: float, hi: float) -> dict[str, list[tuple]]:
    """``row -> [(start, width, colour, hatch)]`` inside [lo, hi], seconds from ``lo``."""
    rows: dict[str, list[tuple]] = {"compute": []}
    for record in data.copies:
        began, ended = record.began, record.ended
        if began is None or ended is None or ended < lo or began > hi:
            continue
        row = record.stream if record.manager == 0 else f"{record.stream} ({record.manager})"
        colour = _CATEGORY_COLOURS[record.category]
        rows.setdefault(row, []).append((began - lo, max(ended - began, 1e-6), colour, None))
    for span in data.phases:
        if span.end < lo or span.start > hi:
            continue
        width = max(span.end - span.start, 1e-6)
        rows.setdefault(span.track, []).append((span.start - lo, width, _PHASE_COLOUR, None))
    for stall in data.stalls:
        began, ended = stall.began, stall.ended
        if began is None or ended is None or ended < lo or began > hi or ended <= began:
            continue
        rows["compute"].append((began - lo, ended - began, _STALL_FILL, "////"))
    order = {name: index for index, name in enumerate(STANDARD_TRACKS)}
    return dict(sorted(rows.items(), key=lambda item: order.get(item[0], len(order))))


def _draw_step(axes: Any, data: ProfileData, step: StepTime) -> None:
    rows = _timeline_rows(data, step.start, step.end)
    for row, spans in enumerate(rows.values()):
        for start, width, colour, hatch in spans:
            axes.broken_barh(
                [(start * 1e3, width * 1e3)],
                (row - 0.4, 0.8),
                facecolor=colour,
                edgecolor=_STALL_COLOUR if hatch else "none",
                hatch=hatch,
                linewidth=0.6,
            )
    for span in data.phases:  # name the longer phases where they are
        if span.start >= step.start and span.end <= step.end:
            width = span.end - span.start
            if width > 0.08 * step.wall:
                row = list(rows).index(span.track)
                axes.text(
                    (span.start - step.start + width / 2) * 1e3,
                    row,
                    span.name,
                    ha="center",
                    va="center",
                    fontsize="x-small",
                    color="white",
                )
    axes.set_yticks(range(len(rows)), list(rows))
    axes.invert_yaxis()
    axes.set_xlim(0, step.wall * 1e3)
    axes.set_xlabel(f"milliseconds into step {step.index + 1}")
    axes.set_title(
        f"step {step.index + 1} of {len(data.step_marks)} (median wall time, "
        f"{step.wall * 1e3:.1f} ms, {step.exposed * 1e3:.1f} ms exposed): copies by stream, "
        "phases, and compute stalls"
    )
    from matplotlib.patches import Patch

    handles = [
        Patch(color=c, label=k.value.replace("_", " ")) for k, c in _CATEGORY_COLOURS.items()
    ]
    handles += [
        Patch(color=_PHASE_COLOUR, label="phase"),
        Patch(
            facecolor=_STALL_FILL, edgecolor=_STALL_COLOUR, hatch="////", label="compute stalled"
        ),
    ]
    axes.legend(handles=handles, loc="lower right", fontsize="x-small", ncols=3)


def _draw_steps(axes: Any, steps: list[StepTime], chosen: StepTime | None) -> None:
    x = [s.index + 1 for s in steps]
    compute = [s.compute * 1e3 for s in steps]
    exposed = [s.exposed * 1e3 for s in steps]
    optimizer = [s.optimizer * 1e3 for s in steps]
    axes.bar(x, compute, width=0.85, color="tab:gray", label="compute")
    axes.bar(x, exposed, width=0.85, bottom=compute, color=_STALL_COLOUR, label="exposed transfer")
    axes.bar(
        x,
        optimizer,
        width=0.85,
        bottom=[c + e for c, e in zip(compute, exposed, strict=True)],
        color="tab:cyan",
        label="optimizer",
    )
    axes.scatter(x, [s.wall * 1e3 for s in steps], marker="_", color="black", s=40, label="wall")
    if chosen is not None:
        axes.axvline(chosen.index + 1, color="black", linewidth=0.6, linestyle=":")
    axes.set_xlabel("step (dotted: the step zoomed above)")
    axes.set_ylabel("ms")
    axes.set_title("per step: compute, exposed transfer, optimizer")
    axes.legend(loc="upper right", fontsize="x-small", ncols=4)


def _tiers(data: ProfileData) -> list[tuple[str, list[tuple[str, float]]]]:
    """``[(tier, [(what, MiB)])]`` for the device and the host."""
    pools = data.pools_end or data.pools_start
    device = [p for p in pools.values() if p.get("kind") == "device"]
    host = [p for p in pools.values() if p.get("kind") != "device"]
    torch_peak = max((s.device_torch_peak or 0 for s in data.memory), default=0)
    ledger_peak = max((max(s.device, s.device_peak or 0) for s in data.memory), default=0)
    tiers = [
        (
            "device",
            [
                ("budget", data.device_budget / _MIB),
                ("library (peak)", ledger_peak / _MIB),
                ("pools", sum(p["capacity_bytes"] for p in device) / _MIB),
                ("blocks in use (peak)", sum(p["peak_bytes_in_use"] for p in device) / _MIB),
            ],
        ),
        (
            "host",
            [
                ("process RSS (peak)", data.rss_peak / _MIB),
                ("pools", sum(p["capacity_bytes"] for p in host) / _MIB),
                ("blocks in use (peak)", sum(p["peak_bytes_in_use"] for p in host) / _MIB),
            ],
        ),
    ]
    if torch_peak:
        tiers[0][1].insert(1, ("torch, all (peak)", torch_peak / _MIB))
    return tiers


def _draw_tiers(axes: Any, data: ProfileData) -> None:
    labels, values, colours = [], [], []
    for tier_index, (tier, bars) in enumerate(_tiers(data)):
        for what, mib in bars:
            labels.append(f"{tier}: {what}")
            values.append(mib)
            colours.append(f"C{tier_index}")
    rows = range(len(labels))
    axes.barh(rows, values, color=colours)
    for row, value in zip(rows, values, strict=True):
        axes.text(value, row, f" {value:,.1f}", va="center", fontsize="x-small")
    axes.set_yticks(rows, labels, fontsize="small")
    axes.invert_yaxis()
    axes.set_xscale("symlog", linthresh=1.0)
    axes.set_xlim(0, max(values, default=1.0) * 4)  # room for the labels
    axes.set_xlabel("MiB (log scale)")
    axes.set_title("memory by tier")


def plot_profile(data: ProfileData, path: Path) -> Path:
    """Write the PNG to ``path`` (parent folders created); returns ``path``."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ImportError(_MISSING) from exc
    figure = Figure(figsize=(12, 11), layout="constrained")
    FigureCanvasAgg(figure)
    zoom, bars, memory = figure.subplots(3, 1, height_ratios=(4, 3, 2.4))
    steps = step_times(data)
    chosen = representative_step(steps)
    if chosen is None:
        zoom.text(0.5, 0.5, "no prof.step() was recorded", ha="center", transform=zoom.transAxes)
        zoom.set_axis_off()
        bars.set_axis_off()
    else:
        _draw_step(zoom, data, chosen)
        _draw_steps(bars, steps, chosen)
    _draw_tiers(memory, data)
    figure.suptitle("zero-offload traffic profile")
    with atomic_file(path, what="plot") as handle:  # replaced whole, see fileio
        figure.savefig(handle, dpi=100, format=path.suffix.lstrip(".") or None)
    return path
