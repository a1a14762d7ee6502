"""TrafficProfiler: listens to the memory managers and the tracing phases while it records.

It keeps no bookkeeping of its own beyond what it hears: the managers' ``CopyRecord``s
(Note [one choke point for copies]) and ``StallRecord``s (Note [exposed time is measured on
the compute stream]), the ``tracing.phase`` spans, samples of the device
ledger and the pools, and the pool stats at start and stop.
Everything it reports is derived from those in ``summary.py``.

Note [the profiler reads memory per step, never per copy]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A copy listener runs on the thread that issues the copy, often autograd's, thousands of
times a step; ``torch.cuda.memory_allocated()`` rebuilds the allocator's stats dict at every
call (about 0.1-0.2 ms, estimated from the H200 traces of issue 39), and profiled steps
there ran about a second slower. So a copy only hands its record to the timeline
(Note [the profiler keeps numbers, not events] in ``timeline.py``). Memory is read at three
rates:
- per step (``start``, ``prof.step()``, ``stop``): the peaks since the previous step sample,
  exact rather than sampled: the ledger's through a ``PeakWindow`` (which leaves the ledger's
  own ``peak`` alone), the pools' blocks in use, summed per kind (device, host), through a
  ``PoolsPeakWindow`` each (which leave the pools' own ``peak_bytes_in_use`` alone; a pool
  built while recording counts from the step sample after it appeared), torch's through
  ``max_memory_allocated`` followed by ``reset_peak_memory_stats`` (so, while recording,
  the profiler owns torch's peak statistics on its CUDA devices); and the pools' use now and
  the process's RSS;
- per phase (a phase ends at most a few times per bucket): the ledger's current use, one
  lock and no allocator call, for the trace's memory track;
- per copy: nothing.
The cyclic GC's pauses are taken per step too (Note [GC pauses per step] in
``gc_pauses.py``), and the host synchronisations counted between start and stop (Note
[host syncs are counted where they can block] in ``accelerator/host_syncs.py``).

Layering: ``data.py`` holds what is recorded; the recorder writes it, and the writers
(``summary``, ``report``, ``chrome_trace``, ``plot``) only read it. Nothing imports the
recorder back.
"""

from __future__ import annotations

import enum
import json
import threading
import time
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import psutil
import torch

from ..accelerator import Accelerator, PeakWindow
from ..accelerator.host_syncs import SyncKey, host_syncs
from ..collectives import CommCounters
from ..fileio import write_text
from ..memory.manager import TieredMemoryManager
from ..tracing import add_phase_listener
from .chrome_trace import write_chrome_trace
from .data import MemorySample, PhaseSpan, ProfileData
from .gc_pauses import GcPauses
from .link import LinkBandwidth, measure_link
from .plot import plot_profile
from .pool_peaks import PoolsPeakWindow
from .report import format_report
from .summary import summarize

__all__ = ["ProfilerState", "TrafficProfiler"]


class ProfilerState(enum.Enum):
    """Where a profiler is in its life; what it holds in each."""

    #: Built; no listener attached, nothing recorded.
    READY = "ready"
    #: Listeners attached to the managers and the phases; records grow with every copy.
    RECORDING = "recording"
    #: Listeners removed and pending copies waited for: the timeline is complete.
    STOPPED = "stopped"


def resolve_managers(targets: Iterable[Any]) -> list[TieredMemoryManager]:
    """The distinct managers behind ``targets`` (managers, or objects with ``.manager``)."""
    managers: list[TieredMemoryManager] = []
    for target in targets:
        manager = target if isinstance(target, TieredMemoryManager) else None
        if manager is None:
            manager = getattr(target, "manager", None)
        if not isinstance(manager, TieredMemoryManager):
            raise TypeError(
                f"profile() takes TieredMemoryManager objects or objects with a .manager "
                f"(OffloadAdamW, ActivationOffloader), got {type(target).__name__}"
            )
        if all(manager is not known for known in managers):
            managers.append(manager)
    if not managers:
        raise ValueError("profile() needs at least one optimizer, offloader or memory manager")
    return managers


def resolve_comm_counters(targets: Iterable[Any]) -> list[CommCounters]:
    """The distinct collective counters of ``targets`` (an optimizer on several ranks has
    ``.comm.counters``); the others have none."""
    found: list[CommCounters] = []
    for target in targets:
        comm = getattr(target, "comm", None)
        counters = getattr(comm, "counters", None)
        if isinstance(counters, CommCounters) and all(counters is not c for c in found):
            found.append(counters)
    return found


