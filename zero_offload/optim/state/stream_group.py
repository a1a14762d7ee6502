"""The NVMe buckets of one segment streamed as one: reads issued by a bucket's update for
the next bucket's first tiles, and the wait for an I/O buffer (Note [the step streams the
state] in ``nvme.py``)."""

from __future__ import annotations

import contextlib
from typing import Protocol

from ...errors import StorageError
from ...memory.storage import IOBuffer, IOBufferState, StorageFile, StorageState, StorageTier
from ...tracing import phase

__all__ = ["StreamGroup", "StreamedStore", "settle"]


class StreamedStore(Protocol):
    """What the group asks of a bucket's NVMe state file (``nvme_stream.TileStream``)."""

    @property
    def bucket(self) -> int: ...

    @property
    def file(self) -> StorageFile | None: ...

    @property
    def tiles(self) -> int: ...

    def read_tile(self, tile: int, buffer: IOBuffer) -> None:
        """Queue reading ``tile`` into ``buffer`` (FREE -> READING)."""


def settle(buffer: IOBuffer) -> None:
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
        self.order: list[StreamedStore] = []
        self.prefetched: list[tuple[StreamedStore, int, IOBuffer]] = []

    def take_prefetched(self, owner: StreamedStore, tiles: list[int]) -> list[tuple[int, IOBuffer]]:
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
                # A read nobody will use: its error is not ``owner``'s, and the record is
                # read again (failing in its own bucket) when needed. Note [a failed write
                # leaves the others intact].
                with contextlib.suppress(StorageError):
                    buffer.settle()
        return taken

    def forget(self, backend: StreamedStore) -> None:
        """``backend`` closed: neither the order nor a prefetched read names it any more (the
        group would hold the closed store: Note [a publication does not hold its store] in
        store.py). Its buffers are the store's to settle."""
        if backend in self.order:
            self.order.remove(backend)
        self.prefetched = [entry for entry in self.prefetched if entry[0] is not backend]

    def prefetch_after(self, backend: StreamedStore, count: int) -> None:
        """Issue reads of the first ``count`` tiles of the NVMe bucket after ``backend``
        (after the last one: the first, for the next step)."""
        index = self.order.index(backend)
        after = self.order[(index + 1) % len(self.order)]
        if after.file is None or after.file.state is StorageState.FAILED:
            return  # its own update refuses, naming it
        for tile in range(min(count, after.tiles)):
            buffer = self.tier.next_buffer()
            settle(buffer)
            try:
                after.read_tile(tile, buffer)
            except StorageError:
                # Not this bucket's failure (Note [a failed write leaves the others
                # intact]): ``after`` reads the tile itself and reports it.
                buffer.settle()
                return
            self.prefetched.append((after, tile, buffer))
