"""The host path's route through the device accumulator (``DeviceRoute``, mixed into
``HostGradients`` in ``to_host.py``): a window that accumulates on the device adds each
flush into its ``DeviceSum`` instead of copying it to staging, and the sum lands in the host
accumulator once, during backward at the window's predicted last flush if the accumulator is
free, else at the step (Note [micro-batches add up on the device] in ``device_acc.py``).
``DeviceWindow`` (``device_window.py``) keeps the window's facts; this decides when to add
and when to land.
"""

from __future__ import annotations

from ...accelerator import Event
from ...memory.manager import TieredMemoryManager
from ...partition import BucketLayout
from ..ranks import Ranks
from .device_window import DeviceWindow
from .host_acc import HostAccumulator
from .landing import Landing
from .open_buffer import OpenBuffer
from .path import GradSource

__all__ = ["DeviceRoute"]


class DeviceRoute:
    """``HostGradients``' flushes into the device accumulator and its landing. Uses its
    fields (``HostGradients``' docstring and ``__init__`` say what each holds)."""

    layout: BucketLayout
    manager: TieredMemoryManager
    shard: tuple[int, int]
    open: OpenBuffer
    acc: HostAccumulator
    device: DeviceWindow
    _source: GradSource
    _window_flushes: int
    _landing: Landing
    _acc_landed: bool
    _staging_consumed: Event | None

    def _flush_to_device(self, *, overwrite: bool, ranks: Ranks) -> None:
        """Add this backward's device gradients into the device accumulator; land the sum
        when this is the window's predicted last flush and the host accumulator is free."""
        after = None
        if self.open.adopted is not None:
            src = self.open.adopted
        else:
            self.open.flushable_block()  # Note [an interrupted gradient path]
            self.open.zero_unfilled()
            compute = self.manager.compute_ready()
            ready = ranks.reduce_scatter(
                self.open.tensor,
                compute,
                what=f"bucket {self.layout.index} ({self.layout.padded_numel} el)",
            )
            after = ready if ready is not compute else None
            start, stop = self.shard
            src = self.open.tensor[start:stop]
        self.device.add(src, overwrite=overwrite, after=after)
        self.open.drop()  # reuse is stream-ordered after the add
        self._source = GradSource.ACCUMULATOR
        # _acc_landed and _landing stay: grad_acc still holds the last landing, which a
        # delayed update queued before this backward may be reading, following its tiles.
        self._window_flushes = 1 if overwrite else self._window_flushes + 1
        if self._window_flushes == self.device.expected and self._acc_is_free():
            self.land()  # the predicted last micro-batch: land during this backward

    def _acc_readers(self) -> list[Event]:
        """The host worker's events after the last readers of ``grad_acc``: a step's
        update, the statistics of the last landing."""
        return [e for e in (self.device.acc_free, self._staging_consumed) if e is not None]

    def _acc_is_free(self) -> bool:
        return all(event.query() for event in self._acc_readers())

    def land(self) -> None:
        """Bring a window summed on the device to the host accumulator, in tiles CPU Adam
        follows (its statistics were taken on the device); nothing to do when it landed
        already or the window is on the host (Note [micro-batches add up on the device])."""
        if not self.device.unlanded:
            return
        acc = self.acc.ensure()
        acc_block = self.acc.block
        if acc_block is None:
            raise RuntimeError(f"bucket {self.layout.index}: no accumulator block (bug)")
        self._landing = self.device.land(acc, acc_block, readers=self._acc_readers())
        self._acc_landed = True
