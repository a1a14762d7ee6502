"""HostWorker: the optimizer's CPU thread for host-side work that must follow a copy.

It accumulates a copied gradient bucket in fp32 without blocking the caller, and runs the
delayed parameter update (``overlap_step``). It is a real CPU thread on every accelerator,
so it is built on ``accelerator.threads.ThreadStream``, not on the host accelerator's
simulated streams: the CUDA path never imports the simulator.

With the host accelerator's race checker on, the worker is a lane of its own (Note [race
checking with vector clocks] in ``accelerator/race_checker.py``). A task declares what it
touches from inside itself, when it runs: ``accelerator.declare_access(tensor, stream=None,
...)`` (``None`` is the calling thread, here the worker); its clock moves as its work runs,
see Note [when a thread stream's clock moves] in ``accelerator/threads.py``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from ..accelerator import Accelerator, Event
from ..accelerator.host_syncs import synchronize_completed
from ..accelerator.threads import ThreadStream
from ..thread_budget import mark_thread_beside

__all__ = ["HostWorker"]


class HostWorker(ThreadStream):
    """One CPU worker thread: ``submit``, ``record_event``, ``wait_event``, ``synchronize``,
    ``close`` (see ``ThreadStream``). ``wait_event`` blocks the worker, never the caller;
    on CUDA that is a blocking (non-spinning) ``cudaEventSynchronize`` on the worker thread.
    """

    clock_at_execution = True

    def __init__(self, accelerator: Accelerator, name: str = "host_worker") -> None:
        # Bound to the accelerator's device, whichever thread built the optimizer: Note
        # [every library thread binds its device] in accelerator/device_context.py.
        # Its CPU Adam runs beside the caller's torch work, which takes host cores when the
        # accelerator computes on the host, else one, to launch kernels: Note [one thread
        # budget].
        bind_device = accelerator.bind_thread
        launcher = not accelerator.computes_on_host

        def bind() -> None:
            bind_device()
            mark_thread_beside(launcher=launcher)

        super().__init__(name, checker=accelerator.race_checker, bind=bind)
        # The event recorded by the last synchronize(), and whether work was queued after
        # it: an idle worker is not waited for (synchronize).
        self._tail: Event | None = None
        self._since_tail = False
        self._tail_lock = threading.Lock()  # guards the two above and each submit's queuing

    def submit(self, fn: Callable[[], Any]) -> None:
        with self._tail_lock:  # marked and queued together: synchronize() sees both or none
            self._since_tail = True
            super().submit(fn)

    def synchronize(self) -> None:
        """Block until the queued work is done. With nothing queued since the last wait it
        is no wait, and counted as none (Note [host syncs are counted where they can
        block]): unlike a simulated device stream's, a CPU worker's queue is as empty on a
        GPU machine. The event that ended the last wait still orders this one. A fresh
        wait counts as one even when the worker gets there first: the count depends on
        what was queued, not on timing."""
        with self._tail_lock:
            tail = self._tail
            fresh = tail is None or self._since_tail
            if fresh:
                tail = self.record_event()  # if this raises, the flag still says "queued"
                self._tail, self._since_tail = tail, False
        if not fresh and tail.query():
            self._check()
            synchronize_completed(tail)
            return
        tail.synchronize()
        self._check()
