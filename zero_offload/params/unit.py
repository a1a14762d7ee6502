"""One unit of parameter offload: its lifecycle (one enum, checked transitions), its slot and
its fetches.

Note [a unit's lifecycle]
~~~~~~~~~~~~~~~~~~~~~~~~~
The authoritative training-dtype weights of a unit live in pinned host memory, in each of
its buckets' *home*: the ``weights_staging`` CPU Adam writes for bf16/fp16, the fp32 master
itself for fp32 (``HostState.weights_home`` in ``optim/state/host.py``). A step updates the homes only; the next
fetch brings the update (nothing else crosses the link for these weights).

- ON_HOST: the parameters are views of the homes (pinned host memory, no device bytes of
  their own); the unit's slot may hold another unit. Code that writes the parameters now
  (``load_state_dict``) writes the homes, which the optimizer reconciles as for any write
  (Note [weights written outside the optimizer] in ``views/param_views.py``).
- FETCHING: H2D copies (one per bucket, on the ``h2d`` stream through the memory manager)
  are writing the homes into the slot; the parameters are already views of the slot, and
  compute must wait on ``ready`` before reading them.
- ON_DEVICE: compute waited on ``ready``; kernels may read the slot.

ON_HOST -> FETCHING -> ON_DEVICE -> ON_HOST, or FETCHING -> ON_HOST (released before use).
A release re-points the parameters at the homes; the slot's bytes are overwritten only by a
fetch, whose copies wait for the compute stream's work issued before it (every kernel that
read the previous occupant is among it: stream-ordered reuse, the CPU does not wait).
``ParamUnit.content_valid`` says the slot still holds this unit's current weights (released,
nobody fetched into the slot since, no step since): a fetch then copies nothing.
"""

from __future__ import annotations

import enum

from ..accelerator import Event
from ..memory.manager import TieredMemoryManager
from ..memory.traffic import Category, Direction
from .units import UnitSpec
from .views import WindowedViews
from .window import Slot

__all__ = ["ParamUnit", "UnitState"]


class UnitState(enum.Enum):
    """Where a unit's weights are, and what that means for device memory."""

    #: Parameters are views of the pinned host homes; no device bytes are the unit's.
    ON_HOST = "on_host"
    #: The unit's slot is being written by H2D copies; compute must wait on ``ready``.
    FETCHING = "fetching"
    #: The slot holds the unit's weights and compute waited for them.
    ON_DEVICE = "on_device"


_S = UnitState
_ALLOWED = frozenset(
    {
        (_S.ON_HOST, _S.FETCHING),
        (_S.FETCHING, _S.ON_DEVICE),
        (_S.FETCHING, _S.ON_HOST),
        (_S.ON_DEVICE, _S.ON_HOST),
    }
)


class ParamUnit:
    """One unit; see Note [a unit's lifecycle].

    Fields:
        spec: which modules and parameters (``UnitSpec``).
        index: position in forward order (``find_units``).
        slot: its fixed slot (Note [a unit always returns to its slot]).
        views: one ``WindowedViews`` per bucket of the unit, each at a fixed offset of
            the slot.
        ready: end event of the last fetch's copies, until compute waited on it (None then).
        fetched: the same event, kept until the CPU waited on it (``settle``): the homes it
            reads are written by the next step's CPU Adam.
        fetches: fetches that copied bytes (a statistic; the tests count them).
    """

    def __init__(self, spec: UnitSpec, index: int, slot: Slot) -> None:
        self.spec = spec
        self.index = index
        self.slot = slot
        self.views: list[WindowedViews] = []
        self.state = UnitState.ON_HOST
        self.ready: Event | None = None
        self.fetched: Event | None = None
        self.content_valid = False
        self._versions: tuple[int, ...] = ()  # the parameters' versions at the release
        self.fetches = 0

    def _current_versions(self) -> tuple[int, ...]:
        return tuple(param._version for param in self.spec.params)

    def __repr__(self) -> str:
        return f"unit {self.index} ({self.spec.name}, {self.state.name})"

    def _go(self, to: UnitState) -> None:
        if (self.state, to) not in _ALLOWED:
            raise RuntimeError(
                f"{self!r}: parameter-offload state {self.state.name} -> {to.name} is not a "
                "valid transition (a bug in zero-offload; please report it)"
            )
        self.state = to

    @property
    def resident(self) -> bool:
        """FETCHING or ON_DEVICE: the parameters are views of the slot."""
        return self.state is not UnitState.ON_HOST

    def fetch(self, manager: TieredMemoryManager) -> None:
        """ON_HOST -> FETCHING: queue the homes' copies into the slot (after the previous
        occupant's readers), re-point the parameters. The previous occupant must have been
        released by the caller."""
        slot = self.slot
        if slot.occupant is not None and slot.occupant is not self and slot.occupant.resident:
            raise RuntimeError(f"{self!r}: slot {slot.index} is held by {slot.occupant!r} (bug)")
        if self.content_valid and self._versions != self._current_versions():
            self.content_valid = False  # the homes were written while released
        if not (slot.occupant is self and self.content_valid):
            # Write-after-read: the previous occupant's readers were all issued before now.
            after = [manager.compute_ready()]
            end = None
            for views in self.views:
                home, home_block = views.home_pair()
                end = manager.copy(
                    views.weights_dev,
                    home,
                    direction=Direction.H2D,
                    category=Category.WEIGHTS,  # parameter fetches: label "param ..."
                    after=after,
                    # The end event on both ends: the slot is not rewritten and the home not
                    # reused (or updated by a step, ``ParamOffloader.before_step``) before.
                    blocks=[slot.block, home_block],
                    label=f"param {self.spec.name} bucket{views.layout.index}",
                )
            self.ready = self.fetched = end  # one stream, in order: the last end covers all
            self.fetches += 1
        slot.occupant = self
        self.content_valid = True
        for views in self.views:
            views.bind_device()
        self._go(UnitState.FETCHING)

    def use(self, manager: TieredMemoryManager) -> None:
        """FETCHING -> ON_DEVICE: compute waits for the fetch (exposed time, if any)."""
        if self.state is UnitState.ON_DEVICE:
            return
        if self.ready is not None:
            # Synchronisation point (stream-side on CUDA): compute reads the slot next.
            manager.wait_for([self.ready], category=Category.WEIGHTS)
            self.ready = None
        self._go(UnitState.ON_DEVICE)

    def release(self) -> None:
        """-> ON_HOST: the parameters point at the homes again; the slot is rewritten only
        by a later fetch, ordered after the compute issued before it."""
        for views in self.views:
            views.bind_home()
        self._versions = self._current_versions()
        self._go(UnitState.ON_HOST)

    def settle(self) -> None:
        """Wait on the host for this unit's last fetch (the homes are about to be written).

        Synchronisation point: blocks the caller on the H2D copy; compute has waited for
        nearly all of them already (a prefetch nobody used is the exception), so this
        rarely waits."""
        if self.fetched is not None:
            self.fetched.synchronize()
            self.fetched = None
