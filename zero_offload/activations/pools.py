"""Where an offloaded activation's bytes live (one host pool, one device pool, sized by the
config), and what to change when they do not fit.

``ActivationPools`` allocates both pools once, at construction (pinned memory is never
taken on the fly), and turns a full pool into an error that names the setting to raise.
Which activation takes which block, and when, is the offloader's (``offloader.py``).

Note [a reload can find the free bytes split]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The device pool is never compacted while a backward runs (Note [no compaction inside
backward] in memory/moves.py), and a reloaded tensor's view pins its block anyway (Note
[views pin unregistered blocks] in memory/pool.py). When saved tensors of different sizes
die in an order other than the one they were reloaded in (``offload_activations``, where
each saved tensor is its own group), a demand reload can find enough free bytes split
between live blocks, none large enough, and fail. Sizing the pool to what is live at once
does not prevent it; one size does: the device sizes (bytes plus pointer slack, rounded to
the pool's alignment) of every activation packed since the device pool was last empty
after a backward.
A best-fit request takes from the pool's free tail only when no other range holds it, and
takes exactly its size from the tail's start, while frees only lengthen the tail; so a
pool holding the sum of every request of a backward always has a tail that holds the next
one. ``packed_device_bytes`` keeps that sum, and the error names it.
"""

from __future__ import annotations

import functools
import gc
from collections.abc import Callable

import torch

from ..accelerator import Stream
from ..config import format_bytes
from ..errors import Attempts, DeviceBudgetExceeded, PoolExhausted
from ..memory.block import Block
from ..memory.manager import Tier, TieredMemoryManager
from ..memory.pool import BlockPool
from .config import ActivationOffloadConfig
from .layout import LAYOUT_ALIGN
from .record import OffloadedActivation

__all__ = ["ActivationPools"]


