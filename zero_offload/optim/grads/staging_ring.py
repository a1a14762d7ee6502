"""A ring of a few gradient staging buffers shared by every bucket
(``OffloadConfig(grad_staging="in_flight")``): the ``Staging`` (``staging.py``) of a bucket
whose flushes take a slot each.

Note [gradient staging for the buckets in flight]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
With ``grad_staging="in_flight"`` the host holds ``grad_staging_buffers`` (K) staging buffers
for a segment's offloaded buckets, each as large as the largest bucket's shard in bytes,
instead of one per bucket. A flush takes the slot released longest ago (FREE, or RELEASING:
its last reader is queued on the host worker, and the flush waits for that reader's event on
the caller's thread before its copy is issued, as Note [staging is reused only once
consumed] in ``staging.py`` says and for its reason: a CUDA stream cannot wait on host-thread work). What
releases a slot:

- the host worker's pass over it, when the gradient goes on into the fp32 accumulator (a
  window with several flushes);
- otherwise the window's gradient stays in the slot for the step, and the slot is released
  by the work that reads it last: the bucket's CPU Adam queued during backward by an
  announced step (Note [stepping during backward] in ``update/eager.py``), a fold into the
  accumulator when another flush follows, or the end of the window (``step()``, a skipped
  step, ``zero_grad``), after everything queued on the host worker so far.
- a flush that fails after taking its slot (its copy, the accumulator's allocation) gives
  it back at once (``unused``): nothing will read it, and what it queued into the slot is on
  the d2h stream, before any later copy into it.

So when every step is announced and runs during backward, bucket b+K's flush waits for
bucket b's update, which was queued when b's copy was, and the host holds K buffers
whatever the model's size. A step that runs in ``step()`` (not announced, or refused, or
micro-batches accumulating into one step) holds each bucket's slot until it is done: a
flush that finds every slot HELD grows the ring by one buffer (a pinned allocation, warned
once) rather than wait for a release that cannot come before ``step()``. The result is
bitwise that of per-bucket staging either way: the same bytes are copied, passed over and
read by the same kernels in the same order; only the buffer they sit in changes. A slot's
bytes past what a flush copies (a lone gradient, Note [a lone gradient is its own buffer],
is shorter than its padded shard) keep an earlier bucket's gradient: nothing reads past a
bucket's real elements (the host passes stop there, CPU Adam reads the parameters' runs).
Grown buffers are kept for later steps, like the spare staging.

Where each step runs during backward, a gradient is gone once its bucket's update ran: a
step planned from it again (``load_state_dict`` superseded the step, and ``step()`` would
step from the loaded state with per-bucket staging) is refused before anything changes
(``check_kept``), until the window ends.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass

import torch

from ...accelerator import Event
from ...caller_warning import warn_caller
from ...config import format_bytes
from ...memory.align import aligned
from ...memory.block import Block
from ...memory.manager import Tier, TieredMemoryManager
from ...memory.pool import BlockPool
from ...partition import BucketLayout
from ...tracing import phase
from .staging import Staging

__all__ = ["RingStaging", "SlotState", "StagingRing", "ring_slot_bytes"]


def ring_slot_bytes(layouts: list[BucketLayout], itemsize: list[int], *, alignment: int) -> int:
    """Bytes of one ring slot: the largest shard of ``layouts`` in its training dtype,
    ``max a(k*s)`` (0 for no bucket)."""
    sizes = [aligned(s * b.shard_numel, alignment) for b, s in zip(layouts, itemsize, strict=True)]
    return max(sizes, default=0)


class SlotState(enum.Enum):
    """A ring slot's lifecycle: what its bytes hold."""

    #: Nothing anyone will read: the next flush may copy into it at once.
    FREE = "free"
    #: A bucket's gradient whose last reader is not queued yet: no flush may take it.
    HELD = "held"
    #: The last reader is queued on the host worker: a flush may take it once ``event``
    #: completed (it waits for it on the caller's thread).
    RELEASING = "releasing"


