"""Every file the library writes, written so that a failed or killed write loses nothing.

Note [atomic replacement]
~~~~~~~~~~~~~~~~~~~~~~~~~
A checkpoint (``save_streaming``'s directory, ``save_consolidated``'s file) and every export
(a trace, a report) replaces its previous version only once the new one is complete and
durable:

- a file is written to a hidden sibling ``.name.tmp-<pid>-<random>`` (created with
  ``O_EXCL``), flushed and ``fsync``-ed, renamed over ``name`` (``rename`` is atomic within
  a directory), and the directory is ``fsync``-ed so the rename itself survives a crash;
- a directory is written as the sibling ``name.tmp-<pid>-<random>/``; its files and the
  directory are ``fsync``-ed, then the old one is renamed to ``name.old``, the new one to
  ``name``, the parent is ``fsync``-ed and ``name.old`` is removed (a removal that fails
  only warns: the save is done, and the next save or load of ``name`` removes it).

A write that raises removes its temporary and leaves ``name`` as it was. A process killed at
any point leaves either the old version or the new one loadable: killed between the two
renames of a directory swap, only ``name.old`` is there, and ``recover_directory`` (called by
the loaders and before each save) renames it back; killed after them, both are, and the new
one wins. A disk that fills up mid-write raises ``StorageFull`` naming the bytes, and the old
version stays. Temporaries of killed writers are removed by the next save of that name: see
Note [a write that cannot finish]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A save can stop on a full disk (ENOSPC), a user's quota (EDQUOT) or a file-size limit
(EFBIG: ``ulimit -f``, or a filesystem such as FAT32 that caps a file at 4 GiB). The last two
reached the caller as the bare "[Errno 27] File too large" or "Disk quota exceeded", with no
file and no bytes. A quota is StorageFull now, as a full disk is (its message names quotas);
EFBIG names the file, what was written and both limits it can be. The previous version stays
either way (Note [atomic replacement]).

Note [a dead writer's temporaries].

Note [a dead writer's temporaries]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A writer killed mid-save leaves its temporary (``.name.tmp-<pid>-<random>`` for a file,
``name.tmp-<pid>-<random>/`` for a directory), as large as the save. Before it writes, every
save of ``name`` (``atomic_file`` and ``atomic_directory``, so every caller of either)
removes the temporaries of ``name`` whose writer is gone, and never a live writer's (two
processes, or two threads, may save one name): a temporary goes when the pid in its name is
not this process's and no process of that pid exists. A pid reused since keeps the
temporary (a later save removes it, once that process is gone too). Pids are a host's own:
writers on two machines saving one name on a shared filesystem (or in two pid namespaces)
would see each other as dead, but they would also replace each other's saves; give them
different names. Only names of exactly that shape are touched, and removal is best effort (a
failure leaves the temporary for the next save, and the save goes on).

Note [private files]
~~~~~~~~~~~~~~~~~~~~
Optimizer state on disk is the model: files are created ``0600`` and directories ``0700``
whatever the umask (a umask only removes bits, so the mode is set explicitly after creation),
and directories that exist already are left as they are.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import secrets
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

import torch

from .caller_warning import warn_caller
from .config import format_bytes
from .errors import StorageFull

__all__ = [
    "DIR_MODE",
    "FILE_MODE",
    "atomic_directory",
    "atomic_file",
    "free_bytes",
    "make_private_dirs",
    "private_file",
    "recover_directory",
    "save_torch",
    "write_text",
]

FILE_MODE = 0o600  # Note [private files]
DIR_MODE = 0o700

# The system calls the protocol depends on, looked up at call time (tests inject faults and
# kills at each step by replacing them).
_fsync: Callable[[int], None] = os.fsync
_replace: Callable[[Any, Any], None] = os.replace
_rmtree: Callable[..., None] = shutil.rmtree

_OLD_SUFFIX = ".old"
_TMP_MARK = ".tmp-"
# What follows ``_TMP_MARK`` in a temporary's name: ``<pid>-<random>`` (``_sibling``).
_TMP_TAIL = re.compile(r"([0-9]+)-[0-9a-f]{8}")


def free_bytes(path: str | os.PathLike[str]) -> int | None:
    """Bytes free for this user on ``path``'s filesystem, or ``None`` when the filesystem
    does not say (``f_blocks == 0``: ramfs and some FUSE filesystems report 0 of 0)."""
    stats = os.statvfs(path)
    if stats.f_blocks == 0:
        return None
    return stats.f_bavail * stats.f_frsize


def make_private_dirs(path: str | os.PathLike[str]) -> Path:
    """Create ``path`` and its missing parents, each ``0700`` (Note [private files]);
    directories that exist are left alone. Returns ``Path(path)``."""
    path = Path(path)
    missing = []
    probe = path
    while not probe.exists() and probe != probe.parent:
        missing.append(probe)
        probe = probe.parent
    for directory in reversed(missing):
        try:
            os.mkdir(directory, DIR_MODE)
        except FileExistsError:
            continue  # another rank made it first
        os.chmod(directory, DIR_MODE)
    return path


def private_file(path: str | os.PathLike[str]) -> BinaryIO:
    """A new file at ``path`` (it must not exist), ``0600``, open for binary writing; for
    files inside an ``atomic_directory`` staging directory (which is made durable whole)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, FILE_MODE)
    try:
        os.fchmod(fd, FILE_MODE)
        return os.fdopen(fd, "wb")
    except BaseException:
        os.close(fd)
        raise


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        _fsync(fd)
    finally:
        os.close(fd)


