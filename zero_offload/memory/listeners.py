"""Who listens to a manager's copies and stalls: ``Listeners``, the registry behind
``TieredMemoryManager.subscribe``.

A copy asks it one question, read without a lock: ``hooks``, None while nobody listens, else
one callable (or None) per kind of listener. Subscribing and unsubscribing replace the
answer whole under the registry's lock (copy on write), so the copy path never locks.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, NamedTuple

from .traffic import RecordListener

__all__ = ["TICK_EVERY", "FieldListener", "Hooks", "Listeners", "Tick"]

#: Copies between two calls of a subscriber's ``tick`` (``TieredMemoryManager.subscribe``).
TICK_EVERY = 64

#: Called with a copy's fields, in ``CopyRecord``'s order (``subscribe(fields=True)``).
FieldListener = Callable[[tuple], None]
Tick = Callable[[], None]
#: (the record listeners, the field listeners, the ticks), each one callable or None.
Hooks = tuple[Callable[[Any], None] | None, FieldListener | None, Tick | None]


# Note [one call per kind of listener]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A listened copy calls each kind of listener once: the one subscriber of that kind itself
# (the profiler's ``list.extend``, its ``tick``), or a fan-out over several, built when the
# subscriptions change. A loop over a tuple of one per kind per copy, and the tick's test
# made for nobody, were a third of the listened copy's extra cost (0.6 of 1.4 us beside a
# 16 us copy on the host accelerator: issue 39 asks for under 10%).


def _one_call(listeners: list[Callable[..., None]]) -> Callable[..., None] | None:
    """None for no listener, the listener itself for one, else one call that calls each in
    subscription order (Note [one call per kind of listener])."""
    if len(listeners) <= 1:
        return listeners[0] if listeners else None
    fan = tuple(listeners)

    def each(*args: Any) -> None:
        for listener in fan:
            listener(*args)

    return each


class _Subscription(NamedTuple):
    """One ``subscribe`` call: who hears copies (records, or fields) and stalls."""

    copies: Callable[[Any], None]
    stalls: RecordListener
    fields: bool
    tick: Tick | None


class Listeners:
    """The subscriptions of one manager. ``hooks`` and ``stalls`` are read without the lock:
    each is replaced whole."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._subscriptions: tuple[_Subscription, ...] = ()
        #: None while nobody listens, else one callable or None per kind of listener.
        self.hooks: Hooks | None = None
        #: Who hears each stall, in subscription order.
        self.stalls: tuple[RecordListener, ...] = ()

    def add(
        self,
        listener: RecordListener,
        *,
        stalls: RecordListener | None,
        fields: bool,
        tick: Tick | None,
    ) -> Callable[[], None]:
        """Subscribe (``TieredMemoryManager.subscribe`` says what each argument means);
        returns the call that removes this subscription (later calls do nothing)."""
        subscription = _Subscription(
            listener, stalls if stalls is not None else listener, fields, tick
        )
        with self._lock:
            self._set((*self._subscriptions, subscription))

        def remove() -> None:
            with self._lock:
                if subscription in self._subscriptions:
                    kept = list(self._subscriptions)
                    kept.remove(subscription)
                    self._set(tuple(kept))

        return remove

    def _set(self, subscriptions: tuple[_Subscription, ...]) -> None:
        """Replace the listeners whole; the caller holds ``_lock``."""
        self._subscriptions = subscriptions
        records = _one_call([s.copies for s in subscriptions if not s.fields])
        fields = _one_call([s.copies for s in subscriptions if s.fields])
        ticks = _one_call([s.tick for s in subscriptions if s.tick is not None])
        self.stalls = tuple(s.stalls for s in subscriptions)
        self.hooks = (records, fields, ticks) if subscriptions else None
