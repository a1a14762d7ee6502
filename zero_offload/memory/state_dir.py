"""The NVMe tier's directory ``nvme_dir/rank{r}``: checked, private, locked, and cleaned.

One ``StateDirectory`` per ``StorageTier``; the tiers of one process that use the same
directory share its lock (a count per directory, ``_HELD``). See ``storage.py`` for what goes
in it.

Note [the directory is checked and private]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The state files are the model. ``nvme_dir`` (``~`` expanded) must be a directory this user
owns that group and others cannot write to, or one we can create; every directory we create
is ``0700`` and every file ``0600`` whatever the umask (Note [private files] in
``fileio.py``). A directory another user owns, or one others can write to, could have its
state read or swapped under us: it is refused with a ``ValueError`` saying so. An OS error
(no permission, a read-only filesystem, a file in the way) names ``OffloadConfig.nvme_dir``
and the path.

Note [stale directories]
~~~~~~~~~~~~~~~~~~~~~~~~
The ``LOCK`` file is held with ``flock`` for as long as a tier of this process uses the
directory, and holds the host name and the pid. Taking it is atomic (two processes racing
cannot both hold it), and the kernel drops it when its holder dies, however it dies. A tier
removes its files, then the lock and the directory, at ``close()`` and at interpreter exit
(``atexit``); a process killed by a signal leaves them behind. At the next construction:
a ``LOCK`` that can be taken but names a process means its writer is gone, so the directory
is stale: its record files (``*.zo-state``, never anything else) are deleted with a warning.
A lock held by a live process, or written on another host (a shared filesystem, where the
lock may be local to each host), is refused with the pid and the host, and what to do.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
import stat
import threading
from pathlib import Path

from ..caller_warning import warn_caller
from ..config import format_bytes
from ..fileio import DIR_MODE, FILE_MODE, free_bytes, make_private_dirs

__all__ = ["FILE_SUFFIX", "LOCK_NAME", "StateDirectory", "check_nvme_dir"]

#: Suffix of the record files; a stale directory loses these and nothing else.
FILE_SUFFIX = ".zo-state"
LOCK_NAME = "LOCK"

# The lock's fd and how many tiers of this process use it, per directory; guarded by _LOCK.
_HELD: dict[Path, tuple[int, int]] = {}
_LOCK = threading.Lock()


def _forget_after_fork() -> None:
    """In a forked child the locks are the parent's: Note [a tier belongs to the process
    that opened it] in ``storage.py``."""
    global _LOCK
    _LOCK = threading.Lock()  # another thread of the parent may have held it at the fork
    for fd, _users in _HELD.values():
        with contextlib.suppress(OSError):
            os.close(fd)  # the child's copy: the parent's flock stays, held by the parent's
    _HELD.clear()


os.register_at_fork(after_in_child=_forget_after_fork)


def _os_error(exc: OSError, root: object, path: Path, doing: str) -> OSError:
    error = type(exc)(
        exc.errno,
        f"OffloadConfig.nvme_dir={str(root)!r}: cannot {doing} {path}: {exc.strerror or exc}. "
        "Point OffloadConfig.nvme_dir at a directory on a local disk that this user can write",
    )
    error.filename = str(path)
    return error


def _check_private(path: Path, root: object) -> None:
    """Refuse ``path`` unless this user owns it and only this user may write to it."""
    try:
        info = os.stat(path)
    except OSError as exc:
        raise _os_error(exc, root, path, "inspect") from exc
    if not stat.S_ISDIR(info.st_mode):
        raise ValueError(
            f"OffloadConfig.nvme_dir={str(root)!r}: {path} exists and is not a directory; "
            "give a directory (or a path where one can be created)"
        )
    if info.st_uid != os.geteuid():
        raise ValueError(
            f"OffloadConfig.nvme_dir={str(root)!r}: {path} is owned by uid {info.st_uid}, not "
            f"by this user (uid {os.geteuid()}): its owner could read or replace the optimizer "
            "state. Use a directory of your own"
        )
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise ValueError(
            f"OffloadConfig.nvme_dir={str(root)!r}: {path} has mode "
            f"{stat.S_IMODE(info.st_mode):#o}, so other users can write to it and replace the "
            f"optimizer state. Use a directory only you can write to (chmod go-w {path}, or a "
            "new path, which is created 0700)"
        )
    if not os.access(path, os.W_OK | os.X_OK):
        raise _os_error(PermissionError(errno.EACCES, "not writable"), root, path, "write to")


def check_nvme_dir(root: str | os.PathLike[str]) -> Path:
    """``root`` with ``~`` expanded, created (``0700``) when missing, and checked; Note [the
    directory is checked and private]."""
    path = Path(os.path.expanduser(os.fspath(root)))
    if not path.exists():
        try:
            make_private_dirs(path)
        except OSError as exc:
            raise _os_error(exc, root, path, "create") from exc
    _check_private(path, root)
    return path


class StateDirectory:
    """``root/rank{rank}``: see the module docstring.

    ``acquire`` creates and locks it (shared by this process's tiers); ``release`` gives the
    lock back and, after the last user, removes the lock and the (empty) directory."""

    def __init__(self, root: str | os.PathLike[str], *, rank: int) -> None:
        self.root = check_nvme_dir(root)
        self.path = self.root / f"rank{rank}"
        self.rank = rank
        self._config_value = root

    def free_bytes(self) -> int | None:
        """Bytes free for this user on the directory's filesystem now; ``None`` when the
        filesystem does not say (ramfs reports 0 of 0 blocks: unknown, not full)."""
        return free_bytes(self.path if self.path.exists() else self.root)

    def full_message(self, needed: int, *, what: str, refused: bool = False) -> str:
        """The ``StorageFull`` message: what, bytes needed, free, where, and the fix.
        ``refused``: the filesystem said ENOSPC although it reports space (a quota)."""
        free = self.free_bytes()
        shown = "an unknown amount" if free is None else f"{format_bytes(free)} ({free} bytes)"
        where = (
            f"the filesystem refused to allocate it (ENOSPC: full, or over a quota) while "
            f"it reports {shown} free"
            if refused
            else f"only {shown} is free there"
        )
        return (
            f"rank {self.rank}: {what} needs {format_bytes(needed)} ({needed} bytes) on "
            f"disk under {self.path}, but {where}. Free space (or raise the quota), point "
            "OffloadConfig.nvme_dir at a larger disk, or raise OffloadConfig.host_budget so "
            "that less state goes to disk"
        )

    def acquire(self) -> None:
        """Create and lock the directory; Note [stale directories]."""
        with _LOCK:
            held = _HELD.get(self.path)
            if held is not None:
                _HELD[self.path] = (held[0], held[1] + 1)
                return
            if self.path.exists():
                try:
                    _check_private(self.path, self._config_value)
                except (OSError, ValueError):
                    # Its last user (another process) removed it between the two looks:
                    # not this directory's fault; _take_lock makes it again, private.
                    if self.path.exists():
                        raise
            fd = self._take_lock()
            _HELD[self.path] = (fd, 1)

    def release(self) -> None:
        """One user fewer; the last one unlocks and removes the lock and the directory."""
        with _LOCK:
            fd, users = _HELD.pop(self.path, (-1, 0))
            if users > 1:
                _HELD[self.path] = (fd, users - 1)
                return
            if fd < 0:
                return
            # Unlink before unlocking: a process that opened this inode meanwhile sees it
            # is no longer the LOCK (``_take_lock`` compares inodes) and tries again.
            with contextlib.suppress(OSError):
                (self.path / LOCK_NAME).unlink()
            os.close(fd)
            # Not empty: files that are not ours stay, and so does the directory.
            with contextlib.suppress(OSError):
                self.path.rmdir()

    def _take_lock(self) -> int:
        lock = self.path / LOCK_NAME
        host = socket.gethostname()
        while True:
            try:
                make_private_dirs(self.path)
                fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, FILE_MODE)
            except FileNotFoundError:
                continue  # the last user removed the directory just now: make it again
            except OSError as exc:
                raise _os_error(exc, self._config_value, lock, "create") from exc
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                owner_host, pid = _read_owner(fd)
                os.close(fd)
                raise ValueError(_in_use(self.path, owner_host, pid, host)) from None
            if _same_file(fd, lock):
                break
            os.close(fd)  # we locked a LOCK its holder had just removed: try again
        try:
            os.fchmod(fd, FILE_MODE)
            os.chmod(self.path, DIR_MODE)
            owner_host, pid = _read_owner(fd)
            if owner_host is not None and owner_host != host:
                raise ValueError(_in_use(self.path, owner_host, pid, host))
            if owner_host is not None or pid is not None:
                _clean_stale(self.path, pid)
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{host}\n{os.getpid()}\n".encode(), 0)
        except BaseException:
            os.close(fd)  # refused: the LOCK is left as it was found
            raise
        return fd


def _same_file(fd: int, path: Path) -> bool:
    try:
        here, there = os.fstat(fd), os.stat(path)
    except FileNotFoundError:
        return False
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)


def _read_owner(fd: int) -> tuple[str | None, int | None]:
    """(host, pid) written in the lock; (None, None) when empty; a torn or unreadable lock
    (its writer died writing it) reads as this host with an unknown pid."""
    try:
        text = os.pread(fd, 4096, 0).decode()
    except (OSError, UnicodeDecodeError):
        return socket.gethostname(), None
    if not text:
        return None, None
    try:
        owner_host, owner_pid = text.split()
        return owner_host, int(owner_pid)
    except ValueError:
        return socket.gethostname(), None


def _in_use(directory: Path, owner_host: str | None, pid: int | None, host: str) -> str:
    who = f"pid {pid}" if pid is not None else "a process that has not written its pid yet"
    if owner_host is not None and owner_host != host:
        return (
            f"nvme_dir {directory} is locked by {who} on host {owner_host!r} (this is "
            f"{host!r}): another machine may be using it. Give each machine its own "
            f"OffloadConfig.nvme_dir, or delete {directory} if that run is gone"
        )
    process = f"the live process {pid}" if pid is not None else who
    return (
        f"nvme_dir {directory} is in use by {process} on this host. Give each concurrent "
        "run its own OffloadConfig.nvme_dir (or stop that process)"
    )


def _clean_stale(directory: Path, pid: int | None) -> None:
    """Remove a dead process's record files; Note [stale directories]."""
    stale = sorted(directory.glob(f"*{FILE_SUFFIX}"))
    nbytes = sum(path.stat().st_size for path in stale)
    for path in stale:
        path.unlink(missing_ok=True)
    warn_caller(
        f"zero-offload: {directory} was left by process {pid if pid is not None else '?'}, "
        f"which is gone (killed?); removed its {len(stale)} state file(s) "
        f"({format_bytes(nbytes)})"
    )
