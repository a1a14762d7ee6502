"""RaceChecker: finds accesses to a buffer from two streams that nothing orders.

A GPU runs each stream's work whenever it likes, so a copy that reads a buffer on one stream
while another stream writes it races unless a ``wait_event`` (or a host synchronisation)
orders the two. The host accelerator runs everything in a safe order by construction, so
such a missing wait would never show in a test. This checker makes it show: it reasons about
the *issue order* of work, not the order in which it happened to run, the way PyTorch's CUDA
sanitizer (``torch.cuda._sanitizer``) does for CUDA kernels.

Note [race checking with vector clocks]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Every stream, and every CPU thread that issues work, is a *lane*. Each lane carries a vector
clock: for every lane, the number of that lane's accesses known to have finished before the
lane's next piece of work. The clock moves in five ways, all at issue time on the issuing
thread:

- an access on lane L ticks L's own entry; the access is stamped with that tick;
- ``record_event`` on L stamps the event with a copy of L's clock;
- ``L.wait_event(e)`` merges ``e``'s stamp into L (element-wise maximum);
- a CPU thread that waits for an event (``synchronize()``) merges its stamp into the
  thread's own lane. A ``query()`` that returns True does not, since the host accelerator's
  copies finish much sooner than a GPU's would; code that relies on one (the pool, handing
  out the bytes of a block whose copies are done) calls ``observed`` itself;
- work a thread issues to a stream is ordered after everything that thread has observed,
  so each issue merges the thread's lane into the stream's lane first.

An access A on lane L is ordered after an earlier access B on lane M exactly when L's clock
has reached B's tick for M. Two accesses conflict when their byte ranges overlap and at least
one is a write; a conflicting pair that is not ordered raises ``StreamRaceError``, naming the
buffer, both lanes and both operations. Per buffer, the checker keeps the last writes and the
reads since (a write supersedes every record it covers, once checked; a read supersedes its
own lane's earlier reads of the range it covers), which is all a later access can conflict
with, because ordering is transitive.

Only buffers the accelerator allocated (pool buffers, device buffers, host allocations) are
tracked; their accesses come from the copy primitive automatically, and from
``Accelerator.declare_access`` for work the library cannot see (compute kernels, CPU loops,
host-worker tasks). Tensors the library did not allocate are ignored: their addresses may be
reused by the CPU allocator, which would make stale records look like races. A tensor over
a storage of its own that lies inside a tracked buffer (a reloaded activation over its
storage slice of a pool buffer, ``activations/layout.py``) is an access to that buffer: the
buffer is found by address range, since the slice exists only while the buffer does.
"""

from __future__ import annotations

import bisect
import enum
import itertools
import os
import sys
import threading
import types
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from ..errors import StreamRaceError

__all__ = [
    "CHECK_RACES_ENV",
    "AccessKind",
    "Lane",
    "RaceChecker",
    "VectorClock",
    "races_enabled_by_env",
]

#: Environment variable turning the checker on for every host accelerator ("1" to enable).
CHECK_RACES_ENV = "ZERO_OFFLOAD_CHECK_RACES"

#: A snapshot of a lane's vector clock: lane id -> accesses of that lane ordered before.
VectorClock = dict[int, int]

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_INTERNAL_DIRS = tuple(
    os.path.join(_PACKAGE_DIR, sub) + os.sep for sub in ("accelerator", "memory")
)


def races_enabled_by_env() -> bool:
    """Whether ``ZERO_OFFLOAD_CHECK_RACES`` asks for the checker ("1", "true", "yes", "on")."""
    value = os.environ.get(CHECK_RACES_ENV, "").strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    raise ValueError(
        f"{CHECK_RACES_ENV}={os.environ[CHECK_RACES_ENV]!r} is not a switch; "
        "use 1 to check for stream races or 0 (or unset it) not to"
    )


class AccessKind(enum.Enum):
    """What an access does to the bytes it covers."""

    #: The bytes are only read: reads on two streams never conflict with each other.
    READ = "read"
    #: The bytes are overwritten: conflicts with every unordered access to them.
    WRITE = "write"


@dataclass(frozen=True)
class Lane:
    """A stream or an issuing CPU thread, as the checker sees it."""

    id: int
    name: str  # e.g. "stream 'h2d'", "CPU thread 'MainThread'"


@dataclass
class _Access:
    lane: Lane
    tick: int  # the lane's own clock entry at this access
    kind: AccessKind
    lo: int  # byte range [lo, hi) within the buffer
    hi: int
    what: str  # the operation, e.g. "h2d copy 'bucket0[0:64]' writes its destination"
    where: str  # file:line of the first caller outside accelerator/ and memory/


