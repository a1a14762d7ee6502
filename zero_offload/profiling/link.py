"""Link bandwidth, measured once per accelerator with a short timed copy each way.

Note [the link probe bypasses the manager]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The profiler reports achieved bandwidth against what the device/host link can do, so at
profile start it times a few copies of a scratch buffer through ``Accelerator.copy_`` on the
manager's own ``d2h``/``h2d`` streams. This is the one call of ``copy_`` outside
``TieredMemoryManager.copy`` (Note [one choke point for copies]): the probe moves no library
state, and routing it through the manager would add bytes to the user's traffic counters
that no training step moved. It runs before the profiler subscribes to the manager, and the
result is cached per accelerator, so each accelerator is probed at most once per process.
On the host accelerator with a simulated link this measures the simulated link.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from ..accelerator import Accelerator, Stream

__all__ = ["LinkBandwidth", "measure_link"]

#: Bytes of one probe copy (smaller when the device budget has less free).
PROBE_BYTES = 8 * 2**20
#: Smallest probe worth timing; with less free device memory the link stays unmeasured.
MIN_PROBE_BYTES = 64 * 2**10
#: Timed copies per direction (after one untimed warm-up copy); the fastest counts.
PROBE_REPEATS = 3


@dataclass(frozen=True)
class LinkBandwidth:
    """What the link can do, in bytes per second each way (``None``: not measured)."""

    h2d: float | None
    d2h: float | None
    probe_bytes: int  # bytes per timed copy; 0 when not measured
    source: str  # "measured", "given", or why it is unknown


_cache: weakref.WeakKeyDictionary[Accelerator, LinkBandwidth] = weakref.WeakKeyDictionary()


def _time_copies(acc: Accelerator, stream: Stream, dst: torch.Tensor, src: torch.Tensor) -> float:
    """Fastest of ``PROBE_REPEATS`` copies, in seconds, from the stream's events."""
    best = float("inf")
    for attempt in range(PROBE_REPEATS + 1):
        start = stream.record_event()
        acc.copy_(dst, src, stream=stream)  # see Note [the link probe bypasses the manager]
        end = stream.record_event()
        # Synchronisation point: the probe's timing must be complete before the next copy.
        end.synchronize()
        began, ended = start.completed_at(), end.completed_at()
        if attempt and began is not None and ended is not None and ended > began:
            best = min(best, ended - began)
    return best


def measure_link(acc: Accelerator, *, d2h: Stream, h2d: Stream) -> LinkBandwidth:
    """The link's bandwidth each way, timed on ``d2h`` and ``h2d`` (cached per accelerator).

    Hidden cost, first call per accelerator only: a scratch device buffer (counted in the
    budget, released at once, the ledger's peak put back), a pinned host buffer, and
    ``2 * (PROBE_REPEATS + 1)`` copies.
    """
    cached = _cache.get(acc)
    if cached is not None:
        return cached
    stats = acc.memory_stats()
    nbytes = min(PROBE_BYTES, (stats["budget"] - stats["in_use"]) // 2)
    if nbytes < MIN_PROBE_BYTES:
        return LinkBandwidth(None, None, 0, "not measured: device budget nearly full")
    peak = stats["peak"]  # the probe's buffer is the profiler's, not training's: put back
    device = acc.allocate_device(nbytes, what="profiler link probe")
    release_timing = acc.hold_timing()  # the probe reads its events' times
    try:
        host = acc.allocate_host(nbytes, pinned=True)
        up = _time_copies(acc, h2d, device.tensor, host)
        down = _time_copies(acc, d2h, host, device.tensor)
    finally:
        release_timing()
        device.release()
        acc.ledger.restore_peak(peak)
    result = LinkBandwidth(
        h2d=nbytes / up if up != float("inf") else None,
        d2h=nbytes / down if down != float("inf") else None,
        probe_bytes=nbytes,
        source="measured",
    )
    _cache[acc] = result
    return result
