"""What one file of the NVMe tier holds: fixed-size records at known offsets, each with its
checksum, and the file's lifecycle.

A ``StorageFile`` is preallocated whole at construction, so a full disk is refused then and
not in a step; its records are read and written only through the tier's engine
(``io_engine.py``) and only by ``TieredMemoryManager.disk_copy``. The tier that opens it is
``storage.py`` (Note [direct I/O and its fallback] there says why records are padded to
``IO_ALIGNMENT``).

Note [checksums per record] (``checksums.py``): each record's xxh3-64, taken on write and
verified on read, in host RAM.
"""

from __future__ import annotations

import enum
import errno
import os
import threading
from pathlib import Path
from typing import Protocol

import numpy as np

from ..config import format_bytes
from ..errors import StorageError, StorageFull
from ..progress import progress
from .checksums import checksum
from .io_buffers import IOBuffer, IOBufferState
from .io_engine import IOEngine, IOEvent
from .state_dir import FILE_SUFFIX

__all__ = ["IO_ALIGNMENT", "FileTier", "StorageFile", "StorageState", "aligned"]

#: Alignment of record sizes, file offsets and buffer addresses, bytes; Note [direct I/O
#: and its fallback].
IO_ALIGNMENT = 4096


def aligned(nbytes: int, alignment: int = IO_ALIGNMENT) -> int:
    """``nbytes`` rounded up to a multiple of ``alignment``."""
    return -(-nbytes // alignment) * alignment


#: Bytes preallocated per ``posix_fallocate`` call (one step of the bar).
_PREALLOCATE_STEP = 256 << 20


class StorageState(enum.Enum):
    """A file's (and the tier's) lifecycle."""

    #: Preallocated on disk; records may be read and written.
    OPEN = "open"
    #: A write failed, or its owner gave up on it mid-update (a bad checksum, a read
    #: error): the file's contents are no longer known. It refuses further I/O until every
    #: record is rewritten (``rewrite_all``: loading a checkpoint).
    FAILED = "failed"
    #: Removed from disk; its fd is closed. Nothing may use it.
    CLOSED = "closed"


class FileTier(Protocol):
    """What a file asks of the tier that opens it (``StorageTier`` in ``storage.py``)."""

    directory: Path
    engine: IOEngine

    def full_message(self, needed: int, *, what: str, refused: bool = False) -> str: ...

    def _open(self, path: Path) -> int: ...

    def _forget(self, file: StorageFile) -> None: ...


class StorageFile:
    """``slots`` records in one preallocated file, each with a checksum; record ``i`` is
    ``lengths[i]`` bytes (a multiple of ``IO_ALIGNMENT``, at most ``record_bytes``, the I/O
    buffers' size) at ``offsets[i]``, packed end to end.

    ``checksums``: ``(slots,)`` uint64, host; 0 with ``written[slot]`` False means never
    written (reading it is a bug). Guarded by ``_lock`` (workers write it).
    """

    def __init__(
        self,
        tier: FileTier,
        name: str,
        *,
        slots: int,
        record_bytes: int,
        lengths: list[int] | None = None,
    ) -> None:
        lengths = [record_bytes] * slots if lengths is None else list(lengths)
        if len(lengths) != slots or any(
            n <= 0 or n % IO_ALIGNMENT or n > record_bytes for n in lengths
        ):
            raise ValueError(
                f"record lengths must be {slots} positive multiples of {IO_ALIGNMENT} of at "
                f"most record_bytes={record_bytes}; round them up with storage.aligned()"
            )
        self.tier = tier
        self.path = tier.directory / f"{name}{FILE_SUFFIX}"
        self.slots = slots
        self.record_bytes = record_bytes
        self.lengths = np.asarray(lengths, dtype=np.int64)  # (slots,) bytes per record
        self.offsets = np.concatenate(([0], np.cumsum(self.lengths)[:-1])).astype(np.int64)
        self.nbytes = int(self.lengths.sum())
        self.state = StorageState.OPEN
        self.checksums = np.zeros(slots, dtype=np.uint64)
        self.written = np.zeros(slots, dtype=bool)
        self._lock = threading.Lock()
        self.fd = tier._open(self.path)
        try:
            # In steps, so that a large file shows a bar (Note [waits say what they wait
            # for] in progress.py); the blocks are the same as in one call.
            steps = range(0, self.nbytes, _PREALLOCATE_STEP)
            for start in progress(steps, desc=f"preallocating {self.path.name}", unit="step"):
                os.posix_fallocate(self.fd, start, min(_PREALLOCATE_STEP, self.nbytes - start))
        except OSError as exc:
            os.close(self.fd)
            self.path.unlink(missing_ok=True)
            if exc.errno == errno.ENOSPC:
                message = tier.full_message(self.nbytes, what=str(self.path), refused=True)
                raise StorageFull(message) from exc
            raise StorageError(
                f"could not preallocate {format_bytes(self.nbytes)} for {self.path}: {exc}"
            ) from exc

    def __repr__(self) -> str:
        return f"StorageFile({str(self.path)!r}, {self.slots} records, {self.nbytes} B)"

    def offset(self, slot: int) -> int:
        """Byte offset of record ``slot`` in the file."""
        if not 0 <= slot < self.slots:
            raise RuntimeError(f"{self.path}: record {slot} of {self.slots} (bug)")
        return int(self.offsets[slot])

    def length(self, slot: int) -> int:
        """Bytes of record ``slot``."""
        return int(self.lengths[slot])

    def _check_open(self, what: str) -> None:
        if self.state is StorageState.FAILED:
            raise StorageError(
                f"{self.path} failed earlier (an I/O error or a bad checksum): its records "
                f"are unknown, so it refuses to {what}. Reload the optimizer from its last "
                "checkpoint (opt.load_streaming(path))"
            )
        if self.state is StorageState.CLOSED:
            raise RuntimeError(f"{self.path} is closed; it cannot {what} (bug)")

    def submit_read(self, slot: int, buffer: IOBuffer) -> IOEvent:
        """Queue reading record ``slot`` into ``buffer`` (FREE -> READING), checksum checked
        on arrival. Only ``TieredMemoryManager.disk_copy`` calls this."""
        self._check_open("read")
        if not self.written[slot]:
            raise RuntimeError(f"{self.path}: record {slot} read before written (bug)")
        buffer.transition(IOBufferState.FREE, IOBufferState.READING)
        buffer.tag = (self, slot)
        expected = int(self.checksums[slot])
        event = self.tier.engine.submit(
            self,
            buffer.data,
            slot,
            write=False,
            after=lambda view: self._verify(slot, view, expected),
        )
        buffer.event = event
        return event

    def submit_write(self, slot: int, buffer: IOBuffer) -> IOEvent:
        """Queue writing ``buffer`` to record ``slot`` (HELD -> WRITING); its checksum is
        taken first, on a worker. Only ``TieredMemoryManager.disk_copy`` calls this."""
        self._check_open("write")
        buffer.transition(IOBufferState.HELD, IOBufferState.WRITING)
        buffer.tag = (self, slot)

        def before(view: memoryview) -> None:
            digest = checksum(view)
            with self._lock:
                self.checksums[slot] = digest
                self.written[slot] = True

        event = self.tier.engine.submit(self, buffer.data, slot, write=True, before=before)
        buffer.event = event
        return event

    def _verify(self, slot: int, view: memoryview, expected: int) -> None:
        # The file is not marked FAILED here: a read ahead runs before the writes of the
        # records before it, which must still land; the reader decides (``optim/state/nvme.py``).
        found = checksum(view)
        if found != expected:
            error = StorageError(
                f"checksum mismatch in record {slot} of {self.path} (bytes "
                f"{self.offset(slot)}..{self.offset(slot) + self.length(slot)}): the record is "
                f"torn or corrupted (xxh3 {found:#018x}, written as {expected:#018x})"
            )
            error.file = self  # type: ignore[attr-defined]
            raise error

    def rewrite_all(self) -> None:
        """The caller is about to write every record without reading any (loading a
        checkpoint): a FAILED file may be used again (FAILED -> OPEN)."""
        if self.state is StorageState.FAILED:
            self.state = StorageState.OPEN

    def fail(self) -> None:
        """Mark the file's contents unknown (OPEN -> FAILED)."""
        if self.state is StorageState.OPEN:
            self.state = StorageState.FAILED

    def close(self) -> None:
        """Close the fd and delete the file (idempotent). The caller settled its I/O."""
        if self.state is StorageState.CLOSED:
            return
        self.state = StorageState.CLOSED
        try:
            os.close(self.fd)
        finally:
            self.path.unlink(missing_ok=True)
            self.tier._forget(self)
