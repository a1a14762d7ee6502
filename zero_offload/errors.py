"""Exception types shared across the library."""

from __future__ import annotations

from collections.abc import Callable

__all__ = [
    "Attempts",
    "CaptureRefused",
    "CollectiveError",
    "DefragmentationRefused",
    "DeviceBudgetExceeded",
    "ForkedStreamError",
    "PoolExhausted",
    "StorageError",
    "StorageFull",
    "StreamError",
    "StreamRaceError",
    "raised_again",
    "without_frames",
]


class DeviceBudgetExceeded(MemoryError):
    """A request for library-owned device memory does not fit the configured budget."""


class StreamError(RuntimeError):
    """Work queued on a stream failed; the original exception is the ``__cause__``.

    See Note [stream errors are sticky] in ``zero_offload.accelerator.base``.
    """


def without_frames(exc: BaseException) -> BaseException:
    """``exc``, and every exception in its cause and context chain, with no traceback: what
    a failed stream keeps (Note [a sticky error holds no frames] in
    ``zero_offload.accelerator.base``; the stream's error carries the traceback's text).
    Returns ``exc``."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        link = todo.pop()
        if link is None or id(link) in seen:
            continue
        seen.add(id(link))
        link.__traceback__ = None
        todo += [link.__cause__, link.__context__, *getattr(link, "exceptions", ())]
    return exc


def raised_again(exc: BaseException) -> BaseException:
    """A fresh copy of a stored ``exc`` to raise (same type, arguments and cause), so the
    stored one gathers no frames (Note [a sticky error holds no frames] in
    ``zero_offload.accelerator.base``); ``exc`` itself, without its traceback, when its
    type cannot be rebuilt from its arguments."""
    args = exc.args
    if isinstance(exc, OSError) and (exc.filename is not None or exc.filename2 is not None):
        # An OSError's file names are not among its args: rebuilt from them alone, the
        # message would no longer name the file.
        args = (exc.errno, exc.strerror, exc.filename, None, exc.filename2)
    try:
        fresh = type(exc)(*args)
    except Exception:
        return exc.with_traceback(None)
    fresh.__cause__ = exc.__cause__
    fresh.__dict__.update(exc.__dict__)  # attributes set on it (a StorageError's file)
    return fresh


class ForkedStreamError(StreamError):
    """A stream (or its event) was used in a forked child of the process that made it.

    The stream's worker thread did not fork, so what is queued there could never run; the
    message names both processes and the fix (build anew in the child, or start it with
    ``spawn``). See Note [a forked child has no worker threads] in
    ``zero_offload.accelerator.forks``.
    """


class PoolExhausted(MemoryError):
    """A ``BlockPool`` cannot serve a request, or cannot be created.

    Raised when an allocation does not fit even after waiting for pending copies and
    defragmenting, and when a host pool would not fit in the host RAM available now. The
    message names the request, the capacity, the bytes free, the largest free block and the
    setting to change.
    """


class DefragmentationRefused(PoolExhausted):
    """A pool was asked to compact (``defragment()``, or an allocation that would need it)
    while a backward pass runs on this thread: tensors autograd saved may view the blocks,
    and moving them would leave those views on stale bytes. See Note [no compaction inside
    backward] in ``zero_offload.memory.pool``."""


class CaptureRefused(RuntimeError):
    """Library work was issued while ``torch.compile`` traces or a CUDA graph captures.

    Streams, events, pool blocks and host copies cannot be replayed by a graph; see Note
    [no graph capture of library work] in ``zero_offload.accelerator.capture``.
    """


class CollectiveError(RuntimeError):
    """A collective across ranks failed or passed its deadline.

    The message names this rank, the collective and the bucket; see Note [collective
    deadlines] in ``zero_offload.collectives``.
    """


class StreamRaceError(RuntimeError):
    """Two streams touch a buffer and nothing orders the accesses (a missing wait).

    Raised by the host accelerator's race checker (``AcceleratorConfig(check_races=True)``
    or ``ZERO_OFFLOAD_CHECK_RACES=1``); the message names the buffer, both streams and both
    operations. See Note [race checking with vector clocks] in
    ``zero_offload.accelerator.race_checker``.
    """


class StorageError(RuntimeError):
    """A read or write of the NVMe tier failed, or a record's checksum did not match.

    The message names the file, the record and what to do (reload the optimizer from its
    last checkpoint); see ``zero_offload.memory.storage``.
    """


class StorageFull(OSError):
    """The NVMe tier's files do not fit the free space of ``nvme_dir`` (``ENOSPC``).

    The message names the bytes needed, the bytes free, the directory and the settings to
    change.
    """


class Attempts:
    """Release steps that each run even when one before them failed (a stream's sticky
    error, a record that cannot be read back): ``attempts(fn)`` runs ``fn`` and keeps what
    it raised; ``raise_first()`` raises the first error once every step has run."""

    def __init__(self) -> None:
        self.errors: list[BaseException] = []

    def __call__(self, fn: Callable[[], object]) -> None:
        try:
            fn()
        except BaseException as exc:  # kept, the first raised by raise_first
            self.errors.append(exc)

    def raise_first(self, *, unless: Callable[[BaseException], bool] | None = None) -> None:
        """Raise the first error kept, if any (and ``unless`` does not say to pass it over),
        and keep none: the errors' tracebacks hold the frames that hold this object, a
        cycle that kept the failed owner alive until the cyclic collector ran (Note [a
        sticky error holds no frames] in ``zero_offload.accelerator.base``)."""
        errors, self.errors = self.errors, []
        if not errors:
            return
        first = errors[0]
        del errors
        try:
            if unless is None or not unless(first):
                raise first
        finally:
            del first  # this frame is in the raised error's traceback
