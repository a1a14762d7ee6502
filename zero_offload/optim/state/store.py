"""The update backend interface: where a bucket's optimizer state lives and who updates it.

A bucket (``flat_bucket.FlatBucket``) is its parameter views, its gradient lifecycle and one
backend, chosen at construction by ``placement.plan_placement``:

- ``offloaded.OffloadedState``: fp32 master weights, moments and the fp32 gradient
  accumulator in the host pool, updated tile by tile by the CPU Adam kernel;
- ``resident.ResidentState``: the same state on the device, updated by torch's fused AdamW.

The lifecycle (``grad_lifecycle.py``) decides *when*; the backend does *what*, for its
placement. Nothing here overrides a method into a no-op for the other placement.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from ...accelerator import Event
from ...memory.pool import BlockPool
from ..ranks import Ranks

__all__ = ["AdamHyper", "BucketPools", "UpdateBackend"]


@dataclass(frozen=True)
class AdamHyper:
    """One param group's hyper-parameters for a step."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    amsgrad: bool
    maximize: bool
    #: True: AdamW's decoupled decay (``param *= 1 - lr * wd``); False: Adam's L2 term.
    decoupled: bool = True


@dataclass(frozen=True)
class BucketPools:
    """Where a bucket's buffers come from."""

    device: BlockPool  # weights_dev, gradient buffers, and a resident bucket's fp32 state
    host: BlockPool  # an offloaded bucket's fp32 state and staging


class UpdateBackend(ABC):
    """A bucket's optimizer state and update, for one placement."""

    #: Whether the state lives on the device (no tier crossing).
    resident: bool

    @abstractmethod
    def open_grad(self, *, new_window: bool, grow: bool = False) -> None:
        """Open the ``(padded_numel,)`` device tensor this backward's gradients add into,
        zeroed where it must be (``new_window``: the window's first). Raises
        ``PoolExhausted`` when no device buffer is free, unless ``grow`` allows an extra
        pool (several ranks); nothing changes then."""

    def can_adopt(self, grad: torch.Tensor) -> bool:
        """Whether ``grad`` (a parameter's own autograd gradient) can serve as the open
        buffer itself, with no device copy (Note [a lone gradient is its own buffer] in
        offloaded.py)."""
        return False

    def adopt_grad(self, grad: torch.Tensor, *, new_window: bool) -> None:
        """Take ``grad`` as the open buffer (only where ``can_adopt``)."""
        raise RuntimeError(f"{type(self).__name__} cannot adopt a gradient (bug)")

    @abstractmethod
    def add_grad(self, slot_index: int, grad: torch.Tensor) -> None:
        """Add one parameter's flat gradient into its slot of the open buffer (on the
        compute stream)."""

    @abstractmethod
    def flush(self, *, overwrite: bool, ranks: Ranks) -> None:
        """Hand the open gradient buffer on (FILLING -> IN_FLIGHT): average it over the
        ranks, copy this rank's shard to the host and queue its accumulation (``overwrite``
        for the window's first flush); the buffer is released."""

    @abstractmethod
    def discard_grad(self) -> None:
        """Release the open gradient buffer without using it (``zero_grad``)."""

    @abstractmethod
    def window_source(self) -> str:
        """The name of the field holding the window's gradient now (what a step planned
        now must read, even if a later flush changes it)."""

    def require_accumulator(self) -> None:
        """Accumulate every window in fp32, even a lone flush (``overlap_step``)."""
        return None

    @abstractmethod
    def grad_sumsq(self) -> tuple[float, bool]:
        """Sum of squares of the window's accumulated gradient (this rank's shard) and
        whether any is non-finite; the caller drained the host worker first."""

    @abstractmethod
    def update(
        self,
        hyper: AdamHyper,
        grad_scale: float,
        runs: list[tuple[int, int, int]],
        *,
        publish: bool,
        source: str | None = None,
        after: list[Event] | None = None,
    ) -> None:
        """One Adam(W) step over ``runs`` (``(start, stop, step)`` bucket ranges), reading
        the gradient from ``source`` (``window_source()`` when the step was planned; now
        when None). With ``publish`` each updated tile's copy to ``weights_dev`` is issued
        as soon as the tile is done, after ``after`` (default: the compute issued so far);
        otherwise ``publish()`` issues them later."""

    @abstractmethod
    def publish(self) -> list[Event]:
        """Issue the weight copies not yet issued; the end events of every copy issued
        since the last ``publish`` (the next forward waits on them)."""

    @abstractmethod
    def drop_unpublished(self) -> None:
        """Forget updated tiles not yet copied (the weights were written since: they win)."""

    @abstractmethod
    def publish_all_from_master(self) -> None:
        """Mark every tile as updated but unpublished: the next ``publish`` writes the
        training-dtype rounding of the master (resuming a delayed update)."""

    @abstractmethod
    def reconcile_master(self) -> None:
        """Where a weight is not the rounding of the master, take the weight into the
        master; see Note [weights written outside the optimizer] in ``param_views.py``."""

    #: Whether ``state_tensors()`` can be copied aside and restored (a speculative step,
    #: Note [speculative steps] in stepping.py); False where the state is not in memory.
    supports_speculation = True

    def state_names(self) -> tuple[str, ...]:
        """The state fields this bucket keeps, without touching them."""
        return tuple(self.state_tensors())

    @abstractmethod
    def state_tensors(self) -> dict[str, torch.Tensor]:
        """This rank's flat state fields by name (master, exp_avg, exp_avg_sq, and
        max_exp_avg_sq with amsgrad), each ``(shard_numel,)`` from the shard's start."""

    @abstractmethod
    def close(self) -> None:
        """Return every block to its pool."""