@dataclass
class _Slot:
    block: Block  # slot_bytes, host, pinned where available; never moves (no callback)
    state: SlotState = SlotState.FREE
    event: Event | None = None  # RELEASING: the last reader's end
    holder: int | None = None  # HELD: the bucket index


class StagingRing:
    """K gradient staging buffers shared by a segment's offloaded buckets: Note [gradient
    staging for the buckets in flight].

    Fields:
        slots: every slot, the first ``buffers`` in ``pool``, each grown one in a pool of
            its own (``grown``).
        _order: indices of the FREE and RELEASING slots, in the order they became so; a
            flush takes the first. Touched on the caller's thread only (flushes, the step,
            ``zero_grad``), so no lock.
        waits: flushes that waited for a slot's last reader (on the caller's thread).
    """

    def __init__(
        self,
        manager: TieredMemoryManager,
        *,
        buffers: int,
        slot_bytes: int,
        name: str,
        alignment: int,
    ) -> None:
        self.manager = manager
        self.name = name
        self.slot_bytes = aligned(max(slot_bytes, 1), alignment)
        # Hidden cost: one pinned allocation of K slots, at construction.
        self.pool: BlockPool | None = manager.create_pool(
            Tier.HOST, buffers * self.slot_bytes, name=name, alignment=alignment
        )
        self.grown: list[BlockPool] = []
        self.slots = [
            _Slot(self.pool.alloc(self.slot_bytes, owner=f"grad_staging_ring{i}"))
            for i in range(buffers)
        ]
        self._order: deque[int] = deque(range(buffers))
        self.waits = 0
        self._warned = False
        self._users = 0  # the RingStaging of each bucket; the last one to close closes it

    @property
    def nbytes(self) -> int:
        """Pinned bytes of every slot, grown ones included."""
        return len(self.slots) * self.slot_bytes

    def acquire(self, holder: int) -> int:
        """A slot for bucket ``holder``'s flush, once its last reader is done; grows the
        ring when every slot is HELD (Note [gradient staging for the buckets in flight])."""
        if not self._order:
            self._grow(holder)
        index = self._order[0]
        slot = self.slots[index]
        if slot.event is not None and not slot.event.query():
            # Synchronisation point: the previous bucket's last reader (usually its CPU
            # Adam, queued during backward) must be done before this copy overwrites it.
            self.waits += 1
            with phase("wait_staging"):
                slot.event.synchronize()
        self._order.popleft()
        slot.state, slot.event, slot.holder = SlotState.HELD, None, holder
        return index

    def _grow(self, holder: int) -> None:
        # Hidden cost: a pinned allocation of one slot (kept for later steps).
        pool = self.manager.create_pool(
            Tier.HOST, self.slot_bytes, name=f"{self.name}.grown{len(self.grown)}"
        )
        self.grown.append(pool)
        self.slots.append(_Slot(pool.alloc(self.slot_bytes, owner="grad_staging_ring_grown")))
        self._order.append(len(self.slots) - 1)
        if not self._warned:
            self._warned = True
            warn_caller(
                f"OffloadConfig(grad_staging='in_flight'): bucket {holder}'s flush found "
                f"every one of the {len(self.slots) - 1} gradient staging buffers holding a "
                "gradient that no update has read yet (the step runs in step(), not during "
                "backward: it was not announced with opt.backward(loss, step=True) or "
                "opt.announce_step(), or micro-batches accumulate), or buckets were flushed "
                "early, half-filled, when the device gradient buffers ran out (backward order "
                "differs from bucket order, or unused parameters). The ring grows by one "
                f"buffer ({format_bytes(self.slot_bytes)} pinned) per such flush, kept for "
                "later steps; the result is exact. Announce each step to keep the host "
                "memory at the buckets in flight"
            )

    def view(self, index: int, dtype: torch.dtype, numel: int) -> tuple[torch.Tensor, Block]:
        """Slot ``index`` as ``(numel,)`` ``dtype``, and its block."""
        block = self.slots[index].block
        return block.view(dtype, (numel,)), block

    def release(self, index: int, event: Event | None) -> None:
        """Slot ``index``'s last reader is queued and ends at ``event`` (None: done)."""
        slot = self.slots[index]
        if slot.state is not SlotState.HELD:
            raise RuntimeError(f"{self.name}: slot {index} released while {slot.state.name} (bug)")
        slot.state = SlotState.FREE if event is None else SlotState.RELEASING
        slot.event, slot.holder = event, None
        self._order.append(index)

    def attach(self) -> None:
        """One more bucket stages through the ring."""
        self._users += 1

    def detach(self) -> None:
        """A bucket closed; the last one closes the ring."""
        self._users -= 1
        if self._users == 0:
            self.close()

    def close(self) -> None:
        """Free every slot and close the pools (again: nothing)."""
        if self.pool is None:
            return
        for slot in self.slots:
            slot.block.free()
        self.slots.clear()
        self._order.clear()
        self.pool.close()
        self.pool = None
        for pool in self.grown:
            pool.close()
        self.grown.clear()


