"""What finalizers hand an ActivationOffloader, and what it gives back when it goes.

Note [finalizers only enqueue]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Finalizers (a saved handle dropped by autograd, a reloaded tensor's storage dying) run
wherever the last reference goes away: on any thread, and even in the middle of code that
holds the offloader's lock or a pool's lock, when the garbage collector runs there. Taking
those (non-reentrant) locks from a finalizer could deadlock, so finalizers only put what
died on the offloader's ``_deferred`` (a lock-free queue): the record of a dropped handle,
or a ``DeviceBlockFreed``. The offloader's ``_reap`` frees them at the start of every pack,
unpack, stats and synchronize, with no lock held. The queue holds data, never a callable
bound to the offloader: the offloader holds the queue, so that would be a cycle (Note [an
offloader released without close]).

Note [an offloader released without close]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A sweep or a notebook drops offloaders without close(), as it drops optimizers (Note
[lifetimes without close] in optim/lifetime.py). The pools are big (1 GiB of host memory
and 256 MiB of the device budget by default), so they must go back when the offloader is
dropped, by reference counting alone: a cycle through the offloader held them until the
cyclic collector ran (after 6 dropped offloaders, 6.5 GiB of RSS; under a 700 MiB device
budget the third raised DeviceBudgetExceeded with nothing live). So nothing the offloader
owns points back at it: the pools take ``run_deferred`` with each call instead of keeping
it, and ``_deferred`` holds data (Note [finalizers only enqueue]). Only the saved-tensor
hooks of a live graph keep it alive. The finalizers of saved handles and reloaded storages
hand over to the queue, never to the offloader, and a storage's finalizer holds the queue
weakly: the finalizer registry holds each finalizer, out of the collector's sight, so
whatever a finalizer holds that holds its own storage is kept for good. A prefetch that a
failed backward never used is such a storage: its record holds it, and the queue holds the
record once the handle died. When the offloader goes, a ``weakref.finalize``
(``release``) frees the blocks still held (after their copies), gives both pools back and
closes the manager if the offloader built it. A reloaded tensor kept past that keeps its
bytes (its storage holds the pool's buffer), not the budget. ``close()`` runs the same
finalizer at once, after checking that no activation is still held. With a shared manager
(``manager=opt.manager``) the finalizer is registered with the manager too, so closing or
dropping the optimizer, which stops the streams, releases the offloader (Note [a manager's
close ends its borrowers] in memory/manager.py); using it afterwards raises, naming why.
"""

from __future__ import annotations

import queue
import weakref
from typing import NamedTuple

from ..errors import Attempts
from ..memory.block import Block
from ..memory.manager import TieredMemoryManager
from ..memory.quiet_exit import quiet_at_exit
from .outgoing import OutgoingCopies
from .pools import ActivationPools
from .prefetch import PrefetchGroups
from .record import OffloadedActivation

__all__ = ["Deferred", "DeviceBlockFreed", "hand_over", "release"]


class DeviceBlockFreed(NamedTuple):
    """A reloaded activation's storage died: its device block goes back to the pool (Note
    [device blocks live as long as their storage] in layout.py)."""

    block: Block  # of the device pool
    nbytes: int  # the activation's bytes, counted in device_bytes until now


#: What a finalizer hands over to the offloader's ``_reap``: Note [finalizers only enqueue].
Deferred = OffloadedActivation | DeviceBlockFreed


def release(
    pools: ActivationPools,
    *,
    outgoing: OutgoingCopies,
    groups: PrefetchGroups,
    deferred: queue.SimpleQueue[Deferred],
    manager: TieredMemoryManager | None,
) -> None:
    """Give back what an offloader owns; Note [an offloader released without close].

    ``outgoing``'s device tensors are read by copies out, which the pools wait for (their
    end events are on the host blocks): they are dropped after, with the records the
    offloader still holds (``groups``, ``deferred``), whose views would keep the host pool's
    buffer alive. ``manager``: the offloader's own, closed last (None when shared).
    """
    attempt = Attempts()
    attempt(pools.discard)  # waits for the copies still touching the pools
    outgoing.abandon()
    groups.clear()
    while not deferred.empty():
        deferred.get_nowait()
    if manager is not None:
        attempt(manager.close)
    # Note [a quiet exit after a failed stream] in memory/quiet_exit.py
    attempt.raise_first(unless=quiet_at_exit)


def hand_over(deferred: weakref.ref[queue.SimpleQueue[Deferred]], item: Deferred) -> None:
    """Put ``item`` on the offloader's queue, if the queue still exists (a finalizer; any
    thread): Note [an offloader released without close]."""
    target = deferred()
    if target is not None:
        target.put(item)
