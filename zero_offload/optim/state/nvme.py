"""NVMe bucket state: fp32 master and moments in files of the storage tier, streamed tile
by tile under the CPU Adam; gradients and weight staging stay in host RAM.

A bucket whose optimizer state does not fit ``OffloadConfig.host_budget`` gets an
``NvmeState`` (``plan_nvme`` decides which, buckets whole). Its gradient path is
``OffloadedState``'s, unchanged (device buffer, D2H into staging, the host worker's fp32
accumulation and statistics): ``NvmeState`` inherits it and allocates only the gradient
and staging fields; the master and moments live in one ``StorageFile`` per bucket
(``memory/storage.py``), one record per tile.

Note [the step streams the state]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The shard's real elements are cut into tiles of ``tile_elements``; record ``t`` of the
bucket's file holds tile ``t``'s master, exp_avg, exp_avg_sq (and max_exp_avg_sq), each
field at a 4 KiB-aligned offset (``RecordLayout``; a short last tile packs its fields at its
own length). A step visits the tiles that hold updated elements in order, over the tier's
ring of ``B`` I/O buffers (4 by default), taken round robin (``StorageTier.next_buffer``):
at tile ``i`` the read of tile ``i + B - 2`` is issued, the CPU waits for tile ``i``'s read
(issued ``B - 2`` tiles ago), runs the same ``adam_step`` kernel on it that
``OffloadedState`` runs (elementwise, so tile boundaries do not change a bit: bitwise equal
to the in-RAM state), writes the training-dtype weights into ``weights_staging`` and issues
their H2D copy, then issues the write of tile ``i``. A buffer is read into only after the
write it last carried completed (``IOBuffer.settle``): that write was issued two tiles
earlier, so in steady state the CPU does not wait on it and the step is bounded by the disk
(read + write) or by the CPU Adam, whichever is slower.

Across buckets (``StreamGroup``, the segment's NVMe buckets in bucket order, the order every
update mode steps them in): at the end of its update a bucket issues the reads of the next
NVMe bucket's first ``B - 2`` tiles, and only then waits for its own last writes, so the
disk is not idle between buckets; the last bucket waits for its writes first and then reads
the first bucket's first tiles for the next step, during the forward and backward in
between (issued earlier they would slow the step's last writes), so the disk is not idle at
the start of a step either. A read
of a record waits for a pending write of the same record first. A bucket's update returns when its own writes are done:
an I/O error surfaces in the update of the bucket that caused it, never later or elsewhere.
A prefetched read the next update does not use (its first tiles got no gradient; another
stream came first) is dropped. Each updated tile is read once and written once per step;
tiles with no updated element are not touched.

Note [a failed write leaves the others intact]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A read error, a bad checksum or a write error in a bucket's step leaves that bucket's file
partly stepped (tiles before the failure updated, tiles after it not): the file is marked
FAILED and refuses further I/O, and the ``StorageError`` names the bucket, the file and the
way out (reload from the last checkpoint). Other buckets' files were not being written and
are intact; their state can still be saved (``state_stream.save_streaming`` skips nothing,
so it refuses a FAILED file, naming it).

Host bytes per NVMe bucket, with ``k`` the shard's elements and ``s`` the training dtype's
bytes (``a(x)`` = ``x`` rounded up to the pool alignment): gradient staging ``a(s*k)`` and
weight staging ``a(s*k)`` (fp32 weights too: the H2D copies' source, so that the I/O buffer
is free as soon as its write is issued); with one micro-batch per step that is all (Adam
reads the gradient from staging, Note [no accumulator for one backward] in
``offloaded.py``). With several micro-batches (or ``overlap_step``) the fp32 accumulator
``a(4k)`` joins, in its own pool, created at the first accumulating step. Plus, once per
segment of buckets, the tier's I/O buffers: ``B * record_bytes + 4096``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import psutil
import torch

from ...accelerator import Event
from ...config import OffloadConfig, format_bytes
from ...errors import StorageError
from ...kernels import adam_step
from ...memory.align import aligned
from ...memory.manager import TieredMemoryManager
from ...memory.storage import (
    IO_ALIGNMENT,
    IO_BUFFERS,
    IOBuffer,
    IOBufferState,
    StorageFile,
    StorageTier,
)
from ...memory.traffic import Category, Direction
from ...partition import BucketLayout, clip_runs
from ...tracing import phase
from ...views.param_views import ParamViews
from ..grads.to_host import GradBuffers, OffloadedState
from .placement import Placement, _host_bytes
from .store import AdamHyper, BucketPools

__all__ = [
    "AUTO_HOST_HEADROOM_MIN",
    "NvmeBackends",
    "NvmePlan",
    "NvmeState",
    "RecordLayout",
    "StateNotInHostRam",
    "StreamGroup",
    "plan_nvme",
]

#: ``host_budget="auto"`` leaves max(10% of total RAM, this) free, for activations, the data
#: loader, the interpreter and the page cache.
AUTO_HOST_HEADROOM_MIN = 2 << 30
AUTO_HOST_HEADROOM_FRACTION = 0.10


class StateNotInHostRam(RuntimeError):
    """The optimizer state of a bucket lives on NVMe: it cannot be handed out as tensors
    (``state_dict``, ``opt.state[p]``); the message names the streaming calls."""


@dataclass(frozen=True)
class RecordLayout:
    """Where each state field of one tile sits in its record: ``fields`` is ``(name, dtype,
    byte offset)`` for a whole tile; each field starts 4 KiB-aligned. A short tile (the last
    of a shard) packs its fields the same way at its own length (``offsets``), so its record
    is only its own bytes, aligned."""

    tile_elements: int
    fields: tuple[tuple[str, torch.dtype, int], ...]
    record_bytes: int

    @classmethod
    def make(cls, tile_elements: int, moments_dtype: torch.dtype, amsgrad: bool) -> RecordLayout:
        names = [("master", torch.float32), ("exp_avg", moments_dtype)]
        names.append(("exp_avg_sq", moments_dtype))
        if amsgrad:
            names.append(("max_exp_avg_sq", moments_dtype))
        fields, offset = [], 0
        for name, dtype in names:
            fields.append((name, dtype, offset))
            offset += aligned(tile_elements * dtype.itemsize, IO_ALIGNMENT)
        return cls(tile_elements, tuple(fields), offset)

    def offsets(self, count: int) -> list[int]:
        """Byte offset of each field in the record of a tile of ``count`` elements."""
        out, offset = [], 0
        for _, dtype, _ in self.fields:
            out.append(offset)
            offset += aligned(count * dtype.itemsize, IO_ALIGNMENT)
        return out

    def bytes_for(self, count: int) -> int:
        """Bytes of the record of a tile of ``count`` elements (a multiple of 4 KiB)."""
        return sum(aligned(count * dtype.itemsize, IO_ALIGNMENT) for _, dtype, _ in self.fields)

    def views(self, data: torch.Tensor, count: int) -> dict[str, torch.Tensor]:
        """The fields of the record in ``data`` (uint8), each ``(count,)`` long."""
        return {
            name: data[offset : offset + count * dtype.itemsize].view(dtype)
            for (name, dtype, _), offset in zip(self.fields, self.offsets(count), strict=True)
        }


# -- placement -------------------------------------------------------------------------


@dataclass(frozen=True)
class NvmePlan:
    """Which offloaded buckets keep their state on NVMe, and the bytes of each place.

    ``host_pool``: the host pool's capacity (host-resident buckets in full, NVMe buckets'
    gradients and staging); ``host_state``: of that, the master and moments in host RAM
    (what ``host_budget`` bounds); ``disk``: bytes of the files; ``record``: the layout.
    """

    nvme: frozenset[int]
    host_pool: int
    host_state: int
    disk: int
    record: RecordLayout
    host_budget: int | None


def _state_bytes(bucket: BucketLayout, *, moment_size: int, amsgrad: bool, alignment: int) -> int:
    """Master and moments of this rank's shard in the host pool."""
    k = bucket.shard_numel
    return aligned(4 * k, alignment) + (3 if amsgrad else 2) * aligned(moment_size * k, alignment)


