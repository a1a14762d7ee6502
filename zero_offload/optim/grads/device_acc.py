"""Micro-batches that add up on the device: a bucket's fp32 device accumulator, and the
choice, bucket by bucket, of whether the device budget has room for it.

Note [micro-batches add up on the device]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
On the host, a window of k micro-batches cost a copy to the host and a host pass over
every micro-batch: about 4 + 10(k - 1) host bytes per bf16 parameter before CPU Adam reads
one (Note [two staging buffers for accumulation] in ``to_host.py``), passes that fell
behind backward on a GPU and made Adam wait (the H200 run, issue 39). With room in the
device budget, a bucket whose windows accumulate keeps an fp32 accumulator on the device
(``DeviceSum``, ``4s`` device bytes for a shard of ``s`` elements): each flush adds the
backward's device buffer into it on the compute stream (the first flush of a window
copies, the next ones add: ``acc.add_(grad)``, one fp32 add of the training-dtype value,
exactly the host accumulator's ``acc + float(g)`` in the same order, so the sum is bitwise
the host's), and the window's sum lands in the host accumulator once, in fp32 tiles that
CPU Adam follows (Note [Adam follows the gradient in]). The statistics are taken on the
device too, before the sum leaves: each parameter's float64 norm (``DeviceSum.norms``, one
``_foreach_norm`` per bucket, read with every bucket's in one copy when the step needs
them), as for a bucket whose state stays on the device. The host makes no pass over the
gradient at all: a step's host bytes per parameter, whatever k, are the 4 that land and
Adam's own. The price: a binding clip's norm is the float64 sum of per-parameter norms
squared, not the host's exactly added cells (Note [the norm does not depend on the
bucketing] in ``stat_cells.py``): equal to about 1e-16, so a clipped step may differ from
the host accumulator's in the last bit of a few weights; an unclipped one is bitwise equal.

When it lands. A window's flushes are not announced, so the bucket predicts: it lands
right after the flush that makes the window as long as the previous one (the last
micro-batch of a loop that accumulates a fixed number), during that backward, so the copy
overlaps what is left of it; a backward beyond the prediction adds on the device again
and the step lands the sum again. ``step()``, ``grad_norm()`` and an announced step land
whatever has not landed (``HostGradients.land``). The early landing is skipped when the
host accumulator is still being read (a delayed update running, ``overlap_step``): the
autograd thread never waits for the host; ``step()`` lands it then. Every landing waits for
the host worker's event after the last step queued (``DeviceWindow.acc_free``), recorded at
each window's end once the bucket has a host accumulator, with or without a device sum: a
bucket's first window that accumulates is summed on the host, and with ``overlap_step`` its
update still reads that accumulator when the second window's sum lands
(tests/test_overlap_accumulators.py).

Which buckets. ``GradAccumulation.AUTO`` (the default) takes a bucket's accumulator at its
first window that accumulates, when the device budget has its bytes plus a reserve (a
tenth of the budget, or two of the bucket's gradient buffers if more) left for what the
library allocates later (overflow gradient buffers, activation pools), and beside it the
resident step's temporaries where they grow with a parameter (Note [whole parameters
stepped on the device] in ``state/whole_resident.py``); otherwise the
bucket accumulates on the host, and the first such bucket is logged (``zero_offload``
logger) and counted in the profiler's step notes. ``GradAccumulation.HOST`` keeps every
bucket on the host. Windows of one micro-batch need no accumulator, on either side (Note
[no accumulator for one backward]).
"""

from __future__ import annotations

import logging

import torch

from ...accelerator import Event
from ...accelerator.host_syncs import synchronize_completed
from ...config import GradAccumulation
from ...errors import DeviceBudgetExceeded
from ...memory.align import aligned
from ...memory.block import Block
from ...memory.manager import Tier, TieredMemoryManager
from ...memory.pool import BlockPool
from ...memory.traffic import Category
from ...partition import BucketLayout
from ...tracing import phase
from ..access import declare_compute
from .landing import Landing
from .lone_stats import piece_norms

