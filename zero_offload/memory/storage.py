"""The NVMe storage tier: preallocated files of fixed-size records, aligned direct I/O.

One ``StorageTier`` per optimizer and rank owns a directory ``nvme_dir/rank{r}`` (shared by
the optimizers of one process, each with its own files), a small fixed ring of aligned I/O
buffers (pinned where the accelerator pins), and an asynchronous engine. A ``StorageFile`` is
``slots`` records of at most ``record_bytes`` each (packed: a short last tile takes only its
own aligned bytes), every record with its checksum; the optimizer
decides what a record holds (``optim/state/nvme.py``: one tile of master and moments).

Reads and writes are queued only through ``TieredMemoryManager.disk_copy`` (Note [one choke
point for copies] in ``manager.py``), so the traffic counters and the profiler see every
byte; this module never counts.

Note [direct I/O and its fallback]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Files are opened with ``O_DIRECT``: the bytes go between the I/O buffer and the disk without
the page cache, which would otherwise hold a second copy of the state in the very RAM the
tier exists to save (and whose writeback would stall the step unpredictably). Direct I/O
needs the buffer address, the file offset and the length aligned to the device's logical
block: every record is padded to ``IO_ALIGNMENT`` (4 KiB, a multiple of every logical block
size in use) and the buffers are carved at 4 KiB addresses. Some filesystems refuse
``O_DIRECT`` with EINVAL (tmpfs before Linux 6.6, some network and FUSE filesystems); the
tier then opens the files buffered and warns once, naming the directory: correct, but the
page cache now holds the state too.

Note [the engine: a thread pool on preadv/pwritev]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``os.preadv``/``os.pwritev`` release the GIL for the whole system call, so a few threads
keep several requests in flight at the device while the CPU Adam kernel (numba, GIL
released too) runs. Each record is split into ``chunk_bytes`` requests spread over the
workers, which gives the device a queue depth of ``workers`` for one record (8 by default:
on this project's disk, a virtio block device, 1 / 4 / 8 workers read 0.6-0.8 / 0.9-1.0 /
0.95 GiB/s and write 1.0-1.1 / 1.7-1.9 / 2.4 GiB/s with 1 MiB requests). The alternatives
that install from PyPI without building C++ were tried on the same machine: the io_uring
binding ``liburing`` (2026.3.30) takes only ``bytearray`` buffers, which Python does not
align, so every ``O_DIRECT`` request fails with EINVAL (buffered, it would measure the page
cache); ``kvikio-cu12`` (26.10) installs, but even its POSIX compatibility mode needs
``libcuda.so.1`` and fails on a machine without a GPU driver. The thread pool needs nothing
beyond the standard library, runs everywhere the tests run, and is bounded by the disk.

Note [checksums per record] (``checksums.py``): each record's xxh3-64, taken on write and
verified on read, in host RAM.

Note [stale directories] (``state_dir.py``): the directory is checked, private and locked
with ``flock`` for the tier's life, and what a killed process left is cleaned at the next
construction.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import enum
import errno
import os
import threading
import time
import warnings
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..accelerator import Accelerator, Event
from ..config import format_bytes
from ..errors import StorageError, StorageFull
from ..progress import progress
from .checksums import checksum
from .host_ram import check_host_ram
from .state_dir import FILE_SUFFIX, StateDirectory

__all__ = [
    "IO_ALIGNMENT",
    "IO_BUFFERS",
    "IOBuffer",
    "IOBufferState",
    "IOEvent",
    "StorageFile",
    "StorageState",
    "StorageTier",
    "aligned",
]

#: Alignment of record sizes, file offsets and buffer addresses, bytes; Note [direct I/O
#: and its fallback].
IO_ALIGNMENT = 4096

#: I/O buffers per tier: two reads in flight ahead of the tile computed on, that tile, and
#: the previous tile being written (Note [the step streams the state] in optim/state/nvme.py).
IO_BUFFERS = 4

# The system calls, looked up at call time (tests inject faults by replacing them).
_preadv = os.preadv
_pwritev = os.pwritev


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


class IOBufferState(enum.Enum):
    """An I/O buffer's lifecycle; what each state means for its bytes."""

    #: Idle: no I/O touches it; its bytes are garbage. May be handed out.
    FREE = "free"
    #: A read into it is pending (its ``event``): the bytes are not valid yet.
    READING = "reading"
    #: Holds a verified record; its owner reads and writes it on the CPU.
    HELD = "held"
    #: A write from it is pending (its ``event``): it must not change until that completes.
    WRITING = "writing"


