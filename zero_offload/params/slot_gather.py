"""SlotGather: the all-gathers of unit slots on the comm stream under ZeRO-3 with offload,
one after each fetch's H2D copies (``ParamUnit.gather``), and the gathers owed by fetches
still waiting for their disk reads, issued in the order of the fetches (Note [a sharded
unit] and Note [sharded homes on NVMe] in ``sharded_fetch.py``)."""

from __future__ import annotations

from ..accelerator import Event, Stream
from ..collectives import Comm, all_gather_flat, wait_all
from ..memory.manager import TieredMemoryManager
from ..tracing import phase
from .unit import ParamUnit

__all__ = ["SlotGather"]


class SlotGather:
    """All-gathers of unit slots on the comm stream (``ParamUnit.gather``; Note [a sharded unit]
    in ``sharded_fetch.py``).

    Fields:
        last: per slot index, the end event of the last gather into it; the next H2D copy
            into the slot waits for it (``before_fetch``).
        gathers: gathers issued (a statistic; the tests count them).
    """

    def __init__(self, comm: Comm, stream: Stream, manager: TieredMemoryManager) -> None:
        self.comm = comm
        self.stream = stream  # the optimizer's comm stream: collectives stay off the copies
        self.manager = manager
        self.last: dict[int, Event] = {}
        self.gathers = 0
        self.owed: list[ParamUnit] = []  # fetches waiting for disk reads, in fetch order

    def before_fetch(self, unit: ParamUnit) -> None:
        """The ``h2d`` stream waits for the slot's last gather (write-after-write)."""
        event = self.last.get(unit.slot.index)
        if event is not None:
            self.manager.h2d.wait_event(event)

    def owe(self, unit: ParamUnit) -> None:
        """``unit``'s fetch waits for its disk reads (Note [sharded homes on NVMe])."""
        self.owed.append(unit)

    def withdraw(self, unit: ParamUnit) -> None:
        """``unit``'s reads failed: its gather is not owed any more."""
        if unit in self.owed:
            self.owed.remove(unit)

    def __call__(self, unit: ParamUnit, copied: Event) -> Event:
        """Queue the all-gather of every bucket of ``unit``'s slot after ``copied``; its end
        event (recorded on the slot's block). The gathers owed by earlier fetches go first
        (Note [sharded homes on NVMe])."""
        mine = self.owed.index(unit) if unit in self.owed else len(self.owed)
        for earlier in self.owed[:mine]:
            earlier.finish_fetch()  # its reads, copies and gather (leaving ``owed``)
        self.withdraw(unit)
        comm = self.comm
        accelerator = self.manager.accelerator
        self.stream.wait_event(copied)
        buckets = [(views, views.gather_source()) for views in unit.views]
        for views, source in buckets:
            what = f"all-gather of unit {unit.spec.name}"
            accelerator.declare_access(views.weights_dev, stream=self.stream, write=True, what=what)
            if source is not None:
                accelerator.declare_access(source, stream=self.stream, write=False, what=what)

        def run() -> None:
            with phase("all_gather", track="comm"):
                pending = [
                    all_gather_flat(
                        views.weights_dev,
                        comm=comm,
                        what=f"unit {unit.spec.name!r} (bucket {views.layout.index})",
                        source=source,
                    )
                    for views, source in buckets
                ]
                wait_all(pending, comm)

        self.stream.submit(run)
        event = self.stream.record_event()
        unit.slot.block.record_event(event)
        self.last[unit.slot.index] = event
        self.gathers += 1
        return event
