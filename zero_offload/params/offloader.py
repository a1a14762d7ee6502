"""ParamOffloader: a window of units' weights on the device, fetched ahead of forward and
backward, released behind them.

Note [the parameter window]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
Each *use* of a unit (Note [what a unit is] in ``units.py``) moves the window: the unit must
be on the device, the next ``prefetch_layers`` distinct units of the expected order are
fetched (on the ``h2d`` stream, through the memory manager), and every other resident unit
is released (Note [a unit's lifecycle] in ``unit.py``). Uses are:

- forward: the unit's module forward pre-hook. The expected order is the previous forward's
  sequence of uses (the registration order before the first), followed by its reverse (the
  backward), so the last units of a forward stay for the backward that starts with them.
- backward: the first gradient reaching one of the unit's forward outputs (a tensor hook
  registered by the forward post-hook), which fires before any backward node of the unit
  runs. The expected order is this forward's uses, reversed. Autograd runs nodes by
  decreasing sequence number, so when a unit's output gradient arrives every node of the
  units after it in the forward has run: releasing those cannot pull weights from under a
  backward node. Their gradients have gone to the optimizer's buckets already (the backward
  router's hooks), exactly as without parameter offload.
- recompute (activation checkpointing, a forward pre-hook inside a backward): the unit is
  made resident if it is not, and nothing else moves (Note [a recompute moves nothing]).

The end of each backward releases every unit; the optimizer's step pre-hook waits for every
pending fetch (they read the homes the step writes) and releases every unit, so the step
updates only the pinned homes, and the next forward's fetches bring the update. A fetch whose
slot still holds the unit's current weights copies nothing (``ParamUnit.content_valid``).
A forward outside training (``torch.no_grad()``, ``model.eval()``, ``generate()``) moves the
window exactly like a training forward; the units still resident when a forward returns are
*exposed* to user code (Note [a write to a resident unit reaches its home] in
``slot_writes.py``).
User code that reads a released parameter outside the window brings its unit back through
``materialize`` (Note [a released parameter] in ``released.py``), into a buffer of its own
(Note [a read outside the window lands privately] in ``private_reads.py``).

Note [a recompute moves nothing]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A checkpointed region is recomputed inside a backward, and it may span several units (a
module outside ``layers`` checkpointed whole: T5's encoder blocks when ``layers`` is the
decoder's). Its forward pre-hooks run in forward order while the backward plan runs in
reverse, so a recompute use fetches its unit (evicting only its slot's occupant) and
neither releases other units nor moves the plan's position, unless its unit is the plan's
next use: then it is that backward use, prefetch included (a checkpoint per block, the
common case, prefetches the block before during the recompute). Each sub-unit's recomputed
outputs are watched like a forward's (``_after_forward``), so the backward that consumes
them brings each unit back before any of its nodes runs, exactly as in a plain backward:
for reentrant checkpointing that is the checkpoint's inner backward (its own graph task,
whose gradients reach the recomputed outputs), for non-reentrant the original outputs'
hooks (the recomputed outputs are never differentiated; their hooks never fire). A sub-unit
evicted by a later sub-unit of the same recompute (the region has more units than the ring
has slots) is fetched again into its slot, where the views autograd saved point (Note [a
unit always returns to its slot]); a parameter saved whole (``layer_norm`` saves its weight)
is re-pointed at the slot by that fetch. A gradient reaching a unit the plan has passed
already (a recompute used it as the plan's next) finds it resident and moves nothing. Before
this rule each recompute use moved the window, releasing the earlier sub-units of the same
recompute under a reentrant checkpoint's inner backward, which then read zero-byte
placeholders.

Note [no higher-order gradients]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A backward that builds a graph (``torch.autograd.grad(..., create_graph=True)``,
``backward(create_graph=True)``: a gradient penalty) saves the units' weights, or views of
their slots, in the new graph's nodes. That graph is differentiated later, by a backward
that fires none of the units' hooks first: its nodes would read whichever unit holds the
slot then, or a released parameter's zero bytes. So the first unit gradient of a backward
run with grad mode on (the engine's grad mode is ``create_graph``) is refused, before the
unit moves and before any of its nodes runs (``hooks._grad_hook``). The resident optimizer
(``offload_parameters=False``) supports it. A checkpoint's recompute runs with grad mode on
by design; it is a forward pre-hook, not a gradient, and is not refused.

The optimizer builds the window (``window_build.py``: each bucket at an offset of its unit's
slot). Hooks register the uses (``hooks.py``); the state-dict entries of offloaded
parameters are views of their homes (Note [state dict entries are views of the homes] in
``state_dict_entries.py``).

Device bytes: the window pool, ``sum`` of its slots (Note [a unit always returns to its
slot] in ``window.py``): ``prefetch_layers + 2`` ring slots, each of the largest unit in it,
plus one slot per tied unit. Everything else on the device is what it was: the optimizer's
gradient buffers and the activations.

Several ranks (ZeRO-3 with offload, ``ShardedParamOffloader`` in ``sharded_fetch.py``): each
rank holds its shard of each home, fetches the shard into its slice of the slot and
all-gathers the slot on the comm stream before ``use`` (``ParamUnit.ready`` is the
all-gather's event); the window and the lifecycle stay as they are, and the gathers follow
one order on every rank (Note [a sharded unit]).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ..errors import Attempts
from ..memory.manager import TieredMemoryManager
from . import hooks
from .home_store import Bounce
from .hook_ref import Hook as _Hook  # noqa: F401  the old name: models pickled with it load
from .live_units import LiveUnits
from .private_reads import PrivateReads
from .state_dict_entries import StateDictEntries
from .unit import ParamUnit, UnitState
from .units import UnitSpec, find_units
from .window import Window
from .window_build import WindowBuild, checked_blocks

__all__ = ["ParamOffloader", "Phase"]


class Phase(enum.Enum):
    """What the model is doing, as the hooks see it."""

    IDLE = "idle"  # between a backward (or construction) and the next forward
    FORWARD = "forward"
    BACKWARD = "backward"


def _never() -> bool:
    return False


class ParamOffloader(WindowBuild, PrivateReads):
    """Parameter offload for one model and one optimizer; see Note [the parameter window].

    Built by ``OffloadAdamW`` with ``OffloadConfig(offload_parameters=True)`` and
    ``model=``; the optimizer calls ``split_families``, ``plan``, ``views_for``, ``adopt``
    and ``install`` while it builds its buckets (``window_build.py``), and ``close`` when it
    is released.

    Fields:
        units: ``ParamUnit`` per unit, in forward (registration) order.
        window: the device window (``Window``), from ``plan``.
        phase: ``Phase``, as the hooks last saw it.
        entries: the state-dict entries handed out (``StateDictEntries``).
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        layers: Sequence[nn.Module] | None,
        manager: TieredMemoryManager,
        prefetch_layers: int,
        trainable: Sequence[torch.Tensor],
        name: str,
    ) -> None:
        blocks = checked_blocks(model, layers)
        self.model = model
        self.manager = manager
        self.prefetch = prefetch_layers
        self.name = name
        self.specs: list[UnitSpec] = find_units(model, blocks, trainable)
        self._index_of_param = {id(p): i for i, s in enumerate(self.specs) for p in s.params}
        self.units: list[ParamUnit] = []
        self.live: LiveUnits[ParamUnit] = (
            LiveUnits()
        )  # the units not released: Note [the live units]
        self.window: Window | None = None
        self._place: dict[int, tuple[int, int]] = {}  # bucket index -> (unit, byte offset)
        self._handles: list[Any] = []
        self.phase = Phase.IDLE
        self._trace: list[ParamUnit] = []  # this forward's uses
        self._last_trace: list[ParamUnit] = []  # the previous complete forward's uses
        self._backward_plan: list[ParamUnit] = []
        self._backward_pos = 0
        self.bounce: Bounce | None = None  # Note [homes on NVMe are fetched through ...]
        self.entries = StateDictEntries()  # Note [state dict entries are views of the homes]
        #: Whether the optimizer's step is writing the homes now (a step run during
        #: backward, before step()): a forward then is refused, set by the optimizer.
        self.homes_in_update: Callable[[], bool] = _never
        #: Units landed privately for user code, oldest first (Note [a read outside the
        #: window lands privately] in private_reads.py); a released one is dropped at the next look.
        self._private: list[ParamUnit] = []
        self._slot_reads_warned = False  # _warn_slot_read

    # -- the homes and user code ----------------------------------------------------

    def flush_copies(self) -> None:
        """Carry the writes made to state-dict copies of NVMe homes home (Note [state dict
        entries are views of the homes]); forget the copies that are gone."""
        self.entries.flush()

    def materialize(self, unit: ParamUnit) -> None:
        """Bring ``unit`` onto the device for user code and wait for it (Note [a released
        parameter]); it stays until the window or a step releases it, exposed."""
        if self.window is None:
            raise RuntimeError(f"{unit!r} is released after close (bug)")
        self.check_homes_settled("reading a parameter")
        self.recover()
        self._land_for_user(unit)
        unit.expose(self.manager)

    def recover(self) -> None:
        """Every unit a move left MOVING (an interrupt, or an error part-way) is rebuilt
        ON_HOST (Note [an interrupted move] in ``unit.py``); one test of an empty set when
        none is (Note [the live units] in ``live_units.py``)."""
        self.live.recover()

    def check_homes_settled(self, what: str) -> None:
        """Refuse ``what`` (a forward, a parameter read, a state dict: each reads the homes)
        while the optimizer's step run during backward is writing the homes, before step():
        it would see some units before the step, some after, some torn (Note [stepping
        during backward with parameter offload] in optim/update/eager.py)."""
        if self.homes_in_update():
            raise RuntimeError(
                f"{what} between a backward whose step ran during it (backward(loss, "
                "step=True) or announce_step(), with offload_parameters=True) and step(): "
                "the weights are being updated. Call opt.step() first (opt.zero_grad() if "
                "the backward raised)"
            )

    # -- the schedule ------------------------------------------------------------------

    def _expected_forward(self) -> list[ParamUnit]:
        forward = self._last_trace or self.units
        return [*forward, *reversed(forward)]

    def _upcoming(
        self, order: Sequence[ParamUnit], start: int, current: ParamUnit
    ) -> list[ParamUnit]:
        """The next ``prefetch_layers`` distinct units of ``order[start:]``, not ``current``."""
        out: list[ParamUnit] = []
        for unit in order[start:]:
            if len(out) >= self.prefetch:
                break
            if unit is not current and unit not in out:
                out.append(unit)
        return out

    def _advance(self, current: ParamUnit, upcoming: list[ParamUnit]) -> None:
        """Note [the parameter window]: release what left it, fetch ``current`` (if it is
        not resident) and ``upcoming``, and make compute wait for ``current``."""
        keep = {id(current), *(id(u) for u in upcoming)}
        self.recover()  # Note [an interrupted move] in unit.py
        live = self.live.live()  # the units in the window, not every unit: Note [the live units]
        for unit in live:
            if unit.pending and all(p.done() for p in unit.pending):
                unit.finish_fetch()  # a prefetch from NVMe whose reads are done: to the slot
        for unit in live:
            if unit.resident and id(unit) not in keep:
                unit.release()
        self._fetch(current, demand=True)
        for unit in upcoming:
            self._fetch(unit, demand=False)
        current.use(self.manager)

    def _fetch(self, unit: ParamUnit, *, demand: bool) -> None:
        if unit.private is not None:
            unit.release()  # a window use computes in the slot (Note [a unit always ...])
        if unit.resident:
            return
        occupant = unit.slot.occupant
        if occupant is not None and occupant is not unit and occupant.resident:
            if not demand:
                return  # its slot holds a unit still in the window: fetched when needed
            occupant.release()
        unit.fetch(self.manager)

    # -- hooks -------------------------------------------------------------------------

    def _begin_forward(self) -> None:
        self.check_homes_settled("a forward")
        self.phase = Phase.FORWARD
        self._trace = []
        self.flush_copies()
        for unit in self.units:  # written through a state dict entry while resident
            if unit.resident and unit.homes_written:
                unit.release()  # the forward fetches the homes afresh

    def _end_forward(self) -> None:
        if self._trace:
            self._last_trace = list(self._trace)
        for unit in self.units:  # user code runs next: Note [a write to a resident unit ...]
            unit.expose(self.manager)

    def _before_forward(self, unit: ParamUnit) -> None:
        if hooks.in_backward():  # recompute under activation checkpointing
            self._recompute_use(unit)
            return
        if self.phase is not Phase.FORWARD:  # a submodule run without the model's forward
            self._begin_forward()
        position = len(self._trace)
        self._trace.append(unit)
        self._advance(unit, self._upcoming(self._expected_forward(), position + 1, unit))

    def _after_forward(self, unit: ParamUnit, output: Any) -> None:
        if not torch.is_grad_enabled():
            return
        # A recompute's outputs too: Note [a recompute moves nothing].
        hooks.watch(self, unit.index, output)

    def _start_backward(self) -> None:
        """The first use of a backward: its plan, and its end queued on its graph task."""
        self.phase = Phase.BACKWARD
        self._backward_plan = list(reversed(self._trace or self._last_trace or self.units))
        self._backward_pos = 0
        hooks.queue_end_of_backward(self)  # _end_backward, after the router's flushes

    def _recompute_use(self, unit: ParamUnit) -> None:
        """Note [a recompute moves nothing]: ``unit`` on the device, the rest as it is."""
        if self.phase is not Phase.BACKWARD:
            self._start_backward()
        self.recover()
        plan, position = self._backward_plan, self._backward_pos
        if position < len(plan) and plan[position] is unit:
            self._backward_use(unit)
            return
        if unit.state is UnitState.ON_DEVICE:
            return
        self._fetch(unit, demand=True)
        unit.use(self.manager)

    def refuse_higher_order(self, unit: ParamUnit) -> None:
        """Note [no higher-order gradients]: a backward building a graph is refused."""
        raise RuntimeError(
            f"a backward with create_graph=True reached {unit!r} (torch.autograd.grad(..., "
            "create_graph=True) or backward(create_graph=True), e.g. a gradient penalty): "
            "higher-order gradients are not supported with "
            "OffloadConfig(offload_parameters=True), because the graph it builds keeps "
            "views of the parameter-offload window that a later backward would read after "
            "their units left it. Use the resident optimizer, "
            "OffloadConfig(offload_parameters=False), which supports them, or compute the "
            "penalty without create_graph"
        )

    def _backward_use(self, unit: ParamUnit) -> None:
        if self.phase is not Phase.BACKWARD:
            self._start_backward()
        plan = self._backward_plan
        try:
            position = plan.index(unit, self._backward_pos)
            self._backward_pos = position + 1
        except ValueError:
            if unit.resident:  # used ahead of its gradient: Note [a recompute moves nothing]
                unit.use(self.manager)
                return
            position = len(plan)  # not where expected: no prefetch from here
        self._advance(unit, self._upcoming(plan, position + 1, unit))

    def _end_backward(self) -> None:
        self._release_all()
        self.phase = Phase.IDLE

    def _release_all(self) -> None:
        for unit in self.units:
            if unit.resident or unit.state is UnitState.MOVING:
                unit.release()  # a MOVING one is recovered (Note [an interrupted move])

    def before_step(self) -> None:
        """The step writes the homes: every pending fetch reads them, so wait for each
        (Synchronisation point: the copies were needed by compute already, except
        prefetches nobody used); release every unit, so no stale weights stay resident."""
        self.flush_copies()
        for unit in self.units:
            unit.settle()
        self._release_all()
        self.phase = Phase.IDLE

    # -- statistics and teardown -------------------------------------------------------

    @property
    def fetches(self) -> int:
        """Fetches that copied bytes, over every unit."""
        return sum(unit.fetches for unit in self.units)

    @property
    def window_bytes(self) -> int:
        """Device bytes of the window pool (its slots)."""
        return 0 if self.window is None else self.window.capacity

    def close(self) -> None:
        """Remove the hooks, give every parameter a private copy of its current weights on
        the device and its plain class (so the model keeps working without the optimizer's
        pools) and close the window. Every part is attempted even when one fails (a unit's
        prefetch that read a bad record re-raises its error when settled): the first error
        is raised at the end, after the rest is released."""
        attempt = Attempts()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for unit in self.units:
            attempt(unit.settle)
        attempt(self._release_all)
        for unit in self.units:
            for views in unit.views:
                if views.home is not None or views.nvme_home is not None:
                    attempt(views.unbind)
                attempt(views.close)
        if self.window is not None:
            attempt(self.window.close)
            self.window = None
        if self.bounce is not None:
            attempt(self.bounce.close)
            self.bounce = None
        self.entries = StateDictEntries()
        self._private = []
        attempt.raise_first()
