"""How one record's read or write reaches the disk, and when it is done: the I/O engine.

``IOEngine`` splits a record into requests and runs them on a few threads; ``IOEvent`` is the
event of one record's I/O. What a record is (its file, offset and length, its checksum) is
``storage_file.py``; the tier that owns the engine is ``storage.py``.

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
"""

from __future__ import annotations

import concurrent.futures
import errno
import os
import threading
import time
from pathlib import Path
from typing import Any, Protocol

import torch

from ..accelerator import Event
from ..accelerator.forks import forked_error, this_process
from ..accelerator.host_syncs import count_sync
from ..errors import StorageError, raised_again, without_frames

__all__ = ["IOEngine", "IOEvent", "RecordFile"]

# The system calls, looked up at call time (tests inject faults by replacing them).
_preadv = os.preadv
_pwritev = os.pwritev


class RecordFile(Protocol):
    """What the engine needs of a file of records (``StorageFile`` in ``storage_file.py``)."""

    path: Path
    fd: int

    def offset(self, slot: int) -> int: ...

    def length(self, slot: int) -> int: ...

    def fail(self) -> None: ...


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
        self._pid = this_process()  # Note [a forked child has no worker threads]
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
                self._error = without_frames(error)  # its message names file and offset
            self._left -= 1
            last = self._left == 0
        if not last:
            return
        if self._error is None and self._after is not None:
            try:
                self._after(self._view)
            except BaseException as exc:
                self._error = without_frames(exc)  # its message names the record
        self._view = self._after = None  # drop the buffer reference
        self._completed_at = time.perf_counter()
        self._done.set()

    def query(self) -> bool:
        return self._done.is_set()

    def synchronize(self) -> None:
        count_sync("nvme")  # Note [host syncs are counted where they can block]
        if self._pid != this_process() and not self._done.is_set():
            # Note [a forked child has no worker threads] (accelerator/forks.py): the
            # engine's threads did not fork, so a part pending at the fork never ends here.
            raise forked_error("an NVMe read or write", self._pid)
        self._done.wait()
        if self._error is not None:
            raise raised_again(self._error)  # Note [a sticky error holds no frames]

    def completed_at(self) -> float | None:
        return self._completed_at if self._done.is_set() else None


class IOEngine:
    """Note [the engine: a thread pool on preadv/pwritev]. ``workers`` threads; a record is
    ``ceil(length / chunk_bytes)`` requests."""

    def __init__(self, workers: int, chunk_bytes: int) -> None:
        self.chunk_bytes = chunk_bytes
        self.pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=workers, thread_name_prefix="zero_offload:nvme"
        )

    def submit(
        self,
        file: RecordFile,
        data: torch.Tensor,
        slot: int,
        *,
        write: bool,
        before: Any = None,
        after: Any = None,
    ) -> IOEvent:
        """Queue the chunks of record ``slot`` of ``file``, read into or written from ``data``
        (a host ``uint8`` tensor); ``before(view)`` (a write's checksum) runs on a worker
        first, so the caller never hashes."""
        base = file.offset(slot)
        n = file.length(slot)
        view = memoryview(data.numpy()).cast("B")[:n]
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


def _transfer(file: RecordFile, view: memoryview, offset: int, write: bool, event: IOEvent) -> None:
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
