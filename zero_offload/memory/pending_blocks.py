"""InFlightBlocks: a pool's freed blocks whose copies are still pending.

Note [block reuse waits on events]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A copy queued on a stream may still read or write a block after its owner is done with it.
The owner records the copy's event on the block (``block.record_event(event)``). Freeing
never blocks: a block whose events have not all completed becomes IN_FLIGHT and its bytes
stay off the free list. IN_FLIGHT blocks are reclaimed (their bytes returned to the free
list) when ``event.query()`` says their copies are done, checked on every later ``alloc``
and ``free``; such an event is then synchronized, which costs nothing (Note [a completed
event is synchronized]).

When an allocation does not fit the free list, it takes IN_FLIGHT bytes without the CPU
waiting if the caller names the stream that will use the block (``alloc(stream=S)``), the
way the CUDA caching allocator reuses memory: ``S`` waits on the pending events (a GPU-side
wait), the new block inherits them (so defragmentation leaves it in place until they
complete), and the rest of the reused IN_FLIGHT range stays IN_FLIGHT with the same events.
The bytes go to ``S`` only: nobody else sees them before the events complete. Without a
stream, or when no single IN_FLIGHT range holds the request, ``alloc`` waits on the host for
the oldest IN_FLIGHT block's events, one block at a time, until the request fits (a
synchronisation, the last resort before defragmenting); ``alloc(wait=False)`` (a prefetch)
raises instead. Events are
always waited on without the pool's lock held: a copy-stream worker may need the lock to
free a block before the event we wait on can complete.

``InFlightBlocks`` is that set for one pool: not thread-safe by itself, every method runs
under the pool's lock (``pool.py``, class docstring).

Note [a completed event is synchronized]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Handing a block's bytes to any stream because ``query()`` said its copies are done is a
host-side ordering, but neither PyTorch's CUDA sanitizer (CSAN) nor our race checker
counts a query as one: CSAN tracks ``cudaEventSynchronize``, not ``cudaEventQuery``, and
would report the next user's access as racing with the old copy. So an event that a query
found complete is then synchronized (``accelerator.host_syncs.synchronize_completed``): it
returns at once, both checkers see the host wait that orders the reuse, and it is counted
apart from the waits that can block (Note [host syncs are counted where they can block]).
The same holds wherever a query's "done" hands memory on (the activation offloader's
released tensors).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from ..accelerator import Event
from ..accelerator.host_syncs import synchronize_completed
from .block import Block, BlockState

__all__ = [
    "InFlightBlocks",
    "name_range",
    "pending_events",
    "still_pending",
]


def still_pending(events: list[Event]) -> list[Event]:
    """The events of ``events`` not yet complete (``query``; never blocks)."""
    return [event for event in events if not event.query()] if events else events


def name_range(blocks: Iterable[Block], lo: int, hi: int) -> str:
    """For race reports: the owners and states of the blocks overlapping bytes [lo, hi)."""
    owners = sorted(
        {
            f"{b.owner or '<no owner>'} ({b.state.name})"
            for b in blocks
            if b.offset < hi and lo < b.end
        }
    )
    return f"block {', '.join(owners)}" if owners else "no live block"


def pending_events(blocks: Iterable[Block]) -> list[Event]:
    """Every pending event of every block in ``blocks``."""
    return [event for block in blocks for event in still_pending(list(block.events))]


class InFlightBlocks:
    """IN_FLIGHT blocks, oldest first, and their total size ``nbytes`` (rounded, bytes)."""

    def __init__(self) -> None:
        self._blocks: list[Block] = []  # IN_FLIGHT, oldest first
        self.nbytes = 0  # sum of the blocks' sizes

    def __len__(self) -> int:
        return len(self._blocks)

    def __iter__(self) -> Iterator[Block]:
        return iter(list(self._blocks))

    def add(self, block: Block) -> None:
        """``block`` was freed (or split off a reused block) with copies still pending."""
        block.state = BlockState.IN_FLIGHT
        self._blocks.append(block)
        self.nbytes += block.size

    def settle(self, events: list[Event]) -> list[Event]:
        """The events still pending. The bytes of a block whose events are all done may go to
        any stream now, so each completed one is synchronized (free): Note [a completed
        event is synchronized]."""
        pending = still_pending(events)
        if len(pending) < len(events):
            for event in events:
                if event not in pending:
                    synchronize_completed(event, quiet=True)
        return pending

    def reclaim(self) -> list[Block]:
        """Remove and return the blocks whose copies are all done, now FREE. O(blocks), one
        query per event."""
        if not self._blocks:
            return []
        done, still = [], []
        for block in self._blocks:
            (still if block.keep_events(self.settle) else done).append(block)
        for block in done:
            block.state = BlockState.FREE
            self.nbytes -= block.size
        self._blocks = still
        return done

    def take(self, size: int, align: int) -> Block | None:
        """Remove and return the best-fitting block (smallest, then lowest address) of at
        least ``size`` bytes at an offset aligned to ``align``, copies still pending; None
        when none fits. The caller reuses it behind its events on one stream."""
        fits = [b for b in self._blocks if b.size >= size and b.offset % align == 0]
        if not fits:
            return None
        old = min(fits, key=lambda b: (b.size, b.offset))
        self._blocks.remove(old)
        self.nbytes -= old.size
        return old

    def pending_events(self) -> list[Event]:
        """Every pending event of every block in flight."""
        return pending_events(self._blocks)

    def oldest_pending(self) -> list[Event]:
        """The pending events of the oldest block in flight that has any (the first to
        complete, in stream order, as a rule); empty when none is pending."""
        for block in self._blocks:
            events = still_pending(list(block.events))
            if events:
                return events
        return []

    def clear(self) -> None:
        """Forget every block (the pool is closed and its events are done)."""
        self._blocks.clear()
        self.nbytes = 0