def _nvme_host_bytes(bucket: BucketLayout, *, itemsize: int, alignment: int) -> int:
    """An NVMe bucket's bytes in the host pool: gradient staging and weight staging."""
    return 2 * aligned(itemsize * bucket.shard_numel, alignment)


def tile_sizes(bucket: BucketLayout, shard: tuple[int, int], tile_elements: int) -> list[int]:
    """Elements of each tile of a bucket's shard: its real elements in ``tile_elements``
    pieces (one tile at least)."""
    real = bucket.real_in(*shard)
    sizes = [min(tile_elements, real - lo) for lo in range(0, real, tile_elements)]
    return sizes or [1]


def resolve_host_budget(config: OffloadConfig, *, other_host_bytes: int) -> int | None:
    """``config.host_budget`` in bytes for the master and moments; ``"auto"`` is the RAM
    available now less max(10% of total, 2 GiB) and less ``other_host_bytes`` (gradients,
    staging, I/O buffers: they are in host RAM whatever the placement)."""
    budget = config.host_budget
    if budget is None or isinstance(budget, int):
        return budget
    memory = psutil.virtual_memory()
    headroom = max(int(memory.total * AUTO_HOST_HEADROOM_FRACTION), AUTO_HOST_HEADROOM_MIN)
    return max(0, memory.available - headroom - other_host_bytes)


