"""A gradient's statistics taken on the device: each parameter's float64 norm, left there.

``piece_norms`` cuts a bucket's shard into its parameters' pieces and takes their norms in
one ``_foreach_norm`` on the compute stream: for a window summed on the device as it lands
(Note [micro-batches add up on the device] in ``device_acc.py``), and for the lone flush of
a window the delayed update will read with one rank (``LoneFlush.norms`` in
``lone_flush.py``, below). ``ShardNorms`` takes them on the stream that reduce-scattered the
shard, with several ranks, and ``order_norms_read`` orders the step's read after them.

Note [a lone window's statistics are taken on the device]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
With ``overlap_step`` and one micro-batch a step, window k+1's gradient stays in staging
(Note [the delayed update reads one buffer, the next backward fills the other] in
``staging.py``), and its statistics were the host worker's pass over each landed tile. The
one worker is first in, first out, and update k occupies it while backward k+1 runs: that
pass queued behind Adam k (issue 39: nothing of the next backward queues behind the
delayed update), and it read the whole gradient once more on the host, ``k`` bytes a
parameter a step (fp32 4, bf16 2). So a lone flush with ``HostGradients(delayed_update=
True)`` takes its statistics on the device instead, where the bytes already are: at the
flush, with one rank on the compute stream, in order after the backward that wrote it and
beside the copy to staging (with several, below), each parameter's float64 norm of its
piece (``piece_norms``), kept as the window's ``DeviceWindow.norms`` and read with every
bucket's in one copy when the step needs them. The flush queues nothing on the host
worker: CPU Adam follows the copies themselves (Note [Adam follows the gradient in] in
``landing.py``), and the staging buffer's last reader is the update, recorded at the
window's end as before. A second flush in the window after all (a second micro-batch)
folds the lone flush into the accumulator; the fold then waits on the worker for the
flush's last copy, since no pass did, and the window's statistics are the accumulation
passes' again (``norms`` dropped).
The semantics are the device accumulator's: the norm is the float64 sum of per-parameter
norms squared, not the host's exactly added cells (Note [the norm does not depend on the
bucketing] in ``stat_cells.py``); the two agree to about 1e-16, so a step whose clip binds
may differ from the host's statistics (the plain step, several micro-batches on the host)
in the last bit of a few weights, and an unclipped one is bitwise equal. On the host
accelerator the norm is exactly ``sqrt(fsum(n_p ** 2))`` of torch's
``linalg.vector_norm(g_p, dtype=float64)`` over the parameters ``p``
(tests/test_overlap_lone_stats.py). A NaN or an infinity makes its
parameter's norm non-finite (squares of finite values cannot overflow float64), so the
overflow flag is exact. The device holds ``(parameters,)`` float64 per bucket until the
step: 8 bytes a parameter tensor, not a parameter element.
With several ranks the shard is this rank's only once the reduce-scatter ends, on the
communication stream: norms on the compute stream would make compute wait for every
bucket's reduce-scatter (on CUDA it would no longer overlap backward: 13 waits a backward
for 13 buckets, backward 0.39 -> 0.58 s with a 40 ms reduce-scatter on the host
accelerator). So they are taken on the communication stream itself (``ShardNorms``, on
the stream ``reduce_scatter_stream`` names), queued right behind the bucket's
reduce-scatter, in stream order after the bytes it wrote: compute waits for nothing, the
host worker does no pass (2 ranks: fp32 4 -> 0, bf16 2 -> 0 host bytes a parameter a step,
no job of backward k+1 behind update k), and the next bucket's reduce-scatter starts one
small kernel later (it reads the shard once, in device memory). They land in a
``(pieces,)`` float64 device buffer the bucket asks of the budget at its first such flush
and writes in place at every later one (a shard of padding alone has no piece and queues
nothing). Two events keep the bytes alive: the gradient buffer's reuse waits for the norms'
event (recorded on its block beside the copies'), and the window keeps the norms with that
event (``DeviceWindow.norms_ready``), which the step's compute stream waits for before it
reads them (``order_norms_read``). The step's collectives on the caller's thread (the
delayed update's all-gathers as step k+1 publishes it, the statistics' all-reduce) must be
issued after every reduce-scatter of the window, since collectives on one group match by
the order each rank issues them, and where the comm stream is a thread (the host
accelerator, gloo) it issues them: the host worker's synchronisation in ``settle`` gave that
order while passes followed the reduce-scatters. ``ShardedRanks`` keeps that order itself
now, for every collective it issues on the caller's thread (Note [caller collectives follow
the reduce-scatters] in ``optim/ranks.py``). The next write needs no event of its own: it follows the next backward's
reduce-scatter, which the comm stream queues after an event of compute recorded after that
read. The semantics are the one-rank flush's above, over this rank's shard; the ranks add
their sums of squares in the all-reduce as before (tests/test_overlap_lone_stats.py: 2 gloo
ranks under the race checker in strict mode, their reduce-scatters held past backward,
against the host statistics of the same ranks).
"""

from __future__ import annotations

import contextlib

import torch

