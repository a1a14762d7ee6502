"""One bucket: its parameter views, its gradient lifecycle, its gradient path, its state
store, its steps.

Each part is its own managed thing (``views.ParamViews``, ``grads.lifecycle.BucketGrads``,
a ``grads.path.GradientPath`` and a ``state.store.StateStore``, composed per bucket at
construction); the bucket wires them together, so the optimizer and the backward router
talk to one object per bucket.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator

import numpy as np
import torch
import xxhash

from ..accelerator import Event
from ..errors import Attempts
from ..partition import BucketLayout
from ..views.fingerprints import device_fingerprints, host_addressable
from ..views.param_views import ParamViews
from .grads.lifecycle import BucketGrads, GradState
from .grads.path import GradientPath, SumSqParts
from .ranks import Ranks
from .state.store import StateStore

__all__ = ["FlatBucket", "StepPlan", "same_fingerprint"]


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


# Note [a master read after a load]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# After a load the weights are not known yet: the model may load after the optimizer, and a
# checkpoint saved with an ``overlap_step`` update pending publishes it from the master at
# the next step. So the load forgets the fingerprints and the next step's write check takes
# the weights by value (Note [a loaded state claims no weights] in
# ``checkpoint/state_dict.py``). Handing out a view of the master (``opt.state[p]``) must not
# make that check early, as it does after an update that was its own write check (Note [a
# master written outside the optimizer] in ``update/reconcile.py``): a check made at the read
# took the fresh model's weights into the master where the model loaded after (a bf16 resume
# lost the master's low bits), and dropped the pending update's publication (every rule,
# 1e-2 off five steps later). A read changes nothing that training does: Lightning's restore
# iterates ``opt.state`` between the load and the first step.
# What the read must still allow is a write through the view, which the next step keeps. So
# the first view handed out after a load takes a fingerprint of each slot's master
# (``master_marks``), and the next check by value (``FlatBucket.reconcile_master``) keeps the
# master of each slot whose fingerprint moved: that slot's master was written since the
# load and wins over its weights, the others take their weights as the load promised. The
# marks end at that step's write check (``write_checked``).


def _fingerprint(master: torch.Tensor) -> int | torch.Tensor:
    """A fingerprint of one slot's master piece (fp32, contiguous): xxh3-64 of its bytes
    where they are host-addressable, else its position-mixed sum on the device."""
    if host_addressable(master):
        return xxhash.xxh3_64_intdigest(master.detach().view(torch.uint8).numpy())
    return device_fingerprints(master, [(0, master.numel())])


def same_fingerprint(a: int | torch.Tensor, b: int | torch.Tensor) -> bool:
    """Whether two of ``FlatBucket.master_fingerprints()``' entries are equal."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return torch.equal(a, b)  # Synchronisation point (GPU): read once per check
    return a == b


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
        unchecked_load: a state was loaded and no step's write check has run since (the
            weights are not known: Note [a master read after a load]).
        master_marks: one fingerprint per slot of the master when its first view was handed
            out after the load, None before that (Note [a master read after a load]).
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
        self.unchecked_load = False
        self.master_marks: list[int | torch.Tensor] | None = None

    def has_state(self, i: int) -> bool:
        """Whether slot ``i`` has state as torch counts it: stepped, or its step count written
        0 with its state kept (``kept_at_zero``)."""
        return bool(self.steps[i] > 0) or i in self.kept_at_zero

    def expose_master(self, view: torch.Tensor) -> None:
        """``view`` of the master goes to user code, which may write it: Note [a master
        written outside the optimizer] in ``update/reconcile.py``."""
        if self.views.versions is None and self.unchecked_load:
            # Note [a master read after a load]: the check waits for the next step
            if self.master_marks is None:
                self.master_marks = self.master_fingerprints()
        elif self.views.versions is None:  # no fingerprints to keep a master by: check now
            self.store.reconcile_master()
            self.views.remember()
        self.master_exposed = True
        self.master_views += 1
        weakref.finalize(view, self._master_view_gone)

    def _master_view_gone(self) -> None:
        self.master_views -= 1

    def master_fingerprints(self) -> list[int | torch.Tensor]:
        """One fingerprint per slot of the master (its piece on this rank)."""
        return [_fingerprint(self.state_views(i)[2]["master"]) for i in range(len(self.params))]

    def loaded(self, weights_win: Iterable[int]) -> None:
        """A state was loaded into this bucket: the weights are checked by value at the next
        step (Note [a loaded state claims no weights] in ``checkpoint/state_dict.py``), and
        the slots ``weights_win`` keep the weights loaded into them until then
        (``ParamViews.masters_from_weights``)."""
        self.views.forget()
        self.views.masters_from_weights = frozenset(weights_win)
        self.unchecked_load = True
        self.master_marks = None

    def reconcile_master(self) -> None:
        """``store.reconcile_master()``, the check by value, but a slot whose master was
        written through ``opt.state`` since a load keeps it (Note [a master read after a
        load])."""
        kept: list[tuple[torch.Tensor, torch.Tensor]] = []
        if self.master_marks is not None:
            now = self.master_fingerprints()
            for i, (before, after) in enumerate(zip(self.master_marks, now, strict=True)):
                if not same_fingerprint(before, after):
                    master = self.state_views(i)[2]["master"]
                    kept.append((master, master.clone()))
        self.store.reconcile_master()
        with torch.no_grad():
            for master, value in kept:
                master.copy_(value)

    def write_checked(self) -> None:
        """A step's write check ran: a load's weights are known from here on (Note [a
        master read after a load])."""
        self.unchecked_load = False
        self.master_marks = None

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