def plan_nvme(
    layouts: Sequence[BucketLayout],
    placement: Placement,
    *,
    config: OffloadConfig,
    itemsize: int | Sequence[int],
    moments_dtype: torch.dtype,
    amsgrad: bool,
    rank: int,
    alignment: int,
) -> NvmePlan:
    """Place offloaded buckets whole: in bucket order, on the host while their master and
    moments fit ``host_budget``; that bucket and every later one on NVMe.

    Without ``nvme_dir`` every offloaded bucket stays on the host (``host_pool`` is then
    ``placement.host_state``, unchanged)."""
    sizes = [itemsize] * len(layouts) if isinstance(itemsize, int) else list(itemsize)
    record = RecordLayout.make(config.tile_elements, moments_dtype, amsgrad)
    offloaded = [
        (b, s) for b, s in zip(layouts, sizes, strict=True) if b.index not in placement.resident
    ]
    m = moments_dtype.itemsize
    if config.nvme_dir is None:
        state = sum(
            _state_bytes(b, moment_size=m, amsgrad=amsgrad, alignment=alignment)
            for b, _ in offloaded
        )
        return NvmePlan(frozenset(), placement.host_state, state, 0, record, None)
    minimum = sum(_nvme_host_bytes(b, itemsize=s, alignment=alignment) for b, s in offloaded)
    budget = resolve_host_budget(
        config, other_host_bytes=minimum + IO_BUFFERS * record.record_bytes + IO_ALIGNMENT
    )
    nvme: set[int] = set()
    host_pool = host_state = disk = 0
    for b, s in offloaded:
        state = _state_bytes(b, moment_size=m, amsgrad=amsgrad, alignment=alignment)
        if not nvme and (budget is None or host_state + state <= budget):
            host_state += state
            host_pool += _host_bytes(
                b, itemsize=s, moment_size=m, amsgrad=amsgrad, alignment=alignment
            )
            continue
        nvme.add(b.index)
        host_pool += _nvme_host_bytes(b, itemsize=s, alignment=alignment)
        tiles = tile_sizes(b, b.shard_range(rank), config.tile_elements)
        disk += sum(record.bytes_for(n) for n in tiles)
    return NvmePlan(frozenset(nvme), host_pool, host_state, disk, record, budget)


def _settle(buffer: IOBuffer) -> None:
    """``buffer.settle()``; a wait that blocks is timed as ``nvme_wait`` (exposed I/O).

    Synchronisation point: the CPU waits for the disk, which is behind it."""
    event = buffer.event
    if event is not None and not event.query():
        with phase("nvme_wait", track="cpu_optimizer"):
            buffer.settle()
    else:
        buffer.settle()


