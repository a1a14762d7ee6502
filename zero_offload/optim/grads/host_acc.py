"""One bucket's fp32 gradient accumulator on the host (``HostAccumulator``, one per
``HostGradients`` in ``to_host.py``), pinned on first need.

A window with one flush has no accumulator: the step reads staging, and the accumulator is
taken only once a window has a second flush, or its bucket's previous window had one (Note
[no accumulator for one backward] in ``to_host.py``, which decides when). Its pool is the
bucket's own (``AccumulatorPool``: pinned once, kept for later steps), so a bucket that
never accumulates costs nothing.
"""

from __future__ import annotations

import torch

from ...memory.block import Block
from ...memory.manager import TieredMemoryManager
from ...partition import BucketLayout
from .buffers import AccumulatorPool, accumulator_bytes

__all__ = ["HostAccumulator"]


class HostAccumulator:
    """One bucket's host accumulator; see the module docstring.

    Fields:
        memory: the bucket's ``AccumulatorPool`` (its pool is None until the first
            ``ensure``).
        tensor: (shard_numel,) fp32, host, pinned where available, from ``memory``; None
            until ``ensure``.
        block: the block under ``tensor``; None until ``ensure``, and after ``close``.
    """

    def __init__(
        self, manager: TieredMemoryManager, layout: BucketLayout, *, alignment: int, name: str
    ) -> None:
        self.layout = layout
        self.memory = AccumulatorPool(
            manager, accumulator_bytes(layout, alignment=alignment), name=name
        )
        self.tensor: torch.Tensor | None = None
        self.block: Block | None = None

    def ensure(self) -> torch.Tensor:
        """The accumulator, allocated and zeroed if it is not yet (hidden cost, once: a
        pinned allocation)."""
        if self.tensor is None:
            n = self.layout.shard_numel
            block = self.memory.alloc(4 * n, owner=f"bucket{self.layout.index}.grad_acc")
            self.block = block
            block.on_move(lambda b: setattr(self, "tensor", b.view(torch.float32, (n,))))
            self.tensor = block.view(torch.float32, (n,))
            self.tensor.zero_()  # padding stays zero (Note [padding stays at the end])
        return self.tensor

    def close(self) -> None:
        if self.block is not None:
            self.block.free()
        self.block = None
        self.memory.close()
