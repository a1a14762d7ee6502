"""Offloaded bucket state: fp32 master, moments and accumulator in host memory, CPU Adam.

Gradients leave the device a bucket at a time (D2H on the ``d2h`` stream, after a
reduce-scatter with several ranks), the host worker adds them into the fp32 accumulator,
the CPU Adam kernel updates the master tile by tile, and each updated tile goes back to
the device (H2D on the ``h2d`` stream) while the next tile is computed.

With several ranks, every host field covers this rank's shard of the bucket,
``shard_numel`` elements (Note [who owns which shard] in ``partition.py``); after the
update each rank copies its updated shard into its slice of ``weights_dev`` and the
optimizer all-gathers the bucket.

Note [no accumulator for one backward]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
With one flush per window (one micro-batch, no early flush) the CPU Adam kernel reads the
training-dtype gradient straight from ``grad_staging``: the kernel computes
``grad.float() * grad_scale``, bit for bit what it computed from an fp32 copy, and the host
worker's only pass over the gradient is its statistics (``grad_stats``) as the staging
lands. No fp32 accumulator exists. A second flush in the window (a second micro-batch, or
an early flush) first folds staging into an fp32 accumulator, taken on first need from a
lazily created pool (``AccumulatorPool``: pinned once, kept for later steps), and adds each
later flush there, exactly, in fp32. A bucket whose previous window accumulated expects the
next one to as well: its first flush goes straight into the accumulator (an overwriting
pass that also yields the statistics), so a loop that accumulates every step pays no
statistics pass and no fold; a window that then gets one flush after all is stepped from
the accumulator, the same values (``grad.float()``), bitwise. Lazily rather than by a setting: users never declare
accumulation, at the cost of one pinned allocation at the first accumulating step.
``overlap_step`` always accumulates: its delayed update still reads the gradients while
the next backward's copies land, so they cannot stay in staging (Note [delayed parameter
update] in ``stepping.py``).

Note [staging is reused only once consumed]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Each bucket has one host staging buffer for gradients. A flush's copy into it must not
start before the host worker has added the previous flush of the same bucket into the
accumulator, or that gradient would be overwritten unread (a lagging worker, an early flush,
or micro-batches while ``overlap_step``'s update occupies the worker). Each flush records
an event on the host worker after its accumulation, and the next flush of that bucket
waits for it.

Note [Adam follows the gradient in]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A flush copies its gradient into staging in tiles of ``tile_elements``, one copy and one
end event each (``_landing``), and the host worker's pass (statistics, or accumulation
with statistics) follows tile by tile as each lands, so it ends one tile after the copy
does. When the step's decision needs no statistics (Note [a step that needs no
statistics] in ``offload_adamw.py``), ``step()`` does not wait for the host worker at all:
``update()`` waits for the copy of each tile just before it reads it (``_await_grad``),
so CPU Adam starts on the first tile while the rest is still on the way. Events of one
stream complete in order, so a tile's event covers every tile before it. A gradient in
the accumulator waits for the host worker's last pass over the bucket
(``_staging_consumed``), which follows every tile of the window's last flush.
"""

from __future__ import annotations

import bisect
import functools
import math
import warnings

import numba
import numpy as np
import torch

from ...accelerator import Event
from ...config import format_bytes
from ...errors import PoolExhausted
from ...kernels import accumulate_grad, adam_step, grad_stats
from ...memory.block import Block
from ...memory.manager import Tier, TieredMemoryManager
from ...memory.pool import BlockPool
from ...memory.traffic import Category, Direction
from ...partition import BucketLayout, clip_runs
from ...tracing import phase
from ...views.param_views import ParamViews
from ..ranks import Ranks
from ..state.placement import accumulator_bytes
from ..state.store import AdamHyper, BucketPools, UpdateBackend

__all__ = ["AccumulatorPool", "GradBuffers", "OffloadedState"]

