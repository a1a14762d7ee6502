"""What the gradient path to the host knows of a bucket's windows summed on the device.

``HostGradients`` (``to_host.py``) owns one ``DeviceWindow``: the device accumulator, asked
of the budget once (``DeviceAccumulators.take``); whether the current window adds up there;
the flushes it expects (the previous window's: the early landing's prediction); the host
worker's event after the last step that read the host accumulator (a landing overwrites it
only after that); and the landed window's per-parameter norms, left on the device. The
rules are Note [micro-batches add up on the device] in ``device_acc.py``; the host path
decides when to flush and land, this keeps the window's facts.
"""

from __future__ import annotations

import torch

from ...accelerator import Event
from ...memory.block import Block
from ...memory.host_worker import HostWorker
from ...partition import BucketLayout
from .device_acc import DeviceAccumulators, DeviceSum
from .landing import Landing

__all__ = ["DeviceWindow"]


class DeviceWindow:
    """One bucket's device-summed windows; see the module docstring.

    Fields:
        sum: the bucket's fp32 device accumulator once taken (None before, and for good
            when the budget had no room).
        active: whether the current window adds up on the device.
        expected: the flushes the current window is predicted to have (the previous
            window's).
        acc_free: the host worker's event after the last step that read the host
            accumulator (None before any).
        landing: the last landing into the host accumulator (None before any). A delayed
            update queued before the next backward follows its tiles on the host worker,
            although that backward's flushes say the accumulator no longer holds only the
            landing (``HostGradients._acc_landed``): the next write into the accumulator is
            a host pass queued behind the update, or a landing after it (``acc_free``).
        norms: the landed window's per-parameter norms, on the device, or a lone flush's
            taken at the flush for the delayed update (``HostGradients``: Note [a lone
            window's statistics are taken on the device] in ``lone_stats.py``); None: the
            window's statistics come from host passes.
        norms_ready: the event after which ``norms`` hold them when another stream took
            them (the comm stream, several ranks: ``ShardNorms``), which the step's compute
            stream waits for before it reads them (``order_norms_read``); None when the
            compute stream took them.
    """

    def __init__(
        self,
        layout: BucketLayout,
        accumulators: DeviceAccumulators,
        *,
        itemsize: int,
        shard: tuple[int, int],
        tile_elements: int,
    ) -> None:
        self.layout = layout
        self._accumulators = accumulators
        self._itemsize = itemsize
        self._shard = shard
        self._tile_elements = tile_elements
        self._asked = False
        self.sum: DeviceSum | None = None
        self.active = False
        self.expected = 0
        self.acc_free: Event | None = None
        self.landing: Landing | None = None
        self.norms: torch.Tensor | None = None
        self.norms_ready: Event | None = None

    def begin(self, *, accumulates: bool, previous_flushes: int) -> bool:
        """A new window: whether it adds up on the device (it is expected to accumulate,
        and the bucket has, or now gets, an accumulator)."""
        self.expected = previous_flushes
        if accumulates and not self._asked:
            self._asked = True
            self.sum = self._accumulators.take(self.layout, itemsize=self._itemsize)
        self.active = accumulates and self.sum is not None
        return self.active

    @property
    def unlanded(self) -> bool:
        """Whether a flush added into the device sum since it last landed."""
        return self.sum is not None and self.sum.unlanded

    def _taken(self) -> DeviceSum:
        if self.sum is None:
            raise RuntimeError(f"bucket {self.layout.index}: no device accumulator (bug)")
        return self.sum

    def add(self, src: torch.Tensor, *, overwrite: bool, after: Event | None) -> None:
        """``DeviceSum.add``; the norms of the sum before it are stale."""
        self._taken().add(src, overwrite=overwrite, after=after)
        self.keep_norms(None)  # of a sum that grew: taken again when it lands

    def land(self, acc: torch.Tensor, acc_block: Block, *, readers: list[Event]) -> Landing:
        """Queue the sum's landing into ``acc`` (after ``readers``), and take its norms on
        the device: the window's statistics, no host pass."""
        device_sum = self._taken()
        landing = device_sum.land(
            acc, acc_block, readers=readers, tile_elements=self._tile_elements
        )
        self.keep_norms(device_sum.norms(self._shard))
        self.landing = landing
        return landing

    def keep_norms(self, norms: torch.Tensor | None, ready: Event | None = None) -> None:
        """The window's norms on the device (None: its statistics are the host passes'),
        with the event after which they hold them when another stream took them."""
        self.norms = norms
        self.norms_ready = ready if norms is not None else None

    def consumed(self, worker: HostWorker, *, host_acc: bool) -> None:
        """The window is over: the next landing waits for what the worker queued so far.
        ``host_acc``: the bucket has a host accumulator, which a step queued now may read
        although the bucket has no device sum yet (its first window that accumulated was
        summed on the host; with ``overlap_step`` that update still runs when the next
        window lands)."""
        if self.sum is not None or host_acc:
            self.acc_free = worker.record_event()

    def discard(self) -> None:
        """``zero_grad``: the sum is forgotten, not landed."""
        if self.sum is not None:
            self.sum.unlanded = False

    def close(self) -> None:
        if self.sum is not None:
            self.sum.close()
            self.sum = None
