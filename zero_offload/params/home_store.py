"""Units whose homes are on NVMe: the window's bounce ring and the fetch and write-back
through it.

Note [homes on NVMe are fetched through a bounce ring]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A bucket whose home does not fit ``host_budget`` keeps its training-dtype weights in a
weight file (``weights/nvme_home.py``; Note [homes on NVMe] in
``optim/state/nvme_plan.py``). The window has one pinned *bounce* buffer per slot (Note [a
unit always returns to its slot] in ``window.py``), as large as the NVMe-homed buckets of
the largest unit placed in that slot, laid out like the weight files' records (Note [a
weight file's records]); one host pool, allocated when the optimizer is built, freed at
close. A fetch (``ParamUnit.fetch``) of such a bucket queues the reads of its records into
its range of the slot's bounce (direct I/O, checksums checked on arrival) and returns; the
H2D copies bounce -> slot (through the memory manager, one per tile, after the compute that
read the slot's previous occupant) are queued once the reads are done: when the window
next moves and finds them done (``ParamOffloader._advance`` polls), or at the latest when
compute needs the unit (``ParamUnit.use``: the CPU waits for the disk there, as the H2D
stream cannot wait on it), or before a step or a release. The
bounce is rewritten only after those copies completed (``Bounce.idle``: the next fetch into
the slot waits for them on the CPU; they were issued a window earlier, so normally done).
Fetches are issued ``prefetch_layers`` units ahead (Note [the parameter window]), so the
disk reads of a unit are made while the device still computes the units before it; a
fetch whose slot still holds the current weights reads nothing (``content_valid``).

A written slot goes home the other way (Note [a write to a resident unit reaches its
home] in ``slot_writes.py``): D2H slot -> bounce, waited, then the records written and waited for;
the file's ``written`` counter moves, which the optimizer's next step reconciles (Note
[weights written outside the optimizer]). A bad record raises ``StorageError`` naming the
unit, the bucket and the file.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch

from ..accelerator import Event
from ..accelerator.host_syncs import synchronize
from ..errors import StorageError
from ..memory.block import Block
from ..memory.manager import Tier, TieredMemoryManager
from ..memory.pool import BlockPool
from ..memory.storage import IO_ALIGNMENT
from ..memory.traffic import Category, Direction
from .window import Slot

if TYPE_CHECKING:
    from .windowed_views import WindowedViews

__all__ = ["Bounce", "PendingFetch", "bounce_bytes"]


class Bounce:
    """The window's bounce ring; see Note [homes on NVMe are fetched through a bounce ring].

    Fields: ``pool``: host, pinned, ``sum(bytes) + 4 KiB`` per slot with a bounce;
    ``blocks``: per slot index, its ``(bytes[i] + 4096,)`` uint8 block (None for a slot with no NVMe home); ``last``: per slot, the
    end event of the last copy reading or writing its bounce.
    """

    def __init__(self, manager: TieredMemoryManager, nbytes: list[int], *, name: str) -> None:
        self.manager = manager
        # Each block is 4 KiB larger than its records, which start at its first 4 KiB
        # address (the pool's buffer is not page-aligned everywhere).
        nbytes = [n + IO_ALIGNMENT if n else 0 for n in nbytes]
        self.capacity = sum(nbytes)
        self.pool: BlockPool = manager.create_pool(
            Tier.HOST, max(self.capacity, IO_ALIGNMENT), name=name, alignment=IO_ALIGNMENT
        )
        self.blocks: list[Block | None] = [
            self.pool.alloc(n, owner=f"{name}.slot{i}") if n else None for i, n in enumerate(nbytes)
        ]
        self.last: list[Event | None] = [None] * len(nbytes)

    def area(self, slot: Slot, views: WindowedViews) -> tuple[torch.Tensor, Block]:
        """The bucket's records' range of the slot's bounce (uint8, 4 KiB-aligned)."""
        block = self.blocks[slot.index]
        home = views.nvme_home
        if block is None or home is None:
            raise RuntimeError(
                f"slot {slot.index}: no bounce for bucket {views.layout.index} (bug)"
            )
        whole = block.view(torch.uint8)
        start = (-whole.data_ptr()) % IO_ALIGNMENT + views.bounce_offset
        return whole[start : start + home.staged_bytes], block

    def idle(self, slot: Slot) -> None:
        """Wait until no copy reads or writes the slot's bounce (Synchronisation point: a
        window earlier, normally done)."""
        event = self.last[slot.index]
        if event is not None:
            synchronize(event)
            self.last[slot.index] = None

    def begin(
        self, views: WindowedViews, slot: Slot, *, after: list[Event], label: str
    ) -> PendingFetch:
        """Queue the reads of the bucket's records into its bounce range (disk -> bounce);
        ``PendingFetch.finish`` queues the copies to the slot."""
        if views.nvme_home is None:
            raise RuntimeError(f"bucket {views.layout.index}: not homed on NVMe (bug)")
        self.idle(slot)  # the bounce is rewritten: its last copies to the slot are done
        return PendingFetch(self, views, slot, after=after, label=label)

    def write_back(self, views: WindowedViews, slot: Slot, *, label: str) -> None:
        """Slot -> bounce (D2H, waited) -> the weight file (waited)."""
        home = views.nvme_home
        if home is None:
            raise RuntimeError(f"bucket {views.layout.index}: not homed on NVMe (bug)")
        self.idle(slot)
        area, block = self.area(slot, views)
        manager = self.manager
        end = None
        for tile in range(home.tiles):
            lo, hi = home.tile_range(tile)
            end = manager.copy(
                home.tile_view(area, tile),
                views.home_slot()[lo:hi],
                direction=Direction.D2H,
                category=Category.WEIGHTS,
                after=[manager.compute_ready()],  # the writes were issued on compute
                blocks=[slot.block, block],
                label=f"{label} tile {tile}",
            )
        if end is not None:
            end.synchronize()  # Synchronisation point: the CPU hands the bytes to the disk
        home.write_all(manager, area)

    def close(self) -> None:
        """Free the blocks and the pool (after pending copies)."""
        for block in self.blocks:
            if block is not None:
                block.free()
        self.blocks = []
        self.pool.close()
        if self.pool in self.manager.pools:
            self.manager.pools.remove(self.pool)


