"""Which parameters torch would still hold a zeroed ``.grad`` for after
``zero_grad(set_to_none=False)``, and the step that refuses to skip them.

Note [zero gradients are not kept]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
torch's ``zero_grad(set_to_none=False)`` zeroes each ``.grad`` in place instead of dropping
it, and a parameter with a ``.grad`` steps even when no backward since reached it: with a
zero gradient, which still moves it (weight decay, Adam's and Lion's momentum, Adafactor's
factors). The offload optimizers keep no ``.grad`` (the gradients live in the buckets), so
they step the parameters a gradient reached in this window, as torch does after
``zero_grad()`` (``set_to_none=True``, its default and every framework's). The two differ
only for a parameter that had a gradient before, was zeroed with ``set_to_none=False`` and
got none in this window (a layer a batch did not use, an expert no token was routed to).
There the step refuses, before anything changes, naming the parameter, rather than step
differently from torch without a word. So this keeps, per bucket, which parameters got a
gradient since the last ``zero_grad(set_to_none=True)`` (torch's non-None ``.grad``s), and
whether the last ``zero_grad`` kept them. On one rank only: on several, the step takes a
parameter any rank's backward reached, and each rank knows only its own, so a rank that
refused alone would leave the others waiting in the step's collectives (the ranks' merged
arrivals would cost a collective per step where none is taken). Not checked either: an
announced step (``backward(step=True)``), planned before the arrivals are known.
``model.zero_grad(set_to_none=False)`` over every parameter the optimizer trains is its own
``zero_grad(set_to_none=False)`` (Note [zero_grad from elsewhere reaches the window] in
``torch_zero_grad.py``).

Note [a partial clear after a step]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
After a step the buckets keep the window's gradients (``GradState.CONSUMED``): torch keeps
every ``.grad`` after a step, and a second ``step()`` with no backward between steps every
parameter again with the same gradients, as this one does. A ``zero_grad`` that clears some
of the optimizer's parameters there (``model.encoder.zero_grad()``; Note [zero_grad from
elsewhere reaches the window] lets it through, nothing being pending) leaves torch's other
``.grad``s, so torch's next ``step()`` without a backward steps only the parameters not
cleared. A bucket whose every stepped parameter is cleared forgets its window there and
then, as a new window would (torch skips them all: exact). A bucket's window cannot be
dropped for some of its parameters, so where a bucket is cleared in part that ``step()``
refuses, before anything changes, naming a cleared parameter; a backward in between (an
announced one too) opens a new window and nothing is refused (the cleared parameters then
step where it reached them, as in torch). ``zero_grad()`` over them all, or a step, ends
the record. On one rank only, as above.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .checks import describe_param, param_name
from .grads.lifecycle import GradState

if TYPE_CHECKING:
    from .flat_bucket import FlatBucket

__all__ = ["KeptZeroGrads"]


class KeptZeroGrads:
    """See Note [zero gradients are not kept]. ``keeping``: the last ``zero_grad`` had
    ``set_to_none=False``; ``_seen``: per bucket index, (n_slots,) bool, the parameters
    that got a gradient since the last ``zero_grad(set_to_none=True)``."""

    def __init__(self) -> None:
        self.keeping = False
        self._seen: dict[int, np.ndarray] = {}
        #: Per bucket index, (n_slots,) bool: parameters a partial ``zero_grad`` cleared
        #: while the bucket held a stepped window (Note [a partial clear after a step]).
        self._cleared: dict[int, np.ndarray] = {}
        self._cleared_at = -1  # the optimizer's backward count when it was recorded

    def cleared_after_step(
        self, buckets: Sequence[FlatBucket], params: Sequence[Any], backwards: int, *, ranks: int
    ) -> bool:
        """A ``zero_grad`` elsewhere cleared ``params``, some of the parameters these buckets
        train, with no gradient pending, ``backwards`` backwards into the optimizer's life
        (Note [a partial clear after a step]). Nothing on several ``ranks``: each knows only
        its own arrivals, so they could decide a bucket differently. Returns whether a
        bucket's window was forgotten (the window's cached statistics are then stale)."""
        if ranks > 1:
            return False
        forgot = False
        if backwards != self._cleared_at:  # a backward since the last record: a new one
            self._cleared, self._cleared_at = {}, backwards
        wanted = {id(p) for p in params}
        for bucket in buckets:
            if bucket.grads.state is not GradState.CONSUMED:
                continue
            arrived = bucket.grads.arrived
            hit = np.fromiter((id(p) in wanted for p in bucket.params), bool, len(bucket.params))
            hit &= arrived  # a parameter the stepped window reached
            if not hit.any():
                continue
            index = bucket.layout.index
            hit |= self._cleared.pop(index, False)
            if np.array_equal(hit, arrived):  # all of its window cleared: forget it, exactly
                bucket.grads.discard()  # (CONSUMED holds no device buffer)
                forgot = True
            else:
                self._cleared[index] = hit
        return forgot

    def zero_grad(self, set_to_none: bool) -> None:
        """``zero_grad(set_to_none)`` was called."""
        if not isinstance(set_to_none, bool):
            raise TypeError(f"zero_grad(set_to_none=...) takes a bool, got {set_to_none!r}")
        self.keeping = not set_to_none
        self._cleared.clear()  # the whole window is forgotten
        if set_to_none:
            self._seen.clear()

    def check_step(
        self,
        owner: Any,
        buckets: Sequence[FlatBucket],
        param_groups: Sequence[dict[str, Any]],
        *,
        ranks: int,
    ) -> None:
        """Refuse, before anything changes, a step torch would take for a parameter it holds
        a zeroed ``.grad`` for and no gradient reached; then count this window's arrivals.
        Nothing on several ``ranks`` (see the Note). Also refuses a step that would reuse a
        window some of whose parameters were cleared since (Note [a partial clear after a
        step])."""
        if ranks > 1:
            return
        self._check_cleared(owner, buckets, param_groups)
        for bucket in buckets:
            seen = self._seen.get(bucket.layout.index)
            if not self.keeping or seen is None:
                continue
            skipped = np.flatnonzero(seen & ~bucket.grads.arrived)
            if skipped.size:
                slot = bucket.layout.slots[int(skipped[0])]
                param = bucket.params[int(skipped[0])]
                what = describe_param(slot.index, param, param_name(param_groups, slot.index))
                raise ValueError(
                    f"{what} got no gradient in this step, and zero_grad(set_to_none=False) "
                    f"kept its gradient: torch would step it with a zero gradient (weight "
                    f"decay and momentum still move it), and {owner!r} keeps no .grad to "
                    "step it with, so it would skip it (Note [zero gradients are not "
                    "kept]). Call zero_grad() (set_to_none=True, torch's default): then "
                    f"torch skips it too. {skipped.size} parameter(s) of bucket "
                    f"{bucket.layout.index} are in this case: nothing was stepped"
                )
        for bucket in buckets:
            arrived = bucket.grads.arrived
            seen = self._seen.get(bucket.layout.index)
            self._seen[bucket.layout.index] = arrived.copy() if seen is None else seen | arrived

    def _check_cleared(
        self, owner: Any, buckets: Sequence[FlatBucket], param_groups: Sequence[dict[str, Any]]
    ) -> None:
        """Note [a partial clear after a step]: refuse to step a stepped window again where
        some of its parameters were cleared since; the record ends with this step."""
        cleared, self._cleared = self._cleared, {}
        if owner.backwards != self._cleared_at:
            return  # a backward since opened a new window (an announced step's too)
        for bucket in buckets:
            hit = cleared.get(bucket.layout.index)
            if hit is None or bucket.grads.state is not GradState.CONSUMED:
                continue
            first = int(np.flatnonzero(hit)[0])
            slot = bucket.layout.slots[first]
            param = bucket.params[first]
            what = describe_param(slot.index, param, param_name(param_groups, slot.index))
            self._cleared = cleared  # refused: the next step() refuses alike
            raise ValueError(
                f"{what} was cleared by a zero_grad() of only some of the parameters "
                f"{owner!r} trains, after its last step and with no backward reaching it "
                "since: torch "
                "would step the others again with their kept .grad and skip it, and a "
                "stepped window is kept per bucket, not per parameter, so step() would "
                "step it too. Nothing was stepped. Run a backward first, or clear every "
                "parameter with opt.zero_grad() (Note [a partial clear after a step])"
            )
