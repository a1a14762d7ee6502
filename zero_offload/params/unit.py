"""One unit of parameter offload: its lifecycle (one enum, checked transitions), its slot and
its fetches.

Note [a unit's lifecycle]
~~~~~~~~~~~~~~~~~~~~~~~~~
The authoritative training-dtype weights of a unit live in pinned host memory, in each of
its buckets' *home*: the ``weights_staging`` CPU Adam writes for bf16/fp16, the fp32 master
itself for fp32 (``HostState.weights_home`` in ``optim/state/host.py``), or, for a bucket
beyond ``host_budget``, a weight file on NVMe read through the window's bounce ring (Note
[homes on NVMe are fetched through a bounce ring] in ``home_store.py``; a fetch is then
its disk reads, ``pending``, and the H2D copies queued once they are done,
``finish_fetch``). A step updates the homes only; the next fetch brings the update (nothing
else crosses the link for these weights).

- ON_HOST (released): the weights are in the homes only. The parameters are zero-byte
  tensors on the device, of their shape and dtype, that fetch the unit when user code reads
  them (Note [a released parameter] in ``released.py``); the unit's slot may hold another
  unit.
- FETCHING: H2D copies (one per bucket, on the ``h2d`` stream through the memory manager)
  are writing the homes into the slot; the parameters still hold their placeholders, and
  ``use`` binds them to the slot after compute waited on ``ready`` (Note [a fetching
  unit's parameters stay released]).
- ON_DEVICE: compute waited on ``ready``; kernels may read the slot.

Note [a fetching unit's parameters stay released]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A prefetched unit is FETCHING while code between the window's hooks runs: a decoder reading
``enc[i].weight`` or a bias list directly, outside any module forward of its unit, calls no
``use``, so nothing makes compute wait on ``ready``. Had the parameters been views of the slot
(or private buffer) already, that read would see bytes the H2D copy has not written yet (a
silently wrong forward; the tied autoencoder in tests/test_param_offload_reads.py, under
load). So the parameters keep their placeholders while FETCHING and are bound to the device
weights only by ``use``, after compute waited on ``ready``: a read of a FETCHING unit's
parameter is a read of a released parameter, which brings the unit on through
``materialize`` (``expose`` -> ``use``: the wait, then the binding). Invariant: a parameter
with its plain class views device bytes compute has waited for.

ON_HOST -> FETCHING -> ON_DEVICE -> ON_HOST, or FETCHING -> ON_HOST (released before use);
each move that re-points the parameters passes through MOVING (Note [an interrupted move]).
A release points the parameters at their placeholders again, after copying a written slot
home (Note [a write to a resident unit reaches its home] in ``slot_writes.py``); the slot's
bytes are overwritten only by a fetch, whose copies wait for the compute stream's work issued
before it (every kernel that read the previous occupant is among it: stream-ordered reuse,
the CPU does not wait). ``ParamUnit.content_valid`` says the slot still holds this unit's current weights
(released, nobody fetched into the slot since, no step since, the homes not written through
a state dict's views since): a fetch then copies nothing.

Note [an interrupted move]
~~~~~~~~~~~~~~~~~~~~~~~~~~
A ``KeyboardInterrupt`` (Ctrl-C in a notebook) or a signal handler's ``sys.exit`` lands between
any two bytecodes of the thread moving the window: between two parameters being re-pointed,
between a parameter's class switch and its ``.data`` (``released.release``/``restore``), after
a copy is queued and before its event is kept. What is guaranteed:

- A move that re-points parameters (``fetch``, ``fetch_private``, ``release``) does its checks
  first (a refusal changes nothing), then sets the unit MOVING with one attribute store
  (``_begin``), and its final state with one store after its last write (``_end``). So a unit
  is in a state whose meaning holds, or MOVING: never a half-written FETCHING or ON_HOST.
- MOVING means only that the move did not end: each parameter points at the slot (or private
  buffer), at its placeholder, or half-way between; H2D copies may be queued whose end event
  was not kept; a private buffer may be held. ``recover`` rebuilds the unit from those facts,
  not from how far the move got: it waits for the H2D stream (Synchronisation point, only
  after an interrupt), drops pending disk reads, gives every parameter that is on the slot or
  its placeholder its placeholder again (``WindowedViews.bind_placeholders`` is idempotent; a
  replaced one is left for the refusal), marks the slot stale (the next fetch copies afresh),
  gives the private buffer back, and ends ON_HOST. Itself interrupted, it stays MOVING and
  runs again.
- It runs eagerly when a window hook raised (``hooks.py``), and otherwise before anything
  looks at the units in bulk: a window move, a read outside the window, a state dict, a step,
  ``close`` (``ParamOffloader.recover``, which finds them in the window's ``LiveUnits``
  without looking at every unit: Note [the live units] in ``live_units.py``); a MOVING unit
  is not resident, so nothing computes in it or releases it meanwhile. After an interrupted forward or backward, ``zero_grad()``
  (docs/optimizer.md) and the next forward train as if the step had not begun; the
  offloader's phase and trace are reset by that forward's start.
- Not covered: a private buffer interrupted after ``allocate_device`` returned it and before
  ``fetch_private`` keeps it (a few bytecodes) stays counted in the device budget; with
  several ranks an interrupt on one rank leaves the others' gathers waiting (they raise
  ``CollectiveError`` within ``collective_timeout``); and an interrupt at the exit of a
  ``with torch._C.DisableTorchFunctionSubclass()`` block (``released.py``, the views) that
  leaves through no window hook (``close``, a state dict's post-hook): Python then skips the
  exit, torch ignores tensor subclasses on that thread from there on, and a read of a
  released parameter no longer fetches its unit (or reads address 0). One that leaves
  through a hook finds the dispatch state restored there (``hooks._recovering``). The sweep
  of tests/test_interrupt_param_offload.py runs in a process of its own for the rest.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Callable, Sequence

from ..accelerator import DeviceBuffer, Event
from ..memory.manager import TieredMemoryManager
from ..memory.traffic import Category
from .home_store import Bounce, PendingFetch
from .live_units import LiveUnits
from .replaced_params import refuse_replaced
from .slot_writes import SlotWrites
from .unit_copies import Gatherer, UnitCopies
from .units import UnitSpec
from .window import Slot
from .windowed_views import WindowedViews

__all__ = ["ParamUnit", "UnitState"]


class UnitState(enum.Enum):
    """Where a unit's weights are, and what that means for device memory."""

    #: Released: the weights are in the pinned host homes only; the parameters hold
    #: zero-byte device placeholders; no device bytes are the unit's.
    ON_HOST = "on_host"
    #: The unit's slot is being written by H2D copies; compute must wait on ``ready``.
    FETCHING = "fetching"
    #: The slot holds the unit's weights and compute waited for them.
    ON_DEVICE = "on_device"
    #: A move (fetch or release) under way, or interrupted: each parameter points at the
    #: slot, its placeholder or half-way; the slot's bytes are not to be trusted; a private
    #: buffer may be held. Not resident; ``recover`` ends it ON_HOST (Note [an interrupted
    #: move]).
    MOVING = "moving"


