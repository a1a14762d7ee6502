"""Where a bucket's shaped state lies in its one fp32 block, and which whole parameters a step
takes: shared by the stores of a rule that reads whole parameters, on the host
(``whole.py``) and on the device (``whole_resident.py``).

Note [rules that read a whole parameter] in ``rule/base.py`` says why such state exists; a
store keeps a bucket's shaped state in one fp32 block of its pool, the fields of the slots
it owns one after another in slot order, each slot's fields in the rule's order. The NVMe
store (``whole_nvme.py``) keeps it in host RAM the same way.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import torch

from ...memory.block import Block
from ...memory.pool import BlockPool
from ...partition import BucketLayout, ParamSlot
from ..rule.base import ParamField

__all__ = ["KeepsShapedState", "ShapedState", "whole_parameters"]


class ShapedState:
    """A bucket's shaped state: where each slot's fields lie, and the one fp32 block of a
    pool that holds them (``allocate``).

    Fields:
        entries[slot]: ``(name, offset, shape)`` of each field of that slot's shaped state
            (none for a slot outside ``shard``, another rank's).
        numel: the block's fp32 elements (0: no block).
        flat: (numel,) fp32, the block's view (host pool or device pool), re-pointed when
            the block moves; None before ``allocate`` or with no block.
    """

    def __init__(
        self,
        layout: BucketLayout,
        fields_of: Callable[[tuple[int, ...]], tuple[ParamField, ...]],
        *,
        shard: tuple[int, int],
        rule: str,
    ) -> None:
        start, stop = shard
        entries: list[tuple[tuple[str, int, tuple[int, ...]], ...]] = []
        offset = 0
        for slot in layout.slots:
            inside = start <= slot.offset and slot.end <= stop
            if not inside and slot.offset < stop and slot.end > start:
                raise RuntimeError(
                    f"bucket {layout.index}: the {rule} rule reads whole parameters but "
                    f"parameter {slot.index} ({slot.offset}, {slot.end}) straddles this "
                    f"rank's shard {shard} (a bug: Note [a whole parameter has one owner] "
                    "in partition.py)"
                )
            slot_entries = []
            for f in fields_of(tuple(slot.shape)) if inside else ():
                slot_entries.append((f.name, offset, f.shape))
                offset += f.numel
            entries.append(tuple(slot_entries))
        self.entries = tuple(entries)
        self.numel = offset
        self.flat: torch.Tensor | None = None
        self._block: Block | None = None

    def allocate(self, pool: BlockPool, *, owner: str) -> None:
        """Take the block from ``pool`` (nothing when there is no shaped state), zeroed: every
        field starts at 0 (``ParamField``)."""
        numel = self.numel
        if numel == 0:
            return
        block = pool.alloc(4 * numel, owner=owner)
        self._block = block
        block.on_move(lambda b: self._bind(b.view(torch.float32, (numel,))))
        self._bind(block.view(torch.float32, (numel,)))
        block.view(torch.float32, (numel,)).zero_()

    def _bind(self, tensor: torch.Tensor) -> None:
        self.flat = tensor

    @property
    def nbytes(self) -> int:
        """Bytes of the shaped state."""
        return 4 * self.numel

    def views(self, slot_index: int) -> dict[str, torch.Tensor]:
        """Slot ``slot_index``'s shaped state by name, views of the block shaped as the rule
        says (none without a block)."""
        flat = self.flat
        if flat is None:
            return {}
        return {
            name: flat[offset : offset + math.prod(shape)].view(shape)
            for name, offset, shape in self.entries[slot_index]
        }

    def close(self) -> None:
        """Return the block to its pool."""
        if self._block is not None:
            self._block.free()
            self._block = None
            self.flat = None


class KeepsShapedState:
    """What a store of a rule that reads whole parameters adds to its base store (put first
    in its bases): the slots' shaped state from ``_shaped`` (set before the base's
    ``__init__``), its block returned on ``close``, and no speculative steps."""

    _shaped: ShapedState

    # The shaped state is not in state_tensors(): a speculative step's copy would miss it
    # (Note [speculative steps] in update/eager.py), so such a bucket steps in step().
    supports_speculation = False

    def allocate_shaped(self, pool: BlockPool, *, bucket: int) -> None:
        """Take the shaped state's block from ``pool`` once the base store is built; if that
        fails the whole store is closed (every block back to its pool) and it raises."""
        try:
            self._shaped.allocate(pool, owner=f"bucket{bucket}.param_state")
        except BaseException:
            self.close()
            raise

    def param_state(self, slot_index: int) -> dict[str, torch.Tensor]:
        """See ``StateStore.param_state``."""
        return self._shaped.views(slot_index)

    def param_state_bytes(self) -> int:
        """See ``StateStore.param_state_bytes``."""
        return self._shaped.nbytes

    def close(self) -> None:
        """The block, then the base store's."""
        self._shaped.close()
        super().close()  # type: ignore[misc]


def whole_parameters(
    layout: BucketLayout, spans: list[tuple[int, int, int]], first: int
) -> Iterator[tuple[int, ParamSlot, int, int, int]]:
    """``(index, slot, lo, hi, step)`` of each slot lying whole in one of ``spans``
    (``(start, stop, step)`` in elements from ``first``, the store's span start): each
    parameter a step takes, in span then slot order. The alignment gaps between slots are
    not stepped: they hold zeros that no one reads (Note [a run spans the gaps between its
    slots])."""
    for start, stop, step in spans:
        for index, slot in enumerate(layout.slots):
            lo, hi = slot.offset - first, slot.end - first
            if lo >= start and hi <= stop:  # else another rank's, or not in this run
                yield index, slot, lo, hi, step