def _sibling() -> str:
    return f"{_TMP_MARK}{os.getpid()}-{secrets.token_hex(4)}"


def _full(exc: OSError, path: Path, what: str, written: int, needed: int | None) -> StorageFull:
    total = f" of {format_bytes(needed)} ({needed} bytes)" if needed is not None else ""
    error = StorageFull(
        f"{what}: the disk holding {path} is full ({exc.strerror or exc}; a quota counts too) "
        f"after writing {format_bytes(written)} ({written} bytes){total}. Nothing was "
        f"replaced: the previous {path.name} is as it was. Free space or write elsewhere"
    )
    error.errno = errno.ENOSPC
    return error


def _too_large(exc: OSError, path: Path, what: str, written: int) -> OSError:
    """The error for a write past a file-size limit (``EFBIG``), naming the file and bytes."""
    return OSError(
        errno.EFBIG,
        f"{what}: a file of {path} outgrew the largest file allowed ({exc.strerror or exc}) "
        f"after {format_bytes(written)} ({written} bytes) were written: the process's "
        "file-size limit (ulimit -f) or its filesystem's largest file (FAT32: 4 GiB). Nothing "
        f"was replaced: the previous {path.name} is as it was. Raise the limit or write to "
        "another filesystem",
        str(path),
    )


def _failed_write(exc: OSError, path: Path, what: str, written: int, needed: int | None) -> None:
    """Raise what a failed write means to the user (Note [a write that cannot finish]);
    return for an error told as it is."""
    if isinstance(exc, StorageFull):
        return
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        raise _full(exc, path, what, written, needed) from exc
    if exc.errno == errno.EFBIG:
        raise _too_large(exc, path, what, written) from exc


def _check_space(parent: Path, needed: int | None, path: Path, what: str) -> None:
    if needed is None:
        return
    free = free_bytes(parent)
    if free is not None and needed > free:
        error = StorageFull(
            f"{what}: writing {path} needs {format_bytes(needed)} ({needed} bytes) but only "
            f"{format_bytes(free)} ({free} bytes) is free on its disk. Nothing was written: "
            f"the previous {path.name} is as it was. Free space or write elsewhere"
        )
        error.errno = errno.ENOSPC
        raise error


@contextlib.contextmanager
def atomic_file(
    path: str | os.PathLike[str], *, what: str, nbytes: int | None = None
) -> Iterator[BinaryIO]:
    """Write ``path`` through the yielded binary file; it replaces ``path`` only when the
    block ends without raising (Note [atomic replacement]). ``nbytes``, when known, is
    checked against the free space first (``StorageFull``); ``what`` names the caller in
    errors."""
    path = Path(path)
    parent = make_private_dirs(path.parent)
    _remove_dead_temporaries(path)
    _check_space(parent, nbytes, path, what)
    tmp = parent / f".{path.name}{_sibling()}"
    handle = private_file(tmp)
    try:
        with handle:
            yield handle
            handle.flush()
            _fsync(handle.fileno())
        _replace(tmp, path)
        _fsync_path(parent)
    except OSError as exc:
        written = _file_bytes(tmp)
        tmp.unlink(missing_ok=True)
        _failed_write(exc, path, what, written, nbytes)
        raise
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _file_bytes(path: Path) -> int:
    with contextlib.suppress(OSError):
        return path.stat().st_size
    return 0


