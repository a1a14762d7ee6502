"""What a load leaves for the steps after it: the pending update a checkpoint carried
(``ResumedUpdate``), and a load cut short, which they refuse (``LoadGuard``). The update
mode holds one of each (``modes.py``) and tells both when a load completes.

Note [a resumed update is published at the step, not at the load]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A loaded checkpoint's pending update (Note [delayed parameter update] in ``modes.py``) is
written from the master when the first step settles it, not when the state loads. Written at
the load, it reached the weights at once where the store's home is the weights (parameter
offload):
loaded before the model, the model's load then wrote the checkpoint's stale weights over
it and the first step took them into the master, the update lost (1.4e-2 off after five
steps); loaded after, the first forward saw the update, which the uninterrupted run's did
not. Now both orders do what a store behind a link does in both: the first forward runs on
the checkpoint's weights, as the uninterrupted run's did, and its step publishes the
update, then steps from it. Nothing between the load and the step reads the staging it
would have filled, and a master written through ``opt.state`` meanwhile is what it
publishes. One case cannot be mended: parameter offload with fp32 weights, whose home is
the master itself (``StateStore.weights_are_master``). The model's load writes the
checkpoint's weights into the master, so loaded after the optimizer it erases the update;
loaded before, the optimizer's load puts the master into the weights and the first forward
runs on the update (as after ``flush_pending_update()`` before the save). So the load
fingerprints such masters, and the step that would publish refuses, naming the order that
works, where one was written since, but for the parameters whose loaded weights win.

Note [a load cut short]
~~~~~~~~~~~~~~~~~~~~~~~
A load (``load_state_dict``, ``load_streaming``) checks everything before it changes
anything (Note [a load checks everything, then copies] in ``checkpoint/state_dict.py``), so
a refusal, or an interrupt while it checks, leaves the optimizer as it was. Then it copies,
bucket after bucket, and last the param groups, the loss scaler and the skip count: from the
copy's first write to its last the optimizer holds two states. A copy is not undone when it
stops (a Ctrl-C, a SIGTERM handler's exit, a failed read): undoing it would need a second
copy of the state, which a streaming load exists not to hold, and an interrupt must leave
at once (Note [an interrupt is not a failure] in ``modes.py``). It is recorded instead.
``LoadGuard`` is ``COPYING`` from the copy's first bucket until the update mode is told that
the load completed (``UpdateMode.loaded``), and stays so when the copy stops. While it is:

- ``step()`` refuses before anything happens (a step pre-hook, which the load registers
  when it stops: Note [a refused step changes nothing] in ``checkpoint/methods.py``), and
  ``state_dict()`` and ``save_streaming()`` refuse too, each naming the call that was cut,
  the bucket it stopped in, whether that bucket was written in part or not at all, and the
  recovery: the same call again, which overwrites everything a cut load wrote (every bucket,
  the groups, the scaler, the skip count and the pending update);
- nothing of the mixed state reaches the model: the mode has no pending update (``close()``
  publishes none), and an announced step runs in ``step()``, which refuses.

A copy that stops before it writes its first bucket changed nothing: the guard goes back to
what it was before the call (``WHOLE``, or an earlier cut load's record). Before this, the
next step trained on the mix, silently (a cut between buckets), or failed blaming an I/O
error (a cut inside an NVMe bucket, whose file the store marks failed).
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Sequence
from typing import Any

import torch

from ..flat_bucket import FlatBucket, same_fingerprint

__all__ = ["LoadGuard", "LoadInterrupted", "LoadState", "ResumedUpdate"]

_log = logging.getLogger("zero_offload")


class ResumedUpdate:
    """A loaded checkpoint's pending update: Note [a resumed update is published at the
    step, not at the load].

    Fields:
        pending: the loaded state was saved with an ``overlap_step`` update pending; its
            weights are published from the master at the next step, and the weights written
            until then are the checkpoint's own, not an outside write (Note [delayed
            parameter update] in ``modes.py``).
        _masters: fingerprints of the loaded master where the weights are the master, by
            bucket (layout index), for ``refuse_overwritten_master``.
    """

    def __init__(self, where: str = "") -> None:
        self.where = where  # the rank prefix of the refusal (Ranks.where)
        self.pending = False
        self._masters: dict[int, list[int | torch.Tensor]] = {}

    def loaded(self, buckets: Sequence[FlatBucket], *, pending: bool) -> None:
        """A state was loaded; ``pending``: saved with an update pending."""
        self.pending = pending
        # where the weights are the master, what the step will publish from, fingerprinted
        self._masters = {
            bucket.layout.index: bucket.master_fingerprints()
            for bucket in buckets
            if pending and bucket.store.weights_are_master()
        }

    def refuse_overwritten_master(self, buckets: Sequence[FlatBucket]) -> None:
        """Raise (nothing published or stepped) where the loaded master that the pending
        update is published from was overwritten through the weights since the load, but for
        the parameters whose loaded weights win (``masters_from_weights``)."""
        loaded, self._masters = self._masters, {}
        lost: list[int] = []
        for bucket in buckets:
            before = loaded.get(bucket.layout.index)
            if before is None:
                continue
            now = bucket.master_fingerprints()
            for i, (a, b) in enumerate(zip(before, now, strict=True)):
                if i not in bucket.views.masters_from_weights and not same_fingerprint(a, b):
                    lost.append(bucket.layout.slots[i].index)
        if lost:
            self.pending = False  # said once: close() and the next step() go on without it
            raise ValueError(
                f"{self.where}the loaded optimizer state was saved with an "
                "overlap_step update pending, which step() publishes from its fp32 master; "
                "with parameter offload and fp32 weights the parameters are that master, and "
                f"parameters {sorted(lost)} (positions in param_groups) were written after "
                "the optimizer's load (model.load_state_dict after opt.load_state_dict "
                "writes the checkpoint's weights, one update behind), so the update is lost. "
                "Load the model first, then the optimizer (or call "
                "opt.flush_pending_update() before saving). Nothing was stepped; a retried "
                "step() goes on without the update"
            )


class LoadInterrupted(RuntimeError):
    """A step or a save of an optimizer whose last load stopped while it copied: Note [a
    load cut short]."""


class LoadState(enum.Enum):
    """Whether the optimizer's buckets, groups and loss scaler hold one state."""

    #: One state everywhere: the run's own, or the last load's, which completed.
    WHOLE = "whole"
    #: A load is copying, or stopped while it copied: the buckets before ``LoadGuard.at``
    #: hold the checkpoint's state, bucket ``at`` part of it (``inside``) or none, and the
    #: rest (and the groups, the scaler) the state from before the load.
    COPYING = "copying"


