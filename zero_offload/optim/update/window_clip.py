"""The ``clip_grad_norm_`` of a window: which gradients it clips, and a clip that a later
backward in the same window would have made torch compute something else.

Note [a clip in the middle of a window]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
torch's ``clip_grad_norm_`` scales the ``.grad`` it finds in place: called after micro-batch
1 of 2, it clips micro-batch 1's gradient, and micro-batch 2 adds to the clipped sum. Here
a clip is a bound on the window's sum, folded into the step's kernel (the gradients are
never scaled in place: they may be on the device, in flight or in a host accumulator), so
it holds for the gradients it measured and a later backward drops it (Note [clipping by a
total norm] in policy.py; docs/gradient-semantics.md). Where that clip bound (torch's
coefficient ``max_norm / (norm + 1e-6)`` below 1) the two differ, and the step would be
silently not torch's: a loop that clips every micro-batch (accelerate's ``accumulate()``
without the ``sync_gradients`` check) trained about 4e-3 away from torch in 8 steps. So
``step()`` refuses such a window, before anything changes, naming the clip; a clip that did
not bind changed nothing in torch either and is let go. Clipping once, after the window's
last backward, is what HF Trainer, Lightning and accelerate's examples do. A step announced
after such a clip (it runs during the next backward) is refused at the announcement, for the
same reason; reading the norm (``grad_norm()``, the frameworks' ``max_norm=inf``) is no clip.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["WindowClip"]


@dataclass(frozen=True)
class _Clip:
    max_norm: float
    backwards: int  # the router's backward count it measured
    total: float | None  # the norm it is taken against (None: the window's own)
    window: int  # the window it was taken in
    norm: float | None  # the norm it bound against, or None where it did not bind


class WindowClip:
    """The window's ``clip_grad_norm_`` bound, and a binding one that a later backward of
    the same window dropped (Note [a clip in the middle of a window])."""

    def __init__(self) -> None:
        self._clip: _Clip | None = None
        self._window = 0  # windows closed so far (steps and zero_grads)
        self._dropped: _Clip | None = None

    def set(
        self, max_norm: float, backwards: int, total: float | None, window_norm: float | None
    ) -> None:
        """A clip to ``max_norm`` of the gradients of ``backwards`` backwards, against
        ``total`` (or the window's own norm, ``window_norm``)."""
        self._note_dropped(backwards)
        against = window_norm if total is None else total
        binding = (
            against is not None and math.isfinite(against) and max_norm / (against + 1e-6) < 1.0
        )
        self._clip = _Clip(max_norm, backwards, total, self._window, against if binding else None)

    def bound(self, backwards: int) -> tuple[float, float | None] | None:
        """``(max_norm, total)`` of the clip of these gradients, if any."""
        clip = self._clip
        if clip is None or clip.backwards != backwards:
            return None
        return clip.max_norm, clip.total

    def check_not_dropped(self, backwards: int, owner: str) -> None:
        """Refuse a step whose window had a binding clip that a later backward dropped
        (Note [a clip in the middle of a window]); changes nothing."""
        self._note_dropped(backwards)
        dropped = self._dropped
        if dropped is None:
            return
        raise RuntimeError(
            f"{owner}: clip_grad_norm_(max_norm={dropped.max_norm}) bound this window's "
            f"gradients (norm {dropped.norm:.6g}) after its backward {dropped.backwards}, and "
            "another backward followed. torch would have scaled the gradients summed so far "
            "and added the later micro-batches to them; here a clip bounds the window's sum "
            "at the step, so that clip would be lost and the step not torch's. Clip once, "
            "after the window's last backward (with accelerate: under `if "
            "accelerator.sync_gradients:`), or use OffloadConfig(max_grad_norm=...). Nothing "
            "was stepped; zero_grad() drops this window"
        )

    def check_announcement(self, backwards: int, owner: str) -> None:
        """Refuse to announce a step (it would run during the next backward, unclipped)
        after a clip of this window that bound: that backward drops it (Note [a clip in the
        middle of a window]); changes nothing."""
        self._note_dropped(backwards)
        clip = self._dropped or self._clip
        if clip is None or clip.window != self._window or clip.norm is None:
            return
        raise RuntimeError(
            f"{owner}: a step announced (backward(step=True) or announce_step()) after "
            f"clip_grad_norm_(max_norm={clip.max_norm}) bound this window's gradients (norm "
            f"{clip.norm:.6g}): the step would run during the next backward, and a clip "
            "bounds the window's sum, so that clip would be lost. Clip once, after the "
            "window's last backward, and step() then; or clip with "
            "OffloadConfig(max_grad_norm=...), which an announced step applies. Nothing was "
            "announced"
        )

    def close_window(self) -> None:
        """A step or ``zero_grad`` ended the window: its dropped clip goes with it (the clip
        itself holds for a second step on the same gradients)."""
        self._window += 1
        self._dropped = None

    def forget(self) -> None:
        """``zero_grad``: the clip belongs to the window it measured."""
        self._clip = None
        self.close_window()

    def _note_dropped(self, backwards: int) -> None:
        clip = self._clip
        if (
            clip is not None
            and clip.window == self._window
            and clip.backwards != backwards
            and clip.norm is not None
        ):
            self._dropped = clip