__all__ = ["DeviceAccumulators", "DeviceSum", "pool_if_room"]

_log = logging.getLogger("zero_offload")

#: The budget share kept free beside the accumulators (Note [micro-batches add up on the
#: device]).
RESERVE_FRACTION = 0.1


def pool_if_room(
    manager: TieredMemoryManager,
    nbytes: int,
    *,
    buffer_bytes: int,
    name: str,
    keep_free: int = 0,
) -> tuple[BlockPool | None, int, int]:
    """A device pool of ``nbytes`` named ``name`` when the budget has them plus a reserve
    (a tenth of the budget, or two gradient buffers of ``buffer_bytes`` if more, and
    ``keep_free`` beside it) left, else None; with the reserve and the bytes left, for the
    message that says why not."""
    stats = manager.accelerator.memory_stats()
    reserve = max(int(stats["budget"] * RESERVE_FRACTION), 2 * buffer_bytes) + keep_free
    left = stats["budget"] - stats["in_use"]
    if nbytes + reserve > left:
        return None, reserve, left
    try:
        pool = manager.create_pool(Tier.DEVICE, aligned(max(nbytes, 1), 512), name=name)
    except DeviceBudgetExceeded:  # another thread took the room meanwhile
        return None, reserve, left
    return pool, reserve, left


class DeviceSum:
    """One bucket's fp32 accumulator on the device.

    Fields:
        tensor: (shard_numel,) fp32, device; the window's sum of this rank's shard.
        block: the block under ``tensor`` (its own pool).
        unlanded: whether a flush added into ``tensor`` since it last landed on the host.
        read: the end event of the last landing copy out of ``tensor`` (the next window's
            first flush overwrites it after that), or None.
    """

    def __init__(self, manager: TieredMemoryManager, block: Block, layout: BucketLayout) -> None:
        self.manager = manager
        self.layout = layout
        n = layout.shard_numel
        self.block = block
        self.tensor = block.view(torch.float32, (n,))
        block.on_move(lambda b: setattr(self, "tensor", b.view(torch.float32, (n,))))
        self.unlanded = False
        self.read: Event | None = None
        # Past a lone gradient's elements (Note [a lone gradient is its own buffer]) only
        # padding, zero for good: Note [padding stays at the end].
        declare_compute(manager, self.tensor, bucket=layout.index, write=True, what="zeroing")
        self.tensor.zero_()

    def add(self, src: torch.Tensor, *, overwrite: bool, after: Event | None) -> None:
        """``tensor[:n] = src`` (``overwrite``: the window's first flush) or ``+= src``, in
        fp32 on the compute stream, after ``after`` (the reduce-scatter of several ranks);
        ``n`` is ``src``'s elements (the shard's, or a lone parameter's)."""
        manager = self.manager
        # The landing copy still reading the sum: the previous window's, or this window's
        # when a backward came after the predicted last one.
        waits = [e for e in (after, self.read) if e is not None]
        pending = [e for e in waits if not e.query()]
        if pending:
            # The compute stream waits (on CUDA the caller does not): the reduce-scatter,
            # or the previous window's landing copy still reading the accumulator.
            manager.wait_for(pending, category=Category.GRADIENTS)
        for event in waits:
            if event not in pending:
                synchronize_completed(event)  # done: orders the access for the race checker
        dst = self.tensor[: src.numel()]
        declare_compute(
            manager, dst, bucket=self.layout.index, write=True, what="device accumulation"
        )
        if overwrite:
            dst.copy_(src)
        else:
            dst.add_(src)
        self.unlanded = True

    def norms(self, shard: tuple[int, int]) -> torch.Tensor | None:
        """(pieces,) float64 on the device, left there: the L2 norm of each parameter's
        piece of ``shard`` in the sum (None for none), on the compute stream (``piece_norms``
        in ``lone_stats.py``; Note [micro-batches add up on the device])."""
        return piece_norms(self.manager, self.layout, shard, self.tensor)

    def land(
        self, acc: torch.Tensor, acc_block: Block, *, readers: list[Event], tile_elements: int
    ) -> Landing:
        """Queue ``acc = tensor`` (the host accumulator, ``acc_block`` under it) in tiles,
        once ``readers`` (host worker events: the last readers of ``acc``) are done."""
        for event in readers:
            # Synchronisation point, only while a delayed update still reads ``acc``;
            # otherwise done, and it orders the access for the race checker.
            if event.query():
                synchronize_completed(event)
            else:
                with phase("wait_grads"):
                    event.synchronize()
        landing = Landing.queue(
            self.manager,
            self.tensor,
            acc,
            tile_elements=tile_elements,
            label=f"bucket{self.layout.index}.landing",
            after=[self.manager.compute_ready()],
            blocks=[self.block, acc_block],
        )
        self.unlanded = False
        self.read = landing.last
        return landing

    def close(self) -> None:
        self.block.free()


