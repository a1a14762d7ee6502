"""TieredMemoryManager: owns the tiers' pools and streams, and every copy between tiers.

Note [one choke point for copies]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Every byte the library moves between device and host goes through ``TieredMemoryManager.copy``
(which alone calls ``Accelerator.copy_``), and every byte between host and the NVMe tier
(``memory/storage.py``) through ``TieredMemoryManager.disk_copy``, which alone queues its
reads and writes. There each copy is counted (``counters``), given a ``CopyRecord`` with
its end event and, where that event cannot tell when the copy began, a start event (handed to
listeners such as the profiler: Note [a copy's start is its end event's]), ordered after the
events it depends on, and its end event is recorded on the pool blocks it touches (a disk copy's on its
I/O buffer) so they are not reused while it is pending (Note [block reuse waits on events] in
``pool.py``). Nothing else in the library copies across tiers, so the profiler's counts are
complete by construction; a test counts them independently.

Note [a copy's start is its end event's]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A profiler needs of each copy its bytes (by direction, category and stream) and its place on
the timeline: when it began on its stream and when it ended, for the Chrome trace and the
report's time and rate columns (the exposed time is the stalls', ``wait_for``). The end is
the copy's end event. The start used to be a second, timing-only event queued before the
copy (``Stream.record_timestamp``): on the host accelerator an object, a queue put and a
trip through the worker's loop, per copy. Measured on the 2-core VM (issue 39), of the
2.6-2.9 us a listened copy cost beyond an unlistened one's 6.2-6.4 us: the start timestamp
0.6 us on the issuing thread plus its turn on the worker, the ``CopyRecord`` 0.3, the
listener and the timeline's locked append 0.3, settling records into rows 0.7, and the
cyclic GC's extra passes over records kept alive about 0.9 (median of 9 interleaved rounds
of 2000 copies; ``prof`` against ``prof`` with the GC paused).

So where the stream can tell, the end event carries the start: a ``ThreadStream``'s worker
reads the clock as it begins each task and writes the last such time into the next event
it completes (``Event.started_at``; ``Stream.end_carries_start``). The manager queues the
``after`` waits, then the copy, then its end event, so the task just before the end event
is the copy itself, and ``started_at`` is when the worker got past everything queued before
it: the waits for ``after``, and whatever else shares the stream. That is what the
timestamp measured, for one clock read per task on the worker (paid unlistened too: 0.05
us). Another thread queuing a task between the copy and its end event would lend the copy
its start, as it could come between the timestamp and the copy before.

Deriving the start instead from the stream's previous end and the copy's issue time (a
FIFO stream starts a copy when both have passed) was rejected: the copy streams carry
work the manager does not see, each of which would make the copy seem to start early and
take longer than it did: a pool block's reuse waits (``alloc(stream=h2d)``), the sharded
fetch's write-after-write wait, the device shards' ``wait_event`` on ``h2d``, and on CUDA
any kernel issued under ``stream_context``. It would also need a stamp wherever ``after``
made the stream wait. The end event's own start needs neither.

On CUDA an event is a timestamp the GPU writes when it gets there; nothing records when the
work before it began. So a CUDA copy still records a timed start event before it
(``end_carries_start`` is False): a ``cudaEventRecord`` and a wrapper, a few microseconds of
host time beside a copy whose own dispatch and ``cudaMemcpyAsync`` cost about as much, and
a timestamp write on the GPU. Dropping it would make every CUDA span wrong; nothing here
changed for CUDA but the listener's cost, below. (No GPU was lent to measure it.)

The rest of the cost is the listener's. A recorder that only stores subscribes with
``fields=True`` and a ``tick``: the manager hands the copy's fields, a plain tuple, to the
recorder's ``list.extend`` (no ``CopyRecord``, no Python call between), and calls ``tick``
every ``TICK_EVERY`` copies to settle (Note [appending to the profiler takes no lock] in
``profiling/timeline.py``). Listeners that want records (``StepMetrics``, tests) still get
a ``CopyRecord``, built only when one is subscribed.
"""

from __future__ import annotations

import enum
import itertools
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from ..accelerator import Accelerator, Event, Stream, get_accelerator
from ..errors import Attempts, PoolExhausted
from .block import Block
from .exposed import ExposedTime
from .host_worker import HostWorker
from .listeners import TICK_EVERY, Listeners, Tick
from .pool import BlockPool
from .refused import allocation_refused, refused_by_the_os
from .storage import IOBuffer, StorageFile, StorageTier
from .traffic import (
    Category,
    CopyRecord,
    Direction,
    RecordListener,
    StallRecord,
    TrafficCounters,
)