class RingStaging(Staging):
    """One bucket's flushes through its segment's ``StagingRing``.

    Fields:
        _kept: the slot holding the window's gradient for the step, from its flush until
            the last reader is queued (None otherwise).
        _last: the slot the window's gradient stayed in last; the queued update reads it
            after ``_kept`` let it go.
        _taken: the slot acquired by a flush whose pass is not queued yet (None otherwise):
            given back if that flush fails.
        _gone: the window's gradient was stepped during backward and its slot let go: a
            second step from it (``load_state_dict`` superseded the first) would read
            another bucket's gradient, so it is refused until the window ends.
    """

    def __init__(self, ring: StagingRing, layout: BucketLayout, *, dtype: torch.dtype) -> None:
        self.ring = ring
        self.index = layout.index
        self.numel = layout.shard_numel
        self.dtype = dtype
        self._kept: int | None = None
        self._last = 0
        self._taken: int | None = None
        self._gone = False
        ring.attach()

    @property
    def waits(self) -> int:  # type: ignore[override]
        return self.ring.waits

    def acquire(self, *, overwrite: bool, window_flushes: int) -> int:
        if self._kept is not None:
            raise RuntimeError(
                f"bucket {self.index}: a flush while staging still holds the window's "
                "gradient unread (bug: a fold releases it first)"
            )
        self._taken = self.ring.acquire(self.index)
        return self._taken

    def unused(self, buffer: int) -> None:
        if self._taken == buffer:
            self._taken = None
            self.ring.release(buffer, None)

    def get(self, buffer: int) -> tuple[torch.Tensor, Block]:
        return self.ring.view(buffer, self.dtype, self.numel)

    def passed(self, buffer: int, event: Event, *, kept: bool) -> None:
        self._gone, self._taken = False, None
        if kept:
            self._kept = self._last = buffer
        else:
            self.ring.release(buffer, event)

    def kept(self) -> int:
        return self._last

    def read_by(self, event: Event | None) -> None:
        if self._kept is not None:
            self.ring.release(self._kept, event)
            self._kept = None

    def stepped(self, event: Event) -> None:
        self.read_by(event)
        self._gone = True

    def check_kept(self, bucket: int, *, staged: bool) -> None:
        if staged and self._gone:
            raise RuntimeError(
                f"bucket {bucket}: its gradients were stepped during backward and, with "
                "OffloadConfig(grad_staging='in_flight'), their staging buffer went to the "
                "next bucket; the step was superseded (load_state_dict) and cannot be run "
                "again from them. Call opt.zero_grad() and run the backward again"
            )

    @property
    def holding(self) -> bool:
        return self._kept is not None or self._gone

    def release(self, event: Event | None) -> None:
        self.read_by(event)  # None: nothing pending
        self._gone = False

    def close(self) -> None:
        self.release(None)  # the caller drained every queue first
        self.ring.detach()
