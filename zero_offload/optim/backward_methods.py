"""The optimizer's backward and its announced step: ``backward`` (scaled for fp16),
``scaled_backward``, ``announce_step`` and what they report, the methods ``OffloadOptimizer``
takes from ``BackwardMethods`` (Note [stepping during backward] in ``update/eager.py``;
Note [a backward carries the loss scale] in ``scaled_backward.py``)."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

import torch

from ..error_marks import said_to_caller
from ..hook_errors import backward as backward_reporting_hooks
from .checks import check_untouched

__all__ = ["BackwardMethods"]


class BackwardMethods:
    """``OffloadOptimizer``'s backward methods (a mixin over its ``_policy``, ``_router``,
    ``_scaled``, ``_check_open``, ``_group_hyper``, ``loss_scale``, ``buckets``,
    ``param_groups`` and ``rule``)."""

    # The optimizer's own: its StepPolicy, BackwardRouter and ScaledBackwards, and the rest.
    _policy: Any
    _router: Any
    _scaled: Any
    _check_open: Any
    _group_hyper: Any
    loss_scale: float
    buckets: Any
    param_groups: Any
    rule: Any

    @said_to_caller  # Note [an error reaches the caller once]
    def backward(self, loss: torch.Tensor, *, step: bool = False, **kwargs: Any) -> None:
        """``loss.backward()``, scaled by ``loss_scale`` for fp16 models.

        ``step=True`` announces that ``step()`` follows this backward with no clipping or
        other backward in between (``announce_step``): where that makes the update exact,
        it runs during backward."""
        if not isinstance(step, bool):
            raise TypeError(
                f"{type(self).__name__}.backward: step must be a bool (True announces the "
                f"step), got {step!r} ({type(step).__name__})"
            )
        if step:
            self.announce_step()
        with self.scaled_backward():
            if self.loss_scale != 1.0:
                loss = loss * self.loss_scale
            try:  # Note [errors raised inside autograd hooks]
                backward_reporting_hooks(loss, **kwargs)
            except RuntimeError as exc:
                explained = self.stepped_read_error(exc, "backward() without step=True")
                if explained is None:
                    raise
                raise explained from exc

    def scaled_backward(self) -> AbstractContextManager[None]:
        """A block whose backwards carry ``loss_scale``: for code that multiplies the loss
        (or its gradient) by ``opt.loss_scale`` itself instead of calling
        ``opt.backward(loss)``. With fp16 parameters, a gradient from a backward outside
        such a block is refused (Note [a backward carries the loss scale] in
        ``scaled_backward.py``)."""
        return self._scaled.scaled()

    def can_step_during_backward(self) -> bool:
        """Whether an announced step (``backward(step=True)``, ``announce_step()``) would
        run during backward here, as opposed to in ``step()``; Note [stepping during
        backward] in update/eager.py."""
        self._check_open("can_step_during_backward")
        return self._policy.eager_refusal() is None

    @property
    def step_announced(self) -> bool:
        """Whether a step is announced and not taken yet (``step()`` takes it)."""
        return self._policy.eager is not None

    @said_to_caller
    def announce_step(self) -> bool:
        """Announce that the next backward is the window's last and ``step()`` follows it
        with no clipping or another backward in between (for loops that call
        ``loss.backward()`` themselves). Returns whether the step will run during that
        backward; where it cannot be exact (``StepPolicy.eager_refusal``) it runs in
        ``step()`` as usual. Note [stepping during backward] in update/eager.py."""
        self._check_open("announce_step")
        if self._policy.eager is not None:
            raise RuntimeError(
                "a step is already announced and not taken yet; call step() after the "
                "announced backward before announcing another"
            )
        # Note [a clip in the middle of a window] in update/window_clip.py
        self._policy.clip.check_announcement(self._router.backwards, type(self).__name__)
        if self._policy.refuses_announcement(self):
            return False
        check_untouched(
            self, self.param_groups, self.buckets, rule=self.rule
        )  # what step() would refuse
        # Note [weights written outside the optimizer]: checked now, the step runs during
        # backward
        self._policy.mode.write_checks.check(self.buckets, in_update=False)
        self._policy.announce(
            {g: self._group_hyper(g) for g in {b.layout.group for b in self.buckets}}
        )
        return True

    @property
    def share_stepped_during_backward(self) -> float | None:
        """Of the last announced step's elements, the share whose CPU Adam had finished
        when its backward returned (None before any announced step)."""
        return self._policy.last_eager_share

    @property
    def backwards(self) -> int:
        """Backward passes completed since construction (each flushed once)."""
        return self._router.backwards

    def stepped_read_error(self, exc: BaseException, instead: str) -> RuntimeError | None:
        """Where ``exc``, the error a backward raised, is autograd's refusal of a weight an
        announced step had already stepped during that backward, the error that says so and
        what to call ``instead``; None for any other error (Note [a step moves the version
        counters] in views/param_views.py)."""
        eager = self._policy.eager
        if (
            not isinstance(exc, RuntimeError)
            or eager is None
            or not eager.plans
            or "modified by an inplace operation" not in str(exc)
        ):
            return None
        return RuntimeError(
            f"{type(self).__name__}: an announced step ran during this backward, and the "
            f"backward then read a weight of bucket(s) {sorted(eager.plans)} that it had "
            "already stepped (their gradients were complete): the model reads a parameter's "
            "value outside its gradient's path, through .detach() or an autograd Function "
            f"that saves it and returns no gradient for it. Use {instead} for this model "
            "(the step then runs in step()); the buckets stepped so far keep that step, as "
            "zero_grad() will warn. torch's refusal is this error's cause; Note [a step moves "
            "the version counters] in views/param_views.py"
        )
