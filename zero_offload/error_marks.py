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
backward hooks and the forward's gathers), by the optimizer's public methods
(``said_to_caller``: step(), zero_grad(), flush_pending_update(), close(), backward(),
announce_step(), clip_grad_norm_(), add_param_group(), the state dict and streaming
checkpoint methods) whatever they raise, and by a release that raises it (to
close()'s caller, or printed by its finalizer). A release run by a finalizer or at exit
passes over a marked error and reports an unmarked one, once (``memory/quiet_exit.py``,
``passed_over``). Inside a release (``releasing``) nothing reaches a caller, so nothing
is marked there. Before the public methods marked, a ``StepFailed`` from the update's tile
loop or a state dict's drain left unmarked: a program that caught it and went on saw it
printed again when it dropped the optimizer. What still leaves through a call that marks
nothing (a user's own call on a failed stream) counts at exit as the error the script died
of (``sys.last_value``).

Note [a collective failure breaks its owner's collectives]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A collective failure breaks the process group it ran on: every later collective there
fails with a new ``CollectiveError`` of its own (a ZeRO-3 close gathers each unit once
more), a consequence of the one the caller met. So once a ``CollectiveError`` has been
marked, every ``CollectiveError`` of its ``CollectiveScope`` counts as surfaced: one scope
per optimizer, which its comms share (``collectives.CommCounters``: a ZeRO-3 optimizer's
gather group, made beside its own group over the same ranks, fails with it). The scope
was the whole process: with two optimizers in one process, each on a group of its own
(Note [a process group of the optimizer's own] in ``optim/ranks.py``), the first one's
failure made the second one's, which no caller had met, count as seen, and nobody was
told. A ``CollectiveError`` raised with no scope counts for its own cause chain only.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from typing import Any, TypeVar

from .errors import CollectiveError

__all__ = [
    "CollectiveScope",
    "caused_by",
    "is_collective",
    "mark_surfaced",
    "releasing",
    "releasing_now",
    "said_to_caller",
    "same_collective_failure",
    "surfaced",
]

F = TypeVar("F", bound=Callable[..., Any])

_RELEASES = threading.local()  # ``depth``: the releases running on this thread


class CollectiveScope:
    """The collectives that one failure breaks together (an optimizer's), and whether a
    failure of theirs reached a caller: Note [a collective failure breaks its owner's
    collectives]. A ``CollectiveError`` carries its scope as ``scope``."""

    __slots__ = ("surfaced",)

    def __init__(self) -> None:
        self.surfaced = False  # a CollectiveError of this scope reached a caller

    def tag(self, error: CollectiveError) -> CollectiveError:
        """``error``, raised by a collective of this scope (its copies keep the tag:
        ``errors.raised_again`` copies the attributes)."""
        error.scope = self  # type: ignore[attr-defined]
        return error


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


def said_to_caller(method: F) -> F:
    """``method``, a public entry point, marking what it raises: it reaches the caller (Note
    [an error reaches the caller once]); run inside a release, it marks nothing."""

    @functools.wraps(method)
    def marking(*args: Any, **kwargs: Any) -> Any:
        try:
            return method(*args, **kwargs)
        except BaseException as exc:
            if not releasing_now():
                mark_surfaced(exc)
            raise

    return marking  # type: ignore[return-value]


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


def _scopes(links: list[BaseException]) -> list[CollectiveScope]:
    """The scopes of the ``CollectiveError``s among ``links``."""
    found = (getattr(link, "scope", None) for link in links if isinstance(link, CollectiveError))
    return [scope for scope in found if isinstance(scope, CollectiveScope)]


def mark_surfaced(error: BaseException) -> None:
    """Mark ``error`` as having reached a caller (Note [an error reaches the caller once]),
    and its collective failures' scopes (Note [a collective failure breaks its owner's
    collectives])."""
    links = _chain(error)
    for scope in _scopes(links):
        scope.surfaced = True
    for link in links:
        with suppress(AttributeError, TypeError):  # an exception type without a __dict__
            link.surfaced = True  # type: ignore[attr-defined]


def surfaced(error: BaseException) -> bool:
    """Whether ``error`` (or the failure it was raised for) already reached a caller (Note
    [an error reaches the caller once])."""
    links = _chain(error)
    if any(getattr(link, "surfaced", False) for link in links):
        return True
    return any(scope.surfaced for scope in _scopes(links))


def same_collective_failure(error: BaseException, others: list[BaseException]) -> bool:
    """Whether a ``CollectiveError`` of ``error``'s cause chain shares its scope with one
    among ``others``: a consequence of the same broken collectives (Note [a collective
    failure breaks its owner's collectives])."""
    mine = {id(scope) for scope in _scopes(_chain(error))}
    return any(id(scope) in mine for scope in _scopes(others))


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
