"""Which errors already reached a caller: marks on an error's cause chain, so that the
releases after it (close(), a dropped owner's finalizer, the exit) do not report it again.

Note [an error reaches the caller once]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A failed stream raises its failure again at every call that meets it (Note [stream errors
are sticky]), each time a fresh copy whose ``__cause__`` chain is the failure's own objects
(Note [a sticky error holds no frames]). The releases that follow meet it too: close(), a
dropped optimizer's finalizer, the exit hooks. Raised from a finalizer, an error reaches
nobody and is printed ("Exception ignored in ..."), so a failure already raised to the
caller was printed again, once per finalizer, and a failure nobody had met was swallowed
at exit. So the links of an error's cause chain are marked ``surfaced`` when it leaves
the library: by ``surface_collective_errors`` (around the step's gradient wait, the
backward hooks and the forward's gathers) and by a release that raises it (to close()'s
caller, or printed by its finalizer). A release run by a finalizer or at exit passes over
a marked error and reports an unmarked one, once (``memory/quiet_exit.py``,
``passed_over``). Inside a release (``releasing``) nothing reaches a caller, so nothing
is marked there. A call that raises without passing here marks nothing (a ``StepFailed``
from the update's tile loop, a state dict's drain): at exit the error the script died
of counts all the same (``sys.last_value``), but a finalizer that runs while the program
goes on prints such a failure a second time.
A collective failure breaks the process group: every later collective of this process
fails with a new ``CollectiveError`` of its own (a ZeRO-3 close gathers each unit once
more), a consequence of the one the caller met. So once a ``CollectiveError`` has been
marked, every ``CollectiveError`` counts as surfaced.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress

from .errors import CollectiveError

__all__ = ["caused_by", "is_collective", "mark_surfaced", "releasing", "releasing_now", "surfaced"]


_RELEASES = threading.local()  # ``depth``: the releases running on this thread
_COLLECTIVE_SURFACED = [False]  # whether a CollectiveError reached a caller in this process


@contextmanager
def releasing() -> Iterator[None]:
    """Mark the calling thread as releasing: errors met inside reach no caller (Note [an
    error reaches the caller once])."""
    depth = getattr(_RELEASES, "depth", 0)
    _RELEASES.depth = depth + 1
    try:
        yield
    finally:
        _RELEASES.depth = depth


def _chain(error: BaseException) -> list[BaseException]:
    """``error`` and its ``__cause__`` chain, each link once (a re-raised cause can make it
    a cycle)."""
    links: list[BaseException] = []
    seen: set[int] = set()
    link: BaseException | None = error
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        links.append(link)
        link = link.__cause__
    return links


def mark_surfaced(error: BaseException) -> None:
    """Mark ``error`` as having reached a caller (Note [an error reaches the caller once])."""
    for link in _chain(error):
        if isinstance(link, CollectiveError):
            _COLLECTIVE_SURFACED[0] = True
        with suppress(AttributeError, TypeError):  # an exception type without a __dict__
            link.surfaced = True  # type: ignore[attr-defined]


def surfaced(error: BaseException) -> bool:
    """Whether ``error`` (or the failure it was raised for) already reached a caller (Note
    [an error reaches the caller once])."""
    links = _chain(error)
    if any(getattr(link, "surfaced", False) for link in links):
        return True
    return _COLLECTIVE_SURFACED[0] and is_collective(error)


def releasing_now() -> bool:
    """Whether a release runs on this thread (``releasing``): what is raised now reaches no
    caller."""
    return bool(getattr(_RELEASES, "depth", 0))


def caused_by(error: BaseException, types: type | tuple[type, ...]) -> bool:
    """Whether ``error`` or a link of its cause chain is one of ``types``."""
    return any(isinstance(link, types) for link in _chain(error))


def is_collective(error: BaseException) -> bool:
    """Whether ``error`` is a ``CollectiveError`` or was caused by one."""
    return any(isinstance(link, CollectiveError) for link in _chain(error))
