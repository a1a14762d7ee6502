"""Where a bucket's flushes land on the host: the ``Staging`` interface, and the bucket's own
buffers (``OwnStaging``); a ring shared by every bucket is ``staging_ring.py``.

``HostGradients`` (``to_host.py``) asks its ``Staging`` for a buffer at each flush
(``acquire``), tells it when the host worker's pass over that buffer is queued (``passed``)
and when the last reader of the window's gradient in staging is queued (``read_by``: a fold
into the accumulator, or the bucket's update run during backward), and lets the window go
(``release``).

- ``OwnStaging``: one buffer per bucket for the whole model, ``a(ks)`` pinned bytes in the
  host pool, plus the spare pinned on first need (Note [two staging buffers for
  accumulation]).
- ``RingStaging`` (``staging_ring.py``): a slot of the segment's ``StagingRing`` per flush,
  released as soon as what reads it is done.

Note [staging is reused only once consumed]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A flush's copy into a staging buffer must not start before the host worker has passed over
the previous flush into that buffer (added it into the accumulator, or taken its
statistics), or that gradient would be overwritten unread (a lagging worker, an early flush,
or micro-batches while ``overlap_step``'s update occupies the worker). Each pass over a
buffer records an event on the host worker after it (``OwnStaging._consumed``; a lone flush
the delayed update reads gets no pass: its reader is that update, ``read_by``), and the
next flush into that buffer waits for it, on the caller's thread: a CUDA stream cannot wait
on host-thread work. Which buffer a flush uses: Note [two staging buffers for accumulation];
with a ring: Note [gradient staging for the buckets in flight] in ``staging_ring.py``.

Note [two staging buffers for accumulation]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
With one staging buffer, micro-batch k+1's flush of a bucket waited for the host worker's
pass over micro-batch k's: on a GPU, where the autograd thread runs ahead of the device, a
host sync per bucket per micro-batch that drains the launch queue (issue 22). So a window's
flushes alternate: the odd ones (the first) go to ``grad_staging``, the even ones to
``spare_staging``. Flush k+1 waits only for the pass over flush k-1, which had a whole
micro-batch to finish: the autograd thread waits only when the host is two micro-batches
behind, both buffers busy (tests/test_accumulation_stall.py). Results are bitwise
unchanged: the host worker runs the passes in flush order, so the fp32 accumulator adds the
micro-batches in the same order with the same kernel; only the buffer a pass reads
changes. A lone flush still goes to ``grad_staging`` and is read there (Note [no
accumulator for one backward]).
The cost: ``a(ks)`` more pinned host bytes per bucket (shard of ``s`` elements, ``k``-byte
training dtype: 2 bytes a parameter in bf16, 4 in fp32), in a pool of its own created at
the first window with a second flush (``SpareStaging``), like the accumulator: a loop that
never accumulates pays nothing. The estimator's rows that sum micro-batches on the host count
it (``estimate/accumulation.py``).
Not an fp32 accumulator on the device: ``4s`` device bytes per bucket, in the memory
offloading spares (docs/gradient-semantics.md weighs the two).

Note [the delayed update reads one buffer, the next backward fills the other]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
With ``overlap_step`` (``HostGradients(delayed_update=True)``) update k reads window k's
gradient on the host worker while backward k+1's copies land, so window k+1 must not land
where window k's gradient is. A window of one flush needs nothing more than that: the
update reads the training-dtype gradient where it landed (Note [no accumulator for one
backward]), so the bucket's two staging buffers take turns by window (``alternate``): the
first flush of a window goes to the buffer the previous window did not start in, and its
later flushes alternate from there (flush ``j`` of a window starting in ``f`` lands in
``(f + j) % 2``). Update k reads buffer ``f_k``; backward k+1 lands in ``1 - f_k``, whose
last reader, update k-1, step() k drained before it queued update k. The window's
``GradSource`` names the buffer (``STAGING`` the own one, ``SPARE`` the spare), since the
update runs after the next window has moved ``kept()`` on. Correctness never rests on the
turn alone: the end of a window whose gradient stayed in staging records the host worker's
event after the update it queued as that buffer's last reader (``read_by``), and a flush
into it waits for that event (Note [staging is reused only once consumed]): only a window
that changes its number of flushes (one, then several: its second flush lands in the
buffer update k reads) or a window discarded between two steps waits there.
Before, ``overlap_step`` accumulated every window in fp32, even one flush: an fp32 host
accumulator (``a(4s)``) and, where the budget had room, an fp32 device accumulator
(``a(4s)`` device bytes) of which one micro-batch needs neither. Now one micro-batch a step
costs the spare, ``a(ks)`` host bytes, and nothing on the device: bf16 2 host bytes a
parameter instead of 4 + 4 on the device, fp32 4 instead of 4 + 4 (Note [overlap_step's
device extras follow the budget] in ``estimate/delayed.py``). The values Adam reads are the
same bits (``grad.float()``). The statistics are taken on the device at the flush, so
backward k+1 queues nothing on the host worker behind update k, and the host does not read
the gradient before Adam does (Note [a lone window's statistics are taken on the device] in
``lone_stats.py``).
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Iterator

import torch

from ...accelerator import Event
from ...memory.align import aligned
from ...memory.block import Block
from ...memory.manager import TieredMemoryManager
from ...memory.pool import BlockPool
from ...partition import BucketLayout
from ...tracing import phase
from .buffers import SpareStaging
from .path import GradSource

__all__ = ["OwnStaging", "Staging", "own_staging_bytes"]


def own_staging_bytes(layouts: list[BucketLayout], itemsize: list[int], *, alignment: int) -> int:
    """Bytes of every bucket's own gradient staging, ``sum a(k*s)``: what a ring replaces
    in the host pool (and, as weight staging, what stays beside it)."""
    return sum(
        aligned(s * b.shard_numel, alignment) for b, s in zip(layouts, itemsize, strict=True)
    )


class Staging(ABC):
    """Where one bucket's flushes land; see the module docstring."""

    #: Flushes that waited on the caller's thread for a buffer's last reader.
    waits: int = 0
    #: The bucket's second own buffer (Note [two staging buffers for accumulation]); None
    #: with a ring.
    spare: SpareStaging | None = None

    @abstractmethod
    def acquire(self, *, overwrite: bool, window_flushes: int) -> int:
        """The buffer this flush copies into (an id for ``get``), once it may be
        overwritten (a synchronisation point when it may not yet). ``window_flushes``: the
        flushes of the window so far. A failure changes nothing."""

    @contextlib.contextmanager
    def acquired(self, overwrite: bool, window_flushes: int) -> Iterator[int]:
        """``acquire``, and ``unused`` if the flush raises before its pass is queued."""
        buffer = self.acquire(overwrite=overwrite, window_flushes=window_flushes)
        try:
            yield buffer
        except BaseException:
            self.unused(buffer)
            raise

    @abstractmethod
    def get(self, buffer: int) -> tuple[torch.Tensor, Block]:
        """Buffer ``buffer``: ``(shard_numel,)`` training dtype, host, and its block."""

    @abstractmethod
    def passed(self, buffer: int, event: Event, *, kept: bool) -> None:
        """The host worker's pass over ``buffer`` is queued and ends at ``event``;
        ``kept``: the window's gradient stays there for the step (no accumulator)."""

    def unused(self, buffer: int) -> None:  # noqa: B027 (own buffers stay)
        """The flush that acquired ``buffer`` failed before its pass was queued: nothing
        will read it."""

    @abstractmethod
    def kept(self) -> int:
        """The buffer holding the window's gradient when it stayed in staging."""

    def kept_source(self) -> GradSource:
        """The ``GradSource`` naming ``kept()`` for a step planned now."""
        return GradSource.STAGING

    def buffer(self, source: GradSource) -> int:
        """The buffer a step planned at ``source`` (a staging one) reads."""
        return self.kept()

    @abstractmethod
    def read_by(self, event: Event) -> None:
        """The last reader of the window's gradient in staging (a fold) is queued on the
        host worker and ends at ``event``."""

    def stepped(self, event: Event) -> None:
        """The bucket's update, run during backward, read the window's gradient in staging
        (queued on the host worker, ending at ``event``)."""
        self.read_by(event)

    def check_kept(self, bucket: int, *, staged: bool) -> None:  # noqa: B027 (own: kept)
        """Refuse to plan a step from the window's gradient in staging (``staged``) once
        it is gone."""

    @property
    def holding(self) -> bool:
        """Whether ``release`` has anything to give back (a slot) or forget."""
        return False

    def release(self, event: Event | None) -> None:  # noqa: B027 (own buffers stay)
        """The window is over (consumed or discarded); ``event``: the host worker's last
        queued work, which any reader still pending is before."""

    def drop_spare(self) -> None:  # noqa: B027 (a ring has no spare)
        """The bucket's windows are summed on the device now: give the spare back (Note
        [the spare goes when the device sums])."""

    @abstractmethod
    def close(self) -> None:
        """Give the bucket's memory back."""


