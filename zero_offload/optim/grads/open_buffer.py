"""A bucket's open device gradient buffer: where one backward's gradients add up before the
flush copies them to the host (``to_host.py``) or into the device accumulator.

The buffer is opened at the bucket's first gradient of a backward and handed on (freed once
the copies out of it are queued) at the flush. Between the two, each slot is written once
and added into after (Note [a gradient buffer is written once per slot]); a bucket of one
parameter may use autograd's own tensor instead (Note [a lone gradient is its own buffer]).
"""

from __future__ import annotations

import numpy as np
import torch

from ...memory.block import Block
from ...memory.manager import TieredMemoryManager
from ...memory.pool import BlockPool
from ...partition import BucketLayout
from ..access import declare_compute
from .buffers import GradBuffers

__all__ = ["OpenBuffer"]

# Note [a lone gradient is its own buffer]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A bucket of one parameter (a parameter larger than bucket_bytes: an embedding table, a
# large projection) with one rank needs no device gradient buffer: autograd's gradient
# tensor is copied to the host directly, saving a device copy (and a zeroing pass) of
# every element. The tensor stays referenced until its copy is issued; the accelerator
# keeps the caching allocator from reusing it before the copy is done (record_stream
# on CUDA, Note in accelerator/cuda.py copy_). A second gradient for it in the same
# buffer, or several ranks (the reduce-scatter needs the padded buffer), take the
# ordinary path.

# Note [a gradient buffer is written once per slot]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A fresh device gradient buffer is not zeroed as a whole: a slot's first gradient is
# copied in (read 2 + write 2 bytes per element of bf16, instead of a zeroing pass and a
# read-modify-write add), a second one is added, and at the flush the slots that got none
# are zeroed, so the buffer is exact everywhere it is read.


class OpenBuffer:
    """One bucket's device gradient buffer while it is FILLING.

    Fields:
        tensor: (padded_numel,) training dtype, from the device pool (or an overflow pool),
            while open; empty otherwise.
        block: the block under ``tensor`` while open; None otherwise.
        adopted: a lone parameter's own autograd gradient, flat, used as the buffer (Note
            [a lone gradient is its own buffer]); None otherwise.
    """

    def __init__(
        self,
        layout: BucketLayout,
        *,
        manager: TieredMemoryManager,
        device_pool: BlockPool,
        grad_buffers: GradBuffers,
        shard: tuple[int, int],
        dtype: torch.dtype,
    ) -> None:
        self.layout = layout
        self.manager = manager
        self.device_pool = device_pool
        self.grad_buffers = grad_buffers
        self.shard = shard
        self.dtype = dtype
        self.block: Block | None = None
        self.adopted: torch.Tensor | None = None
        self.tensor = torch.empty(0, dtype=dtype, device=manager.accelerator.device)
        # (n_slots,) bool, host: which slots of the buffer hold a gradient (Note [a
        # gradient buffer is written once per slot]); reset when a buffer opens.
        self._filled = np.zeros(len(layout.slots), dtype=bool)

    @property
    def is_open(self) -> bool:
        """Whether a buffer (a block or an adopted tensor) is open."""
        return self.block is not None or self.adopted is not None

    def can_adopt(self, grad: torch.Tensor) -> bool:
        """Whether ``grad`` can serve as the buffer as it is."""
        return (
            len(self.layout.slots) == 1
            and self.shard == (0, self.layout.padded_numel)
            and grad.dtype == self.dtype
            and grad.device == self.tensor.device
            and grad.is_contiguous()
            and grad.layout is torch.strided
        )

    def adopt(self, grad: torch.Tensor) -> None:
        """Take ``grad`` (the only parameter's gradient) as the open buffer."""
        self.adopted = grad.reshape(-1)

    def open(self, *, grow: bool) -> None:
        """Take a buffer from the device pool; only its padding is zeroed (Note [a gradient
        buffer is written once per slot]). Raises ``PoolExhausted`` with nothing taken."""
        nbytes = self.layout.padded_numel * self.dtype.itemsize
        block = self.grad_buffers.alloc(
            self.device_pool, nbytes, owner=f"bucket{self.layout.index}.grad", grow=grow
        )
        block.on_move(self._bind)
        self.block = block
        self._bind(block)
        pad = self.tensor[self.layout.numel :]
        self._declare(pad, what="pad zeroing")
        pad.zero_()
        self._filled = np.zeros(len(self.layout.slots), dtype=bool)

    def add(self, slot_index: int, grad: torch.Tensor) -> None:
        """Copy (the slot's first) or add ``grad`` into its slot, on the compute stream."""
        if self.adopted is not None:
            raise RuntimeError(
                f"bucket {self.layout.index} still holds a gradient that a failed backward or "
                "step left behind (its flush never ran; the error was raised then): call "
                "opt.zero_grad() to clear the window, then reload or rebuild the optimizer as "
                "that error said (Note [a lone gradient is its own buffer])"
            )
        slot = self.layout.slots[slot_index]
        view = self.tensor[slot.offset : slot.end]
        self._declare(view, what=f"backward writes slot {slot_index}")
        if self._filled[slot_index]:
            view.add_(grad)
        else:
            view.copy_(grad)
            self._filled[slot_index] = True

    def zero_unfilled(self) -> None:
        """Zero the slots no gradient reached (and the alignment gaps between slots)."""
        slots, filled = self.layout.slots, self._filled
        position = 0
        for i, slot in enumerate(slots):
            if filled[i]:
                if slot.offset > position:
                    gap = self.tensor[position : slot.offset]
                    self._declare(gap, what="zeroing unfilled slots")
                    gap.zero_()
                position = slot.end
        if self.layout.numel > position:
            tail = self.tensor[position : self.layout.numel]
            self._declare(tail, what="zeroing unfilled slots")
            tail.zero_()

    def flushable_block(self) -> Block:
        """The open buffer's block, for a flush; raises when an interrupted backward (Note
        [an interrupted gradient path] in ``to_host.py``) left the lifecycle saying FILLING
        while the path already handed the buffer on or dropped it."""
        if self.block is None:
            raise RuntimeError(
                f"bucket {self.layout.index}: its device gradients were already handed on: a "
                "backward was interrupted half-way (KeyboardInterrupt) and its window was not "
                "discarded. Call opt.zero_grad() after an interrupted backward"
            )
        return self.block

    def release(self) -> Block:
        """Hand the buffer's block on (the caller frees it once its copies are queued)."""
        block = self.block
        if block is None:
            raise RuntimeError(f"bucket {self.layout.index}: no device gradient buffer (bug)")
        self.block = None
        self.tensor = torch.empty(0, dtype=self.dtype, device=self.tensor.device)
        return block

    def drop(self) -> None:
        """Drop the open buffer, if any: Note [an interrupted gradient path] in
        ``to_host.py``."""
        self.adopted = None  # autograd's tensor: dropping it is all
        if self.block is not None:
            self.release().free()

    def _bind(self, block: Block) -> None:
        self.tensor = block.view(self.dtype, (self.layout.padded_numel,))

    def _declare(self, tensor: torch.Tensor, *, what: str) -> None:
        declare_compute(self.manager, tensor, bucket=self.layout.index, write=True, what=what)
