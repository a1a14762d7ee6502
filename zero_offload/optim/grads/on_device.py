"""The gradient path that stays on the device: gradients add straight into an fp32
accumulator there (the device-resident state store, ``state/resident.py``, reads it).

Nothing crosses a tier, so there is no buffer per backward: the accumulator is the open
buffer of every backward of the window, zeroed when a window opens. A flush hands nothing on
(the window's gradient is already where the step reads it), and ``zero_grad`` has nothing
to release (the next window's first gradient zeroes the accumulator).
"""

from __future__ import annotations

import torch

from ...memory.block import Block
from ...memory.pool import BlockPool
from ...partition import BucketLayout
from ..ranks import Ranks
from .path import GradientPath, GradSource, SumSqParts

__all__ = ["DeviceGradients"]


class DeviceGradients(GradientPath):
    """Gradients accumulated on the device.

    Fields:
        grad_acc: (padded_numel,) fp32, device pool; the window's gradient.
    """

    def __init__(self, layout: BucketLayout, *, device_pool: BlockPool) -> None:
        self.layout = layout
        n = layout.padded_numel
        self._block: Block = device_pool.alloc(4 * n, owner=f"bucket{layout.index}.grad_acc")
        self._block.on_move(lambda b: setattr(self, "grad_acc", b.view(torch.float32, (n,))))
        self.grad_acc = self._block.view(torch.float32, (n,))
        self.grad_acc.zero_()

    def open_grad(self, *, new_window: bool, grow: bool = False) -> None:
        if new_window:
            self.grad_acc.zero_()

    def add_grad(self, slot_index: int, grad: torch.Tensor) -> None:
        slot = self.layout.slots[slot_index]
        self.grad_acc[slot.offset : slot.end].add_(grad)

    def flush(self, *, overwrite: bool, ranks: Ranks) -> None:
        """The gradients are already in the accumulator the step reads: nothing moves."""

    def discard_grad(self) -> None:
        """The accumulator is zeroed when the next window opens: nothing to release."""

    def await_grad(self, grad: torch.Tensor, source: GradSource, lo: int, hi: int) -> None:
        """Nothing to wait for: the accumulator is written and read on the compute stream,
        in order (the resident store's update runs there)."""

    def window_source(self) -> GradSource:
        return GradSource.ACCUMULATOR

    def gradient(self, source: GradSource) -> torch.Tensor:
        return self.grad_acc

    def stats_on_host(self) -> bool:
        return False  # the norms are taken on the device, below

    def grad_sumsq(self) -> SumSqParts:
        # One partial per parameter (a function of its values only, whatever the bucket:
        # Note [the norm does not depend on the bucketing] in stat_cells.py), its float64
        # norm, left on the device: the caller reads all buckets' at once (no sync here).
        # In float64 the squares of finite fp32 values cannot overflow, so a norm is
        # non-finite exactly when some gradient is.
        norms = torch.stack(
            [
                torch.linalg.vector_norm(self.grad_acc[s.offset : s.end], dtype=torch.float64)
                for s in self.layout.slots
            ]
        )
        return SumSqParts([], False, norms)

    def close(self) -> None:
        self._block.free()