class IOEvent(Event):
    """Completes when every chunk of one record's read or write is done (or failed).

    ``started`` completes when the first chunk starts, for the profiler's timeline. On the
    last chunk, ``after(view)`` runs on that worker (a read's checksum check) unless a chunk
    failed. The first error (``StorageError``, naming the file and offset) is raised by
    ``synchronize``. ``_lock`` guards ``_left`` and ``_error``.
    """

    def __init__(self, parts: int, *, view: memoryview | None = None, after: Any = None) -> None:
        self._lock = threading.Lock()
        self._left = parts
        self._error: BaseException | None = None
        self._done = threading.Event()
        self._completed_at: float | None = None
        self._view = view
        self._after = after
        self.started: IOEvent | None = IOEvent(1) if parts > 1 or view is not None else None

    def part_started(self) -> None:
        """A part began (the first completes ``started``)."""
        started = self.started
        if started is not None and not started.query():
            started.part_done()

    def part_done(self, error: BaseException | None = None) -> None:
        """One part finished (with ``error`` when it failed); the last completes the event."""
        with self._lock:
            if error is not None and self._error is None:
                self._error = error
            self._left -= 1
            last = self._left == 0
        if not last:
            return
        if self._error is None and self._after is not None:
            try:
                self._after(self._view)
            except BaseException as exc:
                self._error = exc
        self._view = self._after = None  # drop the buffer reference
        self._completed_at = time.perf_counter()
        self._done.set()

    def query(self) -> bool:
        return self._done.is_set()

    def synchronize(self) -> None:
        self._done.wait()
        if self._error is not None:
            raise self._error

    def completed_at(self) -> float | None:
        return self._completed_at if self._done.is_set() else None


class IOBuffer:
    """One aligned host buffer of ``nbytes`` (a multiple of ``IO_ALIGNMENT``), with the
    event of the I/O that keeps it busy; see ``IOBufferState``.

    Fields: ``data``: ``(nbytes,)`` uint8, host, pinned where available, 4 KiB-aligned
    address. ``event``: the pending (or last) read or write touching ``data``.
    """

    def __init__(self, index: int, data: torch.Tensor) -> None:
        self.index = index
        self.data = data
        self.state = IOBufferState.FREE
        self.event: IOEvent | None = None
        # (file, record) of the I/O it carries or last carried; None when FREE.
        self.tag: tuple[StorageFile, int] | None = None

    def settle(self) -> None:
        """Wait for the pending I/O (raising its error) and become FREE.

        Synchronisation point: the caller blocks until the disk is done with the buffer;
        Note [the step streams the state] in ``optim/state/nvme.py`` keeps this off the critical
        path in steady state."""
        event, self.event = self.event, None
        busy = self.state in (IOBufferState.READING, IOBufferState.WRITING)
        try:
            if busy and event is not None:
                event.synchronize()
        finally:
            self.state = IOBufferState.FREE
            self.tag = None

    def transition(self, old: IOBufferState, new: IOBufferState) -> None:
        """Move ``old -> new``; any other current state is a bug."""
        if self.state is not old:
            raise RuntimeError(
                f"I/O buffer {self.index} is {self.state.value}, expected {old.value} before "
                f"becoming {new.value} (bug)"
            )
        self.state = new


