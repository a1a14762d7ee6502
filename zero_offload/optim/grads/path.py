"""The gradient path interface: how a bucket's gradients reach the place a step reads them.

A bucket composes one gradient path with one state store (``state/store.py``):

- ``to_host.HostGradients``: a device buffer per backward, copied to host staging in tiles
  (after a reduce-scatter with several ranks), the host worker's statistics and fp32
  accumulation; for the host-RAM and NVMe stores;
- ``on_device.DeviceGradients``: gradients add straight into an fp32 accumulator on the
  device; for the device-resident store.

The lifecycle (``lifecycle.py``) decides *when*; the path does *what*.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from typing import NamedTuple

import torch

from ...accelerator import Event
from ..ranks import Ranks

__all__ = ["GradSource", "GradientPath", "SumSqParts"]


class SumSqParts(NamedTuple):
    """One bucket's share of the gradient norm (Note [the norm does not depend on the
    bucketing] in ``stat_cells.py``): partial sums of squares already on the host, whether
    any is non-finite, and, for gradients on the device, ``norms_dev``: (params,) float64,
    on the device, each parameter's norm. The caller reads every bucket's ``norms_dev`` in
    one device-to-host copy, not one per bucket."""

    partials: list[float]
    nonfinite: bool
    norms_dev: torch.Tensor | None = None


class GradSource(enum.Enum):
    """Which field holds the window's gradient (what a step planned now reads, even if a
    later flush changes it)."""

    #: Host staging, training dtype: the window had one flush (Note [no accumulator for
    #: one backward] in ``to_host.py``).
    STAGING = "grad_staging"
    #: The bucket's second host staging buffer, training dtype: the window had one flush
    #: and, with ``overlap_step``, landed there because update k still read the first
    #: (Note [the delayed update reads one buffer, the next backward fills the other] in
    #: ``staging.py``).
    SPARE = "grad_staging_spare"
    #: The fp32 accumulator (host, or device for a resident bucket).
    ACCUMULATOR = "grad_acc"
    #: An offloaded bucket's fp32 accumulator on the device, not landed on the host since
    #: its last flush (Note [micro-batches add up on the device] in ``device_acc.py``): no
    #: step reads it; ``land`` makes it ``ACCUMULATOR``.
    DEVICE = "grad_acc_dev"


class GradientPath(ABC):
    """Where one bucket's gradients go during backward, and what a step reads."""

    def can_adopt(self, grad: torch.Tensor) -> bool:
        """Whether ``grad`` (a parameter's own autograd gradient) can serve as the open
        buffer itself, with no device copy (Note [a lone gradient is its own buffer] in
        ``open_buffer.py``)."""
        return False

    def adopt_grad(self, grad: torch.Tensor, *, new_window: bool) -> None:
        """Take ``grad`` as the open buffer (only where ``can_adopt``)."""
        raise RuntimeError(f"{type(self).__name__} cannot adopt a gradient (bug)")

    @abstractmethod
    def open_grad(self, *, new_window: bool, grow: bool = False) -> None:
        """Open the ``(padded_numel,)`` device tensor this backward's gradients add into,
        zeroed where it must be (``new_window``: the window's first). Raises
        ``PoolExhausted`` when no device buffer is free, unless ``grow`` allows an extra
        pool (several ranks); nothing changes then."""

    @abstractmethod
    def add_grad(self, slot_index: int, grad: torch.Tensor) -> None:
        """Add one parameter's flat gradient into its slot of the open buffer (on the
        compute stream)."""

    @abstractmethod
    def flush(self, *, overwrite: bool, ranks: Ranks) -> None:
        """Hand the open gradient buffer on (FILLING -> IN_FLIGHT); ``overwrite`` for the
        window's first flush."""

    def update_queued(self, event: Event) -> None:  # noqa: B027 (no staging to let go)
        """The bucket's update, run during backward, is queued on the host worker and
        ends at ``event`` (Note [gradient staging for the buckets in flight] in
        ``staging_ring.py``)."""

    def land(self) -> None:  # noqa: B027 (most paths hold the window where it is read)
        """Bring the window's gradient to where a step reads it, if it is not there (Note
        [micro-batches add up on the device] in ``device_acc.py``); before
        ``window_source``."""

    def window_consumed(self) -> None:  # noqa: B027 (no staging to let go)
        """A step consumed the window (or it was discarded)."""

    @abstractmethod
    def discard_grad(self) -> None:
        """Forget the open gradient buffer without using it (``zero_grad``)."""

    @abstractmethod
    def await_grad(self, grad: torch.Tensor, source: GradSource, lo: int, hi: int) -> None:
        """Wait until ``grad[lo:hi]`` (``gradient(source)``'s elements) holds the window's
        gradient, for a CPU kernel to read it next (Note [Adam follows the gradient in] in
        ``to_host.py``)."""

    def landed_through(self, source: GradSource, lo: int, limit: int) -> int:
        """How far past ``lo`` (up to ``limit``) ``gradient(source)`` holds the window's
        gradient now, without waiting (Note [a launch spans the tiles that landed] in
        ``rule/tiles.py``); ``lo`` when nothing is known to have landed."""
        return lo

    @abstractmethod
    def window_source(self) -> GradSource:
        """The field holding the window's gradient now."""

    @abstractmethod
    def gradient(self, source: GradSource) -> torch.Tensor:
        """The flat gradient tensor of ``source`` (this rank's shard's elements)."""

    def stats_on_host(self) -> bool:
        """Whether the window's statistics come from the host worker's passes, so that
        ``grad_sumsq`` needs the worker drained first (default), or were taken on the
        device (Note [micro-batches add up on the device] in ``device_acc.py``, Note [a lone
        window's statistics are taken on the device] in ``lone_stats.py``)."""
        return True

    @abstractmethod
    def grad_sumsq(self) -> SumSqParts:
        """Partial sums of squares of the window's accumulated gradient (this rank's shard;
        ``math.fsum`` of all buckets' partials is the global sum, Note [the norm does not
        depend on the bucketing] in ``stat_cells.py``) and whether any is non-finite; the
        caller drained the host worker when ``stats_on_host()``."""

    @abstractmethod
    def close(self) -> None:
        """Return every block to its pool."""