class StreamGroup:
    """The NVMe buckets of one segment, in bucket order, sharing one tier's ring; holds the
    reads issued ahead for the next bucket (Note [the step streams the state]).

    ``prefetched``: ``(bucket, tile, buffer)`` reads issued by the previous bucket's update
    for the next one; an entry is valid while its buffer is still READING that record."""

    def __init__(self, tier: StorageTier) -> None:
        self.tier = tier
        self.order: list[NvmeState] = []
        self.prefetched: list[tuple[NvmeState, int, IOBuffer]] = []

    def take_prefetched(self, owner: NvmeState, tiles: list[int]) -> list[tuple[int, IOBuffer]]:
        """The valid prefetched reads of ``owner`` that start ``tiles``, in order; every
        other one is dropped (its buffer settled: FREE)."""
        entries, self.prefetched = self.prefetched, []
        taken: list[tuple[int, IOBuffer]] = []
        for backend, tile, buffer in entries:
            valid = (
                backend is owner
                and buffer.state is IOBufferState.READING
                and buffer.tag == (owner.file, tile)
                and len(taken) < len(tiles)
                and tiles[len(taken)] == tile
            )
            if valid:
                taken.append((tile, buffer))
            elif buffer.tag is not None and buffer.tag == (backend.file, tile):
                buffer.settle()  # a read nobody will use (its error, if any, with it)
        return taken

    def prefetch_after(self, backend: NvmeState, count: int) -> None:
        """Issue reads of the first ``count`` tiles of the NVMe bucket after ``backend``
        (after the last one: the first, for the next step)."""
        index = self.order.index(backend)
        after = self.order[(index + 1) % len(self.order)]
        if after.file is None:
            return
        for tile in range(min(count, after.tiles)):
            buffer = self.tier.next_buffer()
            _settle(buffer)
            after._read(tile, buffer)
            self.prefetched.append((after, tile, buffer))


class NvmeBackends:
    """One segment's NVMe placement: which buckets, the tier, and a factory for their
    backends (what ``OffloadAdamW._build_buckets`` asks). ``tier`` is None without NVMe
    buckets; the manager owns it (closed with it)."""

    def __init__(
        self,
        manager: TieredMemoryManager,
        plan: NvmePlan,
        *,
        config: OffloadConfig,
        rank: int,
        name: str,
    ) -> None:
        self.plan = plan
        self.name = name
        self.group: StreamGroup | None = None
        if plan.nvme and config.nvme_dir is not None:
            # StorageFull here, before any pool is pinned, when the files cannot fit.
            tier = manager.open_storage(
                config.nvme_dir,
                rank=rank,
                needed_bytes=plan.disk,
                buffer_bytes=plan.record.record_bytes,
            )
            self.group = StreamGroup(tier)

    def holds(self, index: int) -> bool:
        """Whether bucket ``index``'s state goes to NVMe."""
        return index in self.plan.nvme

    def build(
        self,
        layout: BucketLayout,
        views: ParamViews,
        *,
        manager: TieredMemoryManager,
        pools: BucketPools,
        grad_buffers: GradBuffers,
        shard: tuple[int, int],
    ) -> NvmeState:
        """The bucket's ``NvmeState``; its file is ``{name}.bucket{index}``."""
        if self.group is None:
            raise RuntimeError(f"bucket {layout.index} placed on NVMe without a tier (bug)")
        return NvmeState(
            layout,
            views,
            manager=manager,
            pools=pools,
            grad_buffers=grad_buffers,
            shard=shard,
            record=self.plan.record,
            group=self.group,
            name=f"{self.name}.bucket{layout.index}",
        )


# -- the backend -----------------------------------------------------------------------


