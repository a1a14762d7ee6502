"""What a release says at exit, or from a dropped owner's finalizer, about a failure that
already reached someone: ``passed_over`` (and ``quiet_at_exit``), and whether the interpreter
is exiting (``interpreter_exiting``).

Note [a quiet exit after a failed stream]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A process whose peer died raises its one ``CollectiveError`` (the stream's sticky error,
Note [stream errors are sticky]) and exits. At exit the finalizers of what it still holds
(the optimizer's ``Resources.release``, each pool's drain) meet the same failed streams
and broken process group; an error raised there reaches nobody and is only printed, once
per finalizer, burying the one that matters. So a release run at exit, or by the
finalizer of an owner that was dropped, passes over a first error that already reached a
caller (Note [an error reaches the caller once] in ``error_marks.py``), or that the
interpreter printed as uncaught (``sys.last_value``: the error the script died of, which
may have left through a call that marks nothing, a user's own call on a failed stream), and what
followed from it (pools still holding blocks); one that reached nobody is raised, marked
as it goes, so that it is printed once and the releases after it pass over it
(``passed_over``).
``_EXITING`` is set by an ``atexit`` hook that runs before
``weakref.finalize``'s own (atexit runs hooks last-registered first, and the dummy
finalizer below makes sure weakref's hook is registered before ours).
"""

from __future__ import annotations

import atexit
import contextlib
import sys
import threading
import weakref

from ..error_marks import is_collective, mark_surfaced, same_collective_failure, surfaced

__all__ = ["interpreter_exiting", "passed_over", "quiet_at_exit"]

_EXITING = False


def _mark_exit() -> None:
    global _EXITING
    _EXITING = True


weakref.finalize(_mark_exit, lambda: None)
atexit.register(_mark_exit)
# Python's thread pools (the NVMe I/O engine's) shut down in threading's own exit hooks,
# which all run before any atexit hook: a hook of the user's (atexit.register(opt.close))
# meets them dead, so the exit is marked among threading's hooks too.
with contextlib.suppress(AttributeError, RuntimeError):  # private, present since 3.9
    threading._register_atexit(_mark_exit)  # type: ignore[attr-defined]


def interpreter_exiting() -> bool:
    """Whether the interpreter is running its exit hooks (Note [a quiet exit after a failed
    stream])."""
    return _EXITING


def passed_over(error: BaseException, *, dropped: bool = False) -> bool:
    """Whether a release's first ``error`` is passed over (``Attempts.raise_first(unless=
    ...)``): at exit or when its owner was ``dropped`` (a finalizer: Note [a quiet exit after
    a failed stream]), one that already reached a caller; in a close() call, a collective
    failure that did (Note [a release after a collective failure the caller saw] in
    ``optim/lifetime.py``). One not passed over is marked: it is raised now, to close()'s
    caller or printed by the finalizer, and is not reported again."""
    seen = surfaced(error) or _printed_uncaught(error)
    if seen and (dropped or _EXITING or is_collective(error)):
        return True
    mark_surfaced(error)
    return False


def _links(error: BaseException | None) -> list[BaseException]:
    """``error`` and every exception in its cause and context chains, each once."""
    links: list[BaseException] = []
    seen: set[int] = set()
    todo = [error]
    while todo:
        link = todo.pop()
        if link is None or id(link) in seen:
            continue
        seen.add(id(link))
        links.append(link)
        todo += [link.__cause__, link.__context__]
    return links


def _printed_uncaught(error: BaseException) -> bool:
    """Whether the failure behind ``error`` is in the last error the interpreter printed
    as uncaught (``sys.last_value``: the one a script died of, or a notebook cell's): one
    that reached the caller through a call that does not mark what it raises (a user's own
    call on a failed stream). A collective failure counts for every failure of its scope,
    as in Note [a collective failure breaks its owner's collectives] in ``error_marks.py``."""
    last = getattr(sys, "last_value", None)
    if last is None:
        return False
    printed = _links(last)
    ids = {id(link) for link in printed}
    if any(id(link) in ids for link in _links(error)):
        return True
    return same_collective_failure(error, printed)


def quiet_at_exit(error: BaseException) -> bool:
    """``passed_over`` for a release whose owner is not known to be dropped."""
    return passed_over(error)
