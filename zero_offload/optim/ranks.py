"""What the optimizer asks of its ranks: one interface, a no-op for one rank.

``SingleRank`` is the whole optimizer on one process: every collective is the identity and
buckets may go to the host in any order. ``ShardedRanks`` partitions buckets over a process
group (ZeRO stage 2 with offload, Note [who owns which shard] in ``partition.py``):
gradients are reduce-scattered on the comm stream in one fixed order (Note [ranks in
lockstep] in ``grads/order.py``), the statistics are all-reduced, and the updated shards are
all-gathered. Code above asks neither which one it has nor how many ranks there are.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..accelerator import Accelerator, Event, Stream
from ..accelerator.host_syncs import synchronize_completed
from ..collectives import (
    Comm,
    Pending,
    all_gather_bytes,
    all_gather_flat,
    all_reduce_stats,
    make_comm,
    reduce_scatter_avg,
    wait_all,
)
from ..memory.host_ram import HostShare, host_identity, host_ram, local_processes
from ..memory.manager import TieredMemoryManager
from ..memory.traffic import Category
from ..tracing import phase

__all__ = [
    "Ranks",
    "ShardedParamRanks",
    "ShardedRanks",
    "SingleRank",
    "optimizer_comm",
    "share_host",
]


# Note [a process group of the optimizer's own]
# The reduce-scatters run on the comm stream, a background thread, while backward goes on;
# the all-gathers and the statistics' all-reduce run in step(). User code may call
# collectives of its own meanwhile on the main thread (Lightning broadcasts a SIGTERM flag
# every batch, a loop all-reduces its loss): on one group, collectives match by the order
# each rank issues them, and the two threads interleave differently on different ranks, so
# a user's broadcast would be matched with the optimizer's reduce-scatter and training
# hangs or reduces garbage. So with several ranks and no ``process_group=``, the optimizer
# makes a group of its own over the same ranks and backend at construction
# (``torch.distributed.new_group``: a collective every rank calls, as they all construct
# the optimizer in the same order); nothing else issues collectives on it. A group passed
# as ``process_group=`` is used as given: the caller then keeps other collectives off it
# while the optimizer runs. Each optimizer makes its own (two optimizers' comm threads on
# one group would interleave the same way). A group the optimizer made is destroyed when it
# is closed or collected (``Ranks.close``); when the loop already tore torch.distributed
# down (``destroy_process_group()`` releases every group), there is nothing left to do.


def optimizer_comm(process_group: Any, *, timeout: float) -> Comm | None:
    """The ``Comm`` the optimizer runs its collectives on: ``process_group`` as given, else
    (torch.distributed initialised with several ranks) a new group of the default group's
    ranks; None with one rank. See Note [a process group of the optimizer's own]."""
    if process_group is None and dist.is_available() and dist.is_initialized():
        world = dist.get_world_size()
        if world > 1:
            process_group = dist.new_group(ranks=list(range(world)), backend=dist.get_backend())
    return make_comm(process_group, timeout=timeout)


def share_host(comm: Comm | None) -> HostShare | None:
    """How many of ``comm``'s ranks draw on this process's host RAM (or the launcher's
    count of processes on this node, where larger), and the most RAM any of them sees
    available: one all-gather of 24 bytes per rank (Note [ranks that share a host's RAM] in
    ``memory/host_ram.py``); None for one process. A collective: every rank of the optimizer
    calls it at each build, before anything is allocated."""
    local = local_processes()
    if comm is None:
        return None if local == 1 else HostShare(ranks=local, available=host_ram().available)
    key = hashlib.blake2b(host_identity().encode(), digest_size=16).digest()
    mine = key + host_ram().available.to_bytes(8, "little")
    every = all_gather_bytes(
        mine,
        comm=comm,
        what="which ranks share a host's RAM (Note [ranks that share a host's RAM])",
        advice=(
            "Every rank must construct the optimizer (and call add_param_group) alike, at "
            "the same point of the program; a rank whose construction raised says why in "
            "its log."
        ),
        length=len(mine),
    )
    same = [int.from_bytes(b[16:], "little") for b in every if b[:16] == key]
    return HostShare(ranks=max(len(same), local), available=max(same))


class Ranks(ABC):
    """The ranks one optimizer partitions over."""

    rank: int
    world_size: int

    @property
    def comm(self) -> Comm | None:
        """The process group's ``Comm`` (``None`` with one rank)."""
        return None

    def param_gathers(self) -> tuple[Comm, Stream] | None:
        """The group and stream the parameter all-gathers of ZeRO-3 run on (Note
        [parameter gathers on a group and stream of their own]); None without them."""
        return None

    @property
    def scatter_stream(self) -> Stream | None:
        """The stream the gradients are reduce-scattered on; None with one rank."""
        return None

    def after_scatters(self) -> None:
        """The caller's thread is about to issue a collective on ``comm``: Note [caller
        collectives follow the reduce-scatters] (nothing to wait for with one rank)."""
        return None

    #: Whether the ranks' collectives must match, so buckets go to the host in one order on
    #: every rank (``bucket_order`` in ``grads/order.py``; Note [ranks in lockstep]).
    lockstep = False

    def agree_late(self, flags: torch.Tensor) -> torch.Tensor:
        """OR the (n_buckets,) float64 ``flags`` over the ranks (only where ``lockstep``)."""
        raise RuntimeError(f"{type(self).__name__} has no ranks to agree with (bug)")

    @abstractmethod
    def eager_refusal(self) -> str | None:
        """Why a step cannot run during backward with these ranks, or None (Note
        [stepping during backward] in ``update/eager.py``)."""

    @abstractmethod
    def gather_weights(
        self,
        manager: TieredMemoryManager,
        weights: torch.Tensor,
        published: list[Event],
        *,
        what: str,
    ) -> tuple[list[Event], Pending | None]:
        """This rank's updated shard of ``weights`` reaches ``weights_dev`` with the copies
        ``published``: returns the events compute must still wait for and the issued
        all-gather of every rank's shard (None with one rank)."""

    def where(self) -> str:
        """The prefix of a multi-rank error (``"rank 1/3: "``), empty with one rank."""
        return ""

    def close(self) -> None:
        """Release what the ranks hold (the optimizer's own process group); idempotent."""
        return None

    @abstractmethod
    def reduce_scatter(self, grad: torch.Tensor, ready: Event, *, what: str) -> Event:
        """Queue the mean of ``grad`` over the ranks (after ``ready``); the returned event
        marks when this rank's shard of ``grad`` holds it."""

    @abstractmethod
    def all_reduce_stats(
        self, sumsq: float, nonfinite: bool, arrived: torch.Tensor
    ) -> tuple[float, bool, torch.Tensor]:
        """Sum ``sumsq``, OR ``nonfinite`` and OR the per-parameter ``arrived`` flags (a
        bool tensor) over the ranks, so every rank clips, skips and counts steps alike."""

    @abstractmethod
    def all_gather(self, weights: torch.Tensor, *, what: str) -> Pending | None:
        """Issue the all-gather of every rank's updated shard of ``weights``."""

    @abstractmethod
    def wait(self, pending: Sequence[Pending]) -> None:
        """Wait for issued all-gathers (with the collective deadline)."""


class SingleRank(Ranks):
    """One process: the collectives are the identity."""

    rank = 0
    world_size = 1

    def eager_refusal(self) -> str | None:
        return None

    def gather_weights(
        self,
        manager: TieredMemoryManager,
        weights: torch.Tensor,
        published: list[Event],
        *,
        what: str,
    ) -> tuple[list[Event], Pending | None]:
        return published, None

    def reduce_scatter(self, grad: torch.Tensor, ready: Event, *, what: str) -> Event:
        return ready

    def all_reduce_stats(
        self, sumsq: float, nonfinite: bool, arrived: torch.Tensor
    ) -> tuple[float, bool, torch.Tensor]:
        return sumsq, nonfinite, arrived

    def all_gather(self, weights: torch.Tensor, *, what: str) -> Pending | None:
        return None

    def wait(self, pending: Sequence[Pending]) -> None:
        return None


class ShardedRanks(Ranks):
    """Several ranks over ``comm``; reduce-scatters run on ``stream`` ("comm"), off the
    compute and copy streams, so they overlap backward."""

    def __init__(
        self, comm: Comm, stream: Stream, *, accelerator: Accelerator, owns_group: bool = False
    ) -> None:
        self._comm = comm
        # Whether ``optimizer_comm`` made the group for this optimizer (destroyed at close).
        self._owns_group = owns_group
        self.stream = stream
        self.rank = comm.rank
        self.world_size = comm.world_size
        self._accelerator = accelerator
        self._device = accelerator.device
        # The end of the last reduce-scatter queued on the comm stream, until the caller's
        # thread has issued a collective after it (Note [caller collectives follow the
        # reduce-scatters]).
        self._scattered: Event | None = None

    @property
    def comm(self) -> Comm:
        return self._comm

    @property
    def scatter_stream(self) -> Stream:
        return self.stream

    lockstep = True

    # Note [caller collectives follow the reduce-scatters]
    # The reduce-scatters are issued by the comm stream's thread, the step's all-gathers and
    # the statistics' all-reduce by the caller's; on one group collectives match by the
    # order each rank issues them, so a caller's collective must be issued after every
    # reduce-scatter queued before it, or the ranks pair a reduce-scatter with an
    # all-gather (gloo aborts on the size mismatch). A host pass over each landed tile
    # used to give that order by accident (the step waited for the host worker, whose
    # passes followed the reduce-scatters); the lone window's norms taken on the comm
    # stream (Note [a lone window's statistics are taken on the device] in
    # ``grads/lone_stats.py``) queue no such pass, and a close or a flush after a backward
    # without a step then issued its all-gathers first. So every collective this class
    # issues on the caller's thread, and a build's (``add_param_group``: ``after_scatters``
    # in optim/construction.py), first waits for the last reduce-scatter's event: a wait on
    # the host while it runs, nothing once it is done. Only where the comm stream runs its work on a thread of its own
    # (``Stream.deferred``: the host accelerator); CUDA's stream issues the reduce-scatter at
    # ``submit``, in program order.

    def after_scatters(self) -> None:
        last = self._scattered
        if last is None:
            return
        if not self.stream.deferred:  # issued at submit, in program order: nothing to wait for
            self._scattered = None
            return
        if last.query():
            synchronize_completed(last)  # done: nothing to wait for, the order is known
        else:
            # Synchronisation point: the caller's collective must be issued after it.
            with phase("wait_grads"):
                last.synchronize()
        if self._scattered is last:  # kept if the wait raised: a retry waits again
            self._scattered = None

    def agree_late(self, flags: torch.Tensor) -> torch.Tensor:
        """OR the (n_buckets,) float64 ``flags`` over the ranks: which buckets got a
        gradient after they went in this backward, on some rank (Note [a parameter's
        gradient may arrive several times] in ``grads/order.py``). The all-reduce runs on
        the comm stream, after the reduce-scatters issued before it, as collectives match
        by order. Synchronisation point: the host waits for the comm stream."""
        result: list[torch.Tensor] = []

        def run() -> None:
            result.append(
                all_reduce_stats(
                    flags,
                    comm=self._comm,
                    device=self._device,
                    what="which buckets got a gradient after they went, on some rank (Note [a "
                    "parameter's gradient may arrive several times] in grads/order.py)",
                )
            )

        self.stream.submit(run)
        self.stream.synchronize()
        return result[0] > 0

    def eager_refusal(self) -> str | None:
        return "several ranks (the all-gathers and arrival flags are collective)"

    def gather_weights(
        self,
        manager: TieredMemoryManager,
        weights: torch.Tensor,
        published: list[Event],
        *,
        what: str,
    ) -> tuple[list[Event], Pending | None]:
        # Synchronisation point (host accelerator): the collective reads weights_dev now.
        manager.wait_for(published, category=Category.WEIGHTS)
        self.after_scatters()
        return [], self.all_gather(weights, what=what)

    def where(self) -> str:
        return f"{self._comm.where()}: "

    def close(self) -> None:
        """Destroy the optimizer's own group (Note [a process group of the optimizer's
        own]); nothing when it was given, or when torch.distributed is torn down already."""
        owned, self._owns_group = self._owns_group, False
        if not owned or not (dist.is_available() and dist.is_initialized()):
            return
        # The group may be gone already (a loop that destroyed it, a failed backend): the
        # optimizer is closing either way.
        with contextlib.suppress(RuntimeError, ValueError):
            dist.destroy_process_group(self._comm.group)

    def reduce_scatter(self, grad: torch.Tensor, ready: Event, *, what: str) -> Event:
        comm = self._comm

        def run() -> None:
            with phase("reduce_scatter", track="comm"):
                reduce_scatter_avg(grad, comm=comm, what=what)

        self.stream.wait_event(ready)
        self._accelerator.declare_access(grad, stream=self.stream, write=True, what=what)
        self.stream.submit(run)
        self._scattered = self.stream.record_event()
        return self._scattered

    def all_reduce_stats(
        self, sumsq: float, nonfinite: bool, arrived: torch.Tensor
    ) -> tuple[float, bool, torch.Tensor]:
        # One float64 all-reduce carries the sum of squares, the overflow flag and the
        # arrival flags (Synchronisation point: read on the host).
        self.after_scatters()
        packed = torch.cat(
            [
                torch.tensor([sumsq, 1.0 if nonfinite else 0.0], dtype=torch.float64),
                arrived.to(torch.float64),
            ]
        )
        total = all_reduce_stats(packed, comm=self._comm, device=self._device)
        summed = float(total[0])
        # A NaN sum of squares is an overflow too.
        return summed, bool(total[1] > 0) or math.isnan(summed), total[2:] > 0

    def all_gather(self, weights: torch.Tensor, *, what: str) -> Pending | None:
        # The collective writes every rank's shard into the weights, ordered after the
        # work queued on the compute stream (NCCL's stream waits on it; gloo runs inline).
        acc = self._accelerator
        acc.declare_access(weights, stream=acc.current_stream(), write=True, what=what)
        return all_gather_flat(weights, comm=self._comm, what=what)

    def wait(self, pending: Sequence[Pending]) -> None:
        live = [p for p in pending if p is not None]
        if live:
            with phase("all_gather", track="comm"):
                wait_all(live, self._comm)


# Note [parameter gathers on a group and stream of their own]
# Under ZeRO-3 two sequences of collectives run during backward: the units' all-gathers, in
# the canonical order of Note [a sharded unit] (params/sharded_fetch.py), and the buckets'
# reduce-scatters, in the lockstep order of Note [ranks in lockstep] (grads/order.py). Each
# is the same on every rank, but how they interleave is not: a rank's prefetch issues a
# gather early where another's grad buffers made it issue a reduce-scatter first. On one
# group and one stream the two ranks would then wait on different collectives forever. So
# the gathers get a process group of their own (made at construction, by the group's
# members only) and a stream of their own ("gather"): each sequence matches on its own.


class ShardedParamRanks(ShardedRanks):
    """Several ranks with parameter offload (ZeRO-3 with offload): the step's updated shard
    stays in this rank's home and the next fetch of its unit all-gathers it (Note [a
    sharded unit] in ``params/sharded_fetch.py``), so the step gathers nothing. The
    gathers run on a group and a stream of their own (Note [parameter gathers on a group
    and stream of their own])."""

    def __init__(
        self, comm: Comm, stream: Stream, *, accelerator: Accelerator, owns_group: bool = False
    ) -> None:
        super().__init__(comm, stream, accelerator=accelerator, owns_group=owns_group)
        members = [
            r if comm.group is None else dist.get_global_rank(comm.group, r)
            for r in range(comm.world_size)
        ]
        # A collective of the group's members (every rank builds the optimizer). Over the
        # whole world, named by torch's global count like the optimizer's own group: a group
        # made with use_local_synchronization is named by its ranks and the number of live
        # groups, so the gather group of a second optimizer built after the first was
        # closed got the first one's name, met its stale rendezvous keys and hung.
        local = len(members) != dist.get_world_size()
        group = dist.new_group(
            ranks=members, backend=dist.get_backend(comm.group), use_local_synchronization=local
        )
        self._gather_comm = Comm(
            group=group,
            rank=comm.rank,
            world_size=comm.world_size,
            timeout=comm.timeout,
            counters=comm.counters,  # one count of the optimizer's traffic
        )
        self._gather_stream = accelerator.new_stream("gather")

    def param_gathers(self) -> tuple[Comm, Stream] | None:
        return self._gather_comm, self._gather_stream

    def gather_weights(
        self,
        manager: TieredMemoryManager,
        weights: torch.Tensor,
        published: list[Event],
        *,
        what: str,
    ) -> tuple[list[Event], Pending | None]:
        return published, None  # nothing was published: the home is the source

    def close(self) -> None:
        """Stop the gather stream (after its work) and destroy its group, then the rest."""
        try:
            self._gather_stream.close()
        finally:
            if dist.is_available() and dist.is_initialized():
                with contextlib.suppress(RuntimeError, ValueError):
                    dist.destroy_process_group(self._gather_comm.group)
            super().close()