class StorageFile:
    """``slots`` records in one preallocated file, each with a checksum; record ``i`` is
    ``lengths[i]`` bytes (a multiple of ``IO_ALIGNMENT``, at most ``record_bytes``, the I/O
    buffers' size) at ``offsets[i]``, packed end to end.

    ``checksums``: ``(slots,)`` uint64, host; 0 with ``written[slot]`` False means never
    written (reading it is a bug). Guarded by ``_lock`` (workers write it).
    """

    def __init__(
        self,
        tier: StorageTier,
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
            self, buffer, slot, write=False, after=lambda view: self._verify(slot, view, expected)
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

        event = self.tier.engine.submit(self, buffer, slot, write=True, before=before)
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
            self.tier._files.discard(self)


class _Engine:
    """Note [the engine: a thread pool on preadv/pwritev]. ``workers`` threads; a record is
    ``ceil(length / chunk_bytes)`` requests."""

    def __init__(self, workers: int, chunk_bytes: int) -> None:
        self.chunk_bytes = chunk_bytes
        self.pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=workers, thread_name_prefix="zero_offload:nvme"
        )

    def submit(
        self,
        file: StorageFile,
        buffer: IOBuffer,
        slot: int,
        *,
        write: bool,
        before: Any = None,
        after: Any = None,
    ) -> IOEvent:
        """Queue the record's chunks; ``before(view)`` (a write's checksum) runs on a worker
        first, so the caller never hashes."""
        base = file.offset(slot)
        n = file.length(slot)
        view = memoryview(buffer.data.numpy()).cast("B")[:n]
        chunks = [(lo, min(lo + self.chunk_bytes, n)) for lo in range(0, n, self.chunk_bytes)]
        event = IOEvent(len(chunks), view=view, after=after)

        def fan_out() -> None:
            event.part_started()
            if before is not None:
                try:
                    before(view)
                except BaseException as exc:
                    for _ in chunks:
                        event.part_done(exc)
                    return
            for lo, hi in chunks:
                self.pool.submit(_transfer, file, view[lo:hi], base + lo, write, event)

        if before is None:
            fan_out()
        else:
            self.pool.submit(fan_out)
        return event

    def close(self) -> None:
        self.pool.shutdown(wait=True)


def _transfer(
    file: StorageFile, view: memoryview, offset: int, write: bool, event: IOEvent
) -> None:
    # Runs on an engine worker: the system call releases the GIL. A short transfer (rare:
    # a signal, a filesystem's limit) is resumed until the chunk is complete.
    event.part_started()
    error: BaseException | None = None
    try:
        done = 0
        while done < len(view):
            piece = view[done:]
            if write:
                moved = _pwritev(file.fd, [piece], offset + done)
            else:
                moved = _preadv(file.fd, [piece], offset + done)
            if moved <= 0:
                raise OSError(errno.EIO, "no progress (end of file?)")
            done += moved
    except BaseException as exc:
        if write:
            file.fail()
        kind = "write" if write else "read"
        error = StorageError(
            f"{kind} of {len(view)} bytes at offset {offset} of {file.path} failed: "
            f"{type(exc).__name__}: {exc}"
        )
        error.__cause__ = exc
        error.file = file  # type: ignore[attr-defined]
    event.part_done(error)


# Every open tier of this process, closed at interpreter exit (Note [stale directories]).
_OPEN_TIERS: weakref.WeakSet[StorageTier] = weakref.WeakSet()


@atexit.register
def _close_all_at_exit() -> None:
    for tier in list(_OPEN_TIERS):
        tier.close()


