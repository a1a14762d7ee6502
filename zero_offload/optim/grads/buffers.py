"""The memory a gradient passes through on its way to the host: the device gradient
buffers (``GradBuffers``, with overflow pools for buckets that wait their turn), the fp32
accumulator (``AccumulatorPool``) and the second gradient staging buffer (``SpareStaging``),
each pinned on first need, and the thread count of the host worker's passes over a
gradient."""

from __future__ import annotations

import numba
import torch

from ...caller_warning import warn_caller
from ...config import GradAccumulation, format_bytes
from ...errors import PoolExhausted
from ...memory.align import aligned
from ...memory.block import Block
from ...memory.manager import Tier, TieredMemoryManager
from ...memory.pool import BlockPool
from ...partition import BucketLayout
from ...thread_budget import thread_budget
from .device_acc import DeviceAccumulators

__all__ = [
    "AccumulatorPool",
    "GradBuffers",
    "LazyHostPool",
    "SpareStaging",
    "accumulator_bytes",
    "host_pass_threads",
    "spare_staging_bytes",
]


def accumulator_bytes(bucket: BucketLayout, *, alignment: int) -> int:
    """Bytes of an offloaded bucket's fp32 gradient accumulator, ``a(4k)``: its own pool,
    created at the first accumulating step (Note [no accumulator for one backward] in
    ``grads/to_host.py``)."""
    return aligned(4 * bucket.shard_numel, alignment)


def spare_staging_bytes(bucket: BucketLayout, *, itemsize: int, alignment: int) -> int:
    """Bytes of an offloaded bucket's second gradient staging buffer, ``a(ks)`` for a
    training dtype of ``k = itemsize`` bytes: its own pool, created at the first window with
    a second flush (Note [two staging buffers for accumulation] in ``grads/to_host.py``)."""
    return aligned(itemsize * bucket.shard_numel, alignment)


# Note [the Adam pass gets the cores]
# The host worker's passes over a gradient (statistics, accumulation, the fold into the
# accumulator) run while something else holds the cores: torch's threads running the
# rest of backward, or CPU Adam, which runs on every core (numba's default, as torch's).
# They are vectorised and mostly memory-bound: alone, one thread does the fp32 statistics
# in 1.16x the time of two, bf16 in 1.6x (benchmarks/bench_grad_passes.py). Beside CPU
# Adam, though, a second team of threads oversubscribes the cores and stalls both teams at
# their barriers. So they run on a quarter of the cores (the thread budget's host_pass), at
# least one: one on the 2-vCPU test machine, where that measured 26.5 ms a step against
# 29.1 ms with a team of two (bench_offload_step's embed model, bf16, one micro-batch, no
# clipping, median of 15 interleaved rounds; no change with clipping or 4 micro-batches); on
# a many-core host a few threads keep up with the D2H link (not measured: no GPU host was
# available). "The cores" are the thread budget's (affinity and cgroup quota, never
# os.cpu_count()), and, like every numba launch (numba_threads_now), a pass takes no more
# threads than torch's count: a process told to use fewer threads (ranks sharing a host)
# keeps to it. The count does not change any result: the kernels' sums are cut in fixed
# blocks whatever the threads (Note [sums do not depend on the threads] in
# kernels/_validate.py).


def host_pass_threads() -> int:
    """Threads for one host-worker pass over a gradient: Note [the Adam pass gets the cores]."""
    # A quarter of the cores (Note [one thread budget]), within torch's count (process-wide,
    # so the host worker reads the caller's setting) and numba's pool.
    share = thread_budget().host_pass
    return max(1, min(share, torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS))


class GradBuffers:
    """Device gradient buffers for offloaded buckets: the device pool, plus overflow pools
    grown on demand when buckets must wait for their turn (several ranks, Note [ranks in
    lockstep] in ``order.py``). Overflow pools are kept and reused by later backwards;
    each is counted against the device budget like any pool."""

    def __init__(
        self,
        manager: TieredMemoryManager,
        *,
        name: str,
        accumulation: GradAccumulation = GradAccumulation.AUTO,
        step_reserve: int = 0,
    ) -> None:
        self.manager = manager
        self.name = name
        self.overflow: list[BlockPool] = []  # each one largest-bucket buffer, device
        #: The buckets' fp32 device accumulators (Note [micro-batches add up on the device]);
        #: ``step_reserve``: see ``DeviceAccumulators``.
        self.accumulators = DeviceAccumulators(
            manager, setting=accumulation, name=name, step_reserve=step_reserve
        )

    def alloc(self, pool: BlockPool, nbytes: int, *, owner: str, grow: bool) -> Block:
        """A block of ``nbytes`` from ``pool``, else from an overflow pool (created when
        ``grow`` and none has room). Raises ``PoolExhausted`` otherwise."""
        # The compute stream fills the buffer first: its reuse waits there, not on the CPU
        # (stream-ordered reuse, Note [block reuse waits on events] in
        # memory/pending_blocks.py).
        stream = self.manager.accelerator.current_stream()
        try:
            return pool.alloc(nbytes, owner=owner, stream=stream)
        except PoolExhausted:
            if not grow:
                raise
        for extra in self.overflow:
            try:
                return extra.alloc(nbytes, owner=owner, stream=stream)
            except PoolExhausted:
                continue
        extra = self.manager.create_pool(
            Tier.DEVICE, nbytes, name=f"{self.name}.grad_overflow{len(self.overflow)}"
        )
        if not self.overflow:
            warn_caller(
                f"zero-offload: a gradient bucket of {format_bytes(nbytes)} had to wait for an "
                "earlier bucket that is not complete on this rank (an unused parameter, or "
                "backward order differing from bucket order); its gradients stay on the "
                "device meanwhile, in an extra device pool (kept for later steps). See "
                "'Ranks in lockstep' in the README."
            )
        self.overflow.append(extra)
        return extra.alloc(nbytes, owner=owner, stream=stream)

    def close(self) -> None:
        """Close the overflow pools (their blocks were freed by the buckets)."""
        for extra in self.overflow:
            extra.close()
        self.overflow.clear()
        self.accumulators.close()


