"""ActivationOffloader: when activations are copied out and back, and what each copy holds.

The copies themselves are ``copies.py``; its two pools and what to do when they are full,
``pools.py``; the device tensors held for their copies out, ``outgoing.py``; which groups
are loaded ahead of recomputation, the prefetch queue, ``prefetch.py`` (Note [reuse
order]); its counters, ``stats.py``; what finalizers hand it and what it gives back when it
goes, ``release.py``; the checks on its arguments, ``arguments.py``; the process-wide
offloader, ``default.py``.

Note [activation lifecycle]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
A saved tensor chosen for offload (``policy.is_offloadable``) becomes an
``OffloadedActivation`` record; autograd keeps only a ``SavedActivation`` handle to it.

- pack (forward): a host pool block is taken (never pinned on the fly: the pool was pinned
  once, at construction) and the copy out is queued on the manager's ``d2h`` stream after
  the compute that produced the tensor. The device tensor stays referenced in ``_outgoing``
  until that copy's end event completes; then it is dropped and its memory returns to the
  allocator. Completion is polled at every pack and unpack; when more than
  ``max_offloads_in_flight`` copies are pending, compute waits for the oldest. The record
  is ON_HOST only once the host saw the copy end (LANDING until then, ``record.py``).
- unpack (backward): the record's group (one checkpoint call, or one saved tensor) is loaded
  into device pool blocks on the ``h2d`` stream, each copy after that record's copy out; then
  the ``prefetch_depth`` nearest groups saved before it are loaded too, so the next
  recomputation finds its inputs on the device. Compute waits only for the record's own
  copy back (the wait is counted as exposed time by the manager). The CPU never waits in
  backward: see Note [reloads never block the CPU].
- autograd dropping the handle (after the backward that used it, or with the graph) frees
  the host block; the pool reuses it only after its pending copies end (Note [block reuse
  waits on events] in ``memory/pool.py``).

Note [reloads never block the CPU]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A device block freed by a dead reloaded tensor carries a compute event that, on a GPU, is
pending long after the CPU moved on. Reloads allocate with ``stream=h2d`` (the stream that
fills the block first), so such bytes are reused stream-ordered: ``h2d`` waits for the
event, the CPU does not (Note [block reuse waits on events] in memory/pending_blocks.py).
A prefetch allocates with ``wait=False``: when nothing fits without a host wait it is
skipped (``prefetch_skipped``) and the tensor comes as a demand load when backward needs
it; only a demand load may wait on the host, as the pool's last resort.

Note [holding, not record_stream]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Every buffer travels with the event that keeps it alive: the saved tensor a copy out reads
is held in ``_outgoing`` until its end event completes or compute waited for it (then
its memory goes back to the caching allocator on the compute stream, ordered after the
copy); a reloaded tensor's block is freed with a compute event. So the copies pass
``held=True`` and the CUDA accelerator never calls ``record_stream`` for them: doing both
delays frees for nothing, and ``record_stream`` on a view of a pool buffer asserts under
``PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync``, whose allocator knows only the
pointers it returned (Note [library storages by address range] in accelerator/cuda.py).
"""

from __future__ import annotations

import functools
import gc
import queue
import threading
import weakref
from dataclasses import asdict

import torch

from ..accelerator import Accelerator
from ..memory.block import Block
from ..memory.manager import TieredMemoryManager
from ..memory.pool import BlockPool
from ..memory.traffic import Category
from ..tracing import phase
from .arguments import check_arguments
from .config import ActivationOffloadConfig
from .copies import copy_back, copy_out
from .layout import LAYOUT_ALIGN, span_of
from .outgoing import OutgoingCopies
from .pools import ActivationPools
from .prefetch import PrefetchGroups
from .record import ActivationState, OffloadedActivation, SavedActivation
from .release import Deferred, DeviceBlockFreed, hand_over, release
from .stats import OffloaderStats

__all__ = ["LAYOUT_ALIGN", "ActivationOffloader"]


