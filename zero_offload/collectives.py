"""Stateless collectives over torch.distributed, with deadlines and byte counts.

OffloadAdamW's multi-rank path uses four operations, each a plain function over flat
buckets (see Note [who owns which shard] in ``optim/flat_bucket.py``):

- ``reduce_scatter_avg``: average a bucket's gradients over the ranks, in place, so that
  each rank's own shard of the flat buffer holds the mean. ``dist.reduce_scatter_tensor``
  where the backend has it (NCCL; gloo in recent torch); otherwise the fallback is
  ``dist.all_reduce`` of the whole bucket (same result, twice the wire volume), taken
  when the backend raises that the operation is unsupported.
- ``all_gather_flat``: every rank's updated shard into every rank's flat weights, in
  place (``dist.all_gather_into_tensor``); asynchronous, waited with ``wait_all``.
- ``all_reduce_stats``: the sum of squares of the gradients and the overflow flag, summed
  over the ranks, so every rank clips by the same coefficient and skips the same steps
  (and any other small float64 vector the ranks must agree on, named by the caller).

Beside the step, two byte exchanges with the same deadlines: ``all_gather_bytes`` (what
the ranks compare at construction, Note [the ranks build alike] in
``optim/rank_agreement.py``) and ``gather_bytes`` (the shards of a consolidated
checkpoint, ``checkpoint_io.py``).

Note [collective deadlines]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
A rank that fails or never arrives must not hang the others forever. Every collective is
issued with ``async_op=True`` and its handle is waited with our own deadline
(``OffloadConfig.collective_timeout``): on CPU tensors (gloo) the caller waits at most that
long for a helper thread that calls ``work.wait()`` (gloo's ``work.wait(timeout=...)``
alone keeps waiting while the absent peer's process is alive); a timeout or a backend error (a peer's
socket closed) raises ``CollectiveError`` naming this rank, the collective and the bucket. On CUDA tensors
(NCCL) ``work.wait()`` only makes the current stream wait and returns at once; the
deadline there is the process group's own timeout, which callers should set to the same
value (``dist.init_process_group(timeout=...)``, as the demo does).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from .accelerator.host_syncs import LIBRARY_THREAD_PREFIX, count_sync
from .error_marks import CollectiveScope, caused_by, mark_surfaced, releasing_now
from .errors import CollectiveError, StreamError

__all__ = [
    "Comm",
    "CommCounters",
    "Pending",
    "all_gather_bytes",
    "all_gather_flat",
    "all_reduce_stats",
    "collective_device",
    "gather_bytes",
    "make_comm",
    "reduce_scatter_avg",
    "surface_collective_errors",
    "wait_all",
    "wait_work",
]


class CommCounters:
    """Collective calls and bytes per operation since construction.

    Bytes count the full flat buffer of each call (``padded_numel * itemsize``), the
    ZeRO paper's unit: a reduce-scatter plus an all-gather of a buffer of ``P`` bytes is
    ``2P``, the volume of one data-parallel all-reduce. ``_lock`` guards ``_counts``
    (collectives are issued from the caller's thread and from the comm stream).
    One per optimizer, shared by its comms (a ZeRO-3 optimizer's gather ``Comm`` takes its
    own ``Comm``'s), so it holds their failures' ``scope`` too: Note [a collective failure
    breaks its owner's collectives] in ``error_marks.py``.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, list[int]] = {}
        self.scope = CollectiveScope()  # whether a failure of these comms reached a caller

    def add(self, op: str, nbytes: int) -> None:
        """Count one call of ``op`` over ``nbytes``."""
        with self._lock:
            entry = self._counts.setdefault(op, [0, 0])
            entry[0] += 1
            entry[1] += nbytes

    def snapshot(self) -> dict[str, dict[str, int]]:
        """``{op: {"calls": n, "bytes": b}}`` for every operation seen."""
        with self._lock:
            return {op: {"calls": c, "bytes": b} for op, (c, b) in sorted(self._counts.items())}

    def bytes(self, op: str | None = None) -> int:
        """Bytes of ``op`` (or of all operations)."""
        with self._lock:
            return sum(b for name, (_, b) in self._counts.items() if op is None or name == op)


@dataclass(frozen=True)
class Comm:
    """Who this rank is in which group, and how long a collective may take."""

    group: Any  # a torch.distributed ProcessGroup, or None for the default group
    rank: int  # this process's rank in ``group``
    world_size: int  # ranks in ``group``, >= 2 (one rank needs no Comm)
    timeout: float  # seconds, see Note [collective deadlines]
    counters: CommCounters = field(default_factory=CommCounters, compare=False)

    def where(self) -> str:
        """``"rank 1/3"``, the prefix of every multi-rank error."""
        return f"rank {self.rank}/{self.world_size}"


def make_comm(process_group: Any, *, timeout: float) -> Comm | None:
    """The ``Comm`` for ``process_group`` (or the default group when torch.distributed is
    initialised); ``None`` when there is one rank only, so that case runs the
    single-process path unchanged."""
    if process_group is None and not (dist.is_available() and dist.is_initialized()):
        return None
    world_size = dist.get_world_size(process_group)
    if world_size == 1:
        return None
    return Comm(
        group=process_group,
        rank=dist.get_rank(process_group),
        world_size=world_size,
        timeout=timeout,
    )


def collective_device(comm: Comm) -> torch.device:
    """Where ``comm``'s group takes the tensors of a collective: the current GPU for NCCL,
    else the CPU (gloo)."""
    if "nccl" in str(dist.get_backend(comm.group)):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


#: What a timed-out collective of the step tells the user to check.
STEP_ADVICE = (
    "Every rank must run every backward and step (each bucket is reduced once per "
    "backward), or the ranks' collectives stop matching."
)


@dataclass(frozen=True)
class Pending:
    """An issued asynchronous collective, what to call it in errors, and what a rank that
    never arrives there has probably done wrong (``advice``)."""

    work: Any  # torch.distributed Work
    what: str
    on_cuda: bool
    advice: str = STEP_ADVICE


def wait_work(pending: Pending, comm: Comm) -> None:
    """Wait for one collective with the deadline; see Note [collective deadlines]."""
    if pending.on_cuda:
        pending.work.wait()  # stream-ordered: the current stream waits, the caller does not
        return
    # gloo's own work.wait(timeout=...) does not return while a peer is alive but absent,
    # its works have no future, and some (reduce_scatter) only progress inside wait(), so
    # is_completed() cannot be polled: a helper thread waits, the caller keeps the deadline.
    # Hidden cost: one short-lived thread per collective (tens of microseconds).
    done = threading.Event()
    failure: list[BaseException] = []

    def waiter() -> None:
        try:
            pending.work.wait()
        except BaseException as exc:  # handed to the caller below
            failure.append(exc)
        done.set()

    threading.Thread(
        target=waiter, name=f"{LIBRARY_THREAD_PREFIX}collective_wait", daemon=True
    ).start()
    if not done.wait(comm.timeout):
        error = CollectiveError(
            f"{comm.where()}: {pending.what} did not complete within {comm.timeout:g} s "
            f"(OffloadConfig.collective_timeout). {roll_call(comm, pending.what)} "
            f"{pending.advice} The process group is unusable now"
        )
        raise comm.counters.scope.tag(error)
    if failure:
        error = CollectiveError(
            f"{comm.where()}: {pending.what} failed: {failure[0]}. {roll_call(comm, pending.what)}"
        )
        raise comm.counters.scope.tag(error) from failure[0]


# Note [naming the absent rank]
# A collective that times out or loses a peer's socket knows only that *some* rank is
# missing. On such a failure each rank writes "waiting at <collective>" under its rank into
# the process group's rendezvous store and gives the others ROLL_CALL_SECONDS to do the
# same: the ranks that do not answer are the ones that died or never reached the
# collective, and the error names them. Nothing is written while training goes well. If
# the store itself is unreachable, it lived in the process of a rank (rank 0 under
# torchrun's default) or launcher that is gone, and the error says so. The store keeps
# keys for the job's life, so a rank's answer carries the wall time it was written, and
# only answers from this roll call's window count (within ROLL_CALL_FRESH seconds, which
# also allows for clocks that differ between nodes): the answer of a rank that failed at
# an earlier collective, caught by the loop, is not taken for a rank here now.

#: How long a failing rank waits for the others to report, seconds.
ROLL_CALL_SECONDS = 2.0
#: An answer older than this (by its writer's wall clock) is an earlier roll call's, seconds.
ROLL_CALL_FRESH = 30.0


def _answered(store: Any, key: str, now: float) -> bool:
    """Whether ``key`` holds an answer written in this roll call's window."""
    if not store.check([key]):
        return False
    stamp, _, _ = store.get(key).decode(errors="replace").partition(" ")
    try:
        return abs(now - float(stamp)) < ROLL_CALL_FRESH
    except ValueError:
        return False


def roll_call(comm: Comm, what: str, *, grace: float = ROLL_CALL_SECONDS) -> str:
    """A sentence naming the ranks that did not report within ``grace`` seconds; see Note
    [naming the absent rank]. Never raises."""
    try:
        store = dist.distributed_c10d._get_default_store()
        ranks = list(range(comm.world_size))
        ids = [r if comm.group is None else dist.get_global_rank(comm.group, r) for r in ranks]
        prefix = "zero_offload/roll_call/"
        store.set(f"{prefix}{ids[comm.rank]}", f"{time.time():.3f} {what}")
        deadline = time.monotonic() + grace
        missing = [r for r in ranks if r != comm.rank]
        while missing and time.monotonic() < deadline:
            now = time.time()
            missing = [r for r in missing if not _answered(store, f"{prefix}{ids[r]}", now)]
            if missing:
                time.sleep(0.05)
    except Exception as exc:  # the store is gone with the process that hosted it
        return (
            f"The rendezvous store is unreachable ({exc}): the process that hosted it "
            "(rank 0 or the launcher) probably died; see its log."
        )
    if not missing:
        return "Every rank reported waiting at a collective: they disagree on which one."
    names = ", ".join(str(r) for r in missing)
    return (
        f"Rank(s) {names} did not report within {grace:g} s: they died, or failed or hang "
        "before this collective; see their log."
    )


@contextmanager
def surface_collective_errors() -> Iterator[None]:
    """Re-raise a ``CollectiveError`` that reached the caller wrapped in ``StreamError``s
    (a collective that failed on the comm stream fails every stream waiting on it, Note
    [stream errors are sticky]) as itself, so the caller sees the rank and collective.
    What leaves here is marked for the releases after it, outside a release (Note [an
    error reaches the caller once])."""
    try:
        yield
    except StreamError as exc:
        if not releasing_now():
            mark_surfaced(exc)  # the failure's own causes: every later copy shares them
        cause: BaseException | None = exc
        while cause is not None and not isinstance(cause, CollectiveError):
            cause = cause.__cause__
        if cause is None:
            raise
        raise cause from exc
    except BaseException as exc:  # a CollectiveError, or an error raised from a StreamError
        failure = (StreamError, CollectiveError)
        if not releasing_now() and caused_by(exc, failure):
            mark_surfaced(exc)
        raise


def wait_all(pendings: list[Pending], comm: Comm) -> None:
    """Wait for each of ``pendings`` in order (each with the full deadline)."""
    for pending in pendings:
        wait_work(pending, comm)


# torch 2.13 renamed the tensor forms (reduce_scatter_tensor -> reduce_scatter_single,
# all_gather_into_tensor -> all_gather_single); older releases have the old names only.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _shard(flat: torch.Tensor, comm: Comm) -> torch.Tensor:
    n = flat.numel() // comm.world_size
    return flat[comm.rank * n : (comm.rank + 1) * n]


def _unsupported(exc: Exception) -> bool:
    text = str(exc).lower()
    return "not supported" in text or "unsupported" in text or "not implemented" in text


def reduce_scatter_avg(flat: torch.Tensor, *, comm: Comm, what: str) -> torch.Tensor:
    """Average ``flat`` over the ranks into this rank's shard of it, in place; returns the
    shard (``flat.numel() // world_size`` elements; the rest of ``flat`` is garbage).

    ``flat.numel()`` must be a multiple of the world size (buckets are padded so).
    Blocks until done (with the deadline) on CPU tensors; stream-ordered on CUDA.
    Each rank divides by the world size *before* the sum (gloo has no AVG reduction): in
    fp16 a sum of N finite gradients can overflow where their mean does not, which would
    make every rank skip steps a single process would take.
    """
    if flat.numel() % comm.world_size:
        raise RuntimeError(
            f"{comm.where()}: {what} has {flat.numel()} elements, not a multiple of the "
            f"world size {comm.world_size} (bug: buckets are padded so)"
        )
    shard = _shard(flat, comm)
    name = f"reduce_scatter of {what}"
    flat.div_(comm.world_size)
    try:
        # In place: the output is this rank's chunk of the input, which NCCL and gloo allow.
        work = _reduce_scatter(shard, flat, group=comm.group, async_op=True)
    except (RuntimeError, NotImplementedError) as exc:
        if not _unsupported(exc):
            raise
        work = dist.all_reduce(flat, group=comm.group, async_op=True)
        name = f"all_reduce (reduce_scatter fallback) of {what}"
    comm.counters.add("reduce_scatter", flat.numel() * flat.element_size())
    wait_work(Pending(work, name, flat.is_cuda), comm)
    return shard


def all_gather_flat(
    flat: torch.Tensor, *, comm: Comm, what: str, source: torch.Tensor | None = None
) -> Pending:
    """Issue the all-gather of every rank's shard of ``flat`` into ``flat``: in place, or
    this rank's shard read from ``source`` (``flat.numel() // world_size`` elements of its
    dtype, e.g. a shard kept elsewhere on the device); the caller waits for the returned
    handle (``wait_all``) before reading ``flat``."""
    shard = _shard(flat, comm) if source is None else source
    if shard.numel() * comm.world_size != flat.numel() or shard.dtype != flat.dtype:
        raise RuntimeError(
            f"{comm.where()}: all_gather of {what}: the shard {tuple(shard.shape)} "
            f"{shard.dtype} is not 1/{comm.world_size} of {tuple(flat.shape)} {flat.dtype} (bug)"
        )
    work = _all_gather(flat, shard, group=comm.group, async_op=True)
    comm.counters.add("all_gather", flat.numel() * flat.element_size())
    return Pending(work, f"all_gather of {what}", flat.is_cuda)


#: What ``all_reduce_stats`` agrees on unless its caller names something else.
STEP_STATS = "the gradient norm, overflow and arrival flags"


def all_reduce_stats(
    stats: torch.Tensor,
    *,
    comm: Comm,
    device: torch.device,
    what: str = STEP_STATS,
    advice: str = STEP_ADVICE,
) -> torch.Tensor:
    """Sum a float64 vector of statistics over the ranks (one all-reduce); returns the sum
    on the CPU. OffloadAdamW packs the gradients' sum of squares, the overflow flag and
    the per-parameter arrival flags in it, so every rank clips by the same coefficient,
    skips the same steps and counts the same parameters as stepped. ``what``: what the
    vector holds, as a timeout or failure names the collective (a streamed checkpoint's
    save id, say); ``advice``: what a rank that never arrives has probably done.

    Synchronisation point: the result is read on the host.
    """
    stats = stats.to(device=device, dtype=torch.float64)
    # One host wait, for the other ranks and (NCCL) the read: Note [host syncs are counted
    # where they can block] in accelerator/host_syncs.py.
    count_sync("all_reduce_stats")
    work = dist.all_reduce(stats, group=comm.group, async_op=True)
    comm.counters.add("all_reduce", stats.numel() * stats.element_size())
    wait_work(Pending(work, f"all_reduce of {what}", stats.is_cuda, advice), comm)
    return stats.cpu()


def _byte_tensor(payload: bytes, numel: int, device: torch.device) -> torch.Tensor:
    """``payload`` as a (numel,) uint8 tensor on ``device``, zero-padded after its end."""
    out = torch.zeros(numel, dtype=torch.uint8)
    out.numpy()[: len(payload)] = np.frombuffer(payload, dtype=np.uint8)  # the one copy
    return out.to(device)


def _lengths(
    payload: bytes, *, comm: Comm, device: torch.device, what: str, advice: str
) -> list[int]:
    """Every rank's ``len(payload)``, in rank order (one all-gather, with the deadline)."""
    mine = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    every = torch.empty(comm.world_size, dtype=torch.int64, device=device)
    work = _all_gather(every, mine, group=comm.group, async_op=True)
    wait_work(Pending(work, f"all_gather of the sizes of {what}", every.is_cuda, advice), comm)
    return [int(n) for n in every.cpu()]  # Synchronisation point: read on the host


def all_gather_bytes(
    payload: bytes,
    *,
    comm: Comm,
    what: str,
    advice: str = STEP_ADVICE,
    length: int | None = None,
) -> list[bytes]:
    """Every rank's ``payload``, in rank order, on every rank: an all-gather of the lengths,
    then one of the payloads padded to the longest, each with the deadline (Note
    [collective deadlines]); ``advice``: what a rank that never arrives has probably done;
    ``length``: every rank's payload has that many bytes (a digest), so the lengths need
    no all-gather. For small payloads (every rank receives every one).
    Synchronisation point."""
    device = collective_device(comm)
    if length is None:
        lengths = _lengths(payload, comm=comm, device=device, what=what, advice=advice)
    elif len(payload) == length:
        lengths = [length] * comm.world_size
    else:
        raise RuntimeError(
            f"{comm.where()}: all_gather of {what}: {len(payload)} bytes, not the {length} "
            "every rank sends (bug)"
        )
    longest = max(lengths)
    every = torch.empty(longest * comm.world_size, dtype=torch.uint8, device=device)
    mine = _byte_tensor(payload, longest, device)
    work = _all_gather(every, mine, group=comm.group, async_op=True)
    wait_work(Pending(work, f"all_gather of {what}", every.is_cuda, advice), comm)
    flat = every.cpu().numpy().tobytes()
    return [flat[r * longest : r * longest + n] for r, n in enumerate(lengths)]


def gather_bytes(
    payload: bytes, *, comm: Comm, dst: int, what: str, advice: str = STEP_ADVICE
) -> list[bytes] | None:
    """Every rank's ``payload`` in rank order on rank ``dst`` of ``comm``'s group (``None``
    on the others): ``torch.distributed.gather_object``'s exchange (an all-gather of the
    lengths, a gather of the payloads padded to the longest) with the deadline of Note
    [collective deadlines], which ``gather_object`` cannot take. Hidden cost: rank ``dst``
    holds ``world_size`` times the longest payload. Synchronisation point."""
    if not 0 <= dst < comm.world_size:
        raise ValueError(
            f"{comm.where()}: dst={dst!r} is not a rank of the group, which has ranks "
            f"0..{comm.world_size - 1}; pass one of them"
        )
    device = collective_device(comm)
    lengths = _lengths(payload, comm=comm, device=device, what=what, advice=advice)
    longest = max(lengths)
    mine = _byte_tensor(payload, longest, device)
    parts = None
    if comm.rank == dst:
        parts = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in lengths]
    # torch.distributed.gather takes the global rank; dst counts within the group.
    global_dst = dst if comm.group is None else dist.get_global_rank(comm.group, dst)
    work = dist.gather(mine, parts, dst=global_dst, group=comm.group, async_op=True)
    wait_work(Pending(work, f"gather of {what}", mine.is_cuda, advice), comm)
    if parts is None:
        return None
    return [part[:n].cpu().numpy().tobytes() for part, n in zip(parts, lengths, strict=True)]