class NvmeState(OffloadedState):
    """State on NVMe, streamed under the CPU kernel; see the module docstring.

    Host fields (``(shard_numel,)``, host pool; the gradient path's, as in
    ``OffloadedState``): grad_staging and weights_staging (training dtype, fp32 included),
    and grad_acc (fp32, its own pool) only once a window accumulated. Disk: ``file``, one
    ``RecordLayout`` record per tile of the shard's real elements. ``master``/``exp_avg``/``exp_avg_sq`` are not host tensors here.
    """

    supports_speculation = False  # the state is on disk: no copy to restore from

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
        record: RecordLayout,
        group: StreamGroup,
        name: str,
    ) -> None:
        # OffloadedState.__init__ is not called: it allocates master and moments in the
        # host pool, which is what this backend exists to avoid; the gradient path and the
        # weight copies are set up the same way (OffloadedState._init_gradient_path).
        self._init_gradient_path(
            layout,
            views,
            manager=manager,
            pools=pools,
            grad_buffers=grad_buffers,
            shard=shard,
            tile_elements=record.tile_elements,
        )
        self.record = record
        self.group = group
        self.tier = tier = group.tier
        self.real = layout.real_in(*shard)  # shard elements before the sharding padding
        self.file: StorageFile | None = None
        try:
            self._alloc_host_fields([("grad_staging", self.dtype), ("weights_staging", self.dtype)])
            sizes = tile_sizes(layout, shard, self.tile_elements)
            self.file = tier.create_file(
                name,
                slots=len(sizes),
                record_bytes=record.record_bytes,
                lengths=[record.bytes_for(count) for count in sizes],
            )
            self._load_weights()
            self._stream(self._initial_tile, range(self.file.slots), read=False)
            group.order.append(self)
        except BaseException:
            self.close()
            raise

    @property
    def tiles(self) -> int:
        """Records in the file (tiles of the shard's real elements)."""
        return self.file.slots if self.file is not None else 0

    def _tile_range(self, tile: int) -> tuple[int, int]:
        lo = tile * self.tile_elements
        return lo, min(lo + self.tile_elements, self.real)

    # -- streaming -------------------------------------------------------------------------

    def _stream(
        self,
        fn: Callable[[int, dict[str, torch.Tensor]], None],
        tiles: Sequence[int] | range,
        *,
        read: bool = True,
        write: bool = True,
        prefetch_next: bool = False,
    ) -> None:
        """Run ``fn(tile, fields)`` over ``tiles`` in order, each read from disk first
        (``read``) and written back after (``write``); with ``prefetch_next`` the next NVMe
        bucket's first tiles are read before this one's last writes are waited for. See
        Note [the step streams the state]."""
        file = self.file
        if file is None:
            raise RuntimeError(f"bucket {self.layout.index}: NVMe state used after close (bug)")
        tier = self.tier
        depth = len(tier.buffers) - 2 if read else 0  # reads in flight ahead of the tile
        tiles = list(tiles)
        taken = self.group.take_prefetched(self, tiles if read else [])
        buffers: list[IOBuffer] = [buffer for _, buffer in taken]  # each tile's, as issued

        def fill(upto: int) -> None:
            while len(buffers) < min(upto, len(tiles)):
                buffer = tier.next_buffer()
                _settle(buffer)  # its write of two tiles ago has landed, in steady state
                if read:
                    self._read(tiles[len(buffers)], buffer)
                else:
                    buffer.transition(IOBufferState.FREE, IOBufferState.HELD)
                buffers.append(buffer)

        try:
            fill(depth)
            for position, tile in enumerate(tiles):
                fill(position + depth + 1)
                buffer = buffers[position]
                if read:
                    event = buffer.event
                    if event is not None and not event.query():
                        # Synchronisation point: the disk is behind the CPU (exposed I/O).
                        with phase("nvme_wait", track="cpu_optimizer"):
                            event.synchronize()
                    elif event is not None:
                        event.synchronize()  # done: raises a read or checksum error
                    buffer.transition(IOBufferState.READING, IOBufferState.HELD)
                    buffer.event = None
                lo, hi = self._tile_range(tile)
                fn(tile, self.record.views(buffer.data, hi - lo))
                if write:
                    self.manager.disk_copy(
                        file,
                        tile,
                        buffer,
                        direction=Direction.NVME_WRITE,
                        category=Category.OPTIMIZER_STATE,
                        label=f"bucket{self.layout.index}[tile {tile}]",
                    )
                else:
                    buffer.settle()  # HELD -> FREE: nothing to write
            wraps = prefetch_next and self.group.order[-1] is self
            if prefetch_next and not wraps:
                self.group.prefetch_after(self, depth)  # during this bucket's last writes
            # This bucket's update is complete only when its writes are: errors surface in
            # the call that caused them, naming this bucket.
            for buffer in tier.buffers:
                if buffer.tag is not None and buffer.tag[0] is file:
                    _settle(buffer)
            if wraps:
                self.group.prefetch_after(self, depth)  # during the next forward, backward
        except BaseException as exc:
            self._abort(written=write)
            if isinstance(exc, StorageError):
                changed = (
                    "This bucket's state is partly updated and its file refuses further use"
                    if write
                    else "Nothing was written"
                )
                raise StorageError(
                    f"bucket {self.layout.index}: NVMe I/O failed on {file.path}: {exc}. "
                    f"{changed}; the state of every other bucket is intact. Reload the "
                    "optimizer from its last checkpoint "
                    "(zero_offload.optim.state_stream.load_streaming)"
                ) from exc
            raise

    def _read(self, tile: int, buffer: IOBuffer) -> None:
        """Queue reading ``tile`` into ``buffer`` (FREE -> READING)."""
        if self.file is None:
            raise RuntimeError(f"bucket {self.layout.index}: NVMe state used after close (bug)")
        for other in self.tier.buffers:
            if other.tag == (self.file, tile) and other.state is IOBufferState.WRITING:
                _settle(other)  # read after write of the same record: the write first
        self.manager.disk_copy(
            self.file,
            tile,
            buffer,
            direction=Direction.NVME_READ,
            category=Category.OPTIMIZER_STATE,
            label=f"bucket{self.layout.index}[tile {tile}]",
        )

    def _abort(self, *, written: bool) -> None:
        """After a failure mid-stream: mark the file's contents unknown when the stream was
        writing it (Note [a failed write leaves the others intact]), settle every buffer
        (secondary errors are dropped: the first is being raised; a prefetched read of
        another bucket is dropped too, and read again when needed)."""
        if written and self.file is not None:
            self.file.fail()
        for buffer in self.tier.buffers:
            try:
                buffer.settle()
            except BaseException:  # the first error is the one being raised
                continue

    def _load_weights(self) -> None:
        """The shard's weights from the device into ``weights_staging`` (D2H, waited)."""
        start, stop = self.shard
        # Synchronisation point (rare: construction, loading, weights written outside the
        # optimizer): the weights' bytes must be final and the staging idle.
        self.manager.synchronize()
        done = self.manager.copy(
            self.weights_staging,
            self.views.weights_dev[start:stop],
            direction=Direction.D2H,
            category=Category.OPTIMIZER_STATE,  # reads the weights to re-derive the master
            after=[self.manager.compute_ready()],
            blocks=[self.views.block, self._blocks["weights_staging"]],
            label=f"bucket{self.layout.index} master refresh",
        )
        done.synchronize()  # Synchronisation point: the tiles below read it

    def _initial_tile(self, tile: int, fields: dict[str, torch.Tensor]) -> None:
        lo, hi = self._tile_range(tile)
        for name, view in fields.items():
            if name == "master":
                view.copy_(self.weights_staging[lo:hi])
            else:
                view.zero_()

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
        # As OffloadedState.update: the gradient is staging or the accumulator (Note [no
        # accumulator for one backward]); the weight copies wait for compute issued so far.
        source, grad, after = self._begin_update(source, publish=publish, after=after)
        pieces: dict[int, list[tuple[int, int, int]]] = {}
        for start, stop, step in clip_runs(runs, *self.shard):
            first = start // self.tile_elements
            for tile in range(first, -(-stop // self.tile_elements)):
                lo, hi = self._tile_range(tile)
                lo, hi = max(lo, start), min(hi, stop)
                if lo < hi:
                    pieces.setdefault(tile, []).append((lo, hi, step))
        fp32 = self.dtype == torch.float32

        def step_tile(tile: int, fields: dict[str, torch.Tensor]) -> None:
            base = tile * self.tile_elements
            for lo, hi, step in pieces[tile]:
                a, b = lo - base, hi - base
                master = fields["master"][a:b]
                self._await_grad(grad, source, lo, hi)  # Note [Adam follows the gradient in]
                adam_step(
                    master,
                    grad[lo:hi],
                    fields["exp_avg"][a:b],
                    fields["exp_avg_sq"][a:b],
                    step=step,
                    lr=hyper.lr,
                    beta1=hyper.beta1,
                    beta2=hyper.beta2,
                    eps=hyper.eps,
                    weight_decay=hyper.weight_decay,
                    decoupled_weight_decay=hyper.decoupled,
                    maximize=hyper.maximize,
                    grad_scale=grad_scale,
                    max_exp_avg_sq=fields["max_exp_avg_sq"][a:b] if hyper.amsgrad else None,
                    out=None if fp32 else self.weights_staging[lo:hi],
                )
                if fp32:
                    self.weights_staging[lo:hi].copy_(master)
                if publish:
                    event = self._copy_tile(lo, hi, after)
                    if event is not None:  # None: the source is the weights' home
                        self._issued.append(event)
                else:
                    self._unpublished.append((lo, hi))

        self._stream(step_tile, sorted(pieces), prefetch_next=True)

    def publish_all_from_master(self) -> None:
        def take(tile: int, fields: dict[str, torch.Tensor]) -> None:
            lo, hi = self._tile_range(tile)
            self.weights_staging[lo:hi].copy_(fields["master"])  # round to nearest even

        self._stream(take, range(self.tiles), write=False)
        self._unpublished = [self._tile_range(t) for t in range(self.tiles)]

    def reconcile_master(self) -> None:
        self._load_weights()
        weights = self.weights_staging

        def take(tile: int, fields: dict[str, torch.Tensor]) -> None:
            lo, hi = self._tile_range(tile)
            master = fields["master"]
            if self.dtype == torch.float32:
                master.copy_(weights[lo:hi])
                return
            # As OffloadedState: where the weight is still the rounding of the master, the
            # master keeps its extra bits; elsewhere the weight was written and wins.
            written = weights[lo:hi] != master.to(self.dtype)
            master[written] = weights[lo:hi][written].float()

        self._stream(take, range(self.tiles))
        self._unpublished = []

    # -- state -------------------------------------------------------------------------

    def state_tensors(self) -> dict[str, torch.Tensor]:
        path = self.file.path if self.file is not None else "(closed)"
        raise StateNotInHostRam(
            f"bucket {self.layout.index}'s optimizer state lives on NVMe ({path}, "
            f"{format_bytes(self.file.nbytes if self.file is not None else 0)}): it did not fit "
            "OffloadConfig.host_budget, so state_dict(), load_state_dict() and opt.state[p] "
            "cannot hand it out as tensors without exhausting host RAM. Save and load "
            "bucket by bucket with zero_offload.optim.state_stream.save_streaming(opt, path) "
            "and load_streaming(opt, path)"
        )

    def state_names(self) -> tuple[str, ...]:
        """The state fields this bucket keeps (on disk), without reading them: master,
        exp_avg, exp_avg_sq, and max_exp_avg_sq with amsgrad."""
        return tuple(name for name, _, _ in self.record.fields)

    def stream_fields(
        self,
        fn: Callable[[int, int, dict[str, torch.Tensor]], None],
        *,
        read: bool = True,
        write: bool = False,
    ) -> None:
        """``fn(lo, hi, fields)`` for every tile in order (shard-local ``[lo, hi)``, the
        state fields' views of that tile): read from disk first (``read``; else ``fn``
        must fill every field) and written back after (``write``). For checkpoints: a
        pass that writes every tile without reading makes a FAILED file whole again."""
        if self.file is not None and write and not read:
            self.file.rewrite_all()
        self._stream(
            lambda t, fields: fn(*self._tile_range(t), fields),
            range(self.tiles),
            read=read,
            write=write,
        )

    def close(self) -> None:
        try:
            super().close()
        finally:
            if self in self.group.order:
                self.group.order.remove(self)
            if self.file is not None:
                for buffer in self.tier.buffers:  # its reads and writes, prefetched ones too
                    if buffer.tag is not None and buffer.tag[0] is self.file:
                        with contextlib.suppress(StorageError):
                            buffer.settle()
                self.file.close()
                self.file = None
