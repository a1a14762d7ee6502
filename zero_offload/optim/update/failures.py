"""What a step that failed part-way says: ``StepFailed``, and the note an interrupt carries.

The seam of ``modes.py`` (Note [a step is all or nothing] and Note [an interrupt is not a
failure] there): which buckets were stepped, how far the step got in the one it stopped in
(``BucketPart``), the rank a collective found absent, and how to get the optimizer back.
``modes.py`` and ``eager.py`` raise them.

Note [what a stopped step says]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The summary says exactly what the step did, because the recovery depends on it. The buckets
before the one it stopped in were stepped and counted. The one it stopped in is untouched
(its update had not started: the interrupt came in its write check), partly stepped (its
update was running), or stepped but not counted (its update was done, its step count not
advanced yet). A step that stopped after every bucket was stepped and counted (while its
weights landed, which the step waits for before it leaves: Note [an interrupted step's
copies land before it leaves] in ``modes.py``) was applied whole: the state is one step
further and needs no reload, only ``zero_grad()``, since the window's gradients were taken.
Before, every stop said "bucket k was partly stepped", and one after the whole step said
nothing at all.
"""

from __future__ import annotations

import enum
import logging
import re
from collections.abc import Sequence

from ...errors import CollectiveError
from ..flat_bucket import FlatBucket
from ..ranks import Ranks

__all__ = ["BucketPart", "StepFailed", "failed", "interrupted"]

_log = logging.getLogger("zero_offload")


class StepFailed(RuntimeError):
    """A step failed after it started changing the optimizer state; see Note [a step is
    all or nothing]."""


class BucketPart(enum.Enum):
    """How far a step that stopped got in the bucket it stopped in (Note [what a stopped
    step says])."""

    #: Its update had not started: the bucket's state is as before the step.
    UNTOUCHED = "untouched"
    #: Its update was running: some of its tiles may be stepped, the others not.
    UPDATING = "updating"
    #: Its update was done: its state is stepped, its step count not advanced.
    UPDATED = "updated"


def _absent_ranks(exc: BaseException | None) -> str:
    """Who made a collective of ``exc``'s chain fail, for the first line: the ranks the
    ``CollectiveError`` found absent (Note [naming the absent rank]), else its own first
    line; empty when no collective failed."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, CollectiveError):
            text = str(exc)
            found = re.search(r"Rank\(s\) ([0-9, ]+) did not report", text)
            if found:
                return f" (rank(s) {found.group(1)} died or hung: a collective failed)"
            return f" (a collective failed: {text.splitlines()[0] if text else 'no message'})"
        exc = exc.__cause__ or exc.__context__
    return ""


def _recovery(buckets: Sequence[FlatBucket], ranks: Ranks) -> str:
    """How to get the optimizer back: Note [a step is all or nothing]."""
    if any(bucket.store.on_storage_tier for bucket in buckets):
        load = (
            "opt.load_streaming(path) from the last opt.save_streaming(path) (some state "
            "is on NVMe)"
        )
    elif ranks.comm is not None:
        load = (
            "zero_offload.checkpoint_io.load_consolidated(opt, path) (or "
            "opt.load_state_dict(state) of this rank's state_dict)"
        )
    else:
        load = "opt.load_state_dict(state) from a checkpoint"
    return (
        "The optimizer state no longer matches one step count: call opt.zero_grad(), then "
        f"reload it with {load}, or rebuild the optimizer"
    )


def _summary(stepped: list[int], failing: int | None, part: BucketPart) -> str:
    """Note [what a stopped step says], but for a step applied whole."""
    if failing is None:
        return f"buckets {stepped} were stepped" if stepped else "no bucket was fully stepped"
    if part is BucketPart.UNTOUCHED:
        done = f"buckets {stepped} were stepped" if stepped else "no bucket was stepped"
        return f"{done}; bucket {failing} was not: its update had not started"
    done = f"buckets {stepped} were stepped" if stepped else "no bucket was fully stepped"
    if part is BucketPart.UPDATING:
        return f"{done}; bucket {failing} was partly stepped"
    return f"{done}; bucket {failing}'s state was stepped but its step count was not advanced"


def failed(
    what: str,
    stepped: list[int],
    failing: int | None,
    *,
    buckets: Sequence[FlatBucket] = (),
    ranks: Ranks | None = None,
    cause: BaseException | None = None,
    part: BucketPart = BucketPart.UPDATING,
) -> StepFailed:
    """The ``StepFailed`` for a step that failed after ``stepped`` (Note [a step is all or
    nothing]), in bucket ``failing`` as far as ``part``; ``buckets`` and ``ranks`` choose
    the recovery named, ``cause`` the absent rank named in the first line."""
    recovery = (
        _recovery(buckets, ranks)
        if ranks is not None
        else "The optimizer state no longer matches one step count: call opt.zero_grad(), "
        "then reload it from a checkpoint (opt.load_state_dict) or rebuild the optimizer"
    )
    summary = _summary(stepped, failing, part)
    return StepFailed(f"{what}{_absent_ranks(cause)}: {summary}. {recovery}")


def interrupted(
    exc: BaseException,
    what: str,
    stepped: list[int],
    failing: int | None,
    *,
    buckets: Sequence[FlatBucket],
    ranks: Ranks,
    part: BucketPart = BucketPart.UPDATING,
    applied: bool = False,
) -> bool:
    """Whether ``exc`` is an interrupt (not an ``Exception``) that must leave as itself;
    if so, what the step had done is attached to it: Note [an interrupt is not a failure].
    ``part``: how far it got in bucket ``failing``; ``applied``: every bucket was stepped
    and counted, and the weights it issued have landed (Note [what a stopped step says])."""
    if isinstance(exc, Exception):
        return False
    if applied and ranks.comm is None:
        told = (
            f"the step was applied whole (buckets {stepped} were stepped and counted, and "
            "their weights landed); only what comes after the update was cut. Nothing needs "
            "reloading: call opt.zero_grad() before the next backward (the step took this "
            "window's gradients, and a step() on them again would apply them twice)"
        )
    elif applied:  # the weights' all-gathers may not have finished on every rank
        told = (
            f"every bucket was stepped and counted (buckets {stepped}), but the all-gathers "
            f"of their weights across the ranks may not have finished. "
            f"{_recovery(buckets, ranks)}"
        )
    else:
        told = f"{_summary(stepped, failing, part)}. {_recovery(buckets, ranks)}"
    note = f"zero-offload: {what} was interrupted by {type(exc).__name__}: {told}"
    add_note = getattr(exc, "add_note", None)
    if add_note is not None:  # Python 3.11+
        add_note(note)
    else:
        _log.error(note)
    return True
