"""The gradient path to the host: device buffer, D2H tiles, the host worker's passes.

Gradients leave the device a bucket at a time: each backward's gradients add into a device
buffer (``GradBuffers``), a complete bucket is reduce-scattered with several ranks and this
rank's shard is copied into pinned host staging in tiles (D2H on the ``d2h`` stream); the
host worker takes the statistics and, when a window has several flushes, adds them into the
fp32 accumulator. The state stores that live on the host (``state/host.py``,
``state/nvme.py``) read the gradient from here, tile by tile (``await_grad``).

With several ranks, the host fields cover this rank's shard of the bucket, ``shard_numel``
elements (Note [who owns which shard] in ``partition.py``).

Note [no accumulator for one backward]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
With one flush per window (one micro-batch, no early flush) the CPU Adam kernel reads the
training-dtype gradient straight from ``grad_staging``: the kernel computes
``grad.float() * grad_scale``, bit for bit what it computed from an fp32 copy, and the host
worker's only pass over the gradient is its statistics (``grad_stats``) as the staging
lands (with ``overlap_step`` none: Note [a lone window's statistics are taken on the
device] in ``lone_stats.py``). No fp32 accumulator exists. A second flush in the window (a
second micro-batch, or an early flush) first folds staging into an fp32 accumulator, taken
on first need from a lazily created pool (``AccumulatorPool``: pinned once, kept for later
steps), and adds each later flush there, exactly, in fp32. A bucket whose previous window accumulated expects the
next one to as well: its first flush goes straight into the accumulator (an overwriting
pass that also yields the statistics), so a loop that accumulates every step pays no
statistics pass and no fold; a window that then gets one flush after all is stepped from
the accumulator, the same values (``grad.float()``), bitwise. Lazily rather than by a setting: users never declare
accumulation, at the cost of one pinned allocation at the first accumulating step.
``overlap_step`` is no exception: its delayed update still reads window k's gradient while
backward k+1's copies land (Note [delayed parameter update] in ``update/modes.py``), so
the windows take turns between the bucket's two staging buffers rather than go through an
fp32 accumulator (Note [the delayed update reads one buffer, the next backward fills the
other] in ``staging.py``).

Note [an interrupted gradient path]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A ``KeyboardInterrupt`` may leave backward between any two calls of a hook or a flush: a
buffer opened before the lifecycle (``lifecycle.py``) said FILLING, a flush whose copies
are queued before it said IN_FLIGHT, host passes queued without the event that ends them.
So the path, not the lifecycle, knows what it holds: the bucket keeps its device buffer
until the copies out of it are queued, ``discard_grad`` drops whatever buffer is open (none
is fine), and ``open_grad`` drops one an interrupted open left. ``zero_grad`` after a
backward that did not end waits for what that backward queued before it forgets the window
(``BackwardRouter.discard``), so the next window starts clean.

How the tiles land and what follows them: Note [Adam follows the gradient in] in
``landing.py``. The bucket's parts: its device buffer (``open_buffer.py``), its staging
(``staging.py``, ``staging_ring.py``), its host accumulator (``host_acc.py``), its windows
summed on the device (``device_window.py``), its lone flushes (``lone_flush.py``), the host
worker's passes (``host_passes.py``); the route through the device accumulator is
``DeviceRoute`` (``device_route.py``), and what a step reads of them ``WindowReads``
(``window_reads.py``).
"""

from __future__ import annotations

import functools

import torch

from ...accelerator import Event
from ...memory.block import Block
from ...memory.manager import TieredMemoryManager
from ...memory.pool import BlockPool
from ...partition import BucketLayout
from ..ranks import Ranks
from .buffers import AccumulatorPool, GradBuffers, SpareStaging
from .device_acc import DeviceSum
from .device_route import DeviceRoute
from .device_window import DeviceWindow
from .host_acc import HostAccumulator
from .host_passes import HostPasses
from .landing import Landing
from .lone_flush import LoneFlush
from .lone_stats import reduce_scatter_stream
from .open_buffer import OpenBuffer
from .path import GradientPath, GradSource
from .staging import OwnStaging, Staging
from .staging_ring import RingStaging, StagingRing
from .window_reads import WindowReads

__all__ = ["HostGradients"]


