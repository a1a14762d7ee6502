"""One NVMe bucket's state file, streamed tile by tile through the storage tier's ring of
I/O buffers: which shard elements each record holds, the reads ahead and the writes behind
the CPU update, and what a failure mid-stream leaves.

``nvme.NvmeState`` (and the stores built on it) runs its kernels over the tiles this stream
hands it; the buckets of one segment share a ``StreamGroup`` (``stream_group.py``), which
orders these streams and holds the reads one issues for the next.

How a step streams the tiles, and what a failure leaves: Note [the step streams the state]
and Note [a failed write leaves the others intact] in ``nvme.py``. The record layout is
planned in ``nvme_plan.py``.
"""

from __future__ import annotations

import bisect
import contextlib
import itertools
from collections.abc import Callable, Sequence

import torch

from ...errors import StorageError
from ...memory.manager import TieredMemoryManager
from ...memory.storage import IOBuffer, IOBufferState, StorageFile
from ...memory.traffic import Category, Direction
from ...partition import BucketLayout, clip_runs
from ...tracing import phase
from .nvme_plan import RecordLayout, tile_sizes
from .stream_group import StreamGroup, settle

__all__ = ["TileStream"]


class TileStream:
    """One bucket's state file and the streaming of its tiles; see the module docstring.

    Fields: ``bucket``: the bucket's index (named by errors and labels; the group's order).
    ``shard``: ``(start, stop)`` of the bucket the stream holds; ``real``: its elements before
    the sharding padding. ``starts``, ``sizes``: each tile's first shard element and element
    count (``tile_sizes``). ``file``: one ``RecordLayout`` record per tile, None once closed.
    """

    def __init__(
        self,
        layout: BucketLayout,
        *,
        manager: TieredMemoryManager,
        shard: tuple[int, int],
        record: RecordLayout,
        group: StreamGroup,
        name: str,
    ) -> None:
        self.bucket = layout.index
        self.manager = manager
        self.shard = shard
        self.record = record
        self.group = group
        self.tier = tier = group.tier
        self.real = layout.real_in(*shard)  # shard elements before the sharding padding
        sizes = tile_sizes(layout, shard, record)
        if max(sizes) > record.capacity:
            raise RuntimeError(
                f"bucket {layout.index}: a tile of {max(sizes)} elements does not fit "
                f"the record of {record.capacity} (a bug: RecordLayout.for_buckets)"
            )
        self.starts = [0, *itertools.accumulate(sizes[:-1])]  # each tile's first element
        self.sizes = sizes
        self.file: StorageFile | None = tier.create_file(
            name,
            slots=len(sizes),
            record_bytes=record.record_bytes,
            lengths=[record.bytes_for(count) for count in sizes],
        )

    def join(self) -> None:
        """Take this bucket's place in the group, in bucket order: its file is written."""
        bisect.insort(self.group.order, self, key=lambda s: s.bucket)  # bucket order

    @property
    def tiles(self) -> int:
        """Records in the file (tiles of the shard's real elements)."""
        return self.file.slots if self.file is not None else 0

    def tile_range(self, tile: int) -> tuple[int, int]:
        """Shard elements ``[lo, hi)`` of ``tile`` (``tile_sizes``)."""
        lo = self.starts[tile]
        return lo, min(lo + self.sizes[tile], self.real)

    def pieces(self, runs: list[tuple[int, int, int]]) -> dict[int, list[tuple[int, int, int]]]:
        """The updated ``(lo, hi, step)`` shard ranges of each tile that has any."""
        pieces: dict[int, list[tuple[int, int, int]]] = {}
        for start, stop, step in clip_runs(runs, *self.shard):
            first = bisect.bisect_right(self.starts, start) - 1
            for tile in range(first, bisect.bisect_left(self.starts, stop)):
                lo, hi = self.tile_range(tile)
                lo, hi = max(lo, start), min(hi, stop)
                if lo < hi:
                    pieces.setdefault(tile, []).append((lo, hi, step))
        return pieces

    def stream(
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
            raise RuntimeError(f"bucket {self.bucket}: NVMe state used after close (bug)")
        tier = self.tier
        depth = len(tier.buffers) - 2 if read else 0  # reads in flight ahead of the tile
        tiles = list(tiles)
        taken = self.group.take_prefetched(self, tiles if read else [])
        buffers: list[IOBuffer] = [buffer for _, buffer in taken]  # each tile's, as issued

        def fill(upto: int) -> None:
            while len(buffers) < min(upto, len(tiles)):
                buffer = tier.next_buffer()
                settle(buffer)  # its write of two tiles ago has landed, in steady state
                if read:
                    self.read_tile(tiles[len(buffers)], buffer)
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
                lo, hi = self.tile_range(tile)
                fn(tile, self.record.views(buffer.data, hi - lo))
                if write:
                    self.manager.disk_copy(
                        file,
                        tile,
                        buffer,
                        direction=Direction.NVME_WRITE,
                        category=Category.OPTIMIZER_STATE,
                        label=f"bucket{self.bucket}[tile {tile}]",
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
                    settle(buffer)
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
                    f"bucket {self.bucket}: NVMe I/O failed on {file.path}: {exc}. "
                    f"{changed}; the state of every other bucket is intact. Reload the "
                    "optimizer from its last checkpoint "
                    "(opt.load_streaming(path), zero_offload.optim.checkpoint.streaming)"
                ) from exc
            raise

    def read_tile(self, tile: int, buffer: IOBuffer) -> None:
        """Queue reading ``tile`` into ``buffer`` (FREE -> READING)."""
        if self.file is None:
            raise RuntimeError(f"bucket {self.bucket}: NVMe state used after close (bug)")
        for other in self.tier.buffers:
            if other.tag == (self.file, tile) and other.state is IOBufferState.WRITING:
                settle(other)  # read after write of the same record: the write first
        self.manager.disk_copy(
            self.file,
            tile,
            buffer,
            direction=Direction.NVME_READ,
            category=Category.OPTIMIZER_STATE,
            label=f"bucket{self.bucket}[tile {tile}]",
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

    def close(self) -> None:
        """Leave the group, settle this file's reads and writes (prefetched ones too) and
        close the file."""
        self.group.forget(self)
        if self.file is not None:
            for buffer in self.tier.buffers:  # its reads and writes, prefetched ones too
                if buffer.tag is not None and buffer.tag[0] is self.file:
                    with contextlib.suppress(StorageError):
                        buffer.settle()
            self.file.close()
            self.file = None
