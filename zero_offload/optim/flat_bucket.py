"""One bucket: its parameter views, its gradient lifecycle, its gradient path, its state
store, its steps.

Each part is its own managed thing (``views.ParamViews``, ``grads.lifecycle.BucketGrads``,
a ``grads.path.GradientPath`` and a ``state.store.StateStore``, composed per bucket at
construction); the bucket wires them together, so the optimizer and the backward router
talk to one object per bucket.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator

import numpy as np
import torch

from ..accelerator import Event
from ..errors import Attempts
from ..partition import BucketLayout
from ..views.param_views import ParamViews
from .grads.lifecycle import BucketGrads, GradState
from .grads.path import GradientPath, SumSqParts
from .ranks import Ranks
from .state.store import StateStore

__all__ = ["FlatBucket", "StepPlan"]


# Note [a run spans the gaps between its slots]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The alignment gaps between slots (Note [slots are aligned] in partition.py) hold zero
# weights and receive zero gradients, and every rule leaves a zero weight with a zero
# gradient at zero (Adam's moments stay zero; Lion's sign is 0; Adagrad's sum keeps its
# initial value and divides a zero), so updating them changes nothing anyone reads (Note
# [padding stays at the end]). A run that stopped at each gap cut a bucket of many small parameters
# into one run, one kernel launch and one weight copy per parameter (201 copies for a
# bucket of 400); spanning the gaps makes it one run per bucket in the usual case, so its
# tiles and copies follow the bucket's size, not its parameter count (issue 39's copies per
# bucket). A slot without a gradient, or with another step count, still ends the run.


def _runs(
    layout: BucketLayout, steps: np.ndarray, arrived: np.ndarray
) -> Iterator[tuple[int, int, int]]:
    """Maximal ``(start, stop, step)`` element ranges of consecutive slots that have a
    gradient and share a step count (each parameter keeps its own step, as torch does),
    with the alignment gaps between them (Note [a run spans the gaps between its slots])."""
    start = stop = step = -1
    previous = -2  # the index of the last slot in the run
    for i, slot in enumerate(layout.slots):
        if not arrived[i]:
            continue
        if previous == i - 1 and steps[i] == step:
            stop = slot.end
            previous = i
            continue
        if start >= 0:
            yield start, stop, step
        start, stop, step, previous = slot.offset, slot.end, int(steps[i]), i
    if start >= 0:
        yield start, stop, step


class StepPlan:
    """What one step will do to one bucket, computed before anything changes.

    ``steps``: (n_slots,) int64, the step counts after the step; ``runs``: the
    ``(start, stop, step)`` ranges to update (``_runs``); ``source``: the field holding the
    window's gradient at planning time (``GradientPath.window_source``).
    """

    def __init__(self, bucket: FlatBucket, arrived: np.ndarray) -> None:
        self.bucket = bucket
        self.steps = bucket.steps + arrived.astype(np.int64)
        self.runs = list(_runs(bucket.layout, self.steps, arrived))
        self.every_slot = bool(arrived.all())  # the runs cover every parameter
        bucket.gradients.land()  # an announced step's bucket lands here
        self.source = bucket.gradients.window_source()


class FlatBucket:
    """A bucket of parameters; see the module docstring.

    Fields:
        views: the parameters as views of ``weights_dev`` (``ParamViews``).
        grads: the gradient lifecycle (``BucketGrads``).
        gradients: where the gradients go (``GradientPath``).
        store: where the optimizer state lives and how it is updated (``StateStore``).
        steps: (n_slots,) int64, host; each parameter's Adam step count.
        shard: ``(start, stop)`` of the flat elements this rank owns (the whole padded
            bucket with one rank); see Note [who owns which shard] in ``partition.py``.
        master_exposed: the master may have been written outside the optimizer since its
            last write check (a view of it handed out by ``opt.state``, a loaded state
            that supersedes an announced step): the next check is by fingerprint (Note
            [a master written outside the optimizer] in ``update/reconcile.py``).
        master_views: views of the master handed out and still alive.
    """

    def __init__(
        self,
        layout: BucketLayout,
        views: ParamViews,
        gradients: GradientPath,
        store: StateStore,
        *,
        shard: tuple[int, int],
    ) -> None:
        self.layout = layout
        self.views = views
        self.gradients = gradients
        self.store = store
        self.shard = shard
        self.grads = BucketGrads(layout.index, len(layout.slots))
        self.steps = np.zeros(len(layout.slots), dtype=np.int64)
        #: Slots whose step count was written 0 through ``opt.state`` with their state kept
        #: (torch keeps such an entry): saved and listed though unstepped (Note [writes
        #: through opt.state] in reports/live.py); a reset or a step forgets them.
        self.kept_at_zero: set[int] = set()
        self.params = views.params
        self.dtype = views.dtype
        self.master_exposed = False
        self.master_views = 0

    def has_state(self, i: int) -> bool:
        """Whether slot ``i`` has state as torch counts it: stepped, or its step count written
        0 with its state kept (``kept_at_zero``)."""
        return bool(self.steps[i] > 0) or i in self.kept_at_zero

    def expose_master(self, view: torch.Tensor) -> None:
        """``view`` of the master goes to user code, which may write it: Note [a master
        written outside the optimizer] in ``update/reconcile.py``."""
        if self.views.versions is None:  # no fingerprints to keep a master by: check now
            self.store.reconcile_master()
            self.views.remember()
        self.master_exposed = True
        self.master_views += 1
        weakref.finalize(view, self._master_view_gone)

    def _master_view_gone(self) -> None:
        self.master_views -= 1

    @property
    def resident(self) -> bool:
        """Whether this bucket's optimizer state lives on the device."""
        return self.store.resident

    @property
    def weights_dev(self) -> torch.Tensor:
        """(padded_numel,) training dtype, device: the flat weights."""
        return self.views.weights_dev

    # -- backward ----------------------------------------------------------------------

    def receive_grad(self, slot_index: int, grad: torch.Tensor, *, grow: bool = False) -> bool:
        """Add one parameter's gradient; True when the bucket is complete for this backward.

        Raises ``PoolExhausted`` (nothing changed) when no device buffer can be opened."""
        if not self.grads.holds_device_buffer:
            if self.gradients.can_adopt(grad):  # Note [a lone gradient is its own buffer]
                self.gradients.adopt_grad(grad, new_window=self.grads.opens_window)
                self.grads.start_filling()
                return self.grads.receive(slot_index)
            self.gradients.open_grad(new_window=self.grads.opens_window, grow=grow)
            self.grads.start_filling()
        self.gradients.add_grad(slot_index, grad.reshape(-1))
        return self.grads.receive(slot_index)

    def open_empty(self, *, grow: bool) -> None:
        """Several ranks, end of backward: a bucket with no gradient on this rank still
        goes to the reduce-scatter, contributing zeros (Note [ranks in lockstep])."""
        if not self.grads.holds_device_buffer:
            self.gradients.open_grad(new_window=self.grads.opens_window, grow=grow)
            self.grads.start_filling()

    def flush(self, ranks: Ranks) -> None:
        """Hand this backward's device gradients on; Note [a bucket's gradient lifecycle]."""
        overwrite = self.grads.flushes == 0
        self.gradients.flush(overwrite=overwrite, ranks=ranks)
        self.grads.flushed()

    def discard(self) -> None:
        """Forget the window's gradients (``zero_grad``), device buffer included (whatever
        the path holds, Note [an interrupted gradient path] in ``grads/to_host.py``)."""
        self.gradients.discard_grad()
        self.grads.discard()

    # -- step ----------------------------------------------------------------------------

    @property
    def has_gradients(self) -> bool:
        """Whether the window holds gradients on this rank's shard (possibly all from
        other ranks, or zeros)."""
        return self.grads.state is not GradState.EMPTY

    def stats_on_host(self) -> bool:
        """Whether ``grad_sumsq`` needs the host worker drained first
        (``GradientPath.stats_on_host``)."""
        return self.has_gradients and self.gradients.stats_on_host()

    def grad_sumsq(self) -> SumSqParts:
        """Partial sums of squares of the window's gradient on this rank's shard (see
        ``GradientPath.grad_sumsq``), and the overflow flag; the caller drained the host
        worker when ``stats_on_host()``."""
        return self.gradients.grad_sumsq() if self.has_gradients else SumSqParts([], False)

    def commit(self, plan: StepPlan) -> None:
        """The step of ``plan`` is done: take its step counts, consume the window."""
        self.steps[:] = plan.steps
        self.grads.consume()

    def publish(self) -> list[Event]:
        """Issue the weight copies the last update left (``Publication.publish``); the
        events the next forward waits on."""
        return self.store.publication.publish()

    def state_views(self, slot_index: int) -> tuple[int, int, dict[str, torch.Tensor]]:
        """The piece ``[lo, hi)`` of one flattened parameter that this rank owns (all of it
        with one rank; ``lo == hi`` for none) and flat views of its optimizer state there:
        the rule's state fields, the fp32 master first (``store.state_names()``)."""
        slot = self.layout.slots[slot_index]
        start, stop = self.shard
        lo, hi = self.layout.owned_piece(slot, start, stop)
        first = slot.offset + lo - start  # the piece's first element in the state buffers
        return (
            lo,
            hi,
            {
                name: tensor[first : first + hi - lo]
                for name, tensor in self.store.state_tensors().items()
            },
        )

    def param_state(self, slot_index: int) -> dict[str, torch.Tensor]:
        """One parameter's shaped state by name (a rule that reads whole parameters; Note
        [rules that read a whole parameter] in ``rule/base.py``), empty for the others."""
        return self.store.param_state(slot_index)

    def close(self) -> None:
        """Return every block to its pool: each part is closed even when one before it
        fails (a gradient path left half-way by a failed update), the first error raised at
        the end."""
        attempt = Attempts()
        for part in (
            self.gradients.discard_grad,
            self.gradients.close,
            self.store.publication.close,
            self.store.close,
            self.views.close,
        ):
            attempt(part)
        attempt.raise_first()