#: Names the part of a buffer that a byte range falls in (e.g. the pool block and its owner).
RangeNamer = Callable[[int, int], str]


@dataclass
class _Buffer:
    name: str
    nbytes: int
    accesses: list[_Access]
    namer: RangeNamer | None


class RaceChecker:
    """See Note [race checking with vector clocks]; one per accelerator.

    ``_lock`` guards every clock and buffer record: streams are issued to from several
    threads (the caller, the host worker).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._clocks: dict[int, VectorClock] = {}
        self._stream_lanes: weakref.WeakKeyDictionary[object, Lane] = weakref.WeakKeyDictionary()
        self._thread_lanes = threading.local()
        self._buffers: dict[int, _Buffer] = {}  # by storage address
        self._starts: list[int] = []  # the keys of _buffers, sorted (lookup by range)
        #: Accesses checked against the records so far (tracked buffers only).
        self.accesses_checked = 0

    # ----------------------------------------------------------------- lanes

    def _new_lane(self, name: str) -> Lane:
        lane = Lane(next(self._ids), name)
        self._clocks[lane.id] = {}
        return lane

    def _lane_locked(self, stream: object | None) -> Lane:
        # The lane of ``stream`` (any object with a ``name``), or of the calling thread.
        if stream is None:
            lane = getattr(self._thread_lanes, "lane", None)
            if lane is None:
                lane = self._new_lane(f"CPU thread {threading.current_thread().name!r}")
                self._thread_lanes.lane = lane
            return lane
        lane = self._stream_lanes.get(stream)
        if lane is None:
            lane = self._new_lane(f"stream {getattr(stream, 'name', repr(stream))!r}")
            self._stream_lanes[stream] = lane
        return lane

    def bind_thread(self, stream: object) -> None:
        """Make the calling thread act as ``stream``'s lane (a worker thread running it)."""
        with self._lock:
            self._thread_lanes.lane = self._lane_locked(stream)

    def _issue_locked(self, stream: object | None) -> Lane:
        # Work a thread issues is ordered after what that thread has observed.
        thread = self._lane_locked(None)
        lane = self._lane_locked(stream)
        if lane is not thread:
            _merge(self._clocks[lane.id], self._clocks[thread.id])
        return lane

    # ----------------------------------------------------------------- events

    def stamp(self, stream: object) -> VectorClock:
        """The stamp of an event recorded on ``stream`` now."""
        with self._lock:
            lane = self._issue_locked(stream)
            return dict(self._clocks[lane.id])

    def wait(self, stream: object, stamp: VectorClock | None) -> None:
        """``stream.wait_event(e)`` was issued, ``e`` carrying ``stamp``."""
        if stamp is None:
            return
        with self._lock:
            lane = self._issue_locked(stream)
            _merge(self._clocks[lane.id], stamp)

    def thread_clock(self) -> VectorClock:
        """A copy of the calling thread's clock (what it has seen so far)."""
        with self._lock:
            return dict(self._clocks[self._lane_locked(None).id])

    def observed(self, stamp: VectorClock | None) -> None:
        """The calling thread saw an event with ``stamp`` complete (synchronize, query)."""
        if stamp is None:
            return
        with self._lock:
            _merge(self._clocks[self._lane_locked(None).id], stamp)

    # ----------------------------------------------------------------- buffers

    def track(self, tensor: torch.Tensor, name: str, *, namer: RangeNamer | None = None) -> None:
        """Start tracking the storage under ``tensor`` as buffer ``name`` (anew if tracked).

        ``namer(lo, hi)``, when given, names what a byte range holds, for error messages. A
        bound method is held weakly: the checker must not keep its object (a pool) alive.
        """
        storage = tensor.untyped_storage()
        if storage.nbytes() == 0:
            return
        if isinstance(namer, types.MethodType):
            namer = _weak_namer(weakref.WeakMethod(namer))
        buffer = _Buffer(name, storage.nbytes(), [], namer)
        with self._lock:
            if storage.data_ptr() not in self._buffers:
                bisect.insort(self._starts, storage.data_ptr())
            self._buffers[storage.data_ptr()] = buffer
        # The allocation's own tensor: views keep it alive, so it dies with the last of them.
        weakref.finalize(tensor, self._forget, storage.data_ptr(), buffer)

    def _forget(self, address: int, buffer: _Buffer) -> None:
        with self._lock:
            if self._buffers.get(address) is buffer:  # not a later allocation at that address
                del self._buffers[address]
                self._starts.pop(bisect.bisect_left(self._starts, address))

    def _buffer_locked(self, storage: int) -> tuple[int, _Buffer | None]:
        # The tracked buffer whose bytes hold ``storage`` (its start), and that buffer's start.
        buffer = self._buffers.get(storage)
        if buffer is not None:
            return storage, buffer
        index = bisect.bisect_right(self._starts, storage) - 1
        if index < 0:
            return storage, None
        start = self._starts[index]
        buffer = self._buffers[start]
        return (start, buffer) if storage < start + buffer.nbytes else (storage, None)

    def access(
        self, tensor: torch.Tensor, *, stream: object | None, kind: AccessKind, what: str
    ) -> None:
        """Check and record an access to ``tensor``'s bytes on ``stream`` (None: this thread).

        Raises ``StreamRaceError`` when a conflicting access on another lane is not ordered
        before it. Untracked tensors are ignored.
        """
        if not isinstance(kind, AccessKind):
            raise TypeError(f"kind must be an AccessKind, got {kind!r}")
        if tensor.numel() == 0:
            return
        span = 1 + sum((n - 1) * abs(s) for n, s in zip(tensor.shape, tensor.stride(), strict=True))
        where = _caller()
        with self._lock:
            base, buffer = self._buffer_locked(tensor.untyped_storage().data_ptr())
            if buffer is None:
                return
            lo = tensor.data_ptr() - base
            hi = lo + span * tensor.element_size()
            lane = self._issue_locked(stream)
            clock = self._clocks[lane.id]
            self.accesses_checked += 1
            for earlier in _overlapping(buffer.accesses, lo, hi):
                if earlier.lane is lane:
                    continue
                conflict = kind is AccessKind.WRITE or earlier.kind is AccessKind.WRITE
                if conflict and clock.get(earlier.lane.id, 0) < earlier.tick:
                    raise StreamRaceError(
                        _race_message(buffer, lo, hi, lane, kind, what, where, earlier)
                    )
            tick = clock.get(lane.id, 0) + 1
            clock[lane.id] = tick
            buffer.accesses = [a for a in buffer.accesses if not _superseded(a, lane, kind, lo, hi)]
            buffer.accesses.append(_Access(lane, tick, kind, lo, hi, what, where))