class DeviceAccumulators:
    """A segment's device accumulators: which buckets get one, each in a pool of its own.

    Fields:
        setting: ``OffloadConfig.grad_accumulation``.
        step_reserve: device bytes the resident buckets' step allocates beside the pools at
            once, kept free beside the reserve (Note [whole parameters stepped on the
            device] in ``state/whole_resident.py``; 0 for an elementwise rule).
        pools: one per bucket that accumulates on the device.
        on_host: buckets refused for lack of budget (they accumulate on the host).
    """

    def __init__(
        self,
        manager: TieredMemoryManager,
        *,
        setting: GradAccumulation,
        name: str,
        step_reserve: int = 0,
    ) -> None:
        self.manager = manager
        self.setting = setting
        self.name = name
        self.step_reserve = step_reserve
        self.pools: list[BlockPool] = []
        self.on_host: set[int] = set()

    def take(self, layout: BucketLayout, *, itemsize: int) -> DeviceSum | None:
        """The device accumulator of ``layout``'s bucket, or None (it accumulates on the
        host); asked once per bucket, at its first window that accumulates."""
        if self.setting is GradAccumulation.HOST:
            return None
        nbytes = 4 * layout.shard_numel
        pool, reserve, left = pool_if_room(
            self.manager,
            nbytes,
            buffer_bytes=layout.padded_numel * itemsize,
            name=f"{self.name}.bucket{layout.index}.grad_acc_dev",
            keep_free=self.step_reserve,
        )
        if pool is None:
            self._refused(layout, nbytes, reserve, left)
            return None
        self.pools.append(pool)
        block = pool.alloc(
            nbytes,
            owner=f"bucket{layout.index}.grad_acc_dev",
            stream=self.manager.accelerator.current_stream(),
        )
        self._note()
        return DeviceSum(self.manager, block, layout)

    def _refused(self, layout: BucketLayout, nbytes: int, reserve: int, left: int) -> None:
        if not self.on_host:
            _log.warning(
                "zero-offload: bucket %d accumulates its micro-batches on the host: its fp32 "
                "device accumulator (%d bytes) and a reserve of %d bytes do not fit the %d "
                "bytes left in the device budget (OffloadConfig(grad_accumulation=...); Note "
                "[micro-batches add up on the device]). Later buckets that do not fit are "
                "counted in the profiler's step notes, not logged.",
                layout.index,
                nbytes,
                reserve,
                left,
            )
        self.on_host.add(layout.index)
        self._note()

    def _note(self) -> None:
        notes = self.manager.step_notes
        notes[f"{self.name}.device_accumulating_buckets"] = len(self.pools)
        if self.on_host:
            notes[f"{self.name}.host_accumulating_buckets"] = len(self.on_host)

    def close(self) -> None:
        """Close the pools (their blocks were freed by the buckets)."""
        for pool in self.pools:
            pool.close()
        self.pools.clear()
