"""A bucket's training-dtype weights on NVMe: its *home* when it does not fit host RAM.

With ``OffloadConfig(offload_parameters=True, nvme_dir=...)`` a unit's weights live in its
buckets' homes between uses (Note [a unit's lifecycle] in ``params/unit.py``); a bucket whose
home does not fit ``host_budget`` (``plan_nvme`` in ``optim/state/nvme_plan.py``) keeps it in
a ``WeightFile``, one file of the storage tier per bucket, beside the file of its master and
moments. Sits below ``optim`` and ``params``: the optimizer's step writes it
(``optim/state/nvme_weights.py``), the window's fetches read it (``params/home_store.py``).

Note [a weight file's records]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Record ``t`` holds tile ``t`` of the shard's real elements (``tile_elements`` of them, the
state file's tiles: a step updates both files tile by tile), in the training dtype, padded
to 4 KiB (``IO_ALIGNMENT``, direct I/O) and checksummed like every record (Note [checksums
per record] in ``memory/checksums.py``). A host area that holds several records (a fetch's
bounce buffer, a scratch copy) lays tile ``t`` at byte ``t * record_bytes``, as the file
does (only the last tile is short): every record starts 4 KiB-aligned, so the disk reads
straight into it, and the area is the file's size. A bad checksum or an I/O error is
raised as a ``StorageError`` naming the unit and the file (``owner``, ``path``).

Writes outside the optimizer's step (a written slot copied home, a state-dict copy written
through) count in ``written``: the optimizer reconciles its master with such writes at its
next step (Note [weights written outside the optimizer] in ``views/param_views.py``) and a
unit whose slot may be stale fetches afresh (``ParamUnit.homes_written``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from ..errors import StorageError
from ..memory.block import Block
from ..memory.manager import TieredMemoryManager
from ..memory.pool import BlockPool
from ..memory.storage import IO_ALIGNMENT, IOBuffer, IOBufferState, StorageFile, StorageTier
from ..memory.storage import aligned as io_aligned
from ..memory.traffic import Category, Direction

__all__ = ["HOME_TILE_BUFFERS", "HomeTiles", "WeightFile", "aligned_scratch", "weight_file_bytes"]

#: Weight tile buffers of a segment with homes on NVMe: the tile read ahead, the tile
#: updated, the tile being written (Note [homes on NVMe] in ``optim/state/nvme_plan.py``).
HOME_TILE_BUFFERS = 3


def home_ring_bytes(tile_elements: int, itemsize: int) -> int:
    """Host bytes of a segment's weight tile ring (``HomeTiles``): ``HOME_TILE_BUFFERS``
    records of a whole tile, plus 4 KiB to align them (carved from the host pool)."""
    return HOME_TILE_BUFFERS * io_aligned(tile_elements * itemsize) + IO_ALIGNMENT


def _tile_counts(real: int, tile_elements: int) -> list[int]:
    return [min(tile_elements, real - lo) for lo in range(0, real, tile_elements)] or [1]


def weight_file_bytes(real: int, tile_elements: int, itemsize: int) -> int:
    """Bytes on disk of a bucket shard's weight file (Note [a weight file's records])."""
    return sum(io_aligned(n * itemsize) for n in _tile_counts(real, tile_elements))


def aligned_scratch(nbytes: int) -> torch.Tensor:
    """``(nbytes,)`` uint8 host memory at a 4 KiB address (direct I/O), not pinned: for the
    rare reads outside the window (a state dict's copies, ``close``). Hidden cost: a
    transient allocation of ``nbytes + 4 KiB``."""
    raw = torch.empty(nbytes + IO_ALIGNMENT, dtype=torch.uint8)
    skip = (-raw.data_ptr()) % IO_ALIGNMENT
    return raw[skip : skip + nbytes]


class WeightFile:
    """One bucket shard's training-dtype weights in the storage tier; see Note [a weight
    file's records].

    Fields: ``file``: the ``StorageFile``; ``real``: the shard's real elements;
    ``record_bytes``: one whole tile's record (the stride of a host area of records);
    ``staged_bytes``: a host area holding every record (the file's bytes); ``owner``: what the errors name
    (the unit and bucket, set by the window); ``written``: writes outside the step.
    """

    def __init__(
        self,
        tier: StorageTier,
        name: str,
        *,
        real: int,
        dtype: torch.dtype,
        tile_elements: int,
        owner: str,
    ) -> None:
        self.real = real
        self.dtype = dtype
        self.tile_elements = tile_elements
        self.owner = owner
        self.written = 0
        counts = _tile_counts(real, tile_elements)
        self.record_bytes = io_aligned(tile_elements * dtype.itemsize)
        self.staged_bytes = weight_file_bytes(real, tile_elements, dtype.itemsize)
        self.file: StorageFile = tier.create_file(
            f"{name}.weights",
            slots=len(counts),
            record_bytes=self.record_bytes,
            lengths=[io_aligned(n * dtype.itemsize) for n in counts],
        )

    @property
    def tiles(self) -> int:
        """Records in the file."""
        return self.file.slots

    @property
    def path(self) -> str:
        return str(self.file.path)

    def tile_range(self, tile: int) -> tuple[int, int]:
        """Shard elements ``[lo, hi)`` of ``tile``."""
        lo = tile * self.tile_elements
        return lo, min(lo + self.tile_elements, self.real)

    def tile_view(self, area: torch.Tensor, tile: int) -> torch.Tensor:
        """Tile ``tile``'s weights in a host area of records (uint8), ``(hi - lo,)``."""
        lo, hi = self.tile_range(tile)
        start = tile * self.record_bytes
        return area[start : start + (hi - lo) * self.dtype.itemsize].view(self.dtype)

    def _buffer(self, area: torch.Tensor, tile: int) -> IOBuffer:
        start = tile * self.record_bytes
        return IOBuffer(tile, area[start : start + self.record_bytes])

    # -- one record ----------------------------------------------------------------------

    def read(self, manager: TieredMemoryManager, tile: int, buffer: IOBuffer) -> None:
        """Queue reading record ``tile`` into ``buffer`` (FREE -> READING)."""
        self._disk(manager, tile, buffer, Direction.NVME_READ)

    def write(self, manager: TieredMemoryManager, tile: int, buffer: IOBuffer) -> None:
        """Queue writing ``buffer`` (HELD, or FREE: taken now) to record ``tile``."""
        if buffer.state is IOBufferState.FREE:
            buffer.transition(IOBufferState.FREE, IOBufferState.HELD)
        self._disk(manager, tile, buffer, Direction.NVME_WRITE)

    def _disk(
        self, manager: TieredMemoryManager, tile: int, buffer: IOBuffer, direction: Direction
    ) -> None:
        label = f"{self.owner} weights[tile {tile}]"
        manager.disk_copy(
            self.file, tile, buffer, direction=direction, category=Category.WEIGHTS, label=label
        )

    def settle(self, buffer: IOBuffer) -> None:
        """Wait for ``buffer``'s I/O (Synchronisation point: the CPU waits for the disk);
        an error names the unit and the file."""
        try:
            buffer.settle()
        except StorageError as exc:
            raise StorageError(
                f"the weights of {self.owner} could not be read or written on NVMe "
                f"({self.path}): {exc}. The file is not trusted any more; rebuild the "
                "optimizer and reload the model from the last checkpoint"
            ) from exc

    # -- a host area of records ------------------------------------------------------------

    def begin_read_all(self, manager: TieredMemoryManager, area: torch.Tensor) -> list[IOBuffer]:
        """Queue reading every record into ``area`` (``staged_bytes``, 4 KiB-aligned); the
        buffers to hand to ``settle_all``."""
        return [self._read_into(manager, area, t) for t in range(self.tiles)]

    def _read_into(self, manager: TieredMemoryManager, area: torch.Tensor, tile: int) -> IOBuffer:
        buffer = self._buffer(area, tile)
        self.read(manager, tile, buffer)
        return buffer

    def write_all(self, manager: TieredMemoryManager, area: torch.Tensor) -> None:
        """Every record from ``area``, waited for; a write outside the step (``written``)."""
        buffers = []
        for tile in range(self.tiles):
            buffer = self._buffer(area, tile)
            self.write(manager, tile, buffer)
            buffers.append(buffer)
        self._settle_all(buffers)
        self.written += 1

    def settle_all(self, buffers: list[IOBuffer]) -> None:
        """Wait for every buffer; the first error (naming the unit and the file) is raised
        once all settled."""
        self._settle_all(buffers)

    def _settle_all(self, buffers: list[IOBuffer]) -> None:
        error: StorageError | None = None
        for buffer in buffers:  # every one settles before the first error is raised
            try:
                self.settle(buffer)
            except StorageError as exc:
                error = error or exc
        if error is not None:
            raise error

    def read_range(self, manager: TieredMemoryManager, lo: int, hi: int) -> torch.Tensor:
        """A private copy of shard elements ``[lo, hi)``: ``(hi - lo,)``, host."""
        area, first = self._read_tiles(manager, lo, hi)
        out = torch.empty(hi - lo, dtype=self.dtype)
        self._gather(area, first, lo, hi, out)
        return out

    def write_range(
        self, manager: TieredMemoryManager, lo: int, hi: int, values: torch.Tensor
    ) -> None:
        """Shard elements ``[lo, hi)`` take ``values`` (read, patched, written; waited)."""
        area, first = self._read_tiles(manager, lo, hi)
        self._gather(area, first, lo, hi, values.reshape(-1).to(self.dtype), scatter=True)
        self._each_tile(area, first, (hi - 1) // self.tile_elements, manager, self.write)
        self.written += 1

    def _read_tiles(
        self, manager: TieredMemoryManager, lo: int, hi: int
    ) -> tuple[torch.Tensor, int]:
        if not 0 <= lo < hi <= self.real:
            raise RuntimeError(f"{self.owner}: range [{lo}, {hi}) of {self.real} (bug)")
        first, last = lo // self.tile_elements, (hi - 1) // self.tile_elements
        area = aligned_scratch((last - first + 1) * self.record_bytes)
        self._each_tile(area, first, last, manager, self.read)
        return area, first

    def _each_tile(
        self,
        area: torch.Tensor,
        first: int,
        last: int,
        manager: TieredMemoryManager,
        io: Callable[[TieredMemoryManager, int, IOBuffer], object],
    ) -> None:
        """``io`` (``read`` or ``write``) each record of tiles ``first..last`` from its piece
        of ``area`` (``first``'s record at its start), then wait for them all."""
        buffers = []
        for tile in range(first, last + 1):
            start = (tile - first) * self.record_bytes
            buffer = IOBuffer(tile, area[start : start + self.record_bytes])
            io(manager, tile, buffer)
            buffers.append(buffer)
        self._settle_all(buffers)

    def _gather(
        self,
        area: torch.Tensor,
        first: int,
        lo: int,
        hi: int,
        out: torch.Tensor,
        *,
        scatter: bool = False,
    ) -> None:
        size = self.dtype.itemsize
        done = lo
        while done < hi:
            tile = done // self.tile_elements
            t_lo, t_hi = self.tile_range(tile)
            stop = min(hi, t_hi)
            start = (tile - first) * self.record_bytes + (done - t_lo) * size
            view = area[start : start + (stop - done) * size].view(self.dtype)
            if scatter:
                view.copy_(out[done - lo : stop - lo])
            else:
                out[done - lo : stop - lo].copy_(view)
            done = stop

    def close(self) -> None:
        """Delete the file (its I/O settled by the caller)."""
        self.file.close()


class HomeTiles:
    """A segment's ring of ``HOME_TILE_BUFFERS`` weight tile buffers, one block of the host
    pool (``nvme_plan.home_ring_bytes``), shared by its buckets with homes on NVMe and
    freed when the last of them closes. Only the step and the streaming passes use it (one
    bucket at a time, on the optimizer's thread)."""

    def __init__(self, host_pool: BlockPool, nbytes: int, *, name: str) -> None:
        self.block: Block | None = host_pool.alloc(nbytes, owner=f"{name}.home_tiles")
        self.tile_bytes = (nbytes - IO_ALIGNMENT) // HOME_TILE_BUFFERS
        self.users = 0
        self._cursor = 0
        self._buffers: list[IOBuffer] = []
        self._carve(self.block)
        self.block.on_move(self._carve)

    def _carve(self, block: Block) -> None:
        data = block.view(torch.uint8)
        skip = (-data.data_ptr()) % IO_ALIGNMENT
        self._buffers = [
            IOBuffer(i, data[skip + i * self.tile_bytes : skip + (i + 1) * self.tile_bytes])
            for i in range(HOME_TILE_BUFFERS)
        ]

    def next(self, file: WeightFile) -> IOBuffer:
        """The ring's next buffer, idle (its last write waited for)."""
        buffer = self._buffers[self._cursor % len(self._buffers)]
        self._cursor += 1
        file.settle(buffer)
        return buffer

    def settle_all(self) -> None:
        """Wait for every buffer's I/O; the first error is raised after all settled."""
        error: BaseException | None = None
        for buffer in self._buffers:
            try:
                buffer.settle()
            except StorageError as exc:
                error = error or exc
        if error is not None:
            raise error

    def release(self) -> None:
        """One bucket closed; the last frees the block."""
        self.users -= 1
        if self.users <= 0 and self.block is not None:
            for buffer in self._buffers:
                with contextlib.suppress(StorageError):
                    buffer.settle()
            self.block.free()
            self.block = None
