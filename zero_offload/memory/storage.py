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

Note [the engine: a thread pool on preadv/pwritev] (``io_engine.py``): how a record's I/O
reaches the disk. The file of records and its checksums are ``storage_file.py``; the I/O
buffers, ``io_buffers.py``.

Note [stale directories] (``state_dir.py``): the directory is checked, private and locked
with ``flock`` for the tier's life, and what a killed process left is cleaned at the next
construction.

Note [a tier belongs to the process that opened it]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A child made with ``os.fork()`` inherits the open tiers and their files, fds and ``LOCK``
(its ``flock`` is shared with the parent's fd), and at its exit runs the exit hooks it
inherited (the tiers' ``atexit`` hook below, the optimizer's finalizer). Closing a file or a
tier there would delete the parent's state files and ``LOCK`` under the live parent, and
let a third process take the directory. So in a forked child (``os.register_at_fork``)
every inherited tier and each of its files is disowned: marked ``CLOSED`` in the child's
copy only, and nothing deleted, unlocked or closed. Closing them in the child is then a
no-op, and I/O on them raises; ``create_file`` on an inherited tier says why. The child
also forgets which directories this process locked (``state_dir._HELD``) and closes its
copies of their ``LOCK`` fds, whose ``flock`` stays the parent's: a tier the child opens on
the parent's directory is refused as in use by the parent, instead of counting itself
among the parent's users and writing beside the parent's files, unlocked (the parent's
last close would remove the directory under it); and a child that outlives the parent
does not keep the parent's lock held. The I/O the
parent had pending on the tier's buffers runs in the parent, on the parent's copy of them
(the engine's threads did not fork: Note [a forked child has no worker threads] in
``accelerator/forks.py``), so in the child they are free at once, and settling them
waits for nothing. The fds go with the child; the files and the lock stay the parent's.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import os
import weakref
from pathlib import Path

from ..accelerator import Accelerator
from ..caller_warning import warn_caller
from ..errors import StorageError, StorageFull
from .host_ram import check_host_ram
from .io_buffers import IO_BUFFERS, IOBuffer, IOBufferState
from .io_engine import IOEngine, IOEvent
from .state_dir import StateDirectory
from .storage_file import IO_ALIGNMENT, StorageFile, StorageState, aligned

__all__ = [  # the tier, and (re-exported) the names its users import from here
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


# Every open tier of this process, closed at interpreter exit (Note [stale directories]).
_OPEN_TIERS: weakref.WeakSet[StorageTier] = weakref.WeakSet()


@atexit.register
def _close_all_at_exit() -> None:
    for tier in list(_OPEN_TIERS):
        tier.close()


def _disown_after_fork() -> None:
    """In a forked child: Note [a tier belongs to the process that opened it]."""
    for tier in list(_OPEN_TIERS):
        tier._disown()
    _OPEN_TIERS.clear()


os.register_at_fork(after_in_child=_disown_after_fork)


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
        self._pid = os.getpid()  # Note [a tier belongs to the process that opened it]
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
            self.engine = IOEngine(workers, aligned(chunk_bytes))
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
                warn_caller(
                    f"zero-offload: the filesystem of {self.directory} refuses O_DIRECT "
                    f"({exc.strerror}); the NVMe tier falls back to buffered I/O there, so the "
                    "page cache will hold a copy of the optimizer state in host RAM too. Put "
                    "OffloadConfig.nvme_dir on a local disk (ext4, xfs) for direct I/O"
                )
        return os.open(path, flags, 0o600)

    # -- files ---------------------------------------------------------------------------

    def create_file(
        self, name: str, *, slots: int, record_bytes: int, lengths: list[int] | None = None
    ) -> StorageFile:
        """A new preallocated file of ``slots`` records (``StorageFull`` when it does not
        fit; its name must be unique in the directory); see ``StorageFile``."""
        if self._pid != os.getpid():  # Note [a tier belongs to the process that opened it]
            raise RuntimeError(
                f"storage tier {self.directory} was opened by process {self._pid}, and this "
                f"is process {os.getpid()}, forked from it: its files are that process's. "
                "Build a new optimizer in the child (with its own OffloadConfig.nvme_dir), or "
                "start the child with multiprocessing's 'spawn' or 'forkserver' start method"
            )
        if self.state is not StorageState.OPEN:
            raise RuntimeError(f"storage tier {self.directory} is {self.state.value} (bug)")
        file = StorageFile(self, name, slots=slots, record_bytes=record_bytes, lengths=lengths)
        self._files.add(file)
        return file

    def _forget(self, file: StorageFile) -> None:
        """``file`` is closed: the tier no longer closes it."""
        self._files.discard(file)

    def next_buffer(self) -> IOBuffer:
        """The ring's next buffer, round robin: the one whose last I/O was issued longest
        ago (the caller settles it before use)."""
        buffer = self.buffers[self._cursor % len(self.buffers)]
        self._cursor += 1
        return buffer

    def close(self) -> None:
        """Wait for pending I/O, delete every file, unlock and remove the directory (when
        no other tier of this process uses it). Idempotent; a no-op in a forked child (Note
        [a tier belongs to the process that opened it])."""
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

    def _disown(self) -> None:
        """This process is a forked child: the tier and its files are the parent's. Mark
        them closed here, touching nothing on disk (Note [a tier belongs to the process
        that opened it])."""
        self.state = StorageState.CLOSED
        for file in self._files:
            file.state = StorageState.CLOSED
        self._files.clear()
        for buffer in self.buffers:
            # The I/O pending at the fork runs in the parent, on the parent's copy of the
            # buffer; nothing will ever touch the child's copy: it is free here.
            buffer.event = None
            buffer.settle()