class StorageTier:
    """The NVMe tier of one optimizer on one rank; see the module docstring.

    Args:
        root: ``nvme_dir``; the tier uses ``root/rank{rank}``.
        rank: this process's rank (each rank has its own directory).
        needed_bytes: what the files will hold; refused at construction when the
            filesystem has less free (``StorageFull``, with the numbers).
        buffer_bytes: size of each I/O buffer (one record), rounded up to ``IO_ALIGNMENT``.
        buffers: how many I/O buffers (default ``IO_BUFFERS``, 4); at least 3.
        workers, chunk_bytes: the engine (Note [the engine: a thread pool on preadv/pwritev]).

    Fields: ``buffers``: the ring of ``IOBuffer``; ``_raw``: the ``(buffers * buffer_bytes +
    IO_ALIGNMENT,)`` uint8 host allocation they are carved from (pinned where available).
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        rank: int,
        accelerator: Accelerator,
        needed_bytes: int,
        buffer_bytes: int,
        buffers: int = IO_BUFFERS,
        workers: int = 8,
        chunk_bytes: int = 1 << 20,
    ) -> None:
        if buffers < 3:
            raise ValueError(
                f"buffers must be >= 3 (read ahead, compute, write back), got {buffers}"
            )
        self._dir = StateDirectory(root, rank=rank)  # checked: Note [stale directories]
        self.state = StorageState.OPEN
        self.directory = self._dir.path
        self.rank = rank
        self.direct = True
        self._files: set[StorageFile] = set()
        self._dir.acquire()
        try:
            free = self.free_bytes()
            if free is not None and needed_bytes > free:
                raise StorageFull(self.full_message(needed_bytes, what="the optimizer state"))
            self.buffer_bytes = aligned(buffer_bytes)
            total = buffers * self.buffer_bytes + IO_ALIGNMENT
            # Hidden cost, once: pinning the I/O buffers (page-locks them).
            check_host_ram(total, what="the NVMe tier's I/O buffers", sized_by="tile_elements")
            self._raw = accelerator.allocate_host(total, pinned=True)
            skip = (-self._raw.data_ptr()) % IO_ALIGNMENT
            self.buffers = [
                IOBuffer(
                    i,
                    self._raw[skip + i * self.buffer_bytes : skip + (i + 1) * self.buffer_bytes],
                )
                for i in range(buffers)
            ]
            self.engine = _Engine(workers, aligned(chunk_bytes))
            self._cursor = 0  # the ring's next buffer, Note [the step streams the state]
        except BaseException:
            self._dir.release()
            raise
        _OPEN_TIERS.add(self)

    # -- the directory -----------------------------------------------------------------

    def free_bytes(self) -> int | None:
        """Bytes free for this user on the directory's filesystem now (``None``: the
        filesystem does not say, as ramfs)."""
        return self._dir.free_bytes()

    def full_message(self, needed: int, *, what: str, refused: bool = False) -> str:
        """The ``StorageFull`` message: what, bytes needed, free, where, and the fix."""
        return self._dir.full_message(needed, what=what, refused=refused)

    def _open(self, path: Path) -> int:
        flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC
        if self.direct:
            try:
                return os.open(path, flags | os.O_DIRECT, 0o600)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self.direct = False  # Note [direct I/O and its fallback]
                warnings.warn(
                    f"zero-offload: the filesystem of {self.directory} refuses O_DIRECT "
                    f"({exc.strerror}); the NVMe tier falls back to buffered I/O there, so the "
                    "page cache will hold a copy of the optimizer state in host RAM too. Put "
                    "OffloadConfig.nvme_dir on a local disk (ext4, xfs) for direct I/O",
                    stacklevel=4,
                )
        return os.open(path, flags, 0o600)

    # -- files ---------------------------------------------------------------------------

    def create_file(
        self, name: str, *, slots: int, record_bytes: int, lengths: list[int] | None = None
    ) -> StorageFile:
        """A new preallocated file of ``slots`` records (``StorageFull`` when it does not
        fit; its name must be unique in the directory); see ``StorageFile``."""
        if self.state is not StorageState.OPEN:
            raise RuntimeError(f"storage tier {self.directory} is {self.state.value} (bug)")
        file = StorageFile(self, name, slots=slots, record_bytes=record_bytes, lengths=lengths)
        self._files.add(file)
        return file

    def next_buffer(self) -> IOBuffer:
        """The ring's next buffer, round robin: the one whose last I/O was issued longest
        ago (the caller settles it before use)."""
        buffer = self.buffers[self._cursor % len(self.buffers)]
        self._cursor += 1
        return buffer

    def close(self) -> None:
        """Wait for pending I/O, delete every file, unlock and remove the directory (when
        no other tier of this process uses it). Idempotent."""
        if self.state is StorageState.CLOSED:
            return
        self.state = StorageState.CLOSED
        _OPEN_TIERS.discard(self)
        try:
            for buffer in self.buffers:
                with contextlib.suppress(StorageError):  # closing: the file goes anyway
                    buffer.settle()
            self.engine.close()
        finally:
            for file in list(self._files):
                file.close()
            self._dir.release()