def save_torch(obj: Any, path: str | os.PathLike[str], *, what: str) -> None:
    """``torch.save(obj, path)``, atomically (Note [atomic replacement])."""
    with atomic_file(path, what=what) as handle:
        torch.save(obj, handle)


def write_text(path: str | os.PathLike[str], text: str, *, what: str) -> None:
    """Write ``text`` (UTF-8) to ``path``, atomically (Note [atomic replacement])."""
    data = text.encode()
    with atomic_file(path, what=what, nbytes=len(data)) as handle:
        handle.write(data)


def recover_directory(path: str | os.PathLike[str]) -> None:
    """Finish or undo a directory swap a killed process left half done (Note [atomic
    replacement]): ``path.old`` alone goes back to ``path``; next to ``path`` it goes."""
    path = Path(path)
    old = path.with_name(path.name + _OLD_SUFFIX)
    if not old.is_dir():
        return
    if path.exists():
        _rmtree(old)
    else:
        _replace(old, path)
        _fsync_path(path.parent)


def _remove_dead_temporaries(path: Path) -> None:
    """Remove the temporaries of ``path`` (files and staging directories) whose writer is
    gone; Note [a dead writer's temporaries]."""
    prefixes = (f".{path.name}{_TMP_MARK}", f"{path.name}{_TMP_MARK}")  # a file's, a directory's
    try:
        entries = list(os.scandir(path.parent))
    except OSError:
        return  # best effort: the save itself reports a directory it cannot use
    for entry in entries:
        prefix = next((p for p in prefixes if entry.name.startswith(p)), None)
        if prefix is None:
            continue
        tail = _TMP_TAIL.fullmatch(entry.name[len(prefix) :])
        if tail is None or int(tail.group(1)) == os.getpid() or _alive(int(tail.group(1))):
            continue
        if entry.is_dir(follow_symlinks=False):
            _rmtree(entry.path, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                os.unlink(entry.path)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by another user
    except (OverflowError, ValueError):
        return True  # no pid this large: not ours to judge, so kept
    return True


@contextlib.contextmanager
def atomic_directory(
    path: str | os.PathLike[str], *, what: str, nbytes: int | None = None
) -> Iterator[Path]:
    """Yield an empty private staging directory; when the block ends without raising, its
    files and itself are made durable and it replaces ``path`` (Note [atomic replacement]).
    Write files in it with ``private_file``. ``nbytes``: what the files will hold, checked
    against the free space first (``StorageFull``); ``what`` names the caller in errors."""
    path = Path(path)
    parent = make_private_dirs(path.parent)
    recover_directory(path)
    _remove_dead_temporaries(path)
    _check_space(parent, nbytes, path, what)
    staging = parent / (path.name + _sibling())
    os.mkdir(staging, DIR_MODE)
    os.chmod(staging, DIR_MODE)
    try:
        yield staging
        for entry in sorted(staging.iterdir()):
            _fsync_path(entry)
        _fsync_path(staging)
        _swap(staging, path)
    except OSError as exc:
        written = _tree_bytes(staging)
        _undo(staging, path)
        _failed_write(exc, path, what, written, nbytes)
        raise
    except BaseException:
        _undo(staging, path)
        raise


def _undo(staging: Path, path: Path) -> None:
    """A failed save: its staging goes, and a swap it left half done is undone."""
    _rmtree(staging, ignore_errors=True)
    with contextlib.suppress(OSError):
        recover_directory(path)


def _tree_bytes(directory: Path) -> int:
    with contextlib.suppress(OSError):
        return sum(_file_bytes(entry) for entry in directory.iterdir())
    return 0


def _swap(staging: Path, path: Path) -> None:
    # Each step leaves a loadable state behind (Note [atomic replacement]).
    old = path.with_name(path.name + _OLD_SUFFIX)
    if path.exists():
        _replace(path, old)
    _replace(staging, path)
    _fsync_path(path.parent)
    if old.exists():
        try:
            _rmtree(old)
        except OSError as exc:
            # The save succeeded: the new version is in place and durable. What is left is
            # the previous one, which the next save or load of ``path`` removes
            # (``recover_directory``); a failed save would be the wrong report.
            warn_caller(
                f"zero-offload: saved {path}, but could not remove the previous version at "
                f"{old} ({exc}); the next save or load of {path} removes it, or remove it "
                "yourself",
                RuntimeWarning,
            )
