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
``landing.py``.
"""

from __future__ import annotations

import functools

import torch

from ...accelerator import Event, Stream
from ...accelerator.host_syncs import synchronize_completed, wait_input
from ...memory.block import Block
from ...memory.manager import TieredMemoryManager
from ...memory.pool import BlockPool
from ...partition import BucketLayout
from ...tracing import phase
from ..access import declare_cpu
from ..ranks import Ranks
from .buffers import AccumulatorPool, GradBuffers, SpareStaging, accumulator_bytes
from .device_acc import DeviceSum
from .device_window import DeviceWindow
from .host_passes import HostPasses
from .landing import Landing
from .lone_stats import (
    ShardNorms,
    order_norms_read,
    piece_norms,
    reduce_scatter_stream,
)
from .open_buffer import OpenBuffer
from .path import GradientPath, GradSource, SumSqParts
from .staging import OwnStaging, Staging
from .staging_ring import RingStaging, StagingRing

__all__ = ["HostGradients"]


class HostGradients(GradientPath):
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
        grad_acc: (shard_numel,) fp32, from ``accumulators``, only once a window had a
            second flush (None before).
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
        self.accumulators = AccumulatorPool(
            manager,
            accumulator_bytes(layout, alignment=host_pool.alignment),
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
        self.grad_acc: torch.Tensor | None = None
        self._acc_block: Block | None = None  # under grad_acc
        # Which field holds the window's gradient. Set on the caller's thread at each
        # flush; a step captures it in its plan.
        self._source = GradSource.STAGING
        self.passes = HostPasses(manager, layout, shard)  # the host worker's passes
        self._staging_consumed: Event | None = None  # the host worker's last pass, any buffer
        # (end offset in staging, copy end event) of each tile of the last flush, in order:
        # Note [Adam follows the gradient in] (landing.py).
        self._landing = Landing()
        # The landing of the lone flush each staging buffer holds, by buffer: a delayed
        # update follows its own window's, not the next window's (Note [the delayed update
        # reads one buffer, the next backward fills the other]).
        self._staged: dict[int, Landing] = {}
        # delayed_update: a lone flush stayed in staging and the end of its window has not
        # yet recorded the update that reads it (window_consumed).
        self._reader_unrecorded = False
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
        # A lone flush's norms with several ranks, on the comm stream (Note [a lone window's
        # statistics are taken on the device] in lone_stats.py).
        self._shard_norms = ShardNorms(manager, layout, shard)

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
            self._ensure_accumulator()
            self._fold()
        self.open.adopt(grad)

    def open_grad(self, *, new_window: bool, grow: bool = False) -> None:
        if self.open.is_open:
            # An open interrupted before the lifecycle recorded it (Note [an interrupted
            # gradient path]): that buffer holds nothing of this backward.
            self.open.drop()
        folds = not new_window and self._source is GradSource.STAGING
        if folds:
            self._ensure_accumulator()  # first: a failure leaves nothing allocated
        self.open.open(grow=grow)
        if folds:
            self._fold()

    def _ensure_accumulator(self) -> torch.Tensor:
        if self.grad_acc is None:
            n = self.layout.shard_numel
            block = self.accumulators.alloc(4 * n, owner=f"bucket{self.layout.index}.grad_acc")
            self._acc_block = block
            block.on_move(lambda b: setattr(self, "grad_acc", b.view(torch.float32, (n,))))
            self.grad_acc = block.view(torch.float32, (n,))
            self.grad_acc.zero_()  # padding stays zero (Note [padding stays at the end])
        return self.grad_acc

    def _fold(self) -> None:
        """The window's gradient moves from staging into the fp32 accumulator (queued on
        the host worker after the flush that filled staging); the next copy into staging
        waits for it (Note [staging is reused only once consumed])."""
        acc = self._ensure_accumulator()
        real = self.layout.real_in(*self.shard)
        worker = self.manager.host_worker
        if self.device.norms is not None:  # no pass followed its copies (Note [a lone ...])
            worker.wait_event(self._staged[self.staging.kept()].last)
        staging = functools.partial(self._staging_tensor, self.staging.kept())
        worker.submit(functools.partial(self.passes.fold, acc, staging, real))
        self._acc_landed = False
        self.device.keep_norms(None)
        self._staging_consumed = worker.record_event()
        self.staging.read_by(self._staging_consumed)
        self._source = GradSource.ACCUMULATOR

    def add_grad(self, slot_index: int, grad: torch.Tensor) -> None:
        self.open.add(slot_index, grad)

    def _declare_cpu(self, tensor: torch.Tensor, *, write: bool, what: str) -> None:
        declare_cpu(self.manager, tensor, bucket=self.layout.index, write=write, what=what)

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
            if not overwrite or self._first_flush_accumulates():
                self._ensure_accumulator()  # before anything moves: a failure changes nothing
            block = self.open.flushable_block()  # Note [an interrupted gradient path]
            norms = self._lone_norms(
                grad[start:stop], overwrite, scattered_on=reduce_scatter_stream(ranks), block=block
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
        if not overwrite or self._first_flush_accumulates():
            self._ensure_accumulator()  # before anything moves: a failure changes nothing
        grad = self.open.adopted
        norms = self._lone_norms(grad, overwrite)  # one rank's, whole
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

    def _lone_norms(
        self,
        src: torch.Tensor,
        overwrite: bool,
        *,
        scattered_on: Stream | None = None,
        block: Block | None = None,
    ) -> tuple[torch.Tensor, Event | None] | None:
        """A lone flush's statistics on the device and the event after which they are
        there: on the compute stream (None: in order), or, where ``src`` was
        reduce-scattered on the stream ``scattered_on``, on that stream behind it (compute
        would wait for it), ``block`` (under ``src``) reused after them. None leaves them to
        the host pass: Note [a lone window's statistics are taken on the device]
        (``lone_stats.py``)."""
        if not self.delayed_update or not overwrite or self._first_flush_accumulates():
            return None
        if scattered_on is None:
            norms = piece_norms(self.manager, self.layout, self.shard, src)
            return None if norms is None else (norms, None)
        if block is None:
            raise RuntimeError(f"bucket {self.layout.index}: a scattered flush's block (bug)")
        return self._shard_norms.take(src, stream=scattered_on, block=block)

    # -- Note [micro-batches add up on the device] (device_acc.py) ------------------------

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
        acc = self._ensure_accumulator()
        acc_block = self._acc_block
        if acc_block is None:
            raise RuntimeError(f"bucket {self.layout.index}: no accumulator block (bug)")
        self._landing = self.device.land(acc, acc_block, readers=self._acc_readers())
        self._acc_landed = True

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
        if overwrite and not self._first_flush_accumulates():
            self._source = GradSource.STAGING
            acc = None
        else:
            self._source = GradSource.ACCUMULATOR
            acc = self._ensure_accumulator()
        self._landing = landing
        if acc is None:
            self._staged[buffer] = landing
            self._reader_unrecorded = self.delayed_update
        # Counted once the flush is queued: a flush that failed before it is not counted.
        self._window_flushes = 1 if overwrite else self._window_flushes + 1
        if norms is not None:  # nothing queued behind the update: Note [a lone window's...]
            return
        staging = functools.partial(self._staging_tensor, buffer)
        self._staging_consumed = self.passes.follow(landing, staging, acc, overwrite=overwrite)
        self.staging.passed(buffer, self._staging_consumed, kept=acc is None)

    def _staging_tensor(self, buffer: int) -> torch.Tensor:
        return self.staging.get(buffer)[0]

    def await_grad(self, grad: torch.Tensor, source: GradSource, lo: int, hi: int) -> None:
        """Wait until ``grad[lo:hi]`` (``source``: the field it is) holds the window's
        gradient; Note [Adam follows the gradient in]. Instant when the host worker
        drained."""
        event = None
        landing = self._landing_of(source)
        if landing:
            event = landing.covering(hi)
        elif not self.manager.host_worker.is_current():
            # On the host worker (a delayed or announced update) the update is queued behind
            # the passes over its window, and a later window's event may already be queued
            # behind the update: waiting for it would never end.
            event = self._staging_consumed  # the host worker's last pass over the window
        if event is not None:
            # Synchronisation point: CPU Adam reads this tile next. Always synchronize (a
            # query that says done orders nothing for the race checker); a wait that blocks
            # is timed as waiting for gradients, not as CPU Adam.
            if event.query():
                synchronize_completed(event)
            else:
                with phase("wait_grads", track="cpu_optimizer"):
                    wait_input(event)
        self._declare_cpu(grad[lo:hi], write=False, what="CPU Adam reads the gradient")

    def landed_through(self, source: GradSource, lo: int, limit: int) -> int:
        landing = self._landing_of(source)
        if landing:
            return landing.landed_through(lo, limit)
        if self.manager.host_worker.is_current():
            return limit  # queued behind every pass over the window (see await_grad)
        done = self._staging_consumed
        return limit if done is None or done.query() else lo

    def _landing_of(self, source: GradSource) -> Landing | None:
        """The tile copies that bring ``source``'s gradient in (None: the host worker's
        passes, or nothing, bring it)."""
        if source is GradSource.STAGING or source is GradSource.SPARE:
            return self._staged.get(self.staging.buffer(source))
        if self._acc_landed:
            return self._landing
        # a delayed update follows the last landing while the next backward flushes
        return self.device.landing if self.manager.host_worker.is_current() else None

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
        elif self._reader_unrecorded and self._source is GradSource.STAGING:
            # The update step() just queued reads the window's buffer on the host worker:
            # no flush lands there before it is done (Note [the delayed update reads one
            # buffer, the next backward fills the other]); first, so drop_spare sees it.
            # Once per window: this also runs at zero_grad and at the next window's first
            # flush, whose later events would make a flush wait for that window's passes.
            self.staging.read_by(self.manager.host_worker.record_event())
            self._reader_unrecorded = False
        if self.device.sum is not None:
            self.staging.drop_spare()  # Note [the spare goes when the device sums]
        self.device.consumed(self.manager.host_worker, host_acc=self.grad_acc is not None)

    def window_source(self) -> GradSource:
        if self.device.unlanded:
            return GradSource.DEVICE
        staged = self._source is GradSource.STAGING
        self.staging.check_kept(self.layout.index, staged=staged)
        return self.staging.kept_source() if staged else self._source

    def gradient(self, source: GradSource) -> torch.Tensor:
        if source is GradSource.DEVICE:
            raise RuntimeError(f"bucket {self.layout.index}: its gradient has not landed (bug)")
        if source is GradSource.STAGING or source is GradSource.SPARE:
            grad = self._staging_tensor(self.staging.buffer(source))
        else:
            grad = self.grad_acc
        if grad is None:
            raise RuntimeError(f"bucket {self.layout.index}: no accumulator to read (bug)")
        return grad

    def stats_on_host(self) -> bool:
        return self.device.norms is None  # landed from the device, or a lone flush: taken there

    def grad_sumsq(self) -> SumSqParts:
        norms = self.device.norms
        if norms is not None:
            # The step reads them next, on the compute stream (Note [a lone window's ...]).
            order_norms_read(self.manager, self.layout, norms, self.device.norms_ready)
            return SumSqParts([], False, norms)
        return self.passes.sumsq()

    def close(self) -> None:
        self.open.adopted = None
        self.device.close()
        self._shard_norms.close()
        if self.open.block is not None:
            self.open.block.free()
            self.open.block = None
        if self._acc_block is not None:
            self._acc_block.free()
        self._acc_block = None
        self.accumulators.close()
        self.staging.close()