_S = UnitState
_ALLOWED = frozenset(
    {
        (_S.ON_HOST, _S.FETCHING),
        (_S.FETCHING, _S.ON_DEVICE),
        (_S.FETCHING, _S.ON_HOST),
        (_S.ON_DEVICE, _S.ON_HOST),
    }
)


class ParamUnit(UnitCopies):
    """One unit; see Note [a unit's lifecycle]. Its copies between its homes and the device
    are ``UnitCopies``' (``unit_copies.py``).

    Fields:
        spec: which modules and parameters (``UnitSpec``).
        manager: the memory manager every copy of the unit goes through.
        index: position in forward order (``find_units``).
        slot: its fixed slot (Note [a unit always returns to its slot]).
        views: one ``WindowedViews`` per bucket of the unit, each at a fixed offset of
            the slot.
        ready: end event of the last fetch's copies, until compute waited on it (None then).
        fetched: the same event, kept until the CPU waited on it (``settle``): the homes it
            reads are written by the next step's CPU Adam.
        fetches: fetches that copied bytes (a statistic; the tests count them).
        write_backs: releases that copied a written slot home (a statistic).
        materialize: fetch for user code (``ParamOffloader.materialize``, holding it weakly).
        writes: the write check of the slot (``SlotWrites``): whether user code wrote it
            since the fetch; Note [a write to a resident unit reaches its home] in
            ``slot_writes.py``.
        private: the unit's own device buffer while user code reads it outside the window
            (None: the parameters are views of the slot, or released); Note [a read outside
            the window lands privately] in ``private_reads.py``.
        private_call: which intercepted torch call (``released.current_call``) landed it
            privately, so that call's other arguments do not push it out (None: none).
        gather: with several ranks, queues the all-gather of the slot after the H2D copies'
            end event and returns the gather's (Note [a sharded unit] in
            ``sharded_fetch.py``), or is owed it until the disk reads are done (Note
            [sharded homes on NVMe] there); None on one rank.
        live: the window's ``LiveUnits``, shared by its units, which each move keeps (Note
            [the live units] in ``live_units.py``).
    """

    def __init__(
        self,
        spec: UnitSpec,
        index: int,
        slot: Slot,
        *,
        manager: TieredMemoryManager,
        materialize: Callable[[], None],
        live: LiveUnits[ParamUnit],
    ) -> None:
        self.spec = spec
        self.manager = manager
        self.index = index
        self.slot = slot
        self.materialize = materialize
        self.views: list[WindowedViews] = []
        self.live = live
        self.state = UnitState.ON_HOST
        self.ready: Event | None = None
        self.fetched: Event | None = None
        self.content_valid = False
        self._home_versions: tuple[int, ...] = ()  # the homes' versions at fetch or release
        self.writes = SlotWrites(self.views)
        self.fetches = 0
        self.write_backs = 0
        self.bounce: Bounce | None = None  # the window's, when a bucket's home is on NVMe
        self.pending: list[PendingFetch] = []  # disk reads of a fetch, copies not queued
        self.gather: Gatherer | None = None
        self.private: DeviceBuffer | None = None  # (private_bytes(),) uint8, device
        self.private_call: int | None = None

    def _home_versions_now(self) -> tuple[int, ...]:
        return tuple(views.home_version() for views in self.views)

    @property
    def homes_written(self) -> bool:
        """Whether a home was written through a view of it (a state dict entry) since the
        unit's last fetch or release: the slot may be stale."""
        return self._home_versions != self._home_versions_now()

    def __repr__(self) -> str:
        return f"unit {self.index} ({self.spec.name}, {self.state.name})"

    def _check(self, to: UnitState) -> None:
        if (self.state, to) not in _ALLOWED:
            raise RuntimeError(
                f"{self!r}: parameter-offload state {self.state.name} -> {to.name} is not a "
                "valid transition (a bug in zero-offload; please report it)"
            )

    def _begin(self, to: UnitState) -> None:
        """Start the move to ``to``: MOVING until ``_end`` (Note [an interrupted move]); the
        unit is live and moving before the store (Note [the live units])."""
        self._check(to)
        self.live.units.add(self)
        self.live.moving.add(self)
        self.state = UnitState.MOVING

    def _end(self, to: UnitState) -> None:
        if self.state is not UnitState.MOVING:
            raise RuntimeError(f"{self!r}: ended a move it was not making (bug)")
        self.state = to
        self.live.moving.discard(self)  # after the store: Note [the live units]
        if to is UnitState.ON_HOST:
            self.live.units.discard(self)

    @property
    def resident(self) -> bool:
        """FETCHING or ON_DEVICE: the unit holds its slot (or private buffer); its parameters
        view it once ``bound``."""
        state = self.state
        return state is UnitState.FETCHING or state is UnitState.ON_DEVICE

    @property
    def moving(self) -> bool:
        """MOVING: a move did not end (Note [an interrupted move])."""
        return self.state is UnitState.MOVING

    @property
    def bound(self) -> bool:
        """ON_DEVICE: the parameters view the device weights (Note [a fetching unit's
        parameters stay released])."""
        return self.state is UnitState.ON_DEVICE

    def views_stepped(self, views: WindowedViews, flags: Sequence[bool]) -> None:
        """A step moved the version counters of ``views``' parameters where ``flags``
        (Note [a step moves the version counters] in views/param_views.py): while the
        unit is bound, its write check moves with them, or its release would take the move
        for a write and copy the old weights home over the update."""
        if self.bound:
            self.writes.stepped(views, flags)

    def fetch(self, manager: TieredMemoryManager) -> None:
        """ON_HOST -> FETCHING: queue the homes' copies into the slot (after the previous
        occupant's readers); the parameters keep their placeholders until ``use``. The
        previous occupant must have been released by the caller."""
        slot = self.slot
        self.recover()  # Note [an interrupted move]
        if slot.occupant is not None and slot.occupant is not self and slot.occupant.resident:
            raise RuntimeError(f"{self!r}: slot {slot.index} is held by {slot.occupant!r} (bug)")
        refuse_replaced(self, self.spec, self.views)
        if self.content_valid and self.homes_written:
            self.content_valid = False  # the homes were written through a state dict's views
        self._begin(UnitState.FETCHING)
        if not (slot.occupant is self and self.content_valid):
            slot.occupant = None  # rewritten from here: a failed read leaves it nobody's
            end = self._fill_slot(manager)
            if self.gather is not None:  # several ranks: Note [a sharded unit]
                if self.pending:  # gathered once read: Note [sharded homes on NVMe]
                    self.gather.owe(self)
                elif end is not None:
                    end = self.gather(self, end)
            self.ready = self.fetched = end  # one stream, in order: the last end covers all
            self.fetches += 1
        slot.occupant = self
        self.content_valid = True
        self._fetching()

    def _fetching(self) -> None:
        """The copies are queued; the parameters keep their placeholders until ``use``
        (Note [a fetching unit's parameters stay released])."""
        self._home_versions = self._home_versions_now()
        self.writes.forget()
        self._end(UnitState.FETCHING)

    def private_bytes(self) -> int:
        """Bytes of a private buffer holding every bucket at its slot offset."""
        return max((views.slot_span()[1] for views in self.views), default=0)

    def fetch_private(self, manager: TieredMemoryManager, buffer: DeviceBuffer) -> None:
        """ON_HOST -> FETCHING into ``buffer`` instead of the slot, which keeps its occupant
        and its contents (Note [a read outside the window lands privately] in
        ``private_reads.py``); ``release`` gives the buffer back."""
        if self.gather is not None:
            buffer.release()
            raise RuntimeError(f"{self!r}: a private fetch cannot gather (bug)")
        try:
            self.recover()  # Note [an interrupted move]
            refuse_replaced(self, self.spec, self.views)
            self._begin(UnitState.FETCHING)
        except BaseException:
            buffer.release()  # refused: the budget gets it back (it was never the unit's)
            raise
        self.private = buffer  # first: a recovery gives it back
        for views in self.views:
            views.land_in(buffer.tensor)
        try:
            self.ready = self.fetched = self._fill_slot(manager)
            self.fetches += 1
        except BaseException:
            with contextlib.suppress(Exception):  # the fetch's error is the one to raise
                self.recover()
            raise
        self._fetching()

    def _leave_private(self) -> None:
        """The views go back to the slot and the buffer to the budget; views user code took
        keep its storage (and their values) alive."""
        buffer = self.private
        if buffer is None:
            return
        for views in self.views:
            views.land_in(None)
        if not buffer.released:
            buffer.release()
        self.private = None  # last: an interrupted leave runs again (Note [an interrupted move])
        self.private_call = None

    def use(self, manager: TieredMemoryManager) -> None:
        """FETCHING -> ON_DEVICE: compute waits for the fetch (exposed time, if any)."""
        if self.state is UnitState.ON_DEVICE:
            return
        self.finish_fetch()
        if self.ready is not None:
            # Synchronisation point (stream-side on CUDA): compute reads the slot next.
            manager.wait_for([self.ready], category=Category.WEIGHTS)
            self.ready = None
        # Only now may the parameters view the device weights: Note [a fetching unit's
        # parameters stay released]. A move that re-points them: Note [an interrupted move].
        self._begin(UnitState.ON_DEVICE)
        for views in self.views:
            views.bind_device()
        self.writes.bound()
        self._end(UnitState.ON_DEVICE)

    def expose(self, manager: TieredMemoryManager) -> None:
        """User code may touch the resident unit next: fingerprint its slot (after compute
        waited for the fetch) unless it is exposed already; Note [a write to a resident
        unit reaches its home] in ``slot_writes.py``."""
        if not self.resident or self.writes.exposed is not None:
            return
        self.use(manager)
        self.writes.expose()

    def release(self) -> None:
        """-> ON_HOST: a written slot is copied home, the parameters hold their placeholders
        again; the slot is rewritten only by a later fetch, ordered after the compute issued
        before it. A MOVING unit is recovered instead (Note [an interrupted move])."""
        if self.state is UnitState.MOVING:
            self.recover()
            return
        self._check(UnitState.ON_HOST)
        stale = self.homes_written  # the slot no longer holds what the homes do
        self.finish_fetch()  # a prefetch nobody used: its copies complete the slot
        self.write_back()  # a private buffer's writes mark the slot stale there
        self._begin(UnitState.ON_HOST)
        for views in self.views:
            views.bind_placeholders()
        self.writes.forget()
        if stale:
            self.content_valid = False
        self._home_versions = self._home_versions_now()
        self._leave_private()
        self._end(UnitState.ON_HOST)

    def recover(self) -> None:
        """MOVING -> ON_HOST, from where the parameters point rather than from how far the
        move got; nothing for a unit in any other state (Note [an interrupted move])."""
        if self.state is not UnitState.MOVING:
            return
        pending, self.pending = self.pending, []
        for fetch in pending:
            fetch.drop()
        if pending and self.gather is not None:
            self.gather.withdraw(self)
        # Synchronisation point (only after an interrupt): the copies an interrupted fetch
        # queued may have lost their end event, and they read the homes a step writes and
        # write the slot (or the private buffer given back below).
        self.manager.h2d.synchronize()
        self.ready = self.fetched = None
        self.content_valid = False  # the slot may hold part of a fetch: the next one copies
        for views in self.views:
            views.bind_placeholders()
        self.writes.forget()
        self._home_versions = self._home_versions_now()
        self._leave_private()
        self._end(UnitState.ON_HOST)
