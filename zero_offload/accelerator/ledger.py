"""The device ledger: library-owned device bytes counted against the device budget
(``DeviceLedger``), the buffers it hands out (``DeviceBuffer``), and the peaks observers read
without disturbing each other (``PeakWindow``). Each accelerator keeps one (``ledger``)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

from ..config import format_bytes
from ..errors import DeviceBudgetExceeded

__all__ = ["DeviceBuffer", "DeviceLedger", "PeakWindow"]


@dataclass
class DeviceBuffer:
    """A block of library-owned device memory counted against the device budget.

    ``tensor`` is a flat ``uint8`` tensor of exactly ``nbytes`` on the accelerator's device.
    Call ``release()`` once when done; it returns the bytes to the budget. The tensor must not
    be used afterwards.
    """

    tensor: torch.Tensor  # (nbytes,) uint8, on the accelerator's device
    nbytes: int
    what: str
    _ledger: DeviceLedger = field(repr=False)
    released: bool = False

    def release(self) -> None:
        """Return this buffer's bytes to the device budget."""
        if self.released:
            raise RuntimeError(f"device buffer for {self.what!r} released twice (bug)")
        self.released = True
        self._ledger.release(self.nbytes)
        self.tensor = torch.empty(0, dtype=torch.uint8, device=self.tensor.device)


class PeakWindow:
    """The largest ``in_use`` of one ledger over a window of time, for one observer.

    ``take()`` returns the peak since the window opened or since the previous ``take()``, and
    starts the next window from the use at that moment. Unlike ``DeviceLedger.reset_peak``, it
    leaves the ledger's own ``peak`` (what users read in ``memory_stats()``) alone, so several
    observers (the profiler, a user's loop) never disturb each other. Written under the
    ledger's lock, which guards ``_peak``.
    """

    def __init__(self, ledger: DeviceLedger, in_use: int) -> None:
        self._ledger = ledger
        self._peak = in_use  # bytes; guarded by the ledger's _lock

    def take(self) -> int:
        """Largest library-owned device bytes since the window opened or the last take."""
        with self._ledger._lock:
            peak, self._peak = self._peak, self._ledger.in_use
            return peak

    def close(self) -> None:
        """Stop tracking; later ``take()`` calls return the current use."""
        self._ledger._close_window(self)


class DeviceLedger:
    """Counts library-owned device bytes against the budget.

    Stats, all in bytes: ``budget`` (the limit), ``in_use`` (reserved now), ``peak`` (largest
    ``in_use`` seen since construction or ``reset_peak()``). ``_lock`` guards all three and the
    open ``PeakWindow``s (each reservation raises their peaks), since copy-stream workers
    release memory too.
    """

    def __init__(self, budget: int, budget_source: str) -> None:
        self.budget = budget
        self.budget_source = budget_source
        self.in_use = 0
        self.peak = 0
        self._windows: list[PeakWindow] = []  # open windows; usually none
        self._lock = threading.Lock()

    def open_window(self) -> PeakWindow:
        """A ``PeakWindow`` starting now (close it when done: each open one costs a compare
        per reservation)."""
        with self._lock:
            window = PeakWindow(self, self.in_use)
            self._windows.append(window)
            return window

    def _close_window(self, window: PeakWindow) -> None:
        with self._lock:
            if window in self._windows:
                self._windows.remove(window)

    def reserve(self, nbytes: int, *, what: str) -> None:
        """Count ``nbytes`` as used, or raise ``DeviceBudgetExceeded`` and count nothing."""
        with self._lock:
            if self.in_use + nbytes > self.budget:
                raise DeviceBudgetExceeded(
                    f"cannot place {what!r} ({format_bytes(nbytes)}, {nbytes} bytes) on the device: "
                    f"the device budget is {format_bytes(self.budget)} ({self.budget_source}) and "
                    f"{format_bytes(self.in_use)} is already in use by zero-offload, leaving "
                    f"{format_bytes(self.budget - self.in_use)}. Raise the budget "
                    f"(AcceleratorConfig(device_budget=...) or ZERO_OFFLOAD_DEVICE_BUDGET), or "
                    f"offload more (smaller buckets, higher offload_fraction)."
                )
            self.in_use += nbytes
            self.peak = max(self.peak, self.in_use)
            for window in self._windows:
                window._peak = max(window._peak, self.in_use)

    def release(self, nbytes: int) -> None:
        """Return ``nbytes`` to the budget."""
        with self._lock:
            if nbytes > self.in_use:
                raise RuntimeError(
                    f"device ledger released {nbytes} bytes with only {self.in_use} in use (bug)"
                )
            self.in_use -= nbytes

    def restore_peak(self, peak: int) -> None:
        """Put ``peak`` back as the peak (never below the current use), after a measurement
        of the library's own that reserved and released a scratch buffer (the profiler's
        link probe); a peak another thread reached meanwhile is not kept."""
        with self._lock:
            self.peak = max(peak, self.in_use)

    def reset_peak(self) -> None:
        """Start peak tracking afresh from the current use."""
        with self._lock:
            self.peak = self.in_use

    def stats(self) -> dict[str, int]:
        """Snapshot of ``budget``, ``in_use`` and ``peak``, in bytes."""
        with self._lock:
            return {"budget": self.budget, "in_use": self.in_use, "peak": self.peak}