class ActivationPools:
    """The host pool offloaded activations are copied to and the device pool they are
    reloaded into, built through ``manager`` at ``config``'s sizes.

    The allocations take ``run_deferred``, which runs the frees that finalizers handed over
    (Note [finalizers only enqueue] in ``release.py``): a full pool tries it before giving
    up. It is passed with each call, never kept: the offloader's finalizer holds these pools,
    and a kept bound method of the offloader would hold the offloader in a cycle (Note [an
    offloader released without close] in ``release.py``).

    Fields: ``host``: ``BlockPool``, host (pinned where available), ``config.host_pool_bytes``.
    ``device``: ``BlockPool``, device, ``config.device_pool_bytes``.
    ``packed_device_bytes``: bytes, the device block sizes of the activations packed since
    the device pool was last empty at the first pack after a reload (Note [a reload can
    find the free bytes split]); read for the device pool's error message.
    """

    def __init__(self, manager: TieredMemoryManager, config: ActivationOffloadConfig) -> None:
        self.config = config
        self.packed_device_bytes = 0  # see the class docstring
        self._reloaded = False  # whether a reload took a device block since the last reset
        self.host: BlockPool = manager.create_pool(
            Tier.HOST, config.host_pool_bytes, name="activations.host"
        )
        try:
            self.device: BlockPool = manager.create_pool(
                Tier.DEVICE, config.device_pool_bytes, name="activations.device"
            )
        except DeviceBudgetExceeded as exc:
            self.host.close()
            raise DeviceBudgetExceeded(
                f"{exc}\nThe activation offloader's device pool is "
                f"ActivationOffloadConfig.device_pool_bytes (now {config.device_pool_bytes!r}, "
                "256 MiB by default): size it to what the backward reloads at once, about "
                "(prefetch_depth + 1) x one layer's saved activations (zero-offload estimate "
                "prints that row), e.g. ActivationOffloader(manager=..., config="
                "ActivationOffloadConfig(device_pool_bytes='64MiB'))"
            ) from exc
        except BaseException:
            self.host.close()
            raise

    def check_fits(self, tensor: torch.Tensor, nbytes: int) -> None:
        """Refuse ``tensor`` (``nbytes`` spanned) when either pool could never hold it."""
        # the device block has room to restore the pointer's alignment (Note [saved layout
        # comes back]); nbytes is the span's, more than numel's for a view with gaps
        for field, pool, need in (
            ("host_pool_bytes", self.host, nbytes),
            ("device_pool_bytes", self.device, nbytes + tensor.data_ptr() % LAYOUT_ALIGN),
        ):
            if need > pool.usable:
                raise PoolExhausted(
                    f"a saved activation of shape {tuple(tensor.shape)} and strides "
                    f"{tuple(tensor.stride())} ({tensor.dtype}, {format_bytes(nbytes)}, {nbytes} "
                    f"bytes spanned) cannot fit the activation pool {pool.name!r} of "
                    f"{pool.usable} usable bytes. Raise ActivationOffloadConfig.{field} to at "
                    f"least {need} bytes (more to hold several), or raise min_bytes above "
                    f"{tensor.numel() * tensor.element_size()} to keep such tensors on the device."
                )

    def alloc_host(
        self, nbytes: int, group: int, *, device_nbytes: int, run_deferred: Callable[[], None]
    ) -> Block:
        """A host block for a copy out of ``nbytes`` of activation group ``group``, whose
        reload will take a device block for ``device_nbytes``."""
        block = self._alloc_host(nbytes, group, run_deferred=run_deferred)
        # Note [a reload can find the free bytes split]
        if self._reloaded and self.device.stats()["live_blocks"] == 0:
            self.packed_device_bytes = 0  # the first pack after a backward emptied the pool
            self._reloaded = False
        align = self.device.alignment
        self.packed_device_bytes += -(-device_nbytes // align) * align
        return block

    def _alloc_host(self, nbytes: int, group: int, *, run_deferred: Callable[[], None]) -> Block:
        owner = f"activation group {group}"
        try:
            return self.host.alloc(nbytes, owner=owner)
        except PoolExhausted:
            # Only when the pool is full, on the forward path: frees handed over since the
            # last reap, and the youngest generation's garbage (a graph dropped in a reference
            # cycle this step). Never a full collection here: it would walk every object of
            # the process in the middle of forward.
            run_deferred()
            gc.collect(0)
        try:
            return self.host.alloc(nbytes, owner=owner)
        except PoolExhausted as exc:
            held = self.host.stats()
            raise PoolExhausted(
                f"the host pool for offloaded activations is full: cannot hold another "
                f"{format_bytes(nbytes)} ({nbytes} bytes) with {held['bytes_in_use']} bytes held "
                f"by {held['live_blocks']} activations not yet used by backward. Raise "
                f"ActivationOffloadConfig.host_pool_bytes (now {self.config.host_pool_bytes}) to "
                f"the offloaded bytes of one forward pass (of all forwards before a backward, "
                f"when accumulating gradients), or raise min_bytes to offload less. If graphs "
                f"of earlier steps are kept alive by reference cycles (an output stored on a "
                f"module that holds it), break the cycle or call gc.collect() between steps."
            ) from exc

    def alloc_device(
        self,
        record: OffloadedActivation,
        *,
        stream: Stream,
        demand: bool,
        run_deferred: Callable[[], None],
    ) -> Block | None:
        """A device block to reload ``record`` into, first used by ``stream``; None when a
        prefetch (``demand=False``) finds the pool full."""
        owner = f"activation group {record.group}"
        # Note [reloads never block the CPU] (offloader.py): a prefetch never waits
        alloc = functools.partial(self.device.alloc, owner=owner, stream=stream, wait=demand)
        try:
            nbytes = record.nbytes + record.ptr_mod  # Note [saved layout comes back] (layout.py)
            try:
                block = alloc(nbytes)
            except PoolExhausted:
                run_deferred()  # frees handed over by finalizers since the last reap
                block = alloc(nbytes)
        except PoolExhausted as exc:
            if not demand:
                return None
            raise PoolExhausted(self._device_message(record, nbytes)) from exc
        self._reloaded = True
        return block

    def _device_message(self, record: OffloadedActivation, nbytes: int) -> str:
        held = self.device.stats()
        align = self.device.alignment
        size = -(-nbytes // align) * align
        config = self.config
        # Note [a reload can find the free bytes split]: this size cannot split a reload
        works = max(self.packed_device_bytes, held["bytes_in_use"] + size)
        fix = (
            f"Raise ActivationOffloadConfig.device_pool_bytes (now {config.device_pool_bytes}) "
            f"to {works} bytes ({format_bytes(works)}): the device sizes of every activation "
            f"offloaded since the pool was last empty, a size no order of reloads can split "
            f"(Note [a reload can find the free bytes split] in activations/pools.py). Less "
            f"may do: the pool held at most {held['peak_bytes_in_use']} bytes at once so far. "
            f"For checkpointed layers, ActivationOffloadConfig.for_checkpoints(checkpoint_bytes, "
            f"layers) sizes it. Or lower prefetch_depth (now {config.prefetch_depth}), or raise "
            f"min_bytes to offload fewer tensors."
        )
        if held["bytes_free"] >= size:
            return (
                f"the device pool for reloaded activations cannot reload {record!r} "
                f"({nbytes} bytes, {size} rounded): {held['bytes_free']} bytes are free, "
                f"enough, but split in {held['free_blocks']} ranges, the largest "
                f"{held['largest_free_block']} bytes, between {held['live_blocks']} "
                f"reloaded activations still alive ({held['bytes_in_use']} bytes); the pool "
                f"is not compacted while a backward runs (autograd may hold views of those "
                f"blocks: Note [no compaction inside backward] in memory/moves.py). {fix}"
            )
        return (
            f"the device pool for reloaded activations is full: cannot reload {record!r} "
            f"({nbytes} bytes, {size} rounded) with {held['bytes_in_use']} bytes held by "
            f"{held['live_blocks']} reloaded activations still alive and "
            f"{held['bytes_free']} bytes free (largest free block "
            f"{held['largest_free_block']}). The pool must hold the tensors autograd still "
            f"holds plus prefetch_depth + 1 = {config.prefetch_depth + 1} groups' saved "
            f"tensors (a group is one checkpoint call's inputs, or one saved tensor under "
            f"offload_activations). {fix}"
        )

    def reset_peak(self) -> None:
        """Start both pools' peaks afresh from current use."""
        self.device.reset_peak()
        self.host.reset_peak()

    def close(self) -> None:
        """Give both pools back; every block must have been freed."""
        self.device.close()
        self.host.close()

    def discard(self) -> None:
        """Free every block still live and give both pools back, once the copies touching
        them end (the pools wait for them); for an offloader nobody can use any more."""
        attempt = Attempts()
        for pool in (self.device, self.host):
            for block in pool.live_blocks():
                attempt(block.free)
            attempt(pool.close)
        attempt.raise_first()