from ...accelerator import Event, Stream
from ...accelerator.host_syncs import synchronize_completed
from ...accelerator.ledger import DeviceBuffer
from ...memory.block import Block
from ...memory.manager import TieredMemoryManager
from ...memory.traffic import Category
from ...partition import BucketLayout
from ..access import declare_compute
from ..ranks import Ranks

__all__ = ["ShardNorms", "order_norms_read", "piece_norms", "reduce_scatter_stream"]


def _pieces(layout: BucketLayout, shard: tuple[int, int], src: torch.Tensor) -> list[torch.Tensor]:
    """Each parameter's piece of ``shard`` in ``src`` (the shard's elements from its start,
    or a lone parameter's), in slot order; empty pieces left out."""
    start, stop = shard
    views = []
    for slot in layout.slots:
        lo, hi = layout.owned_piece(slot, start, stop)
        if hi > lo:
            first = slot.offset + lo - start
            views.append(src[first : first + hi - lo])
    return views


def piece_norms(
    manager: TieredMemoryManager, layout: BucketLayout, shard: tuple[int, int], src: torch.Tensor
) -> torch.Tensor | None:
    """(pieces,) float64 on the device, left there: the L2 norm of each parameter's piece of
    ``shard`` in ``src`` (the shard's elements from its start, or a lone parameter's), None
    for none; one ``_foreach_norm`` on the current stream."""
    views = _pieces(layout, shard, src)
    if not views:
        return None
    declare_compute(manager, src, bucket=layout.index, write=False, what="norms")
    return torch.stack(torch._foreach_norm(views, 2, dtype=torch.float64))


def reduce_scatter_stream(ranks: Ranks) -> Stream | None:
    """The stream ``ranks`` reduce-scatter on (the comm stream), None with one rank, whose
    gradients are not scattered."""
    return ranks.scatter_stream


class ShardNorms:
    """One bucket's lone-flush norms taken on the stream that reduce-scattered its shard:
    Note [a lone window's statistics are taken on the device].

    Fields:
        buffer: the (pieces,) float64 device buffer the norms land in, asked of the budget
            at the first flush that takes them and written in place by every later one;
            None before (and after ``close``).
    """

    def __init__(
        self, manager: TieredMemoryManager, layout: BucketLayout, shard: tuple[int, int]
    ) -> None:
        self.manager = manager
        self.layout = layout
        self.shard = shard
        self.buffer: DeviceBuffer | None = None
        self._ready: Event | None = None  # the last norms' end on the comm stream

    def take(
        self, src: torch.Tensor, *, stream: Stream, block: Block
    ) -> tuple[torch.Tensor, Event]:
        """Queue the norms of ``src`` (the shard, reduce-scattered on ``stream``) on
        ``stream``, behind the reduce-scatter; returns the (pieces,) float64 device tensor
        they land in and the event after which it holds them. The reuse of ``block`` (under
        ``src``) waits for that event too. A shard of padding alone has no piece: no norm,
        nothing queued (``(0,)``), and the event is the reduce-scatter's end, which the
        step still orders its collectives after."""
        acc = self.manager.accelerator
        index = self.layout.index
        # The views are built with the stream current: Note [metadata ops are recorded on
        # the current stream] (accelerator/base.py); the accesses are declared on it.
        with acc.stream_context(stream):
            views = _pieces(self.layout, self.shard, src)
            if not views:
                return torch.zeros(0, dtype=torch.float64, device=src.device), stream.record_event()
            if self.buffer is None:  # first need: 8 bytes a parameter piece
                self.buffer = acc.allocate_device(8 * len(views), what=f"bucket{index}.lone_norms")
            out = self.buffer.tensor.view(torch.float64)
            declare_compute(self.manager, src, bucket=index, write=False, what="norms")
            declare_compute(self.manager, out, bucket=index, write=True, what="norms")

            def norms() -> None:
                torch.stack(torch._foreach_norm(views, 2, dtype=torch.float64), out=out)

            stream.submit(norms)
            ready = stream.record_event()
        self._ready = ready
        block.record_event(ready)  # the gradient buffer is reused after the norms read it
        return out, ready

    def close(self) -> None:
        """Give the buffer back to the budget once the last norms written into it are done
        (a close after a backward without a step: the optimizer's synchronisation does not
        cover the comm stream)."""
        ready, self._ready = self._ready, None
        if ready is not None:
            # Synchronisation point: at close only. A failed comm stream's error belongs to
            # the collective it failed (raised there); nothing reads these norms any more,
            # and the buffer goes back either way.
            with contextlib.suppress(Exception):
                ready.synchronize()
        if self.buffer is not None:
            self.buffer.release()
            self.buffer = None


def order_norms_read(
    manager: TieredMemoryManager, layout: BucketLayout, norms: torch.Tensor, ready: Event | None
) -> None:
    """The step's compute stream reads ``norms`` next: order it after ``ready`` (the stream
    that took them; None: compute took them, in order)."""
    if ready is not None:
        if ready.query():
            synchronize_completed(ready)  # done: orders the read for the race checker
        else:
            # The compute stream waits (on CUDA the caller does not) for the comm stream's
            # norms.
            manager.wait_for([ready], category=Category.GRADIENTS)
    declare_compute(manager, norms, bucket=layout.index, write=False, what="the step reads norms")