__all__ = [
    "TICK_EVERY",
    "Tier",
    "TieredMemoryManager",
]

_clock = time.perf_counter
_new_tuple = tuple.__new__


class Tier(enum.Enum):
    """Where a pool's bytes live."""

    #: Accelerator memory, counted against the device budget.
    DEVICE = "device"
    #: Host memory, pinned when the accelerator supports it.
    HOST = "host"


class TieredMemoryManager:
    """The tiers (device, pinned host), their pools, the copy streams, and all copies.

    Streams, each created once:
        ``d2h``: device-to-host copies (gradients out, activations out), so they overlap
            the backward/forward that produces them.
        ``h2d``: host-to-device copies (updated weights, prefetched activations), so they
            overlap the CPU optimizer and the backward that consumes them.
        ``host_worker``: a CPU thread for host-side work that must follow a copy (e.g.
            accumulating a copied gradient bucket in fp32) without blocking the caller.
    """

    def __init__(self, accelerator: Accelerator | None = None) -> None:
        self.accelerator = accelerator if accelerator is not None else get_accelerator()
        acc = self.accelerator
        self.d2h = acc.new_stream("d2h")
        self.h2d = acc.new_stream("h2d")
        self.host_worker = HostWorker(acc)
        self.pools: list[BlockPool] = []
        self.storage: list[StorageTier] = []  # NVMe tiers opened here, closed with the manager
        self.counters = TrafficCounters()
        #: What the owner of this manager reports about its steps, for the profiler (the
        #: optimizer: skipped steps, speculative rollbacks, the share of an announced step
        #: done during backward); plain numbers by name, written by the owner only.
        self.step_notes: dict[str, float] = {}
        # Seconds compute stood still in ``wait_for`` (exposed transfer time), by category:
        # Note [exposed time is measured on the compute stream] (``exposed.py``).
        self.exposed = ExposedTime()
        # Who listens (``listeners.py``): a copy reads its ``hooks`` without a lock.
        self._listeners = Listeners()
        self._seq = itertools.count()
        # Releases of owners that borrow this manager's streams (an ActivationOffloader
        # given manager=), run first by close(): Note [a manager's close ends its borrowers].
        self._borrowers: list[weakref.finalize] = []
        self._closed = False  # set by close()

    # -- pools -------------------------------------------------------------------------

    def create_pool(
        self,
        tier: Tier,
        capacity: int,
        *,
        name: str,
        alignment: int = 512,
        sized_by: str = "capacity_bytes",
    ) -> BlockPool:
        """A new pool of exactly ``capacity`` bytes in ``tier``, allocated now, once;
        ``sized_by`` names what chose the size, for the refusal's message.

        Hidden cost: a host pool is pinned here (slow, and may synchronise the device).
        """
        if not isinstance(tier, Tier):
            raise TypeError(f"tier must be a Tier, got {tier!r}")
        acc = self.accelerator
        kw = {"name": name, "alignment": alignment, "sized_by": sized_by}
        try:
            if tier is Tier.DEVICE:
                pool = BlockPool.device(acc, capacity, **kw)
            else:
                pool = BlockPool.host(acc, capacity, **kw)
        except (RuntimeError, OSError) as exc:
            if not refused_by_the_os(exc):
                raise
            raise PoolExhausted(allocation_refused(name, tier.value, capacity, exc)) from exc
        self.pools.append(pool)
        return pool

    def discard_pool(self, pool: BlockPool) -> None:
        """Free every block still live in ``pool``, close it and forget it.

        For undoing a construction that failed half-way, and for memory an owner gives back
        for good before the end (a bucket's spare gradient staging); owners normally free
        their blocks and call ``pool.close()`` themselves at the end.
        """
        for block in pool.live_blocks():
            block.free()
        pool.close()
        if pool in self.pools:
            self.pools.remove(pool)

    def pool_stats(self) -> dict[str, dict[str, Any]]:
        """Each open pool's ``stats()`` by pool name (a closed pool holds no memory)."""
        return {pool.name: pool.stats() for pool in self.pools if not pool.closed}

    def device_bytes_in_use(self) -> int:
        """Library-owned device bytes now (the accelerator's ledger)."""
        return self.accelerator.memory_stats()["in_use"]

    # -- copies ------------------------------------------------------------------------

    def subscribe(
        self,
        listener: RecordListener,
        *,
        stalls: RecordListener | None = None,
        fields: bool = False,
        tick: Tick | None = None,
    ) -> Callable[[], None]:
        """Call ``listener(record)`` for every copy and stall from now on; returns an
        unsubscribe. While subscribed, the accelerator's events carry timing.

        ``stalls``: called for the stalls instead, so neither listener asks which it got.
        ``fields``: ``listener`` gets a copy's fields as a plain tuple, in ``CopyRecord``'s
        order, rather than the record (a third of the cost to build: for a recorder that
        only stores them, e.g. ``list.extend``). ``tick``: called on the issuing thread
        about every ``TICK_EVERY`` copies, so such a recorder can tidy up without a Python
        call per copy. See Note [a copy's start is its end event's].
        """
        release_timing = self.accelerator.hold_timing()
        remove = self._listeners.add(listener, stalls=stalls, fields=fields, tick=tick)

        def unsubscribe() -> None:
            remove()
            release_timing()

        return unsubscribe

    def copy(
        self,
        dst: torch.Tensor,
        src: torch.Tensor,
        *,
        direction: Direction,
        category: Category,
        after: Iterable[Event] = (),
        blocks: Sequence[Block] = (),
        stream: Stream | None = None,
        label: str = "",
        held: bool = False,
    ) -> Event:
        """Queue ``dst.copy_(src)`` across tiers; returns the event that marks its end.

        ``after``: events the copy must wait for (e.g. the compute stream's "gradients
        ready"). ``blocks``: pool blocks whose bytes the copy reads or writes; the end event
        is recorded on each. ``stream``: defaults to ``d2h`` or ``h2d`` by direction.
        ``held``: the caller holds both tensors until the end event (``Accelerator.copy_``).
        See Note [one choke point for copies].
        """
        if not isinstance(direction, Direction) or not isinstance(category, Category):
            raise TypeError(
                f"direction and category must be Direction and Category members, "
                f"got {direction!r} and {category!r}"
            )
        if dst.shape != src.shape:
            raise ValueError(
                f"copy of {label or category.value}: dst shape {tuple(dst.shape)} differs from "
                f"src shape {tuple(src.shape)}"
            )
        if stream is None:
            stream = self.d2h if direction is Direction.D2H else self.h2d
        for event in after:
            stream.wait_event(event)
        nbytes = src.nbytes
        hooks = self._listeners.hooks  # one read: replaced whole on (un)subscribe
        if hooks is None:
            self.accelerator.copy_(
                dst, src, stream=stream, label=label or category.value, held=held
            )
            end = stream.record_event()
            for block in blocks:
                block.record_event(end)
            self.counters.add(direction, category, nbytes)
            return end
        # Listened: Note [a copy's start is its end event's].
        issued_at = _clock()
        start = None if stream.end_carries_start else stream.record_timestamp()
        self.accelerator.copy_(dst, src, stream=stream, label=label or category.value, held=held)
        end = stream.record_event()
        for block in blocks:
            block.record_event(end)
        self.counters.add(direction, category, nbytes)
        records, keep, tick = hooks
        seq = next(self._seq)
        fields = (seq, direction, category, nbytes, stream.name, issued_at, start, end, label)
        if keep is not None:
            keep(fields)
        if records is not None:
            records(_new_tuple(CopyRecord, fields))  # half the cost of CopyRecord(*fields)
        if tick is not None and not seq % TICK_EVERY:
            tick()
        return end

    def open_storage(
        self, root: str, *, rank: int, needed_bytes: int, buffer_bytes: int
    ) -> StorageTier:
        """An NVMe tier under ``root/rank{rank}`` (``StorageTier``), closed with the manager.

        Hidden cost: its I/O buffers are pinned here; raises ``StorageFull`` when
        ``needed_bytes`` do not fit the filesystem's free space."""
        tier = StorageTier(
            root,
            rank=rank,
            accelerator=self.accelerator,
            needed_bytes=needed_bytes,
            buffer_bytes=buffer_bytes,
        )
        self.storage.append(tier)
        return tier

    def disk_copy(
        self,
        file: StorageFile,
        slot: int,
        buffer: IOBuffer,
        *,
        direction: Direction,
        category: Category,
        label: str = "",
    ) -> Event:
        """Queue reading record ``slot`` of ``file`` into ``buffer`` (``NVME_READ``) or
        writing ``buffer`` there (``NVME_WRITE``); returns the event of its end, which the
        buffer carries too. Counted and reported like ``copy``; Note [one choke point for
        copies]."""
        issued_at = time.perf_counter()
        if direction is Direction.NVME_READ:
            end = file.submit_read(slot, buffer)
        elif direction is Direction.NVME_WRITE:
            end = file.submit_write(slot, buffer)
        else:
            raise ValueError(
                f"disk_copy of {label or category.value}: direction must be NVME_READ or "
                f"NVME_WRITE, got {direction!r} (device/host copies go through copy())"
            )
        nbytes = file.length(slot)
        self.counters.add(direction, category, nbytes)
        hooks = self._listeners.hooks
        if hooks is not None:
            record = CopyRecord(
                seq=next(self._seq),
                direction=direction,
                category=category,
                nbytes=nbytes,
                stream="nvme",
                issued_at=issued_at,
                start=end.started if end.started is not None else end,
                end=end,
                label=label,
            )
            records, keep, _ = hooks  # rare enough: no ticks here
            for listener in (keep, records):  # a record is a tuple of the fields too
                if listener is not None:
                    listener(record)
        return end

    def compute_ready(self) -> Event:
        """An event on the compute stream marking the work issued so far (e.g. a gradient)."""
        return self.accelerator.current_stream().record_event()

    def wait_for(self, events: Iterable[Event], *, category: Category) -> None:
        """Make compute wait for ``events``; the stall counts as exposed time.

        Synchronisation point: on the host accelerator compute is the caller's thread, so
        this blocks; on CUDA the GPU waits and the caller does not. See Note [exposed time
        is measured on the compute stream].
        """
        events = list(events)
        compute = self.accelerator.current_stream()
        timed = self.accelerator.timing
        issued_at = time.perf_counter()
        before = compute.record_event() if timed else None
        for event in events:
            compute.wait_event(event)
        if before is None:
            return
        stall = StallRecord(
            seq=next(self._seq),
            category=category,
            stream=compute.name,
            issued_at=issued_at,
            before=before,
            after=compute.record_event(),
            waited_for=len(events),
        )
        self.exposed.add(stall)
        for listener in self._listeners.stalls:
            listener(stall)

    @property
    def stalls_dropped(self) -> int:
        """Stalls dropped unmeasured (Note [stall records are bounded] in ``exposed.py``)."""
        return self.exposed.dropped

    @property
    def pending_stalls(self) -> int:
        """Stall records held now, awaiting their events (Note [stall records are bounded])."""
        return self.exposed.pending()

    @property
    def exposed_seconds(self) -> dict[Category, float]:
        """Seconds compute stood still in ``wait_for`` so far, by category (a snapshot).

        Only stalls whose events have completed count; see Note [exposed time is measured
        on the compute stream]. Never blocks.
        """
        return self.exposed.seconds()

    def synchronize(self) -> None:
        """Wait for every copy and every host-side task; raise the first error."""
        self.d2h.synchronize()
        self.h2d.synchronize()
        self.host_worker.synchronize()

    @property
    def closed(self) -> bool:
        """Whether ``close()`` ran: the streams are stopped and no copy can be queued."""
        return self._closed

    # Note [a manager's close ends its borrowers]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    # ``close`` stops the copy streams' worker threads (Note [lifetimes without close] in
    # optim/lifetime.py: a closed owner leaves no library thread behind, even while it is
    # still referenced, e.g. by an LR scheduler). An owner that borrowed the streams (an
    # ``ActivationOffloader(manager=opt.manager)``) could not copy any more, so its pools
    # would be held for nothing: it registers its release with ``close_with`` and ``close``
    # runs it first, while the streams still drain what its pools wait for. The release is a
    # ``weakref.finalize`` of the borrower, so the manager never keeps the borrower alive, and
    # a borrower closed or dropped before (its finalizer already ran) is skipped.

    def close_with(self, release: weakref.finalize) -> None:
        """Run ``release`` (a borrower's finalizer) first when this manager closes; Note [a
        manager's close ends its borrowers]."""
        if not isinstance(release, weakref.finalize):
            raise TypeError(f"release must be a weakref.finalize, got {release!r}")
        if self._closed:
            raise RuntimeError("close_with on a closed TieredMemoryManager: its streams stopped")
        self._borrowers = [*(b for b in self._borrowers if b.alive), release]

    def close(self) -> None:
        """Release the borrowers (``close_with``), then finish the queued work and stop the
        ``d2h``, ``h2d`` and host-worker threads (joined), and close the NVMe tiers (their
        files are deleted). Each step runs even when one before it failed (a stream's sticky
        error); the first error is raised at the end. Later calls do nothing more.

        Synchronisation point: waits for every queued copy and host task.
        """
        self._closed = True
        attempt = Attempts()
        borrowers, self._borrowers = self._borrowers, []
        for release in borrowers:
            attempt(release)
        # The host worker first: its tasks may wait for copies on d2h and h2d.
        for stream in (self.host_worker, self.d2h, self.h2d):
            close = getattr(stream, "close", None)  # CUDA streams have no thread to stop
            if close is not None:
                attempt(close)
        for tier in self.storage:
            attempt(tier.close)
        self.storage.clear()
        attempt.raise_first()
