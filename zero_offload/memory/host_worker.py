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

from ..accelerator import Accelerator
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
        # Its CPU Adam runs beside the caller's torch work, which takes host cores only when
        # the accelerator computes on the host: Note [one thread budget].
        bind_device = accelerator.bind_thread
        beside = accelerator.computes_on_host

        def bind() -> None:
            bind_device()
            if beside:
                mark_thread_beside()

        super().__init__(name, checker=accelerator.race_checker, bind=bind)
