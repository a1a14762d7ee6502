"""HostWorker: the optimizer's CPU thread for host-side work that must follow a copy.

It accumulates a copied gradient bucket in fp32 without blocking the caller, and runs the
delayed parameter update (``overlap_step``). It is a real CPU thread on every accelerator,
so it is built on ``accelerator.threads.ThreadStream``, not on the host accelerator's
simulated streams: the CUDA path never imports the simulator.

With the host accelerator's race checker on, the worker is a lane of its own (Note [race
checking with vector clocks] in ``accelerator/race_checker.py``): a task that reads pinned
staging must be declared with ``accelerator.declare_access(..., stream=host_worker)`` when
it is submitted, and the worker's ``wait_event`` orders it after the copy it waits for.
"""

from __future__ import annotations

from ..accelerator import Accelerator
from ..accelerator.threads import ThreadStream

__all__ = ["HostWorker"]


class HostWorker(ThreadStream):
    """One CPU worker thread: ``submit``, ``record_event``, ``wait_event``, ``synchronize``,
    ``close`` (see ``ThreadStream``). ``wait_event`` blocks the worker, never the caller;
    on CUDA that is a blocking (non-spinning) ``cudaEventSynchronize`` on the worker thread.
    """

    def __init__(self, accelerator: Accelerator, name: str = "host_worker") -> None:
        super().__init__(name, checker=accelerator.race_checker)