class LoadGuard:
    """One optimizer's record of its last load's copy (Note [a load cut short]).

    Fields:
        state: ``WHOLE`` or ``COPYING``.
        call: the load as the caller would call it again (``"opt.load_streaming('ckpt')"``).
        buckets: the layout indices of the buckets it copies, in its order.
        at: how many of them were copied whole.
        inside: whether the copy of bucket ``buckets[at]`` began.
        cause: how the copy stopped (``"interrupted by KeyboardInterrupt"``; None while
            it runs).
        hook: the step pre-hook that refuses steps while ``COPYING`` (``checkpoint/
            methods.py`` registers it when a copy stops and this removes it), or None.
    """

    def __init__(self, where: str = "") -> None:
        self.where = where  # the rank prefix of the refusals (Ranks.where)
        self.state = LoadState.WHOLE
        self.call = ""
        self.buckets: list[int] = []
        self.at = 0
        self.inside = False
        self.cause: str | None = None
        self.hook: Any = None  # torch's RemovableHandle
        self._before: tuple[Any, ...] | None = None  # the record a new copy replaced

    @property
    def cut(self) -> bool:
        """Whether the optimizer holds a load's copy that stopped (or is running)."""
        return self.state is LoadState.COPYING

    def start(self, call: str, buckets: list[int]) -> None:
        """A checked load begins copying into ``buckets`` (layout indices, in its order);
        ``call``: the call that recovers (Note [a load cut short])."""
        self._before = (self.state, self.call, self.buckets, self.at, self.inside, self.cause)
        self.state = LoadState.COPYING
        self.call, self.buckets = call, list(buckets)
        self.at, self.inside, self.cause = 0, False, None

    def begin(self, position: int) -> None:
        """The copy of ``buckets[position]`` begins (every one before it was copied whole)."""
        self._check_copying("begin a bucket")
        self.at, self.inside = position, True
        self._before = None  # from here on the state is the mix this call made

    def done(self, position: int) -> None:
        """``buckets[position]`` holds the checkpoint's state, whole."""
        self._check_copying("end a bucket")
        self.at, self.inside = position + 1, False

    def stopped(self, exc: BaseException) -> None:
        """The load left with ``exc``: record it, and tell it on ``exc`` (``add_note``;
        logged where Python has none). A copy that wrote nothing leaves the record as it was
        before the call."""
        if not self.cut:
            return
        if self._before is not None:  # nothing written: as before the call
            before, self._before = self._before, None
            self.state, self.call, self.buckets, self.at, self.inside, self.cause = before
            return
        if self.cause is None:
            how = "failed with" if isinstance(exc, Exception) else "interrupted by"
            self.cause = f"{how} {type(exc).__name__}"
        note = (
            f"zero-offload: {self.where}{self.call} was {self.cause} "
            f"{self.summary()}. step(), state_dict() and save_streaming() refuse until "
            f"{self.call} is called again"
        )
        add_note = getattr(exc, "add_note", None)
        if add_note is not None:  # Python 3.11+
            add_note(note)
        else:
            _log.error(note)

    def finish(self) -> None:
        """A load completed (``UpdateMode.loaded``): one state again; the refusing hook goes."""
        if self.hook is not None:
            hook, self.hook = self.hook, None
            hook.remove()
        self.state, self.cause, self._before = LoadState.WHOLE, None, None

    def summary(self) -> str:
        """Where the copy stopped, and what each bucket holds."""
        n, k = len(self.buckets), self.at
        if k >= n:
            return (
                f"after all {n} buckets were copied, while the param groups, the loss "
                "scaler and the skip count were (each is the checkpoint's or the one from "
                "before the load)"
            )
        bucket = self.buckets[k]
        holders = [_named(self.buckets[:k])] if k else []
        if self.inside:
            holders.append(f"part of bucket {bucket}")
        rest = self.buckets[k + 1 :] if self.inside else self.buckets[k:]
        where = "inside" if self.inside else "before"
        return (
            f"{where} bucket {bucket} ({k + 1} of {n}): {' and '.join(holders) or 'no bucket'} "
            f"{'hold' if len(holders) > 1 or k > 1 else 'holds'} the checkpoint's state; "
            f"{f'{_named(rest)}, ' if rest else ''}the param groups and the loss scaler the "
            "state from before the load"
        )

    def refuse(self, what: str, *, nothing: str) -> None:
        """Raise ``LoadInterrupted`` for ``what`` (``"OffloadAdamW.step()"``) while a copy is
        cut; ``nothing``: what the refusal left undone (``"nothing was stepped"``)."""
        if not self.cut:
            return
        raise LoadInterrupted(
            f"{self.where}{what}: the optimizer state is half-loaded: {self.call} was "
            f"{self.cause or 'cut short'} {self.summary()}. Stepping or saving it would mix the "
            f"checkpoint's state with the one before the load. Call {self.call} again (the "
            f"same checkpoint) to load it whole, or load another whole checkpoint; {nothing}"
        )

    def _check_copying(self, what: str) -> None:
        if not self.cut:
            raise RuntimeError(f"LoadGuard: asked to {what} with no load copying: a bug")


def _named(indices: list[int]) -> str:
    """``"bucket 3"``, ``"buckets 0-6"``, or the list where it has gaps."""
    if len(indices) == 1:
        return f"bucket {indices[0]}"
    if indices == list(range(indices[0], indices[-1] + 1)):
        return f"buckets {indices[0]}-{indices[-1]}"
    return f"buckets {indices}"