class PendingFetch:
    """One bucket's fetch between its disk reads and its H2D copies; see Note [homes on
    NVMe are fetched through a bounce ring]. ``buffers``: the reads in flight, one per
    record, into the bucket's range of the slot's bounce."""

    def __init__(
        self, bounce: Bounce, views: WindowedViews, slot: Slot, *, after: list[Event], label: str
    ) -> None:
        self.bounce, self.views, self.slot = bounce, views, slot
        self.after, self.label = after, label
        self.home = views.nvme_home
        self.area, self.block = bounce.area(slot, views)
        self.buffers = self.home.begin_read_all(bounce.manager, self.area)  # type: ignore[union-attr]

    def done(self) -> bool:
        """Whether every read completed (nothing waits)."""
        return all(b.event is None or b.event.query() for b in self.buffers)

    def drop(self) -> None:
        """Wait for the reads and forget them (a failure elsewhere; errors dropped)."""
        for buffer in self.buffers:
            with contextlib.suppress(StorageError):
                buffer.settle()

    def finish(self) -> Event | None:
        """Wait for the reads (Synchronisation point: the disk; a bad record raises naming
        the unit and the file), then queue the H2D copies bounce -> slot after ``after``;
        the last copy's end event."""
        home = self.home
        if home is None:
            raise RuntimeError(f"bucket {self.views.layout.index}: home closed (bug)")
        home.settle_all(self.buffers)
        manager, end = self.bounce.manager, None
        for tile in range(home.tiles):
            lo, hi = home.tile_range(tile)
            end = manager.copy(
                self.views.home_slot()[lo:hi],
                home.tile_view(self.area, tile),
                direction=Direction.H2D,
                category=Category.WEIGHTS,
                after=self.after,
                blocks=[self.slot.block, self.block],
                label=f"{self.label} tile {tile}",
            )
        self.bounce.last[self.slot.index] = end
        return end


def bounce_bytes(units: list[tuple[int, list[WindowedViews]]], slots: int) -> list[int]:
    """Per slot, the bytes of its bounce: the largest unit's NVMe-homed records; sets each
    bucket's ``bounce_offset``. ``units``: ``(slot index, the unit's views)``."""
    out = [0] * slots
    for slot, views_of_unit in units:
        offset = 0
        for views in views_of_unit:
            if views.nvme_home is not None:
                views.bounce_offset = offset
                offset += views.nvme_home.staged_bytes
        out[slot] = max(out[slot], offset)
    return out
