"""Which process a library thread, and what waits on it, belongs to: what a forked child may
use of what its parent built.

A thread stream (``threads.py``) and the NVMe engine (``memory/io_engine.py``) each run work
on threads of their own; both ask here whether the calling process is the one those threads
run in, and both refuse with the same ``ForkedStreamError`` when it is not.

Note [a forked child has no worker threads]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``os.fork()`` copies only the calling thread. A stream made before a fork exists in the child
(its queue, its pending events, each a held lock: Note [a thread event is a held lock] in
``threads.py``), but its worker thread does not: nothing queued there will run, and a wait
for it would block forever. So a worker remembers the process that started it, and an event
the process it was born in (``_PID``: this process's pid, reset in a forked child by
``os.register_at_fork``). In any other process every call into the stream, and every wait
that would block on one of its events, raises ``ForkedStreamError`` naming both pids and the
fix. An event complete before the fork is complete in the child too, and waiting for it
returns. Such a stream counts as ``closed`` in the child (its worker runs nowhere there:
``Accelerator.synchronize`` passes over it), and closing it there joins no thread. The
parent is untouched, and a child that never calls into what the parent built (a
``DataLoader`` worker) never notices.
``ForkedStreamError`` is a ``StreamError``: a child that exits while it still holds the
parent's optimizer releases it quietly (Note [a quiet exit after a failed stream] in
``memory/quiet_exit.py``), and the parent's NVMe files stay the parent's (Note [a tier belongs
to the process that opened it] in ``memory/storage.py``).
"""

from __future__ import annotations

import os

from ..errors import ForkedStreamError

__all__ = ["forked_error", "this_process"]

# This process's pid, kept current in forked children: Note [a forked child has no worker
# threads]. A global, not ``os.getpid()``, because every event reads it (a system call).
# ``threads.py`` reads it as ``forks._PID``, the module's attribute (a name imported from
# here would keep the parent's pid in a child); elsewhere, ``this_process()``.
_PID = os.getpid()


def _after_fork_in_child() -> None:
    global _PID
    _PID = os.getpid()


os.register_at_fork(after_in_child=_after_fork_in_child)


def this_process() -> int:
    """This process's pid, without a system call (Note [a forked child has no worker
    threads]): what an event made here remembers, to know a forked child."""
    return _PID


def forked_error(what: str, owner: int) -> ForkedStreamError:
    """The error for ``what``, made by process ``owner``, used in this forked child."""
    return ForkedStreamError(
        f"{what} belongs to process {owner}, and this is process {os.getpid()}, forked from "
        "it: the stream's worker thread did not fork (os.fork() copies only the calling "
        "thread), so work queued there can never run and waiting for it would hang forever. "
        f"Use an optimizer only in the process that built it (here, process {owner}): build "
        "a new one in the child, or start the child with multiprocessing's 'spawn' or "
        "'forkserver' start method; see Note [a forked child has no worker threads]"
    )