class HostGradients(WindowReads, DeviceRoute, GradientPath):
    """Gradients to the host: see the module docstring.

    Fields:
        open: the device buffer this backward's gradients add into, while the bucket is
            FILLING (``open_buffer.py``).
        staging: where the flushes land (``staging_ring.py``): the bucket's own buffers
            (``grad_staging``: (shard_numel,) training dtype, host pool, pinned where
            available, and the spare: Note [two staging buffers for accumulation]), or a
            slot of the segment's ring (Note [gradient staging for the buckets in flight]).
            Adam reads the gradient there when the window had one flush (Note [no
            accumulator for one backward]); with ``delayed_update`` in either own buffer,
            by turns (Note [the delayed update reads one buffer, the next backward fills
            the other]).
        acc: the fp32 accumulator on the host (``host_acc.py``; ``grad_acc``: (shard_numel,)
            fp32, only once a window had a second flush, None before).
        lone: the window's lone flush, kept in staging (``lone_flush.py``): which stream
            took its statistics, which copies bring each buffer's in.
        device: the windows summed on the device (``device_window.py``; its ``sum`` is the
            fp32 accumulator there, once a window accumulated and the budget had room: Note
            [micro-batches add up on the device] in ``device_acc.py``).
    """

    def __init__(
        self,
        layout: BucketLayout,
        *,
        manager: TieredMemoryManager,
        device_pool: BlockPool,
        host_pool: BlockPool,
        grad_buffers: GradBuffers,
        shard: tuple[int, int],
        dtype: torch.dtype,
        tile_elements: int,
        delayed_update: bool = False,
        ring: StagingRing | None = None,
    ) -> None:
        self.layout = layout
        self.manager = manager
        self.open = OpenBuffer(
            layout,
            manager=manager,
            device_pool=device_pool,
            grad_buffers=grad_buffers,
            shard=shard,
            dtype=dtype,
        )
        self.shard = shard
        self.dtype = dtype
        self.tile_elements = tile_elements
        # This bucket's accumulator, pinned on first need (Note [no accumulator for one
        # backward]); one pool per bucket, so a bucket that never accumulates costs nothing.
        self.acc = HostAccumulator(
            manager,
            layout,
            alignment=host_pool.alignment,
            name=f"{host_pool.name}.bucket{layout.index}.grad_acc",
        )
        #: overlap_step: a step's update reads the window's gradient after step() returned,
        #: while the next backward lands (Note [the delayed update reads one buffer, the
        #: next backward fills the other] in staging.py).
        self.delayed_update = delayed_update
        self.staging: Staging = (
            OwnStaging(
                manager, layout, host_pool=host_pool, dtype=dtype, alternate=self.delayed_update
            )
            if ring is None
            else RingStaging(ring, layout, dtype=dtype)
        )
        #: Every window accumulates, even a lone flush: the accumulator's path forced, for
        #: the tests that hold the staging path to it bitwise (tests/test_step_bytes.py).
        self.always_accumulate = False
        # Flushes in the current window (until a new window's first flush is done, the one
        # before): a window's first flush goes to the accumulator when the one before
        # accumulated (Note above).
        self._window_flushes = 0
        # Which field holds the window's gradient. Set on the caller's thread at each
        # flush; a step captures it in its plan.
        self._source = GradSource.STAGING
        self.passes = HostPasses(manager, layout, shard)  # the host worker's passes
        self._staging_consumed: Event | None = None  # the host worker's last pass, any buffer
        # (end offset in staging, copy end event) of each tile of the last flush, in order:
        # Note [Adam follows the gradient in] (landing.py).
        self._landing = Landing()
        # The landings of the lone flushes the staging buffers hold, by buffer (a delayed
        # update follows its own window's, not the next window's), and their norms.
        self.lone = LoneFlush(manager, layout, shard, delayed_update=delayed_update)
        # Note [micro-batches add up on the device] (device_acc.py): the window's facts
        # (device_window.py), and whether grad_acc holds what landed from the device sum
        # (CPU Adam then follows _landing into grad_acc).
        self.device = DeviceWindow(
            layout,
            grad_buffers.accumulators,
            itemsize=dtype.itemsize,
            shard=shard,
            tile_elements=tile_elements,
        )
        self._acc_landed = False

    @property
    def grad_acc(self) -> torch.Tensor | None:
        """(shard_numel,) fp32: the host accumulator (``HostAccumulator.tensor``)."""
        return self.acc.tensor

    @property
    def accumulators(self) -> AccumulatorPool:
        """The accumulator's pool (``HostAccumulator.memory``)."""
        return self.acc.memory

    @property
    def device_sum(self) -> DeviceSum | None:
        """The bucket's fp32 accumulator on the device, once taken (``DeviceWindow.sum``)."""
        return self.device.sum

    @property
    def staging_waits(self) -> int:
        """Flushes that waited for their staging buffer's last reader (the ring's: shared)."""
        return self.staging.waits

    @property
    def grad_staging(self) -> torch.Tensor:
        """The staging buffer holding the window's gradient when it had one flush."""
        return self.staging.get(self.staging.kept())[0]

    # -- gradients ---------------------------------------------------------------------

    # Note [a lone gradient is its own buffer] and Note [a gradient buffer is written once
    # per slot]: in open_buffer.py.

    def can_adopt(self, grad: torch.Tensor) -> bool:
        """Whether ``grad`` can serve as this bucket's device buffer as it is."""
        return self.open.can_adopt(grad)

    def adopt_grad(self, grad: torch.Tensor, *, new_window: bool) -> None:
        """Take ``grad`` (the only parameter's gradient) as the open buffer."""
        if not new_window and self._source is GradSource.STAGING:
            self.acc.ensure()
            self._fold()
        self.open.adopt(grad)

    def open_grad(self, *, new_window: bool, grow: bool = False) -> None:
        if self.open.is_open:
            # An open interrupted before the lifecycle recorded it (Note [an interrupted
            # gradient path]): that buffer holds nothing of this backward.
            self.open.drop()
        folds = not new_window and self._source is GradSource.STAGING
        if folds:
            self.acc.ensure()  # first: a failure leaves nothing allocated
        self.open.open(grow=grow)
        if folds:
            self._fold()

    def _fold(self) -> None:
        """The window's gradient moves from staging into the fp32 accumulator (queued on
        the host worker after the flush that filled staging); the next copy into staging
        waits for it (Note [staging is reused only once consumed])."""
        acc = self.acc.ensure()
        real = self.layout.real_in(*self.shard)
        worker = self.manager.host_worker
        if self.device.norms is not None:  # no pass followed its copies (Note [a lone ...])
            self.lone.order_fold(worker, self.staging.kept())
        staging = functools.partial(self._staging_tensor, self.staging.kept())
        worker.submit(functools.partial(self.passes.fold, acc, staging, real))
        self._acc_landed = False
        self.device.keep_norms(None)
        self._staging_consumed = worker.record_event()
        self.staging.read_by(self._staging_consumed)
        self._source = GradSource.ACCUMULATOR

    def add_grad(self, slot_index: int, grad: torch.Tensor) -> None:
        self.open.add(slot_index, grad)

    @property
    def staging_block(self) -> Block:
        """The block of the buffer holding the window's lone flush."""
        return self.staging.get(self.staging.kept())[1]

    @property
    def spare_staging(self) -> SpareStaging | None:
        """The second own staging buffer (None with a ring)."""
        return self.staging.spare

    def flush(self, *, overwrite: bool, ranks: Ranks) -> None:
        manager = self.manager
        if overwrite:  # a new window: the last one's staging, if still held, is free
            self.window_consumed()
            self.device.begin(
                accumulates=self._first_flush_accumulates(), previous_flushes=self._window_flushes
            )
        if self.device.active:
            self._flush_to_device(overwrite=overwrite, ranks=ranks)
            return
        # Waits until the buffer may be overwritten (given back if this flush fails): Note
        # [staging is reused only once consumed], Note [gradient staging for the buckets in flight].
        with self.staging.acquired(overwrite, self._window_flushes) as buffer:
            index = self.layout.index
            if self.open.adopted is not None:
                self._flush_adopted(overwrite=overwrite, buffer=buffer)
                return
            self.open.zero_unfilled()
            grad = self.open.tensor
            ready = ranks.reduce_scatter(
                grad,
                manager.compute_ready(),
                what=f"bucket {index} ({self.layout.padded_numel} el)",
            )
            start, stop = self.shard
            if not self._lone(overwrite):
                self.acc.ensure()  # before anything moves: a failure changes nothing
            block = self.open.flushable_block()  # Note [an interrupted gradient path]
            norms = self.lone.norms(
                grad[start:stop],
                lone=self._lone(overwrite),
                scattered_on=reduce_scatter_stream(ranks),
                block=block,
            )
            # The bucket keeps its buffer until the copies are queued: if they fail or are
            # interrupted, zero_grad releases it (Note [an interrupted gradient path]).
            staging, staging_block = self.staging.get(buffer)
            landing = self._copy_to_staging(
                grad[start:stop], staging, after=[ready], blocks=[block, staging_block]
            )
            self.open.release().free()  # reuse waits on the copies, Note [block reuse waits...]
            self._after_copy(landing, overwrite=overwrite, buffer=buffer, norms=norms)

    def _flush_adopted(self, *, overwrite: bool, buffer: int) -> None:
        """Note [a lone gradient is its own buffer]: copy it to staging, drop it."""
        if not self._lone(overwrite):
            self.acc.ensure()  # before anything moves: a failure changes nothing
        grad = self.open.adopted
        norms = self.lone.norms(grad, lone=self._lone(overwrite))  # one rank's, whole
        staging, staging_block = self.staging.get(buffer)
        # Still the bucket's buffer until its copy is queued: zero_grad drops it.
        landing = self._copy_to_staging(
            grad, staging, after=[self.manager.compute_ready()], blocks=[staging_block]
        )
        self.open.adopted = None
        self._after_copy(landing, overwrite=overwrite, buffer=buffer, norms=norms)

    def _first_flush_accumulates(self) -> bool:
        """Whether a window's first flush goes to the accumulator (Note [no accumulator for
        one backward]); asked before the flush is counted, so ``_window_flushes`` is still
        the previous window's."""
        return self.always_accumulate or self._window_flushes > 1

    def _lone(self, overwrite: bool) -> bool:
        """Whether a flush stays in staging, its window's lone one so far (its statistics:
        ``LoneFlush.norms``); asked before it is counted, as ``_first_flush_accumulates``."""
        return overwrite and not self._first_flush_accumulates()

    def _copy_to_staging(
        self, src: torch.Tensor, dst: torch.Tensor, *, after: list[Event], blocks: list[Block]
    ) -> Landing:
        """Queue ``dst[:n] = src`` (a staging buffer, or the accumulator) in tiles; Note
        [Adam follows the gradient in] in ``landing.py``."""
        return Landing.queue(
            self.manager,
            src,
            dst,
            tile_elements=self.tile_elements,
            label=f"bucket{self.layout.index}",
            after=after,
            blocks=blocks,
        )

    def _after_copy(
        self,
        landing: Landing,
        *,
        overwrite: bool,
        buffer: int,
        norms: tuple[torch.Tensor, Event | None] | None,
    ) -> None:
        """Queue the host worker's pass over each tile of ``buffer`` (none with ``norms``,
        taken on the device with the event after which they are there)."""
        self._acc_landed = False
        self.device.keep_norms(*(norms or (None,)))
        if self._lone(overwrite):
            self._source = GradSource.STAGING
            acc = None
        else:
            self._source = GradSource.ACCUMULATOR
            acc = self.acc.ensure()
        self._landing = landing
        if acc is None:
            self.lone.stage(buffer, landing)
        # Counted once the flush is queued: a flush that failed before it is not counted.
        self._window_flushes = 1 if overwrite else self._window_flushes + 1
        if norms is not None:  # nothing queued behind the update: Note [a lone window's...]
            return
        staging = functools.partial(self._staging_tensor, buffer)
        self._staging_consumed = self.passes.follow(landing, staging, acc, overwrite=overwrite)
        self.staging.passed(buffer, self._staging_consumed, kept=acc is None)

    def discard_grad(self) -> None:
        """Forget the window: the open device buffer, and its staging once what the host
        worker queued is done (Note [gradient staging for the buckets in flight])."""
        self.open.drop()
        self.device.discard()
        self.window_consumed()

    def update_queued(self, event: Event) -> None:
        """The bucket's update (run during backward) is queued on the host worker and
        ends at ``event``: the last reader of a gradient in staging."""
        if self._source is GradSource.STAGING:
            self.staging.stepped(event)

    def window_consumed(self) -> None:
        """The window is over: staging may be reused after the host worker's queue, and the
        accumulator landed into again (Note [micro-batches add up on the device])."""
        if self.staging.holding:
            self.staging.release(self.manager.host_worker.record_event())
        elif self._source is GradSource.STAGING:
            # The update step() just queued reads the window's buffer on the host worker.
            self.lone.record_reader(self.staging, self.manager.host_worker)
        if self.device.sum is not None:
            self.staging.drop_spare()  # Note [the spare goes when the device sums]
        self.device.consumed(self.manager.host_worker, host_acc=self.grad_acc is not None)

    def close(self) -> None:
        self.open.adopted = None
        self.device.close()
        self.lone.close()
        if self.open.block is not None:
            self.open.block.free()
            self.open.block = None
        self.acc.close()
        self.staging.close()
