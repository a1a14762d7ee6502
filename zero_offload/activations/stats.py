"""The counters of one ActivationOffloader, and the device activation bytes it holds.

``device_bytes`` counts what the offloader holds on the device: saved tensors whose copy out
is pending (``outgoing.py``), and reloaded activations still alive (Note [device blocks live
as long as their storage] in ``layout.py``); ``device_bytes_peak`` never falls below it.

Not thread-safe by itself: every method runs under the offloader's lock.
"""

from __future__ import annotations

from dataclasses import dataclass

from .record import OffloadedActivation

__all__ = ["OffloaderStats"]


@dataclass
class OffloaderStats:
    """Counters of one offloader; guarded by its lock. Units in the names."""

    offloaded_tensors: int = 0  # saved tensors copied out
    offloaded_bytes: int = 0  # their bytes
    reloads: int = 0  # copies back issued (prefetch or demand)
    prefetch_hits: int = 0  # unpacks whose copy back had been issued ahead of time
    demand_loads: int = 0  # unpacks that had to issue their own copy back
    prefetch_skipped: int = 0  # prefetches dropped because the device pool was full
    forward_waits: int = 0  # packs that waited for an older copy out (max_offloads_in_flight)
    device_bytes: int = 0  # activation bytes on the device held by the offloader, now
    device_bytes_peak: int = 0  # largest device_bytes since construction or reset_peak()

    def add_device_bytes(self, nbytes: int) -> None:
        """``nbytes`` more activation bytes held on the device."""
        self.device_bytes += nbytes
        self.device_bytes_peak = max(self.device_bytes_peak, self.device_bytes)

    def count_released(self, released: list[OffloadedActivation]) -> None:
        """The device tensors of ``released`` are no longer held for their copies out."""
        for record in released:
            self.device_bytes -= record.nbytes

    def reset_peak(self) -> None:
        """Start ``device_bytes_peak`` afresh from current use."""
        self.device_bytes_peak = self.device_bytes
