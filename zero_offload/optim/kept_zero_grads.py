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
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .checks import describe_param, param_name

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

    def zero_grad(self, set_to_none: bool) -> None:
        """``zero_grad(set_to_none)`` was called."""
        if not isinstance(set_to_none, bool):
            raise TypeError(f"zero_grad(set_to_none=...) takes a bool, got {set_to_none!r}")
        self.keeping = not set_to_none
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
        Nothing on several ``ranks`` (see the Note)."""
        if ranks > 1:
            return
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