class OwnStaging(Staging):
    """A bucket's own staging buffer (block 0, in the host pool) and its spare (block 1),
    Note [two staging buffers for accumulation].

    Fields:
        block: the own buffer's block, ``(shard_numel,)`` training dtype, host pool.
        spare: the second buffer, pinned on first need.
        alternate: windows take turns between the buffers (``overlap_step``: Note [the
            delayed update reads one buffer, the next backward fills the other]).
        _first: the buffer the current (or last) window's first flush went to; always 0
            without ``alternate``.
        _next: the buffer the next window's first flush goes to (0, then by turns).
        _consumed: per buffer, the host worker's last pass over it, or the delayed update
            that reads it (Note [staging is reused only once consumed]).
    """

    def __init__(
        self,
        manager: TieredMemoryManager,
        layout: BucketLayout,
        *,
        host_pool: BlockPool,
        dtype: torch.dtype,
        alternate: bool = False,
    ) -> None:
        self.numel = n = layout.shard_numel
        self.alternate = alternate
        self._first = self._next = 0
        self.dtype = dtype
        self.index = layout.index
        self.spare = SpareStaging(
            manager,
            layout,
            dtype=dtype,
            alignment=host_pool.alignment,
            name=f"{host_pool.name}.bucket{layout.index}.grad_staging_spare",
        )
        self.waits = 0
        self._consumed: list[Event | None] = [None, None]
        self.block = host_pool.alloc(n * dtype.itemsize, owner=f"bucket{layout.index}.grad_staging")
        self.block.on_move(self._bind)
        self._bind(self.block)
        self.tensor.zero_()

    def _bind(self, block: Block) -> None:
        self.tensor = block.view(self.dtype, (self.numel,))

    def acquire(self, *, overwrite: bool, window_flushes: int) -> int:
        # Note [two staging buffers for accumulation]: odd flushes to the window's first
        # buffer (0, or with ``alternate`` the one the last window did not start in: Note
        # [the delayed update reads one buffer, the next backward fills the other]), even
        # ones to the other.
        if overwrite:
            first = buffer = self._next
        else:
            first = self._first
            buffer = (first + window_flushes) % 2
        consumed = self._consumed[buffer]
        if consumed is not None and not consumed.query():
            # Note [staging is reused only once consumed]. Synchronisation point: the caller
            # waits, since a CUDA stream cannot wait on host-thread work; only when the host
            # worker is two flushes behind.
            self.waits += 1
            with phase("wait_staging"):
                consumed.synchronize()
        if buffer == 1:
            self.spare.ensure()  # before anything moves: a failure changes nothing
        self._first = first
        if overwrite and self.alternate:
            self._next = 1 - first
        return buffer

    def get(self, buffer: int) -> tuple[torch.Tensor, Block]:
        if buffer == 0:
            return self.tensor, self.block
        return self.spare.get(self.index)

    # Note [the spare goes when the device sums]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    # A bucket's first window that accumulates is summed on the host (its device accumulator
    # is taken then, for the windows after it: Note [micro-batches add up on the device]),
    # and pins the spare for its second flush. From the next window on the bucket's flushes
    # add up on the device and land once, never through the spare, so keeping it would hold
    # 2 bytes per bf16 parameter that no window reads (22 bytes a parameter where the
    # estimator's "summed on the device" row counts 20). So once the bucket has its device
    # accumulator, the end of a window frees the spare and closes its pool, as soon as the
    # host worker's last pass over it is done (its event, queried: the caller never waits);
    # a pass still running leaves it to the next window's end. A later window summed on the
    # host again would pin it afresh (``SpareStaging.ensure``).

    def drop_spare(self) -> None:
        """Free the spare once its last pass is done (Note [the spare goes when the device
        sums])."""
        last = self._consumed[1]
        if self.spare is None or self.spare.block is None:
            return
        if last is not None and not last.query():
            return  # its last pass is still running: the next window's end frees it
        self.spare.give_back()
        self._consumed[1] = None

    def passed(self, buffer: int, event: Event, *, kept: bool) -> None:
        self._consumed[buffer] = event

    def kept(self) -> int:
        return self._first

    def kept_source(self) -> GradSource:
        return GradSource.SPARE if self._first == 1 else GradSource.STAGING

    def buffer(self, source: GradSource) -> int:
        return 1 if source is GradSource.SPARE else 0

    def read_by(self, event: Event) -> None:
        self._consumed[self._first] = event

    def close(self) -> None:
        self.block.free()
        self.spare.close()
