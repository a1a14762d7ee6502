"""The prefetch queue of an ActivationOffloader: which offloaded activations are packed and
not yet unpacked, by group, and which groups a backward loads ahead of recomputation.

A group is one checkpoint call (its kept inputs) or one saved tensor: the unit that is
unpacked at once and prefetched at once. Group ids grow in forward order, so the groups
saved before the one being unpacked are the ones backward needs next. The offloader issues
the copies back (``offloader.py``); this queue only says which.

Note [reuse order]
~~~~~~~~~~~~~~~~~~
Every iteration allocates and frees device blocks in the same order (reverse forward order,
``prefetch_depth + 1`` groups live at a time, plus what autograd still holds), and best-fit
placement is deterministic, so the device pool's layout repeats from one iteration to the
next. Within one backward it can
still split the free bytes when saved tensors of different sizes die out of order; the pool
is not compacted then (Note [a reload can find the free bytes split] in ``pools.py``).

Not thread-safe by itself: every method runs under the offloader's lock, but ``new_group``
(a counter) and ``clear`` (the offloader released: nobody holds the lock then).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

from .record import OffloadedActivation

__all__ = ["PrefetchGroups"]


class PrefetchGroups:
    """Group id -> its records not yet unpacked, in pack order; groups in forward order.

    A group leaves the queue when its last record is unpacked or dropped by autograd.
    """

    def __init__(self) -> None:
        self._ids = itertools.count()
        self._groups: dict[int, list[OffloadedActivation]] = {}  # in forward order

    def new_group(self) -> int:
        """A fresh group id (one per checkpoint call); ids grow in forward order."""
        return next(self._ids)

    def add(self, record: OffloadedActivation) -> None:
        """``record`` was packed: it joins its group, after the records packed before it."""
        self._groups.setdefault(record.group, []).append(record)

    def members(self, record: OffloadedActivation) -> list[OffloadedActivation]:
        """What unpacking ``record`` needs now: its whole group (a checkpoint unpacks all its
        inputs at once), or ``record`` alone when its group is gone."""
        members = self._groups.get(record.group, [])
        return list(members) if record in members else [record]

    def before(self, group: int, depth: int) -> list[OffloadedActivation]:
        """The records of the ``depth`` nearest groups saved before ``group``, nearest first
        (Note [reuse order])."""
        targets: list[OffloadedActivation] = []
        found = 0
        for gid in reversed(self._groups):
            if gid >= group:
                continue
            targets.extend(self._groups[gid])
            found += 1
            if found == depth:
                break
        return targets

    def forget(self, record: OffloadedActivation) -> None:
        """``record`` was unpacked or dropped: it is no longer prefetched."""
        members = self._groups.get(record.group)
        if members is not None and record in members:
            members.remove(record)
            if not members:
                del self._groups[record.group]

    def records(self) -> Iterator[OffloadedActivation]:
        """Every record in the queue, group by group in forward order."""
        for members in self._groups.values():
            yield from members

    def clear(self) -> None:
        """Forget every record, for an offloader released (Note [an offloader released
        without close] in ``release.py``)."""
        self._groups.clear()
