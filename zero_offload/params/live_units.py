"""LiveUnits: the units of one window that are not released, kept as each move starts and
ends, so a use of the window looks at them rather than at every unit.

Note [the live units]
~~~~~~~~~~~~~~~~~~~~~
Each use of a unit (``ParamOffloader._advance``, a recompute, a read outside the window)
asks two questions of the units: which did an interrupt leave MOVING (Note [an interrupted
move] in ``unit.py``), and which resident ones left the window. Asked of every unit, that is
``units`` state tests per use and ``units**2`` per backward (4096 per unit at 64 units), for
answers that concern the ``prefetch_layers + 2`` units of the ring at most (and those landed
privately). So the units of a window share one ``LiveUnits``, and each state store that
leaves or enters ON_HOST keeps it (``ParamUnit._begin`` and ``_end``):

- ``units``: every unit whose state is not ON_HOST (FETCHING, ON_DEVICE, MOVING);
- ``moving``: every MOVING unit; empty unless a move is under way or was interrupted, so
  ``ParamOffloader.recover`` returns at once in the common case.

Interrupts: a ``KeyboardInterrupt`` lands between any two bytecodes, so a unit enters a set
*before* the store that gives it the state, and leaves it *after* the store that takes the
state away. Each set is then a superset of what it stands for: a unit may be in ``units``
while ON_HOST, or in ``moving`` while not MOVING (an interrupt between the two stores), never
the other way. Whoever reads a set tests the state of each member (``live``, ``recover``)
and drops a stale one; a set grows only by units that moved, so the stale ones are few.
Membership is a set of units (identity hash), one C call per enter or leave.
"""

from __future__ import annotations

from typing import Generic, Protocol, TypeVar

__all__ = ["LiveUnit", "LiveUnits"]


class LiveUnit(Protocol):
    """What the set asks of a unit (``ParamUnit``; a protocol, so this module stays below
    the one that keeps it)."""

    index: int

    @property
    def resident(self) -> bool:
        """FETCHING or ON_DEVICE."""

    @property
    def moving(self) -> bool:
        """MOVING."""

    def recover(self) -> None:
        """MOVING -> ON_HOST (Note [an interrupted move] in ``unit.py``)."""


U = TypeVar("U", bound=LiveUnit)


class LiveUnits(Generic[U]):
    """The units of a window not ON_HOST, and those MOVING; Note [the live units].

    Fields:
        units: every unit whose state is not ON_HOST (and possibly a few that are).
        moving: every MOVING unit (and possibly a few that are not).
    """

    def __init__(self) -> None:
        self.units: set[U] = set()
        self.moving: set[U] = set()

    def live(self) -> list[U]:
        """The units not ON_HOST, in unit order (the order a scan of every unit would see
        them in); stale members are dropped."""
        out = []
        for unit in sorted(self.units, key=_index):
            if unit.resident or unit.moving:
                out.append(unit)
            else:
                self.units.discard(unit)  # an interrupt after its release's store
        return out

    def recover(self) -> None:
        """Every MOVING unit is recovered (Note [an interrupted move] in ``unit.py``); nothing
        to do, and no unit looked at, when none is."""
        if not self.moving:
            return
        for unit in sorted(self.moving, key=_index):
            unit.recover()  # itself interrupted: still MOVING, still here, runs again
            if not unit.moving:
                self.moving.discard(unit)  # an interrupt between its store and its leave


def _index(unit: LiveUnit) -> int:
    return unit.index
