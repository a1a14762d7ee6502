"""Per-step figures for a framework's own logs: what offload costs, without a profiler.

Note [offload metrics in the framework's logs]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A Trainer, accelerate or Lightning run logs loss and learning rate; with offload a user
also needs to see the host memory it holds, how long compute stood still waiting for
copies, how long CPU Adam took, and the NVMe throughput when the state is on disk.
``StepMetrics`` gathers them cheaply and always: a phase listener adds up the ``cpu_adam``
spans of its optimizer (``tracing.phase``, owned by the optimizer's manager), a copy listener on the optimizer's manager adds up NVMe bytes,
and the manager's ``exposed_seconds`` already counts the stalls. ``collect(steps)`` returns
the averages per step since the last call, under ``offload/`` keys, which the integrations
merge into the framework's log record (``OffloadTrainer.log``, ``OffloadAccelerator.log``,
``OffloadLightningModule``). Nothing here syncs the device or blocks.
"""

from __future__ import annotations

import threading
import time
import weakref
from typing import Any

from ..memory.manager import TieredMemoryManager
from ..memory.traffic import CopyRecord, Direction, Record
from ..tracing import add_phase_listener

__all__ = ["StepMetrics"]


class StepMetrics:
    """Listens to one optimizer (anything with ``.manager`` and ``.placement``) until
    ``close()``; see Note [offload metrics in the framework's logs]."""

    def __init__(self, optimizer: Any) -> None:
        manager = optimizer.manager
        if not isinstance(manager, TieredMemoryManager):
            raise TypeError(
                f"StepMetrics takes an OffloadAdamW (with a .manager), got "
                f"{type(optimizer).__name__}"
            )
        # Weakly: the phase listener list is global, and must not keep a dropped optimizer
        # (its pinned state, pools and threads) alive; the listeners go with the optimizer.
        self._optimizer = weakref.ref(optimizer)
        self._lock = threading.Lock()  # guards the running sums, written by stream workers
        self._cpu_adam = 0.0  # seconds in cpu_adam phases since the last collect
        self._nvme_bytes = 0  # bytes read from or written to the NVMe tier since then
        self._exposed_mark = self._exposed_total(manager)
        self._time_mark = time.perf_counter()
        me = weakref.WeakMethod(self._on_phase)
        # This optimizer's CPU Adam only (its phases name its manager), not every one's.
        self._remove_phase = add_phase_listener(lambda *span: _call(me, *span), owner=manager)
        # Copy records are needed for the NVMe figure only; subscribing turns on event timing.
        self._remove_copy = _noop
        if optimizer.placement.nvme:
            on_copy = weakref.WeakMethod(self._on_copy)
            self._remove_copy = manager.subscribe(lambda record: _call(on_copy, record))
        self._finalizer = weakref.finalize(optimizer, self.close)

    @staticmethod
    def _exposed_total(manager: TieredMemoryManager) -> float:
        return sum(manager.exposed_seconds.values())

    def _on_phase(self, name: str, track: str, start: float, end: float) -> None:
        if name == "cpu_adam":
            with self._lock:
                self._cpu_adam += end - start

    def _on_copy(self, record: Record) -> None:
        if isinstance(record, CopyRecord) and record.direction in (
            Direction.NVME_READ,
            Direction.NVME_WRITE,
        ):
            with self._lock:
                self._nvme_bytes += record.nbytes

    def collect(self, steps: int = 1) -> dict[str, float]:
        """The figures since the last call, per step over ``steps`` optimizer steps (at
        least 1): host bytes held, exposed transfer ms, CPU Adam ms; NVMe GB/s over the
        wall time when the state has a disk tier."""
        optimizer = self._optimizer()
        if optimizer is None or optimizer.closed:
            return {}
        steps = max(int(steps), 1)
        now = time.perf_counter()
        exposed = self._exposed_total(optimizer.manager)
        with self._lock:
            cpu_adam, self._cpu_adam = self._cpu_adam, 0.0
            nvme, self._nvme_bytes = self._nvme_bytes, 0
        elapsed = max(now - self._time_mark, 1e-9)
        exposed_delta = exposed - self._exposed_mark
        self._time_mark, self._exposed_mark = now, exposed
        placement = optimizer.placement
        metrics = {
            "offload/host_bytes": float(placement.pinned + placement.pageable),
            "offload/exposed_transfer_ms": 1000.0 * exposed_delta / steps,
            "offload/cpu_adam_ms": 1000.0 * cpu_adam / steps,
        }
        if placement.nvme:
            metrics["offload/nvme_gbps"] = nvme / elapsed / 1e9
        return metrics

    def close(self) -> None:
        """Stop listening (idempotent)."""
        self._remove_phase()
        self._remove_copy()
        self._remove_phase = self._remove_copy = _noop


def _noop() -> None:
    return None


def _call(method: weakref.WeakMethod, *args: Any) -> None:
    bound = method()
    if bound is not None:
        bound(*args)
