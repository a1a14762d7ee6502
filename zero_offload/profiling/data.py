"""What a profiler records: plain data, written by ``recorder.py`` and read by the writers
(``summary.py``, ``report.py``, ``chrome_trace.py``, ``plot.py``)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from ..accelerator.host_syncs import SyncKey
from ..memory.manager import TieredMemoryManager
from .gc_pauses import GcWindow
from .link import LinkBandwidth
from .timeline import CopyTimeline, StallTimeline

__all__ = ["MemorySample", "PhaseSpan", "ProfileData"]


@dataclass(frozen=True, slots=True)
class PhaseSpan:
    """One ``tracing.phase`` that ended while recording (times on ``perf_counter``)."""

    name: str
    track: str
    start: float
    end: float


@dataclass(frozen=True, slots=True)
class MemorySample:
    """Memory at one instant, or over the window since the previous step sample, in bytes.

    ``device``: library-owned device bytes now (the accelerators' ledgers). The other fields
    are ``None`` in samples taken when a phase ends, and filled in step samples (start,
    ``prof.step()``, stop; Note [the profiler reads memory per step, never per copy] in
    ``recorder.py``): ``device_pools`` and ``host_pools``, bytes of blocks in use in the device
    and host pools now; ``device_peak``, the ledgers' largest use since the previous step
    sample; ``device_torch_peak``, the most memory torch had allocated on the CUDA devices
    since the previous step sample, activations included (``None`` without CUDA);
    ``device_pools_peak`` and ``host_pools_peak``, the largest bytes of blocks in use at once
    in the device (host) pools since the previous step sample, summed over the pools at each
    instant (``pool_peaks.PoolsPeakWindow``): blocks taken and freed between two samples
    (activations, staging) count.
    """

    at: float
    device: int
    device_pools: int | None
    host_pools: int | None
    device_peak: int | None
    device_torch_peak: int | None
    device_pools_peak: int | None
    host_pools_peak: int | None


@dataclass
class ProfileData:
    """Everything recorded; ``summary.summarize`` turns it into the report."""

    managers: list[TieredMemoryManager]
    link: LinkBandwidth
    started_at: float = 0.0
    stopped_at: float | None = None
    # Note [the profiler keeps numbers, not events] (timeline.py): plain rows once settled.
    copies: CopyTimeline = field(default_factory=CopyTimeline)
    stalls: StallTimeline = field(default_factory=StallTimeline)
    phases: list[PhaseSpan] = field(default_factory=list)
    memory: list[MemorySample] = field(default_factory=list)
    step_marks: list[float] = field(default_factory=list)  # perf_counter at each prof.step()
    # The cyclic GC's collections in each step window (one per prof.step(), then one from
    # the last step to stop): Note [GC pauses per step] in gc_pauses.py.
    gc_steps: list[GcWindow] = field(default_factory=list)
    # Host synchronisations counted between start and stop (``accelerator.host_syncs``:
    # Note [host syncs are counted where they can block]), by thread, stream and kind.
    host_syncs: Counter[SyncKey] = field(default_factory=Counter)
    rss_peak: int = 0  # process resident bytes, largest sample (start, steps, stop)
    pools_start: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> stats()
    pools_end: dict[str, dict[str, Any]] | None = None
    device_budget: int = 0  # bytes, summed over the accelerators
    # The targets' collective counters (``collectives.CommCounters``: one per optimizer on
    # several ranks) and their ``snapshot()`` at start and stop: bytes by kind of collective.
    comm_counters: list[Any] = field(default_factory=list)
    comm_start: list[dict[str, dict[str, int]]] = field(default_factory=list)
    comm_end: list[dict[str, dict[str, int]]] | None = None