class TrafficProfiler:
    """Records copies, phases and memory of one or more memory managers; see ``profile()``.

    Listeners run on the caller's thread (phases, copies issued there) and on stream worker
    threads; they append phases to lists (atomic under the GIL), hand records to the
    timelines (each under its own lock, settling now and then: Note [the profiler keeps
    numbers, not events]) and take the device ledgers' locks. The pools (their locks contend with the copy streams) are read only at start,
    ``step()`` and stop. ``_lock`` guards ``state``.
    """

    def __init__(
        self,
        targets: Iterable[Any],
        *,
        link_bandwidth: float | None = None,
        sample_rss: bool = True,
    ) -> None:
        if link_bandwidth is not None and not (
            isinstance(link_bandwidth, (int, float)) and link_bandwidth > 0
        ):
            raise ValueError(
                f"link_bandwidth must be bytes per second > 0 or None (measure it), "
                f"got {link_bandwidth!r}"
            )
        targets = list(targets)  # read twice: managers and collective counters
        managers = resolve_managers(targets)
        self._accelerators: list[Accelerator] = []
        for manager in managers:
            if all(manager.accelerator is not acc for acc in self._accelerators):
                self._accelerators.append(manager.accelerator)
        self._link_given = link_bandwidth
        self._sample_rss = sample_rss
        self._process = psutil.Process()
        self._cuda_devices = [acc.device for acc in self._accelerators if acc.device.type == "cuda"]
        # Open while recording: each accelerator ledger's peak since the last step sample.
        self._windows: list[PeakWindow] = []
        # Open while recording: the pools' summed blocks in use, device and host pools apart.
        self._device_pools = PoolsPeakWindow()
        self._host_pools = PoolsPeakWindow()
        self._gc: GcPauses | None = None  # listening to the collector while recording
        self._syncs_start: Counter[SyncKey] = Counter()  # host_syncs() at start
        self.data = ProfileData(managers=managers, link=LinkBandwidth(None, None, 0, "not started"))
        self.data.comm_counters = resolve_comm_counters(targets)
        self.state = ProfilerState.READY
        self._detach: list[Any] = []  # unsubscribe / remove callables while recording
        self._lock = threading.Lock()

    # -- life cycle --------------------------------------------------------------------

    def start(self) -> TrafficProfiler:
        """Measure the link (first time per accelerator), take baselines, start listening."""
        with self._lock:
            if self.state is not ProfilerState.READY:
                raise RuntimeError(f"a profiler starts once; this one is {self.state.value}")
            self.state = ProfilerState.RECORDING
        data = self.data
        first = data.managers[0]
        if self._link_given is not None:
            given = float(self._link_given)
            data.link = LinkBandwidth(given, given, 0, "given")
        else:
            data.link = measure_link(first.accelerator, d2h=first.d2h, h2d=first.h2d)
        data.device_budget = sum(acc.memory_stats()["budget"] for acc in self._accelerators)
        data.pools_start = self._pool_stats()
        data.comm_start = [counters.snapshot() for counters in data.comm_counters]
        self._windows = [acc.ledger.open_window() for acc in self._accelerators]
        self._watch_pools()
        self._torch_peak()  # starts torch's peak window
        for index, manager in enumerate(data.managers):
            self._subscribe(index, manager)
        self._detach.append(add_phase_listener(self._on_phase))
        self._gc = GcPauses()
        self._syncs_start = host_syncs()
        data.started_at = time.perf_counter()
        self._sample_step(rss=True)
        return self

    def stop(self, *, wait: bool = True) -> None:
        """Stop listening, wait for pending copies, take the final snapshots. Idempotent.

        ``wait=False`` skips the wait (copies still in flight then show as pending).
        """
        with self._lock:
            if self.state is not ProfilerState.RECORDING:
                return
            self.state = ProfilerState.STOPPED
        data = self.data
        for detach in self._detach:
            detach()
        self._detach.clear()
        data.host_syncs = host_syncs() - self._syncs_start  # not stop()'s own waits
        if wait:
            # Synchronisation point: copies still in flight have no end time yet; the
            # report and the trace need every one of them finished.
            for manager in data.managers:
                manager.synchronize()
        self._sample_step(rss=True)
        self._take_gc()  # from the last step to stop
        if self._gc is not None:
            self._gc.close()
        for window in self._windows:
            window.close()
        self._device_pools.close()
        self._host_pools.close()
        data.stopped_at = time.perf_counter()
        data.pools_end = self._pool_stats()
        data.comm_end = [counters.snapshot() for counters in data.comm_counters]

    def __enter__(self) -> TrafficProfiler:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, *rest: object) -> None:
        # After an error in the body, a failed stream must not hide that error behind its own.
        self.stop(wait=exc_type is None)

    def step(self) -> None:
        """Mark the end of one training step (for per-step averages and the trace)."""
        if self.state is not ProfilerState.RECORDING:
            raise RuntimeError(
                f"prof.step() is for a recording profiler; this one is {self.state.value}"
            )
        self.data.step_marks.append(time.perf_counter())
        self._take_gc()
        self._sample_step(rss=self._sample_rss)

    # -- listeners ---------------------------------------------------------------------

    def _subscribe(self, index: int, manager: TieredMemoryManager) -> None:
        # No memory read here: Note [the profiler reads memory per step, never per copy]. The
        # listeners are the timelines' inboxes' ``extend`` itself, no Python call per copy
        # (Note [appending to the profiler takes no lock] in timeline.py).
        copies, stalls = self.data.copies, self.data.stalls

        def tick() -> None:
            copies.tick()
            stalls.tick()

        self._detach.append(
            manager.subscribe(
                copies.keeper(index), stalls=stalls.keeper(index), fields=True, tick=tick
            )
        )

    def _on_phase(self, name: str, track: str, start: float, end: float) -> None:
        self.data.phases.append(PhaseSpan(name, track, start, end))
        # The ledger's use only (one lock): Note [the profiler reads memory per step, ...].
        device = sum(acc.memory_stats()["in_use"] for acc in self._accelerators)
        self.data.memory.append(
            MemorySample(time.perf_counter(), device, None, None, None, None, None, None)
        )

    def _sample_step(self, *, rss: bool) -> None:
        """The per-step sample: peaks since the previous one, the pools, the RSS; and the
        records whose events completed become plain rows (Note [the profiler keeps
        numbers, not events])."""
        self.data.copies.settle()
        self.data.stalls.settle()
        device = sum(acc.memory_stats()["in_use"] for acc in self._accelerators)
        device_peak = sum(window.take() for window in self._windows)
        self._watch_pools()  # pools built since the previous sample
        device_pools_peak = self._device_pools.take()
        host_pools_peak = self._host_pools.take()
        device_pools = host_pools = 0
        for manager in self.data.managers:
            for pool in manager.pools:
                in_use = int(pool.stats()["bytes_in_use"])
                if pool.kind == "device":
                    device_pools += in_use
                else:
                    host_pools += in_use
        self.data.memory.append(
            MemorySample(
                time.perf_counter(),
                device,
                device_pools,
                host_pools,
                device_peak,
                self._torch_peak(),
                max(device_pools_peak, device_pools),
                max(host_pools_peak, host_pools),
            )
        )
        if rss:
            self.data.rss_peak = max(self.data.rss_peak, self._process.memory_info().rss)

    def _watch_pools(self) -> None:
        """Count every pool of the managers in its kind's peak window (once each)."""
        for manager in self.data.managers:
            for pool in manager.pools:
                window = self._device_pools if pool.kind == "device" else self._host_pools
                window.watch(pool)

    def _take_gc(self) -> None:
        """The collector's pauses since the previous step (Note [GC pauses per step])."""
        if self._gc is not None:
            self.data.gc_steps.append(self._gc.take())

    def _torch_peak(self) -> int | None:
        """Bytes torch allocated at most on the CUDA devices since the previous call, and a
        new window from now (None without CUDA). Hidden cost: each call builds the
        allocator's stats twice per device; per step only."""
        if not self._cuda_devices:
            return None
        peak = 0
        for device in self._cuda_devices:
            peak += torch.cuda.max_memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
        return peak

    def _pool_stats(self) -> dict[str, dict[str, Any]]:
        stats: dict[str, dict[str, Any]] = {}
        for index, manager in enumerate(self.data.managers):
            for pool in manager.pools:
                key = pool.name if index == 0 else f"{pool.name} (manager {index})"
                stats[key] = dict(pool.stats(), kind=pool.kind)
        return stats

    # -- outputs -----------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """The summary as plain JSON-friendly data (see ``summary.summarize``), while
        recording or after; before ``start()`` there is nothing to summarise (RuntimeError)."""
        if self.state is ProfilerState.READY:
            raise RuntimeError(
                "the profiler has recorded nothing yet: call start() (or use it as "
                "`with zero_offload.profile(opt) as prof:`) before to_dict(), to_json() or "
                "report()"
            )
        return summarize(self.data)

    def to_json(self, path: str | Path | None = None) -> str:
        """``to_dict()`` as JSON text; also written to ``path`` when given."""
        target = None if path is None else _file_path(path, "to_json", "profile.json")
        text = json.dumps(self.to_dict(), indent=2)
        if target is not None:
            write_text(target, text + "\n", what="to_json")  # atomically, see fileio
        return text

    def report(self) -> str:
        """The traffic report as a text table (what ``str(prof)`` prints)."""
        return format_report(self.to_dict())

    def __str__(self) -> str:
        if self.state is ProfilerState.READY:
            return f"{type(self).__name__} ({self.state.value}: nothing recorded yet)"
        return self.report()

    def export_chrome_trace(self, path: str | Path) -> Path:
        """Write a Chrome trace (Perfetto, chrome://tracing) to ``path``; returns the path."""
        return write_chrome_trace(self.data, _file_path(path, "export_chrome_trace", "trace.json"))

    def plot(self, path: str | Path) -> Path:
        """Write a PNG: transfers per stream over time, and memory over time (needs matplotlib)."""
        return plot_profile(self.data, _file_path(path, "plot", "profile.png"))


def _file_path(path: str | Path, method: str, example: str) -> Path:
    """``path`` for an output file; a folder that exists is refused (the write goes to a temp
    file beside it, then replaces it: it would fail on the folder with an error naming the
    temp file)."""
    target = Path(path)
    if target.is_dir():
        raise ValueError(
            f"{method}: path={str(path)!r} is a directory; give a file path in it, e.g. "
            f"{str(target / example)!r}"
        )
    return target
