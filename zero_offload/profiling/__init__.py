"""Traffic profiler: where the time and the bytes of offloaded training go.

``with zero_offload.profile(optimizer) as prof:`` around any number of steps, then
``print(prof.report())``, ``prof.export_chrome_trace(path)``, ``prof.plot(path)`` or
``prof.to_dict()``. See ``recorder.py`` for what is recorded and ``summary.py`` for what each
number means.
"""

from __future__ import annotations

from typing import Any

from .recorder import ProfilerState, TrafficProfiler

__all__ = ["ProfilerState", "TrafficProfiler", "profile"]


def profile(
    *targets: Any, link_bandwidth: float | None = None, sample_rss: bool = True
) -> TrafficProfiler:
    """A profiler over the memory managers of ``targets``, to use as a context manager.

    ``targets``: ``OffloadAdamW`` optimizers, activation offloaders, or anything with a
    ``.manager`` that is a ``TieredMemoryManager``, or managers themselves; each distinct
    manager is listened to once. ``link_bandwidth``: bytes per second to report achieved
    bandwidth against; default ``None`` measures it with a short timed copy each way at
    start (once per accelerator). ``sample_rss``: read the process's resident memory at every
    ``prof.step()`` (about 20 us each).

    The profiler starts on ``__enter__`` and stops on ``__exit__``, which waits for the
    copies still in flight so that the timeline is complete. It reads device memory per step,
    never per copy; on CUDA, while it records, it resets torch's peak memory statistics at
    start and at each ``prof.step()`` (Note [the profiler reads memory per step, never per
    copy] in ``recorder.py``).
    """
    return TrafficProfiler(targets, link_bandwidth=link_bandwidth, sample_rss=sample_rss)