# Note [the Adam pass gets the cores]
# The host worker's passes over a gradient (statistics, accumulation, the fold into the
# accumulator) run while something else holds the cores: torch's threads running the
# rest of backward, or CPU Adam, which runs on every core (numba's default, as torch's).
# They are vectorised and mostly memory-bound: alone, one thread does the fp32 statistics
# in 1.16x the time of two, bf16 in 1.6x (benchmarks/bench_grad_passes.py). Beside CPU
# Adam, though, a second team of threads oversubscribes the cores and stalls both teams at
# their barriers. So they run on a quarter of numba's threads, at least one: one on the
# 2-vCPU test machine, where that measured 26.5 ms a step against 29.1 ms with a team of
# two (bench_offload_step's embed model, bf16, one micro-batch, no clipping, median of 15
# interleaved rounds; no change with clipping or 4 micro-batches); on a many-core host a
# few threads keep up with the D2H link (not measured: no GPU host was available).


def host_pass_threads() -> int:
    """Threads for one host-worker pass over a gradient: Note [the Adam pass gets the cores]."""
    return max(1, numba.config.NUMBA_NUM_THREADS // 4)


class GradBuffers:
    """Device gradient buffers for offloaded buckets: the device pool, plus overflow pools
    grown on demand when buckets must wait for their turn (several ranks, Note [ranks in
    lockstep] in ``backward.py``). Overflow pools are kept and reused by later backwards;
    each is counted against the device budget like any pool."""

    def __init__(self, manager: TieredMemoryManager, *, name: str) -> None:
        self.manager = manager
        self.name = name
        self.overflow: list[BlockPool] = []  # each one largest-bucket buffer, device

    def alloc(self, pool: BlockPool, nbytes: int, *, owner: str, grow: bool) -> Block:
        """A block of ``nbytes`` from ``pool``, else from an overflow pool (created when
        ``grow`` and none has room). Raises ``PoolExhausted`` otherwise."""
        # The compute stream fills the buffer first: its reuse waits there, not on the CPU
        # (stream-ordered reuse, Note [block reuse waits on events] in pool.py).
        stream = self.manager.accelerator.current_stream()
        try:
            return pool.alloc(nbytes, owner=owner, stream=stream)
        except PoolExhausted:
            if not grow:
                raise
        for extra in self.overflow:
            try:
                return extra.alloc(nbytes, owner=owner, stream=stream)
            except PoolExhausted:
                continue
        extra = self.manager.create_pool(
            Tier.DEVICE, nbytes, name=f"{self.name}.grad_overflow{len(self.overflow)}"
        )
        if not self.overflow:
            warnings.warn(
                f"zero-offload: a gradient bucket of {format_bytes(nbytes)} had to wait for an "
                "earlier bucket that is not complete on this rank (an unused parameter, or "
                "backward order differing from bucket order); its gradients stay on the "
                "device meanwhile, in an extra device pool (kept for later steps). See "
                "'Ranks in lockstep' in the README.",
                stacklevel=2,
            )
        self.overflow.append(extra)
        return extra.alloc(nbytes, owner=owner, stream=stream)

    def close(self) -> None:
        """Close the overflow pools (their blocks were freed by the buckets)."""
        for extra in self.overflow:
            extra.close()
        self.overflow.clear()


class AccumulatorPool:
    """fp32 gradient accumulator memory, created on first need (Note [no accumulator for
    one backward]); ``capacity`` in bytes."""

    def __init__(self, manager: TieredMemoryManager, capacity: int, *, name: str) -> None:
        self.manager = manager
        self.capacity = capacity
        self.name = name
        self.pool: BlockPool | None = None  # host, pinned where available; None until needed

    def alloc(self, nbytes: int, *, owner: str) -> Block:
        """A block of ``nbytes``; the first call creates the pool (hidden cost: a pinned
        allocation of ``capacity`` bytes)."""
        if self.pool is None:
            self.pool = self.manager.create_pool(Tier.HOST, self.capacity, name=self.name)
        return self.pool.alloc(nbytes, owner=owner)

    def close(self) -> None:
        """Close the pool (its blocks were freed by the buckets)."""
        if self.pool is not None:
            self.pool.close()
            self.pool = None


class OffloadedState(UpdateBackend):
    """State on the host, updated by the CPU kernel; see the module docstring.

    Host fields (all ``(shard_numel,)``, the elements of ``shard``; host pool, pinned where
    available):
        master: fp32 master weights.
        exp_avg, exp_avg_sq (and max_exp_avg_sq with amsgrad): fp32 or bf16 moments.
        grad_staging: training dtype, the D2H copy's destination; Adam reads it directly
            when the window had one flush (Note [no accumulator for one backward]).
        grad_acc: fp32 gradient accumulator, from ``accumulators``, only once a window had
            a second flush (None before).
        weights_staging: training dtype (absent for fp32), the kernel's fused copy-out and
            the H2D copy's source.
    Device field: grad_dev, (padded_numel,) training dtype, while the bucket is FILLING.
    """

    resident = False

    def __init__(
        self,
        layout: BucketLayout,
        views: ParamViews,
        *,
        manager: TieredMemoryManager,
        pools: BucketPools,
        grad_buffers: GradBuffers,
        shard: tuple[int, int],
        moments_dtype: torch.dtype,
        amsgrad: bool,
        tile_elements: int,
    ) -> None:
        self._init_gradient_path(
            layout,
            views,
            manager=manager,
            pools=pools,
            grad_buffers=grad_buffers,
            shard=shard,
            tile_elements=tile_elements,
        )
        fields: list[tuple[str, torch.dtype]] = [
            ("master", torch.float32),
            ("exp_avg", moments_dtype),
            ("exp_avg_sq", moments_dtype),
            ("grad_staging", self.dtype),
        ]
        if amsgrad:
            fields.append(("max_exp_avg_sq", moments_dtype))
        if self.dtype != torch.float32:
            fields.append(("weights_staging", self.dtype))
        try:
            self._alloc_host_fields(fields)
        except BaseException:
            self.close()
            raise
        self.reconcile_master()  # fp32 master from the model's initial weights

    def _init_gradient_path(
        self,
        layout: BucketLayout,
        views: ParamViews,
        *,
        manager: TieredMemoryManager,
        pools: BucketPools,
        grad_buffers: GradBuffers,
        shard: tuple[int, int],
        tile_elements: int,
    ) -> None:
        """The fields of the gradient path and the weight copies, which every host-side
        backend shares (this one, and ``nvme.NvmeState``, whose state is on disk)."""
        self.layout = layout
        self.views = views
        self.manager = manager
        self.pools = pools
        self.grad_buffers = grad_buffers
        self.shard = shard
        self.dtype = views.dtype
        self.tile_elements = tile_elements
        # This bucket's accumulator, pinned on first need (Note [no accumulator for one
        # backward]); one pool per bucket, so a bucket that never accumulates costs nothing.
        self.accumulators = AccumulatorPool(
            manager,
            accumulator_bytes(layout, alignment=pools.host.alignment),
            name=f"{pools.host.name}.bucket{layout.index}.grad_acc",
        )
        self.always_accumulate = False  # overlap_step: see the Note above
        # Flushes in the current window (until a new window's first flush is done, the one
        # before): a window's first flush goes to the accumulator when the one before
        # accumulated (Note above).
        self._window_flushes = 0
        self._blocks: dict[str, Block] = {}  # state and staging blocks by field name
        self.grad_acc: torch.Tensor | None = None
        # Which field holds the window's gradient: "grad_staging" or "grad_acc". Set on the
        # caller's thread at each flush; a step captures it in its plan.
        self._source = "grad_staging"
        self._grad_block: Block | None = None  # under grad_dev while FILLING
        # A lone parameter's own autograd gradient, used as the bucket's device buffer
        # (Note [a lone gradient is its own buffer]); None otherwise.
        self._adopted: torch.Tensor | None = None
        self.grad_dev = torch.empty(0, dtype=self.dtype, device=manager.accelerator.device)
        self._stats = (0.0, False)  # (sum of squares, non-finite) of the window; host worker
        self._issued: list[Event] = []  # end events of weight copies issued, not yet handed
        self._unpublished: list[tuple[int, int]] = []  # updated shard tiles not yet copied
        # End events of the last published weight copies: they read the staging (or the
        # fp32 master) the next update rewrites.
        self._source_readers: list[Event] = []
        self._staging_consumed: Event | None = None  # host worker done with grad_staging
        # (end offset in staging, copy end event) of each tile of the last flush, in order:
        # Note [Adam follows the gradient in].
        self._landing: list[tuple[int, Event]] = []
        self._landing_ends: list[int] = []  # the end offsets of _landing, for bisect
        self.max_exp_avg_sq: torch.Tensor | None = None
        self.weights_staging: torch.Tensor | None = None

    def _alloc_host_fields(self, fields: list[tuple[str, torch.dtype]]) -> None:
        """Each named ``(shard_numel,)`` field from the host pool, zeroed, re-taken after a
        move; the blocks are in ``_blocks`` (freed by ``close``)."""
        n = self.layout.shard_numel
        for name, dtype in fields:
            block = self.pools.host.alloc(
                n * dtype.itemsize, owner=f"bucket{self.layout.index}.{name}"
            )
            self._blocks[name] = block
            block.on_move(
                lambda b, name=name, dtype=dtype: setattr(self, name, b.view(dtype, (n,)))
            )
            tensor = block.view(dtype, (n,))
            tensor.zero_()
            setattr(self, name, tensor)

    # -- gradients ---------------------------------------------------------------------

    # Note [a lone gradient is its own buffer]
    # A bucket of one parameter (a parameter larger than bucket_bytes: an embedding table, a
    # large projection) with one rank needs no device gradient buffer: autograd's gradient
    # tensor is copied to the host directly, saving a device copy (and a zeroing pass) of
    # every element. The tensor stays referenced until its copy is issued; the accelerator
    # keeps the caching allocator from reusing it before the copy is done (record_stream
    # on CUDA, Note in accelerator/cuda.py copy_). A second gradient for it in the same
    # buffer, or several ranks (the reduce-scatter needs the padded buffer), take the
    # ordinary path.

    def can_adopt(self, grad: torch.Tensor) -> bool:
        """Whether ``grad`` can serve as this bucket's device buffer as it is."""
        return (
            len(self.layout.slots) == 1
            and self.shard == (0, self.layout.padded_numel)
            and grad.dtype == self.dtype
            and grad.device == self.grad_dev.device
            and grad.is_contiguous()
            and grad.layout is torch.strided
        )

    def adopt_grad(self, grad: torch.Tensor, *, new_window: bool) -> None:
        """Take ``grad`` (the only parameter's gradient) as the open buffer."""
        if not new_window and self._source == "grad_staging":
            self._ensure_accumulator()
            self._fold()
        self._adopted = grad.reshape(-1)

    def open_grad(self, *, new_window: bool, grow: bool = False) -> None:
        folds = not new_window and self._source == "grad_staging"
        if folds:
            self._ensure_accumulator()  # first: a failure leaves nothing allocated
        nbytes = self.layout.padded_numel * self.dtype.itemsize
        block = self.grad_buffers.alloc(
            self.pools.device, nbytes, owner=f"bucket{self.layout.index}.grad", grow=grow
        )
        block.on_move(self._bind_grad)
        self._grad_block = block
        self._bind_grad(block)
        # Note [a gradient buffer is written once per slot]: only the padding is zeroed now.
        self._declare_compute(self.grad_dev[self.layout.numel :], write=True, what="pad zeroing")
        self.grad_dev[self.layout.numel :].zero_()
        self._filled = np.zeros(len(self.layout.slots), dtype=bool)
        if folds:
            self._fold()

    def _ensure_accumulator(self) -> torch.Tensor:
        if self.grad_acc is None:
            n = self.layout.shard_numel
            block = self.accumulators.alloc(4 * n, owner=f"bucket{self.layout.index}.grad_acc")
            self._blocks["grad_acc"] = block
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
        worker.submit(functools.partial(self._fold_on_host, acc, real))
        self._staging_consumed = worker.record_event()
        self._source = "grad_acc"

    def add_grad(self, slot_index: int, grad: torch.Tensor) -> None:
        # Note [a gradient buffer is written once per slot]
        # A fresh device gradient buffer is not zeroed as a whole: a slot's first gradient
        # is copied in (read 2 + write 2 bytes per element of bf16, instead of a zeroing
        # pass and a read-modify-write add), a second one is added, and at the flush the
        # slots that got none are zeroed, so the buffer is exact everywhere it is read.
        if self._adopted is not None:
            raise RuntimeError(
                f"bucket {self.layout.index}: a second gradient into an adopted one (bug: "
                "Note [a lone gradient is its own buffer])"
            )
        slot = self.layout.slots[slot_index]
        view = self.grad_dev[slot.offset : slot.end]
        self._declare_compute(view, write=True, what=f"backward writes slot {slot_index}")
        if self._filled[slot_index]:
            view.add_(grad)
        else:
            view.copy_(grad)
            self._filled[slot_index] = True

    def _zero_unfilled(self) -> None:
        """Zero the slots no gradient reached (and the alignment gaps between slots)."""
        slots, filled = self.layout.slots, self._filled
        position = 0
        for i, slot in enumerate(slots):
            if filled[i]:
                if slot.offset > position:
                    gap = self.grad_dev[position : slot.offset]
                    self._declare_compute(gap, write=True, what="zeroing unfilled slots")
                    gap.zero_()
                position = slot.end
        if self.layout.numel > position:
            tail = self.grad_dev[position : self.layout.numel]
            self._declare_compute(tail, write=True, what="zeroing unfilled slots")
            tail.zero_()

    def _declare_compute(self, tensor: torch.Tensor, *, write: bool, what: str) -> None:
        """Tell the race checker about compute-stream work on ``tensor`` (Note [declaring
        stream accesses] in accelerator/base.py); nothing without a checker."""
        acc = self.manager.accelerator
        acc.declare_access(
            tensor,
            stream=acc.current_stream(),
            write=write,
            what=f"bucket{self.layout.index} {what}",
        )

    def _declare_cpu(self, tensor: torch.Tensor, *, write: bool, what: str) -> None:
        """The same for work of the calling CPU thread (the caller or the host worker)."""
        self.manager.accelerator.declare_access(
            tensor, stream=None, write=write, what=f"bucket{self.layout.index} {what}"
        )

    def _bind_grad(self, block: Block) -> None:
        self.grad_dev = block.view(self.dtype, (self.layout.padded_numel,))

    def _release_grad(self) -> Block:
        block = self._grad_block
        if block is None:
            raise RuntimeError(f"bucket {self.layout.index}: no device gradient buffer (bug)")
        self._grad_block = None
        self.grad_dev = torch.empty(0, dtype=self.dtype, device=self.grad_dev.device)
        return block

    def flush(self, *, overwrite: bool, ranks: Ranks) -> None:
        manager = self.manager
        grad = self.grad_dev
        staging_block = self._blocks["grad_staging"]
        if self._staging_consumed is not None and not self._staging_consumed.query():
            # Note [staging is reused only once consumed]. Synchronisation point: the caller
            # waits, since a CUDA stream cannot wait on host-thread work; it is rare (the
            # worker is usually far ahead).
            with phase("wait_staging"):
                self._staging_consumed.synchronize()
        index = self.layout.index
        if self._adopted is not None:
            self._flush_adopted(overwrite=overwrite, staging_block=staging_block)
            return
        self._zero_unfilled()
        ready = ranks.reduce_scatter(
            grad,
            manager.compute_ready(),
            what=f"bucket {index} ({self.layout.padded_numel} el)",
        )
        start, stop = self.shard
        if not overwrite or self._first_flush_accumulates():
            self._ensure_accumulator()  # before anything moves: a failure changes nothing
        block = self._release_grad()
        try:
            landing = self._copy_to_staging(
                grad[start:stop], after=[ready], blocks=[block, staging_block]
            )
        except BaseException:
            self._grad_block = block  # the bucket keeps its buffer: zero_grad releases it
            self._bind_grad(block)
            raise
        block.free()  # reuse waits on the copies, Note [block reuse waits on events]
        self._after_copy(landing, overwrite=overwrite)

    def _flush_adopted(self, *, overwrite: bool, staging_block: Block) -> None:
        """Note [a lone gradient is its own buffer]: copy it to staging, drop it."""
        if not overwrite or self._first_flush_accumulates():
            self._ensure_accumulator()  # before anything moves: a failure changes nothing
        grad, self._adopted = self._adopted, None
        try:
            landing = self._copy_to_staging(
                grad, after=[self.manager.compute_ready()], blocks=[staging_block]
            )
        except BaseException:
            self._adopted = grad  # still the bucket's buffer: zero_grad drops it
            raise
        self._after_copy(landing, overwrite=overwrite)

    def _first_flush_accumulates(self) -> bool:
        """Whether a window's first flush goes to the accumulator (Note [no accumulator for
        one backward]); asked before the flush is counted, so ``_window_flushes`` is still
        the previous window's."""
        return self.always_accumulate or self._window_flushes > 1

    def _copy_to_staging(
        self, src: torch.Tensor, *, after: list[Event], blocks: list[Block]
    ) -> list[tuple[int, Event]]:
        """Queue ``grad_staging[:n] = src`` in tiles; Note [Adam follows the gradient in]."""
        landing: list[tuple[int, Event]] = []
        try:
            self._queue_tiles(src, landing, after=after, blocks=blocks)
        except BaseException:
            for block in blocks if landing else ():  # what was queued still uses them
                block.record_event(landing[-1][1])
            raise
        return landing

    def _queue_tiles(
        self,
        src: torch.Tensor,
        landing: list[tuple[int, Event]],
        *,
        after: list[Event],
        blocks: list[Block],
    ) -> None:
        """Queue the tile copies one by one, appending each to ``landing``."""
        n, step, index = src.numel(), self.tile_elements, self.layout.index
        for lo in range(0, n, step):
            hi = min(lo + step, n)
            event = self.manager.copy(
                self.grad_staging[lo:hi],
                src[lo:hi],
                direction=Direction.D2H,
                category=Category.GRADIENTS,
                # The stream is in order: the first copy waits, the last one's end event
                # (recorded on the blocks) is every copy's end.
                after=after if lo == 0 else (),
                blocks=blocks if hi == n else (),
                label=f"bucket{index}" if n <= step else f"bucket{index}[{lo}:{hi}]",
            )
            landing.append((hi, event))

    def _after_copy(self, landing: list[tuple[int, Event]], *, overwrite: bool) -> None:
        """Queue the host worker's pass over each tile of staging as it lands."""
        worker = self.manager.host_worker
        if overwrite and not self._first_flush_accumulates():
            self._source = "grad_staging"
            acc = None
        else:
            self._source = "grad_acc"
            acc = self._ensure_accumulator()
        self._landing = landing
        self._landing_ends = [end for end, _ in landing]
        # Counted once the flush is queued: a flush that failed before it is not counted.
        self._window_flushes = 1 if overwrite else self._window_flushes + 1
        real = self.layout.real_in(*self.shard)
        partials: list[float] = []
        lo = 0
        for hi, event in landing:
            worker.wait_event(event)
            if min(hi, real) > lo:  # a tile of padding only has nothing to add or count
                task = self._host_pass_tile
                worker.submit(functools.partial(task, acc, overwrite, lo, min(hi, real), partials))
            lo = hi
        worker.submit(functools.partial(self._sum_partials, partials))
        self._staging_consumed = worker.record_event()

    def _fold_on_host(self, acc: torch.Tensor, real: int) -> None:
        # Host worker: the window's first gradient, from staging into the accumulator.
        self._declare_cpu(self.grad_staging, write=False, what="fold reads staging")
        self._declare_cpu(acc, write=True, what="fold writes the accumulator")
        accumulate_grad(
            acc, self.grad_staging, overwrite=True, stop=real, num_threads=host_pass_threads()
        )

    def _host_pass_tile(
        self, acc: torch.Tensor | None, overwrite: bool, lo: int, hi: int, partials: list[float]
    ) -> None:
        # Host worker, once staging[lo:hi] landed. Without an accumulator: the window's only
        # pass over a lone flush, its statistics; step() needs no pass of its own (Note [no
        # accumulator for one backward]). With one: Note [a bucket's gradient lifecycle];
        # the same pass yields the statistics of the accumulated gradient.
        staging = self.grad_staging
        if acc is None:
            self._declare_cpu(staging[lo:hi], write=False, what="statistics read staging")
            partials.append(
                grad_stats(staging, start=lo, stop=hi, num_threads=host_pass_threads())[0]
            )
            return
        self._declare_cpu(staging[lo:hi], write=False, what="accumulation reads staging")
        self._declare_cpu(acc[lo:hi], write=True, what="accumulation writes the accumulator")
        partials.append(
            accumulate_grad(
                acc,
                staging,
                overwrite=overwrite,
                start=lo,
                stop=hi,
                num_threads=host_pass_threads(),
            )[0]
        )

    def _sum_partials(self, partials: list[float]) -> None:
        # Host worker, after the last tile: the flush's statistics (float64 sums, in order).
        total = math.fsum(partials) if partials else 0.0
        self._stats = (total, not math.isfinite(total))

    def _await_grad(self, grad: torch.Tensor, source: str, lo: int, hi: int) -> None:
        """Wait until ``grad[lo:hi]`` (``source``: the field it is) holds the window's
        gradient; Note [Adam follows the gradient in]. Instant when the host worker
        drained."""
        event = None
        if source == "grad_staging" and self._landing:
            # The first tile copy ending at or past hi (the last one past the copied part).
            ends = self._landing_ends
            event = self._landing[min(bisect.bisect_left(ends, hi), len(ends) - 1)][1]
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
                event.synchronize()
            else:
                with phase("wait_grads", track="cpu_optimizer"):
                    event.synchronize()
        self._declare_cpu(grad[lo:hi], write=False, what="CPU Adam reads the gradient")

    def discard_grad(self) -> None:
        if self._adopted is not None:
            self._adopted = None  # autograd's tensor: dropping it is all
            return
        self._release_grad().free()

    def window_source(self) -> str:
        return self._source

    def grad_sumsq(self) -> tuple[float, bool]:
        return self._stats

    # -- update ------------------------------------------------------------------------

    def update(
        self,
        hyper: AdamHyper,
        grad_scale: float,
        runs: list[tuple[int, int, int]],
        *,
        publish: bool,
        source: str | None = None,
        after: list[Event] | None = None,
    ) -> None:
        source, grad, after = self._begin_update(source, publish=publish, after=after)
        for name, tensor in self.state_tensors().items():
            self._declare_cpu(tensor, write=True, what=f"CPU Adam writes {name}")
        for start, stop, step in clip_runs(runs, *self.shard):
            for lo in range(start, stop, self.tile_elements):
                hi = min(lo + self.tile_elements, stop)
                self._await_grad(grad, source, lo, hi)
                adam_step(
                    self.master,
                    grad,
                    self.exp_avg,
                    self.exp_avg_sq,
                    step=step,
                    lr=hyper.lr,
                    beta1=hyper.beta1,
                    beta2=hyper.beta2,
                    eps=hyper.eps,
                    weight_decay=hyper.weight_decay,
                    decoupled_weight_decay=hyper.decoupled,
                    maximize=hyper.maximize,
                    grad_scale=grad_scale,
                    max_exp_avg_sq=self.max_exp_avg_sq if hyper.amsgrad else None,
                    out=self.weights_staging,
                    start=lo,
                    stop=hi,
                )
                if publish:
                    event = self._copy_tile(lo, hi, after)
                    if event is not None:  # None: the source is the weights' home
                        self._issued.append(event)
                else:
                    self._unpublished.append((lo, hi))

    def weights_home(self) -> tuple[torch.Tensor, Block]:
        """The pinned training-dtype copy CPU Adam writes, ``(shard_numel,)``, and its block:
        ``weights_staging``, or the fp32 master itself for an fp32 bucket (with parameter
        offload the weights live there between uses, ``zero_offload.params``)."""
        name = "master" if self.weights_staging is None else "weights_staging"
        return getattr(self, name), self._blocks[name]

    def _begin_update(
        self, source: str | None, *, publish: bool, after: list[Event] | None
    ) -> tuple[str, torch.Tensor, list[Event]]:
        """What every update of the host-side backends does first: the field holding the
        gradient to read (``source``, or the window's now) and that gradient, the staging
        free of the last step's weight copies, the accesses declared, and the events the
        new weight copies wait for."""
        source = source or self._source
        grad = getattr(self, source)
        for event in self._source_readers:
            # Synchronisation point (rare: two steps with no backward between, or a device
            # far behind): the last step's weight copies read the staging about to be
            # rewritten. Usually long done.
            event.synchronize()
        self._source_readers = []
        # The gradient's reads are declared tile by tile (``_await_grad``).
        if self.weights_staging is not None:
            self._declare_cpu(self.weights_staging, write=True, what="CPU Adam writes weights")
        # The weight copies overwrite weights_dev: they wait for compute issued so far
        # (a forward or a weight-reading kernel still queued), write-after-read; a step
        # run during backward passes the event recorded when the bucket was complete.
        if after is None:
            if publish:
                self.declare_weight_readers()
            after = [self.manager.compute_ready()] if publish else []
        return source, grad, after

    def _copy_tile(self, lo: int, hi: int, after: list[Event]) -> Event | None:
        source, block = self.weights_home()
        offset = self.shard[0]
        return self.views.copy_in(
            self.manager,
            offset + lo,
            offset + hi,
            source[lo:hi],
            block,
            after=after,
            label=f"bucket{self.layout.index}[{lo}:{hi}]",
        )

    def declare_weight_readers(self) -> None:
        """Kernels queued on compute so far read the weights (what ``after`` orders the
        weight copies behind)."""
        self._declare_compute(
            self.views.weights_dev, write=False, what="kernels queued on compute read weights"
        )

    def publish(self) -> list[Event]:
        after = []
        if self._unpublished:
            self.declare_weight_readers()
            after = [self.manager.compute_ready()]
        copies = [self._copy_tile(lo, hi, after) for lo, hi in self._unpublished]
        events = self._issued + [event for event in copies if event is not None]
        self._issued, self._unpublished = [], []
        self._source_readers = list(events)
        return events

    def drop_unpublished(self) -> None:
        self._unpublished = []

    def publish_all_from_master(self) -> None:
        real = self.layout.real_in(*self.shard)
        if self.weights_staging is not None:
            self.weights_staging[:real].copy_(self.master[:real])  # round to nearest even
        self._unpublished = [
            (lo, min(lo + self.tile_elements, real)) for lo in range(0, real, self.tile_elements)
        ]

    def reconcile_master(self) -> None:
        start, stop = self.shard
        # Synchronisation point (rare: construction, loading, weights written outside the
        # optimizer): the weights' bytes must be final and the staging idle.
        self.manager.synchronize()
        target, target_block = self.weights_home()
        done = self.views.copy_out(
            self.manager,
            start,
            stop,
            target,
            target_block,
            label=f"bucket{self.layout.index} master refresh",
        )
        if done is not None:
            done.synchronize()  # Synchronisation point: the comparison below reads it
        if self.weights_staging is not None:
            weights = self.weights_staging
            # Where the weight is still the rounding of the master, the master keeps its
            # extra bits; elsewhere the weight was written and wins.
            written = weights != self.master.to(self.dtype)
            self.master[written] = weights[written].float()
        self._unpublished = []

    def state_tensors(self) -> dict[str, torch.Tensor]:
        out = {"master": self.master, "exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}
        if self.max_exp_avg_sq is not None:
            out["max_exp_avg_sq"] = self.max_exp_avg_sq
        return out

    def require_accumulator(self) -> None:
        self.always_accumulate = True

    def close(self) -> None:
        self._adopted = None
        if self._grad_block is not None:
            self._grad_block.free()
            self._grad_block = None
        for block in self._blocks.values():
            block.free()
        self._blocks.clear()
        self.accumulators.close()