class LazyHostPool:
    """Host memory for one bucket's field that only some windows need, created on first
    need and kept for later steps; ``capacity`` in bytes. Subclassed per field, so each
    field's pool is a type of its own (its name says which)."""

    #: What the pool's host RAM refusal tells the user to change (``check_host_ram``).
    sized_by = "the model's offloaded buckets"

    def __init__(self, manager: TieredMemoryManager, capacity: int, *, name: str) -> None:
        self.manager = manager
        self.capacity = capacity
        self.name = name
        self.pool: BlockPool | None = None  # host, pinned where available; None until needed

    def alloc(self, nbytes: int, *, owner: str) -> Block:
        """A block of ``nbytes``; the first call creates the pool (hidden cost: a pinned
        allocation of ``capacity`` bytes)."""
        if self.pool is None:
            self.pool = self.manager.create_pool(
                Tier.HOST, self.capacity, name=self.name, sized_by=self.sized_by
            )
        return self.pool.alloc(nbytes, owner=owner)

    def close(self) -> None:
        """Close the pool (its blocks were freed by the buckets)."""
        if self.pool is not None:
            self.pool.close()
            self.pool = None

    def give_back(self) -> None:
        """Free the pool's memory for good and forget it (the manager lists it no more); a
        later ``alloc`` creates it afresh."""
        if self.pool is not None:
            self.manager.discard_pool(self.pool)
            self.pool = None


class AccumulatorPool(LazyHostPool):
    """fp32 gradient accumulator memory (``accumulator_bytes``), created on first need
    (Note [no accumulator for one backward])."""

    sized_by = (
        "the micro-batches a step (one needs no accumulator; several pin an fp32 accumulator "
        "per offloaded bucket, 4 bytes a parameter, at the first step that accumulates), or, "
        "with nvme_dir, OffloadConfig.host_budget: the accumulators sit beside the state it "
        "placed, and host_budget='auto' leaves them no room (Note [the accumulators sit "
        "beside the host budget] in zero_offload/estimate/accumulation.py; `zero-offload "
        "estimate` with micro-batches prints a budget that leaves them room)"
    )


class SparePool(LazyHostPool):
    """A bucket's second gradient staging buffer's memory (``SpareStaging``)."""

    sized_by = (
        "the micro-batches a step or overlap_step (summed on the host, or with the delayed "
        "update, each bucket takes a second gradient staging buffer at the first step that "
        "needs it: 2 bytes a bf16 parameter; OffloadConfig(grad_accumulation='auto') sums on "
        "the device where its budget has room), or, with nvme_dir, OffloadConfig.host_budget "
        "(Note [the accumulators sit beside the host budget] in "
        "zero_offload/estimate/accumulation.py)"
    )


class SpareStaging:
    """A bucket's second gradient staging buffer (Note [two staging buffers for
    accumulation] in ``grads/to_host.py``), allocated on first need from a pool of its own.

    Fields:
        tensor: (numel,) training dtype, host, pinned where available; None until
            ``ensure``.
        block: the block under ``tensor``; None until ``ensure``.
    """

    def __init__(
        self,
        manager: TieredMemoryManager,
        bucket: BucketLayout,
        *,
        dtype: torch.dtype,
        alignment: int,
        name: str,
    ) -> None:
        self.numel = bucket.shard_numel
        self.dtype = dtype
        self.owner = f"bucket{bucket.index}.grad_staging_spare"
        capacity = spare_staging_bytes(bucket, itemsize=dtype.itemsize, alignment=alignment)
        self.memory = SparePool(manager, capacity, name=name)  # its pool, lazily
        self.tensor: torch.Tensor | None = None
        self.block: Block | None = None

    def ensure(self) -> None:
        """Allocate the buffer if it is not yet (hidden cost, once: a pinned allocation)."""
        if self.block is None:
            block = self.memory.alloc(self.numel * self.dtype.itemsize, owner=self.owner)
            self.block = block
            block.on_move(self._bind)
            self._bind(block)

    def _bind(self, block: Block) -> None:
        self.tensor = block.view(self.dtype, (self.numel,))

    def get(self, bucket_index: int) -> tuple[torch.Tensor, Block]:
        """The buffer and its block; a bug before ``ensure``."""
        if self.tensor is None or self.block is None:
            raise RuntimeError(f"bucket {bucket_index}: no spare staging buffer (bug)")
        return self.tensor, self.block

    def close(self) -> None:
        """Free the buffer and close its pool."""
        if self.block is not None:
            self.block.free()
        self.block = self.tensor = None
        self.memory.close()

    def give_back(self) -> None:
        """Free the buffer and its pool's memory (Note [the spare goes when the device sums]
        in ``staging.py``); ``ensure`` pins it afresh if a window needs it again."""
        if self.block is not None:
            self.block.free()
        self.block = self.tensor = None
        self.memory.give_back()
