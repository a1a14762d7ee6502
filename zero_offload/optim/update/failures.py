"""What a step that failed part-way says: ``StepFailed``, and the note an interrupt carries.

The seam of ``modes.py`` (Note [a step is all or nothing] and Note [an interrupt is not a
failure] there): which buckets were stepped, which one in part, the rank a collective
found absent, and how to get the optimizer back. ``modes.py`` and ``eager.py`` raise them.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence

from ...errors import CollectiveError
from ..flat_bucket import FlatBucket
from ..ranks import Ranks

__all__ = ["StepFailed", "failed", "interrupted"]

_log = logging.getLogger("zero_offload")


class StepFailed(RuntimeError):
    """A step failed after it started changing the optimizer state; see Note [a step is
    all or nothing]."""


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


def _summary(stepped: list[int], failing: int | None) -> str:
    part = f"; bucket {failing} was partly stepped" if failing is not None else ""
    done = f"buckets {stepped} were stepped" if stepped else "no bucket was fully stepped"
    return f"{done}{part}"


def failed(
    what: str,
    stepped: list[int],
    failing: int | None,
    *,
    buckets: Sequence[FlatBucket] = (),
    ranks: Ranks | None = None,
    cause: BaseException | None = None,
) -> StepFailed:
    """The ``StepFailed`` for a step that failed after ``stepped`` (Note [a step is all or
    nothing]); ``buckets`` and ``ranks`` choose the recovery named, ``cause`` the absent
    rank named in the first line."""
    recovery = (
        _recovery(buckets, ranks)
        if ranks is not None
        else "The optimizer state no longer matches one step count: call opt.zero_grad(), "
        "then reload it from a checkpoint (opt.load_state_dict) or rebuild the optimizer"
    )
    return StepFailed(f"{what}{_absent_ranks(cause)}: {_summary(stepped, failing)}. {recovery}")


def interrupted(
    exc: BaseException,
    what: str,
    stepped: list[int],
    failing: int | None,
    *,
    buckets: Sequence[FlatBucket],
    ranks: Ranks,
) -> bool:
    """Whether ``exc`` is an interrupt (not an ``Exception``) that must leave as itself;
    if so, what the step had done is attached to it: Note [an interrupt is not a failure]."""
    if isinstance(exc, Exception):
        return False
    note = (
        f"zero-offload: {what} was interrupted by {type(exc).__name__}: "
        f"{_summary(stepped, failing)}. {_recovery(buckets, ranks)}"
    )
    add_note = getattr(exc, "add_note", None)
    if add_note is not None:  # Python 3.11+
        add_note(note)
    else:
        _log.error(note)
    return True
