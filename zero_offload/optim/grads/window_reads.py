"""What a step reads of a window on the host (``WindowReads``, mixed into ``HostGradients``
in ``to_host.py``): which field holds the window's gradient, when each of its tiles is in
for CPU Adam (Note [Adam follows the gradient in] in ``landing.py``), and its statistics,
from the host worker's passes or left on the device (Note [a lone window's statistics are
taken on the device] in ``lone_stats.py``). ``HostGradients``' flushes decide what each
field holds; this half only reads them.
"""

from __future__ import annotations

import torch

from ...accelerator import Event
from ...accelerator.host_syncs import synchronize_completed, wait_input
from ...memory.manager import TieredMemoryManager
from ...partition import BucketLayout
from ...tracing import phase
from ..access import declare_cpu
from .device_window import DeviceWindow
from .host_acc import HostAccumulator
from .host_passes import HostPasses
from .landing import Landing
from .lone_flush import LoneFlush
from .lone_stats import order_norms_read
from .path import GradSource, SumSqParts
from .staging import Staging

__all__ = ["WindowReads"]


class WindowReads:
    """``HostGradients``' reads for a step. Uses its fields (``HostGradients``' docstring and
    ``__init__`` say what each holds)."""

    layout: BucketLayout
    manager: TieredMemoryManager
    staging: Staging
    acc: HostAccumulator
    device: DeviceWindow
    passes: HostPasses
    lone: LoneFlush
    _source: GradSource
    _landing: Landing
    _acc_landed: bool
    _staging_consumed: Event | None

    def _staging_tensor(self, buffer: int) -> torch.Tensor:
        return self.staging.get(buffer)[0]

    def await_grad(self, grad: torch.Tensor, source: GradSource, lo: int, hi: int) -> None:
        """Wait until ``grad[lo:hi]`` (``source``: the field it is) holds the window's
        gradient; Note [Adam follows the gradient in]. Instant when the host worker
        drained."""
        event = None
        landing = self._landing_of(source)
        if landing:
            event = landing.covering(hi)
        elif not self.manager.host_worker.is_current():
            # On the host worker (a delayed or announced update) the update is queued behind
            # the passes over its window, and a later window's event may already be queued
            # behind the update: waiting for it would never end.
            event = self._staging_consumed  # the host worker's last pass over the window
        if event is not None:
            # Synchronisation point: CPU Adam reads this tile next. Always synchronize (a
            # query that says done orders nothing for the race checker); a wait that blocks
            # is timed as waiting for gradients, not as CPU Adam.
            if event.query():
                synchronize_completed(event)
            else:
                with phase("wait_grads", track="cpu_optimizer"):
                    wait_input(event)
        declare_cpu(
            self.manager,
            grad[lo:hi],
            bucket=self.layout.index,
            write=False,
            what="CPU Adam reads the gradient",
        )

    def landed_through(self, source: GradSource, lo: int, limit: int) -> int:
        landing = self._landing_of(source)
        if landing:
            return landing.landed_through(lo, limit)
        if self.manager.host_worker.is_current():
            return limit  # queued behind every pass over the window (see await_grad)
        done = self._staging_consumed
        return limit if done is None or done.query() else lo

    def _landing_of(self, source: GradSource) -> Landing | None:
        """The tile copies that bring ``source``'s gradient in (None: the host worker's
        passes, or nothing, bring it)."""
        if source is GradSource.STAGING or source is GradSource.SPARE:
            return self.lone.landing(self.staging.buffer(source))
        if self._acc_landed:
            return self._landing
        # a delayed update follows the last landing while the next backward flushes
        return self.device.landing if self.manager.host_worker.is_current() else None

    def window_source(self) -> GradSource:
        if self.device.unlanded:
            return GradSource.DEVICE
        staged = self._source is GradSource.STAGING
        self.staging.check_kept(self.layout.index, staged=staged)
        return self.staging.kept_source() if staged else self._source

    def gradient(self, source: GradSource) -> torch.Tensor:
        if source is GradSource.DEVICE:
            raise RuntimeError(f"bucket {self.layout.index}: its gradient has not landed (bug)")
        if source is GradSource.STAGING or source is GradSource.SPARE:
            grad = self._staging_tensor(self.staging.buffer(source))
        else:
            grad = self.acc.tensor
        if grad is None:
            raise RuntimeError(f"bucket {self.layout.index}: no accumulator to read (bug)")
        return grad

    def stats_on_host(self) -> bool:
        return self.device.norms is None  # landed from the device, or a lone flush: taken there

    def grad_sumsq(self) -> SumSqParts:
        norms = self.device.norms
        if norms is not None:
            # The step reads them next, on the compute stream (Note [a lone window's ...]).
            order_norms_read(self.manager, self.layout, norms, self.device.norms_ready)
            return SumSqParts([], False, norms)
        return self.passes.sumsq()
