"""The device window: a fixed set of slots, each a block of one device pool, that units are
fetched into.

Note [a unit always returns to its slot]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Autograd keeps what a forward saved for backward, and for a weight that is often a view
(``weight.t()`` inside ``linear``) made while the unit was on the device: it points at the
device bytes of *that* fetch, not at the parameter. If the unit came back for its backward at
another address, those views would read whatever unit lives there now. So each unit owns one
fixed slot, at a fixed device address, for good: fetched for its forward, released, fetched
again for its backward, it lands at the same bytes, and every view autograd saved is valid
again. Units share slots in a ring: unit ``j`` (in forward order, ``find_units``) takes ring
slot ``j mod (prefetch_layers + 2)``; consecutive units never share one, and a window is
``prefetch_layers + 1`` consecutive units (the one computing and those prefetched), plus the
one before it whose compute may still be queued. Each ring slot is as large as the largest
unit assigned to it. A unit used at two distant points of the forward (tied embedding and
head, ``UnitSpec.tied``) gets a slot of its own, so no neighbour can collide with it.

The rejected alternative: allocate each fetch from a free list and re-point the parameters.
It needs saved-tensor hooks around every unit's forward to re-derive each saved view from the
current address, which would shadow the user's own saved-tensor hooks (activation offload).

Slot lifetime: a slot's block is allocated at construction and freed at close. Writing it
(a fetch) waits for the compute stream's work issued so far, which holds every kernel that
read the previous occupant (stream-ordered reuse: the H2D stream waits, not the CPU); the
fetch's end event is recorded on the block (Note [block reuse waits on events]).
"""

from __future__ import annotations

from typing import Protocol

import torch

from ..config import format_bytes
from ..errors import DeviceBudgetExceeded
from ..memory.block import Block
from ..memory.manager import Tier, TieredMemoryManager
from ..memory.pool import BlockPool


class Occupant(Protocol):
    """What the window asks of a unit in a slot (``unit.ParamUnit``; a protocol, so this
    module stays below the unit that imports it)."""

    resident: bool  # its parameters point at the slot now
    content_valid: bool  # the slot holds its current weights

    def release(self) -> None:
        """Leave the slot (a written slot is copied home; the parameters hold their
        zero-byte placeholders again)."""


__all__ = ["Slot", "Window", "plan_slots"]


def plan_slots(
    unit_bytes: list[int], tied: list[bool], *, prefetch_layers: int
) -> tuple[list[int], list[int]]:
    """``(slot_of_unit, slot_bytes)``: each unit's slot index and each slot's bytes; see
    Note [a unit always returns to its slot]. Units in forward order; ``unit_bytes`` aligned.

    The ring never has more slots than there are untied units: past that every unit has a
    slot of its own already, so a ``prefetch_layers`` larger than the model (any int the
    config accepts) plans the same window as the number of units does."""
    untied = sum(1 for is_tied in tied if not is_tied)
    ring = max(1, min(prefetch_layers + 2, untied))
    ring_bytes = [0] * ring
    slot_of: list[int] = []
    dedicated: list[int] = []
    position = 0
    for nbytes, is_tied in zip(unit_bytes, tied, strict=True):
        if is_tied:
            slot_of.append(-1 - len(dedicated))  # fixed up below, after the ring
            dedicated.append(nbytes)
            continue
        slot = position % ring
        ring_bytes[slot] = max(ring_bytes[slot], nbytes)
        slot_of.append(slot)
        position += 1
    used_ring = [b for b in ring_bytes if b > 0]
    slot_of = [s if s >= 0 else len(used_ring) + (-1 - s) for s in slot_of]
    return slot_of, used_ring + dedicated


class Slot:
    """One fixed device range units are fetched into.

    Fields:
        block: (nbytes,) uint8, the window pool; the units' parameters are views of it.
        occupant: the unit whose bytes the slot holds or is receiving (None: nothing valid).
    """

    def __init__(self, index: int, block: Block) -> None:
        self.index = index
        self.block = block
        self.occupant: Occupant | None = None

    def region(self, offset: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """``(numel,)`` of ``dtype`` at byte ``offset`` of the slot."""
        nbytes = numel * dtype.itemsize
        return self.block.view(torch.uint8)[offset : offset + nbytes].view(dtype)


class Window:
    """The window pool (device) and its slots; Note [a unit always returns to its slot].

    The pool holds exactly the slots, ``sum(slot_bytes)``, counted in the device budget
    from construction to ``close``."""

    def __init__(
        self, manager: TieredMemoryManager, slot_bytes: list[int], *, name: str, alignment: int
    ) -> None:
        self.manager = manager
        self.capacity = sum(slot_bytes)
        try:
            self.pool: BlockPool = manager.create_pool(
                Tier.DEVICE, max(self.capacity, alignment), name=name, alignment=alignment
            )
        except DeviceBudgetExceeded as error:
            stats = manager.accelerator.memory_stats()
            raise DeviceBudgetExceeded(
                f"the parameter-offload window needs {format_bytes(self.capacity)} "
                f"({self.capacity} bytes: {len(slot_bytes)} slots of "
                f"{', '.join(format_bytes(b) for b in slot_bytes)}) on the device, but the "
                f"budget is {format_bytes(stats['budget'])} with {format_bytes(stats['in_use'])} "
                "in use. Raise the device budget, lower OffloadConfig.prefetch_layers, or pass "
                "smaller blocks as layers=[...] (each slot holds the largest unit placed in it)"
            ) from error
        try:
            self.slots = [
                Slot(i, self.pool.alloc(nbytes, owner=f"{name}.slot{i}"))
                for i, nbytes in enumerate(slot_bytes)
            ]
        except BaseException:
            manager.discard_pool(self.pool)
            raise

    def close(self) -> None:
        """Free the slots and give the pool back to the budget (after pending copies)."""
        for slot in self.slots:
            slot.block.free()
        self.slots = []
        self.pool.close()
        if self.pool in self.manager.pools:
            self.manager.pools.remove(self.pool)
