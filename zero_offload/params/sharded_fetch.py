"""Parameter offload across ranks (ZeRO-3 with offload, ZeRO-Infinity's configuration): each
rank's homes hold its shard of each bucket, and a fetch all-gathers the slot.

Note [a sharded unit]
~~~~~~~~~~~~~~~~~~~~~
With several ranks each bucket of a unit is split into even, padded shards, the partition of
stage 2 (Note [who owns which shard] in ``partition.py``): rank ``r``'s home holds
``[r * shard_numel, (r + 1) * shard_numel)`` of the bucket, which is exactly what its CPU
Adam updates (``HostState`` covers that shard). Host bytes per rank: each bucket's home
shard and state shard, a ``1/world_size`` share of one rank's.

A fetch copies the home shard H2D into this rank's slice of the unit's slot
(``WindowedViews.home_slot``), and the slot is then all-gathered on the comm stream, after
the copies' end event (``SlotGather``); ``ParamUnit.ready`` is the gather's event, which
compute waits for before the unit's forward or backward. The next fetch into the same slot
waits for that gather on the ``h2d`` stream (a prefetch nobody used was never waited for by
compute). The end-of-step all-gather of stage 2 is not done: the step updates the homes and
the next fetch gathers them (``ShardedParamRanks`` in ``optim/ranks.py``). Per step the wire
carries the all-gathers of the forward and of the backward and the gradients'
reduce-scatter: 3Ψ, against stage 2's 2Ψ (a unit still in its slot from the forward is not
gathered again for its backward, so the measured figure is at most 3Ψ).

Lockstep. All-gathers match by the order each rank issues them, but the window's schedule is
each rank's own: a rank that skips a block (a router, a conditional branch) would gather
fewer units, and the others would wait forever or gather the wrong bytes. So gathers follow
one *canonical order* on every rank: the units in registration order for a forward, in
reverse for a backward. A pass through a phase keeps a cursor into that order; fetching the
unit at position ``p`` first takes part in the gather of every unit between the cursor and
``p`` that its slot does not hold validly (``_pass_through``: gathered into its slot, left
released), and the end of each forward and backward sweeps the order to its end. A unit
whose slot holds it validly is fetched without a gather and without moving the cursor (a
tied unit's own slot keeps it from its forward to its backward). So each rank issues the
same gathers in the same order: the slots' contents change only by those gathers and by a
step, which makes every slot stale on every rank (``before_step``: a rank whose shard of a
bucket is all padding updates nothing there, yet the others' updates arrive with the next
gather), so whether a unit needs a gather is the same everywhere; only the timing differs.
A prefetch that would evict a unit in use stops (it changes timing, not the order). A unit
needed again behind the cursor whose slot no longer holds it (a block run twice in one
forward, a forward that runs the units far out of their registration order) would need a
gather out of the order: that is refused, naming the unit.

Note [a unit's gradients are over]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A rank's backward waits for gathers the other ranks issue from their backward, and a
bucket's reduce-scatter waits for the same bucket on every rank. A bucket that a rank
completes only at the end of its backward (a parameter unused there: Note [ranks in
lockstep] in ``optim/grads/order.py``) holds back this rank's reduce-scatters; the other
ranks' reduce-scatters wait for it, their gradient buffers run out, they stop before their
next gather, and this rank waits for that gather: a deadlock stage 2 never had. So when a
unit's output gradient arrives (``_backward_use``), every unit used in this forward only
after it, and every unit not used at all, has had its whole backward (Note [the parameter
window] in ``offloader.py``): its buckets are declared finished (``BackwardRouter
.finished``), completed with zeros where nothing came, and go in their turn. Not done when
several forwards feed one backward or for a unit user code read during the forward (its
parameters may be used anywhere): those buckets wait for the end of backward as in stage 2,
and a parameter unused on one rank inside a unit that ran can still deadlock that way.

Outside a forward or backward (``materialize``: user code reading a released parameter,
``model.state_dict()``, ``torch.save(model)``, ``close``) a fetch gathers directly: such a
read is collective, every rank must make it in the same order (FSDP's full state dict is the
same). A state-dict entry is then a host copy of the gathered parameter, not a view of a
home (no rank holds the whole parameter); a write to it does not reach the model.

Note [sharded homes on NVMe]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~
With ``nvme_dir`` too (ZeRO-Infinity across ranks), a bucket whose home shard does not fit
this rank's ``host_budget`` keeps it in a weight file of this rank's directory
(``nvme_dir/rank{r}``, beside its state: Note [homes on NVMe] in
``optim/state/nvme_plan.py``), the shard's real elements only. A fetch reads the records
into the slot's bounce and returns (Note [homes on NVMe are fetched through a bounce ring]
in ``home_store.py``); the H2D copies into this rank's slice (``home_slot``) and then the
slot's all-gather are queued once the reads are done (``ParamUnit.finish_fetch``). The
ranks' budgets, and so which buckets are on disk, may differ; the order of the gathers may
not. So a unit whose reads are pending is *owed* its gather (``SlotGather.owe``), and a
gather asked for while earlier ones are owed first finishes those fetches, in the order
they were made (the CPU waits for their disk reads there): each rank issues its gathers in
the order of its fetches, which is the canonical order above, whatever is on disk. The
padding of a shard is not on disk; its bytes in the slot are never a parameter's. A record
that cannot be read raises ``StorageError`` naming the rank, the unit, the bucket and the
file, and the gather is never issued: the other ranks' gather of that unit fails with a
``CollectiveError`` at the collective deadline (``collective_timeout``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ..accelerator import Stream
from ..collectives import Comm, surface_collective_errors
from ..errors import Attempts
from ..partition import BucketLayout
from . import released
from .offloader import ParamOffloader, Phase
from .sharded_homes import ShardedParamUnit, ShardedWindowedViews
from .slot_gather import SlotGather
from .unit import ParamUnit
from .windowed_views import WindowedViews

__all__ = ["ShardedParamOffloader"]


class ShardedParamOffloader(ParamOffloader):
    """``ParamOffloader`` over several ranks; see Note [a sharded unit].

    Fields (beyond ``ParamOffloader``'s):
        gather: the ``SlotGather`` every unit's fetch ends with.
        _order: the canonical gather order of the current pass (empty: no pass, a fetch
            gathers directly).
        _cursor: how far into ``_order`` this rank has taken part in the gathers.
    """

    unit_class = ShardedParamUnit

    def __init__(
        self,
        model: nn.Module,
        *,
        comm: Comm,
        stream: Stream,
        finished: Callable[[list[int]], None],
        **kwargs: Any,
    ) -> None:
        super().__init__(model, **kwargs)
        self.comm = comm
        self.gather = SlotGather(comm, stream, self.manager)
        self.finished = finished  # the optimizer's BackwardRouter.finished
        self._order: list[ParamUnit] = []
        self._cursor = 0
        self._grad_forwards = 0  # forwards with autograd since the last backward
        self._touched: set[int] = set()  # units read by user code during a forward
        self._declared: set[int] = set()  # units whose buckets were declared finished

    def _new_views(
        self,
        layout: BucketLayout,
        params: Sequence[nn.Parameter],
        unit: ParamUnit,
        region: torch.Tensor,
    ) -> WindowedViews:
        shard = layout.shard_range(self.comm.rank)
        return ShardedWindowedViews(layout, params, unit, region, shard=shard)

    def plan(
        self, layouts: Sequence[BucketLayout], params: Sequence[Any], *, alignment: int
    ) -> None:
        super().plan(layouts, params, alignment=alignment)
        for unit in self.units:
            unit.gather = self.gather

    def adopt(self, views: WindowedViews, backend: Any) -> None:
        super().adopt(views, backend)
        if views.nvme_home is not None:  # its errors name the rank too
            views.nvme_home.owner = f"{self.comm.where()} {views.nvme_home.owner}"

    # -- the canonical order -----------------------------------------------------------

    def _start_pass(self, order: list[ParamUnit]) -> None:
        self._order = order
        self._cursor = 0

    def _sweep(self) -> None:
        """Take part in every gather left in this pass (Note [a sharded unit])."""
        with surface_collective_errors():
            for unit in self._order[self._cursor :]:
                if not _holds(unit):
                    self._pass_through(unit, demand=True)
        self._order = []
        self._cursor = 0

    def _pass_through(self, unit: ParamUnit, *, demand: bool) -> bool:
        """Gather ``unit`` into its slot for the other ranks and leave it released."""
        if not self._fetch_one(unit, demand=demand):
            return False
        unit.release()
        return True

    def _fetch_one(self, unit: ParamUnit, *, demand: bool) -> bool:
        occupant = unit.slot.occupant
        if occupant is not None and occupant is not unit and occupant.resident:
            if not demand:
                return False  # its slot holds a unit still in the window
            occupant.release()
        if not _holds(unit):
            self.gather.before_fetch(unit)
        unit.fetch(self.manager)
        return True

    def _fetch(self, unit: ParamUnit, *, demand: bool) -> None:
        if unit.resident:
            return
        if _holds(unit) or not self._order:
            # No gather (the slots are alike on every rank: the others gather nothing
            # either), or outside a pass: a collective read, in the caller's order.
            self._fetch_one(unit, demand=demand)
            return
        position = self._order.index(unit)
        if position < self._cursor:
            if demand:
                raise RuntimeError(
                    f"{self.comm.where()}: {unit!r} is needed again after the ranks' "
                    f"gathers moved past it in this {self.phase.value} (order: "
                    f"{', '.join(u.spec.name for u in self._order)}), and its slot holds "
                    f"{unit.slot.occupant!r} now. With several ranks the units are "
                    "gathered in registration order (reversed for backward) on every rank. "
                    "Register the modules in the order the forward runs them, do not run "
                    "a block twice in one forward, or raise OffloadConfig.prefetch_layers"
                )
            return
        for skipped in self._order[self._cursor : position]:
            if not _holds(skipped) and not self._pass_through(skipped, demand=demand):
                return  # a prefetch stops here; the demand fetch takes part later
            self._cursor += 1
        if self._fetch_one(unit, demand=demand):
            self._cursor = position + 1

    def _upcoming(
        self, order: Sequence[ParamUnit], start: int, current: ParamUnit
    ) -> list[ParamUnit]:
        """Prefetch in the canonical order: the next units after ``current`` there."""
        if not self._order:
            return super()._upcoming(order, start, current)
        position = self._order.index(current)
        return super()._upcoming(self._order, position + 1, current)

    def _advance(self, current: ParamUnit, upcoming: list[ParamUnit]) -> None:
        with surface_collective_errors():  # a failed gather fails the compute stream
            super()._advance(current, upcoming)

    def materialize(self, unit: ParamUnit) -> None:
        if self.phase is Phase.FORWARD:
            self._touched.add(unit.index)  # its parameters may have a gradient anywhere
        with surface_collective_errors():
            super().materialize(unit)

    def _land_for_user(self, unit: ParamUnit) -> None:
        """Into the slot, gathered in the ranks' order (Note [a sharded unit]); not
        privately (Note [a read outside the window lands privately] in ``private_reads.py``).
        One torch call reading two units that share a slot is refused, on every rank alike
        before any gather (the second would evict the first, and the call would run on its
        placeholder)."""
        call = released.current_call()
        occupant = unit.slot.occupant
        if (
            call is not None
            and occupant is not None
            and occupant is not unit
            and occupant.resident
            and occupant.private_call == call
        ):
            raise RuntimeError(
                f"{self.comm.where()}: one torch call reads parameters of {occupant!r} and "
                f"{unit!r}, which share window slot {unit.slot.index}: with several ranks a "
                "parameter read outside the window is gathered into its unit's slot, so "
                "both cannot be on the device at once. Read them in separate calls (clone "
                "the first: a = p.clone(); then a + q), or with one rank each lands in a "
                "buffer of its own. Nothing was read"
            )
        self._fetch(unit, demand=True)
        unit.private_call = call  # which call holds the slot (no private buffer here)

    # -- the passes --------------------------------------------------------------------

    def _begin_forward(self) -> None:
        if self._order:
            self._sweep()  # a forward that never ended (a submodule run alone)
        super()._begin_forward()
        self._start_pass(list(self.units))
        if torch.is_grad_enabled():
            self._grad_forwards += 1

    def _end_forward(self) -> None:
        self._sweep()
        super()._end_forward()

    def _start_backward(self) -> None:
        if self._order:
            self._sweep()
        self._start_pass(list(reversed(self.units)))
        self._declared = set()
        super()._start_backward()

    def _backward_use(self, unit: ParamUnit) -> None:
        if self.phase is not Phase.BACKWARD:
            self._start_backward()
        self._declare_finished(unit)
        super()._backward_use(unit)

    def _declare_finished(self, unit: ParamUnit) -> None:
        """Note [a unit's gradients are over]."""
        if self._grad_forwards != 1 or unit.index in self._touched:
            return  # several graphs in one backward, or a unit read outside its forward
        positions: dict[int, list[int]] = {}
        for position, used in enumerate(self._trace):
            positions.setdefault(used.index, []).append(position)
        if unit.index not in positions:
            return
        last = max(positions[unit.index])
        over = [
            other
            for other in self.units
            if other.index not in self._declared
            and other.index not in self._touched
            and (other.index not in positions or min(positions[other.index]) > last)
        ]
        self._declared.update(other.index for other in over)
        indices = sorted(views.layout.index for other in over for views in other.views)
        if indices:
            self.finished(indices)

    def _end_backward(self) -> None:
        self._sweep()
        self._grad_forwards = 0
        self._touched = set()
        super()._end_backward()

    def close(self) -> None:
        """Each unit is gathered once more (collective: every rank closes its optimizer) and
        its parameters take private copies of the whole weights, before the base class
        closes the window: that too when a gather failed (the process group is broken:
        Note [a release after a collective failure the caller saw] in optim/lifetime.py),
        the gather's error raised after it."""
        self._order = []
        attempt = Attempts()
        attempt(self._unbind_all)
        attempt(super().close)
        attempt.raise_first()

    def _unbind_all(self) -> None:
        with surface_collective_errors():
            for unit in self.units:
                if any(v.home is not None or v.nvme_home is not None for v in unit.views):
                    for views in unit.views:
                        views.unbind()  # the first gathers the unit, the others reuse it
                    unit.release()  # the parameters are private copies now: left alone

    def before_step(self) -> None:
        if self._order:
            self._sweep()
        super().before_step()
        # The step writes the homes on the ranks whose shard holds parameters: a rank whose
        # shard of a bucket is all padding writes nothing and would keep its slot valid
        # while the others gather. Every slot is stale on every rank (Note [a sharded unit]).
        for unit in self.units:
            unit.content_valid = False


def _holds(unit: ParamUnit) -> bool:
    """Whether ``unit``'s slot holds its current weights (a fetch would gather nothing)."""
    if unit.resident:
        return True
    return unit.slot.occupant is unit and unit.content_valid
