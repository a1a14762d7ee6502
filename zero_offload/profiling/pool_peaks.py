"""The largest bytes in use at once over a set of pools: the profiler's pool blocks peak."""

from __future__ import annotations

import threading
from collections.abc import Callable

from ..memory.pool import BlockPool

__all__ = ["PoolsPeakWindow"]


class PoolsPeakWindow:
    """The largest sum of ``bytes_in_use`` over a set of pools, over windows of time, for one
    observer (the profiler's ``device_pools_peak_bytes`` and ``host_pools_peak_bytes``).

    Each watched pool reports its ``bytes_in_use`` when added (``BlockPool.watch_use``) and
    every change after, under its own lock; the window adds them up under ``_lock`` (taken
    inside a pool's lock, never the other way round), so ``take()`` is the exact peak of the
    sum: not each pool's peak added up, nor a sample. Like the ledger's ``PeakWindow``, it
    leaves the pools' own ``peak_bytes_in_use`` alone. Costs a lock and a compare per alloc
    and free of a watched pool; ``close()`` it when done.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()  # guards _in_use and _peak
        self._in_use = 0  # bytes in use now, summed over the watched pools
        self._peak = 0  # largest _in_use since the window opened or the last take()
        # The watched pools and their unwatch calls; changed by the observer's thread only.
        self._pools: list[tuple[BlockPool, Callable[[], None]]] = []

    def watch(self, pool: BlockPool) -> None:
        """Count ``pool`` from now on (a pool already watched is left as it is)."""
        if all(pool is not known for known, _ in self._pools):
            self._pools.append((pool, pool.watch_use(self._add)))

    def take(self) -> int:
        """Largest summed bytes in use since the window opened or the last ``take()``; the
        next window starts from the use now."""
        with self._lock:
            peak, self._peak = self._peak, self._in_use
            return peak

    def close(self) -> None:
        """Stop watching every pool."""
        for _, unwatch in self._pools:
            unwatch()
        self._pools.clear()

    def _add(self, nbytes: int) -> None:
        """A watched pool's use changed by ``nbytes``; called under that pool's lock."""
        with self._lock:
            self._in_use += nbytes
            if self._in_use > self._peak:
                self._peak = self._in_use
