"""The copies of one unit between its homes and the device (``UnitCopies``, mixed into
``ParamUnit``; its lifecycle, which decides when each runs, is Note [a unit's lifecycle] in
``unit.py``):

- a fetch's H2D copies of the homes into the slot (or a private buffer), after the compute
  issued so far; for a home on NVMe its disk reads, ``pending``, and the copies queued once
  they are done (``finish_fetch``; Note [homes on NVMe are fetched through a bounce ring]
  in ``home_store.py``); with several ranks, then the slot's all-gather (``Gatherer``);
- a write-back's D2H copies of the buckets user code wrote in the slot (Note [a write to a
  resident unit reaches its home] in ``slot_writes.py``);
- the CPU's wait for the last fetch before a step writes the homes (``settle``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from ..accelerator import DeviceBuffer, Event
from ..memory.manager import TieredMemoryManager
from ..memory.traffic import Category, Direction
from .home_store import Bounce, PendingFetch
from .slot_writes import SlotWrites
from .units import UnitSpec
from .window import Slot
from .windowed_views import WindowedViews

__all__ = ["Gatherer", "UnitCopies"]


class Gatherer(Protocol):
    """What a unit asks of its ranks' gathers (``slot_gather.SlotGather``; a protocol, so
    this module stays below the one that builds it)."""

    def __call__(self, unit: UnitCopies, copied: Event) -> Event:
        """Queue the all-gather of ``unit``'s slot after ``copied``; its end event."""

    def owe(self, unit: UnitCopies) -> None:
        """``unit``'s fetch waits for disk reads: its gather comes later, before any other."""

    def withdraw(self, unit: UnitCopies) -> None:
        """``unit``'s owed gather will not be issued (its reads failed)."""


class UnitCopies:
    """``ParamUnit``'s copies between its homes and the device. Uses the unit's fields
    (``ParamUnit``'s docstring says what each holds) and its ``bound`` and
    ``_home_versions_now``."""

    spec: UnitSpec
    manager: TieredMemoryManager
    slot: Slot
    views: list[WindowedViews]
    ready: Event | None
    fetched: Event | None
    content_valid: bool
    _home_versions: tuple[int, ...]
    writes: SlotWrites
    write_backs: int
    bounce: Bounce | None
    pending: list[PendingFetch]
    gather: Gatherer | None
    private: DeviceBuffer | None
    bound: bool
    _home_versions_now: Callable[[], tuple[int, ...]]

    def _fill_slot(self, manager: TieredMemoryManager) -> Event | None:
        """Queue the copies of the homes into the slot (H2D, after the compute issued so
        far); the last copy's end event (None: nothing queued yet, NVMe reads pending)."""
        # Write-after-read: the previous occupant's readers were all issued before now.
        after = [manager.compute_ready()]
        end = None
        for views in self.views:
            label = f"param {self.spec.name} bucket{views.layout.index}"
            if views.nvme_home is not None and self.bounce is not None:
                # Note [homes on NVMe are fetched through a bounce ring]: reads now, the
                # copies to the slot once they are done (``finish_fetch``).
                self.pending.append(self.bounce.begin(views, self.slot, after=after, label=label))
                continue
            home, home_block = views.home_pair()
            end = manager.copy(
                views.home_slot(),
                home,
                direction=Direction.H2D,
                category=Category.WEIGHTS,  # parameter fetches: label "param ..."
                after=after,
                # The end event on both ends: the slot is not rewritten and the home not
                # reused (or updated by a step, ``ParamOffloader.before_step``) before.
                blocks=[self.slot.block, home_block],
                label=label,
            )
        return end

    def _home_written(self, views: WindowedViews) -> None:
        """A written slot range went home (``write_back``): nothing more here; a unit whose
        homes have a device copy refreshes it (``params/device_shards.py``)."""

    def finish_fetch(self) -> None:
        """Queue the slot copies of the buckets whose disk reads are pending (waiting for
        the reads); Note [homes on NVMe are fetched through a bounce ring]. A failed read
        leaves the slot nobody's and raises, naming the unit and the file."""
        pending, self.pending = self.pending, []
        if not pending:
            return
        while pending:
            fetch = pending.pop(0)
            try:
                end = fetch.finish()
            except BaseException:
                for rest in pending:
                    rest.drop()
                if self.private is None:  # a private fetch never held the slot
                    self.content_valid = False
                    self.slot.occupant = None
                if self.gather is not None:
                    self.gather.withdraw(self)  # never gathered: the others time out
                raise
            if end is not None:  # one stream, in order: the last end covers all
                self.ready = self.fetched = end
        if self.gather is not None and self.ready is not None:  # Note [sharded homes on NVMe]
            self.ready = self.fetched = self.gather(self, self.ready)

    def write_back(self) -> None:
        """Copy each bucket the write check finds written (``SlotWrites.written``) home (D2H)
        and wait for it; Note [a write to a resident unit reaches its home] in
        ``slot_writes.py``. Only for an ON_DEVICE unit."""
        if not self.bound:
            return  # nobody computed on (or wrote) a slot still being fetched
        manager = self.manager
        written = self.write_backs
        for views in self.writes.written():
            if views.nvme_home is not None and self.bounce is not None:
                label = f"param {self.spec.name} bucket{views.layout.index} write-back"
                self.bounce.write_back(views, self.slot, label=label)
                self.write_backs += 1
                self._home_versions = self._home_versions_now()  # our own write
                continue
            home, home_block = views.home_pair()
            end = manager.copy(
                home,
                views.home_slot(),
                direction=Direction.D2H,
                category=Category.WEIGHTS,
                after=[manager.compute_ready()],  # the writes were issued on compute
                blocks=[self.slot.block, home_block],
                label=f"param {self.spec.name} bucket{views.layout.index} write-back",
            )
            # Synchronisation point (only after a write outside the optimizer): the home is
            # read by the next fetch and written by the next step.
            end.synchronize()
            self._home_written(views)
            self.write_backs += 1
            self._home_versions = self._home_versions_now()  # our own write
        self.writes.went_home()
        if self.private is not None and self.write_backs != written:
            # The private buffer's writes went home, past the slot, which still holds the
            # bytes before them (Note [a read outside the window lands privately]).
            self.content_valid = False

    def settle(self) -> None:
        """Wait on the host for this unit's last fetch (the homes are about to be written).

        Synchronisation point: blocks the caller on the H2D copy; compute has waited for
        nearly all of them already (a prefetch nobody used is the exception), so this
        rarely waits."""
        self.finish_fetch()
        if self.fetched is not None:
            self.fetched.synchronize()
            self.fetched = None