class ActivationOffloader:
    """Moves saved activations to a host pool and back; shared by ``checkpoint`` and
    ``offload_activations``.

    Pass ``manager=`` to share a ``TieredMemoryManager`` (and its copy streams and traffic
    counters) with an ``OffloadAdamW`` (``opt.manager``); otherwise one is built for
    ``accelerator`` (default ``get_accelerator()``). The host and device pools are
    allocated here, once, at the sizes in ``config``. See Note [activation lifecycle].
    ``close()`` gives them back; so does dropping the offloader, or closing (or dropping)
    the optimizer whose manager it shares (Note [an offloader released without close] in
    ``release.py``).

    Device activation bytes (``stats()["device_bytes"]``, ``["device_bytes_peak"]``) count
    what the offloader holds on the device: saved tensors whose copy out is pending, and
    reloaded activations still alive. Tensors it keeps referenced are the only ones it can
    release; a saved tensor the caller also holds stays allocated regardless.
    """

    def __init__(
        self,
        *,
        manager: TieredMemoryManager | None = None,
        config: ActivationOffloadConfig | None = None,
        accelerator: Accelerator | None = None,
    ) -> None:
        config = check_arguments(manager=manager, config=config, accelerator=accelerator)
        owned = manager is None
        if manager is None:
            manager = TieredMemoryManager(accelerator)
        self.config = config
        self.manager = manager
        self.accelerator = manager.accelerator
        self.device = self.accelerator.device
        # Note [finalizers only enqueue] (release.py): what finalizers handed over, run by _reap.
        self._deferred: queue.SimpleQueue[Deferred] = queue.SimpleQueue()
        try:
            self.pools = ActivationPools(manager, config)
        except BaseException:
            if owned:
                manager.close()
            raise
        self._lock = threading.Lock()  # guards everything below and every record's fields
        self._groups = PrefetchGroups()  # the prefetch queue (its new_group needs no lock)
        self._outgoing = OutgoingCopies()  # Note [holding, not record_stream]
        self._stats = OffloaderStats()
        # Note [an offloader released without close] (release.py): nothing here references self.
        self._finalizer = weakref.finalize(
            self,
            release,
            self.pools,
            outgoing=self._outgoing,
            groups=self._groups,
            deferred=self._deferred,
            manager=manager if owned else None,
        )
        if not owned:
            manager.close_with(self._finalizer)  # Note [a manager's close ends its borrowers]

    def __repr__(self) -> str:
        return f"ActivationOffloader(device={self.device}, config={self.config})"

    @property
    def host_pool(self) -> BlockPool:
        """The host pool offloaded activations are copied to (``ActivationPools.host``)."""
        return self.pools.host

    @property
    def device_pool(self) -> BlockPool:
        """The device pool activations are reloaded into (``ActivationPools.device``)."""
        return self.pools.device

    # -- public ------------------------------------------------------------------------

    def new_group(self) -> int:
        """A fresh prefetch group id (one per checkpoint call); ids grow in forward order."""
        return self._groups.new_group()

    def pack(self, tensor: torch.Tensor, *, group: int) -> SavedActivation:
        """Start copying ``tensor`` to the host; the handle stands in for it in autograd.

        The caller has decided ``tensor`` should be offloaded (``policy.is_offloadable``).
        """
        self._check_open("pack")
        span = span_of(tensor)  # Note [saved layout comes back] in layout.py
        nbytes = span * tensor.element_size()
        ptr_mod = tensor.data_ptr() % LAYOUT_ALIGN
        self.pools.check_fits(tensor, nbytes)
        # The copy runs on another thread (host accelerator), outside this grad mode.
        source = tensor.detach().as_strided((span,), (1,))  # the span, over the same storage
        with phase("act_offload", track="copy"):
            self._reap()
            self._bound_outgoing()
            host_block = self.pools.alloc_host(
                nbytes, group, device_nbytes=nbytes + ptr_mod, run_deferred=self._run_deferred
            )
            host_view = host_block.view(tensor.dtype, (span,))
            end = copy_out(self.manager, host_view, source, host_block=host_block, group=group)
            record = OffloadedActivation(
                group=group,
                dtype=tensor.dtype,
                shape=tuple(tensor.shape),
                stride=tuple(tensor.stride()),
                ptr_mod=ptr_mod,
                nbytes=nbytes,
                host_block=host_block,
                host_view=host_view,
                out_event=end,
            )
            with self._lock:
                self._outgoing.add(record, source, end)
                self._groups.add(record)
                self._stats.add_device_bytes(nbytes)
                self._stats.offloaded_tensors += 1
                self._stats.offloaded_bytes += nbytes
        handle = SavedActivation(record)
        weakref.finalize(handle, self._deferred.put, record)  # Note [finalizers only enqueue]
        return handle

    def unpack(self, handle: SavedActivation) -> torch.Tensor:
        """The activation back on the device; prefetches the next groups backward needs."""
        self._check_open("unpack")
        record = handle.record
        with phase("act_prefetch", track="copy"):
            self._reap()
            with self._lock:
                hit = record.state is ActivationState.MOVING_IN
                members = self._groups.members(record)
                if hit:
                    self._stats.prefetch_hits += 1
                else:
                    self._stats.demand_loads += 1
            if not hit:
                for member in members:
                    self._load(member, demand=True)
            self._prefetch_before(record.group)
        in_event = record.in_event
        if in_event is None:
            raise RuntimeError(f"{record!r} has no copy back after loading it (bug)")
        self.manager.wait_for([in_event], category=Category.ACTIVATIONS)
        return self._take(record)

    def stats(self) -> dict[str, int | float]:
        """Counters (see ``OffloaderStats``), pool occupancy and exposed wait, bytes and seconds.

        First lets go of what has finished (never blocks): the frees finalizers handed over
        and the device tensors whose copy out completed, so a graph dropped without
        backward shows, and gives back, no device memory once its copies ended.
        """
        self._reap()
        with self._lock:
            stats: dict[str, int | float] = dict(asdict(self._stats))
            stats["pending_offloads"] = len(self._outgoing)
        device = self.device_pool.stats()
        host = self.host_pool.stats()
        stats["device_pool_peak_bytes"] = device["peak_bytes_in_use"]
        stats["device_pool_fragmentation"] = device["fragmentation"]
        stats["host_pool_bytes_in_use"] = host["bytes_in_use"]
        stats["host_pool_peak_bytes"] = host["peak_bytes_in_use"]
        stats["exposed_seconds"] = self.manager.exposed_seconds.get(Category.ACTIVATIONS, 0.0)
        return stats

    def reset_peak(self) -> None:
        """Start ``device_bytes_peak`` and the pools' peaks afresh from current use."""
        with self._lock:
            self._stats.reset_peak()
        self.pools.reset_peak()

    def synchronize(self) -> None:
        """Wait for every pending copy out and release the device tensors they held.

        Synchronisation point: blocks the caller until the ``d2h`` stream is idle.
        """
        self._check_open("synchronize")
        self.manager.d2h.synchronize()
        self._reap()

    def close(self) -> None:
        """Give both pools back (device pool: to the budget), and stop the manager's threads
        when the offloader built it; every activation must have been dropped by autograd.
        Optional: a dropped offloader is released the same way, and closing the optimizer
        whose manager it shares closes it too (Note [an offloader released without close]
        in ``release.py``). Calling ``close`` again does nothing."""
        if not self._finalizer.alive:
            return
        self.synchronize()
        self.manager.h2d.synchronize()
        gc.collect()  # hidden cost: collects graphs kept alive only by reference cycles
        self._run_deferred()
        self.pools.close()  # raises, releasing nothing, while an activation is still held
        self._finalizer()

    @property
    def closed(self) -> bool:
        """Whether the offloader was closed: by ``close()``, or with its shared manager."""
        return not self._finalizer.alive

    def _check_open(self, what: str) -> None:
        if not self._finalizer.alive:
            raise RuntimeError(
                f"ActivationOffloader.{what}() after close: its pools are given back (by "
                "close(), or by closing the optimizer whose manager it shares); build a new "
                "ActivationOffloader"
            )

    # -- copies out --------------------------------------------------------------------

    def _run_deferred(self) -> None:
        while True:
            try:
                item = self._deferred.get_nowait()
            except queue.Empty:
                return
            if not self._finalizer.alive:
                continue  # released: every block went back with the pools
            if isinstance(item, DeviceBlockFreed):
                self._free_device_block(item.block, item.nbytes)
            else:
                self._drop(item)

    def _reap(self) -> None:
        """Run deferred frees, and drop the device tensors whose copy out has completed
        (never blocks)."""
        self._run_deferred()
        with self._lock:
            released = self._outgoing.release_completed()
            self._stats.count_released(released)
        del released  # the device memory returns to the allocator here, outside the lock

    def _bound_outgoing(self) -> None:
        limit = self.config.max_offloads_in_flight
        while True:
            with self._lock:
                if len(self._outgoing) <= limit:
                    return
                record, event = self._outgoing.oldest()
                self._stats.forward_waits += 1
            # Synchronisation point: compute waits for the oldest copy out, bounding the device
            # memory held by outgoing activations (on CUDA the GPU waits, not the caller;
            # dropping the tensor then is safe, its memory is reused only by later compute).
            self.manager.wait_for([event], category=Category.ACTIVATIONS)
            self._release_through(record)

    def _release_through(self, record: OffloadedActivation) -> None:
        """Drop the outgoing tensors up to ``record``'s, after compute waited for its copy."""
        with self._lock:
            released = self._outgoing.release_through(record)
            self._stats.count_released(released)
        del released

    # -- copies back -------------------------------------------------------------------

    def _load(self, record: OffloadedActivation, *, demand: bool) -> bool:
        """Issue ``record``'s copy back; False when a prefetch found the device pool full."""
        with self._lock:
            state = record.state
        if state is ActivationState.MOVING_OUT:
            # Synchronisation point (only for the last activations of a forward): release
            # the outgoing device tensor before taking a device block for the same bytes,
            # so both are never counted at once. The copy back must follow it anyway.
            self.manager.wait_for([record.out_event], category=Category.ACTIVATIONS)
            self._release_through(record)
        elif state not in (ActivationState.ON_HOST, ActivationState.LANDING):
            return True  # MOVING_IN already; FREED cannot be unpacked
        # Note [reloads never block the CPU]: h2d fills the block first
        block = self.pools.alloc_device(
            record, stream=self.manager.h2d, demand=demand, run_deferred=self._run_deferred
        )
        with self._lock:
            if block is None:
                self._stats.prefetch_skipped += 1
                return False
            self._stats.add_device_bytes(record.nbytes)
        device_tensor, end = copy_back(
            self.manager,
            record,
            block,
            # Note [finalizers only enqueue]; Note [an offloader released without close]
            functools.partial(
                hand_over, weakref.ref(self._deferred), DeviceBlockFreed(block, record.nbytes)
            ),
        )
        with self._lock:
            record.device_tensor = device_tensor
            record.in_event = end
            record.state = ActivationState.MOVING_IN
            self._stats.reloads += 1
        return True

    def _prefetch_before(self, group: int) -> None:
        depth = self.config.prefetch_depth
        if depth == 0:
            return
        with self._lock:
            targets = self._groups.before(group, depth)
        for record in targets:
            if not self._load(record, demand=False):
                return

    def _take(self, record: OffloadedActivation) -> torch.Tensor:
        """Hand the reloaded tensor to autograd; the record goes back to ON_HOST (or
        LANDING, until the host sees its copy out end)."""
        with self._lock:
            tensor = record.device_tensor
            if record.state is not ActivationState.MOVING_IN or tensor is None:
                raise RuntimeError(f"unpacking {record!r}, which was not reloaded (bug)")
            record.device_tensor = None
            record.in_event = None
            self._outgoing.settle(record)
            self._groups.forget(record)
        return tensor

    # -- blocks ------------------------------------------------------------------------

    def _free_device_block(self, block: Block, nbytes: int) -> None:
        # See Note [device blocks live as long as their storage] (layout.py); runs on the
        # thread that dropped the storage's last reference.
        block.record_event(self.manager.compute_ready())
        block.free()
        with self._lock:
            self._stats.device_bytes -= nbytes

    def _drop(self, record: OffloadedActivation) -> None:
        """Autograd dropped ``record``'s handle: free its blocks (finalizer; any thread)."""
        with self._lock:
            self._groups.forget(record)
            record.state = ActivationState.FREED
            device_tensor, record.device_tensor = record.device_tensor, None
        record.host_block.free()  # reused only after its copies end (pool Note)
        del device_tensor  # a prefetched, never used block returns via its storage finalizer