def _merge(into: VectorClock, other: VectorClock) -> None:
    for lane_id, tick in other.items():
        if into.get(lane_id, 0) < tick:
            into[lane_id] = tick


def _overlapping(accesses: list[_Access], lo: int, hi: int) -> Iterator[_Access]:
    return (a for a in accesses if a.lo < hi and lo < a.hi)


def _superseded(old: _Access, lane: Lane, kind: AccessKind, lo: int, hi: int) -> bool:
    # Checked already: a covering write orders every later access after the old one or
    # conflicts itself; a covering read of the same lane follows the old read in issue order.
    covered = lo <= old.lo and old.hi <= hi
    if not covered:
        return False
    return kind is AccessKind.WRITE or (old.lane is lane and old.kind is AccessKind.READ)


def _caller() -> str:
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith(_INTERNAL_DIRS):
        frame = frame.f_back
    if frame is None:
        return "<unknown>"
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"


def _race_message(
    buffer: _Buffer,
    lo: int,
    hi: int,
    lane: Lane,
    kind: AccessKind,
    what: str,
    where: str,
    earlier: _Access,
) -> str:
    part = f", {buffer.namer(lo, hi)}" if buffer.namer is not None else ""
    return (
        f"stream race on {buffer.name} (bytes [{lo}, {hi}) of {buffer.nbytes}{part}): "
        f"{what} ({kind.value}, on {lane.name}, issued at {where}) is not ordered after "
        f"{earlier.what} ({earlier.kind.value} of bytes [{earlier.lo}, {earlier.hi}), on "
        f"{earlier.lane.name}, issued at {earlier.where}). On a GPU the two may run at the "
        f"same time. Make {lane.name} wait for an event recorded on {earlier.lane.name} after "
        f"that {earlier.kind.value} (stream.wait_event(event), or manager.copy(after=[event])), "
        f"or synchronize that event on the host before issuing this {kind.value}."
    )


def _weak_namer(method: weakref.WeakMethod) -> RangeNamer:
    def namer(lo: int, hi: int) -> str:
        bound = method()
        return bound(lo, hi) if bound is not None else "a dropped owner"

    return namer
