"""One bucket's shaped state, for a rule that reads whole parameters: every slot's
``param_state`` fields (Adafactor's factors, Muon's momentum buffer) in one fp32 block of a
host pool, slot after slot (Note [rules that read a whole parameter] in ``rule/base.py``).

Both stores of such a rule keep it so: ``whole.WholeParameterHostState`` beside its
per-element fields in RAM, ``whole_nvme.WholeParameterNvmeState`` beside its records on
NVMe (Note [NVMe tiles follow whole parameters] in ``nvme_plan.py``).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from ...memory.block import Block
from ...memory.pool import BlockPool
from ...partition import BucketLayout
from ..rule.base import ParamField

__all__ = ["KeepsShapedState", "ShapedState"]


class ShapedState:
    """A bucket's shaped state in one block of ``host_pool``, starting at 0 (``ParamField``),
    of the slots in this rank's ``shard`` (each lies whole inside it or outside it: Note [a
    whole parameter has one owner] in ``partition.py``).

    Host fields:
        flat: (numel,) fp32, host pool (None without shaped state, or once closed): the
            fields of the slots in the shard, slot after slot, each slot's in the rule's
            order.
        _offsets: per slot, ``(name, offset, shape)`` of each of its fields in ``flat``
            (none for another rank's slot).
    """

    def __init__(
        self,
        layout: BucketLayout,
        fields_of: Callable[[tuple[int, ...]], tuple[ParamField, ...]],
        host_pool: BlockPool,
        *,
        shard: tuple[int, int],
        rule: str,
    ) -> None:
        start, stop = shard
        self._offsets: list[tuple[tuple[str, int, tuple[int, ...]], ...]] = []
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
            entries = []
            for f in fields_of(tuple(slot.shape)) if inside else ():
                entries.append((f.name, offset, f.shape))
                offset += f.numel
            self._offsets.append(tuple(entries))
        self.numel = offset
        self.flat: torch.Tensor | None = None
        self._block: Block | None = None
        if offset == 0:
            return
        block = host_pool.alloc(4 * offset, owner=f"bucket{layout.index}.param_state")
        self._block = block
        block.on_move(lambda b: self._bind(b.view(torch.float32, (offset,))))
        self._bind(block.view(torch.float32, (offset,)))
        self.flat.zero_()  # type: ignore[union-attr]

    def _bind(self, tensor: torch.Tensor) -> None:
        self.flat = tensor

    @property
    def nbytes(self) -> int:
        """Bytes of the fields (the block's alignment aside)."""
        return 4 * self.numel

    def of(self, slot_index: int) -> dict[str, torch.Tensor]:
        """Slot ``slot_index``'s fields by name, each a view shaped as the rule declares."""
        flat = self.flat
        if flat is None:
            return {}
        return {
            name: flat[offset : offset + math.prod(shape)].view(shape)
            for name, offset, shape in self._offsets[slot_index]
        }

    def close(self) -> None:
        """Return the block to its pool."""
        if self._block is not None:
            self._block.free()
            self._block = None
            self.flat = None


class KeepsShapedState:
    """What a store of such a rule answers from its ``ShapedState`` (``shaped``, None until
    allocated and once closed); mixed in before the store's base class."""

    shaped: ShapedState | None

    def param_state(self, slot_index: int) -> dict[str, torch.Tensor]:
        return {} if self.shaped is None else self.shaped.of(slot_index)

    def param_state_bytes(self) -> int:
        return 0 if self.shaped is None else self.shaped.nbytes

    def close_shaped(self) -> None:
        """Return the shaped state's block to its pool (the store's ``close`` calls it)."""
        if self.shaped is not None:
            self.shaped.close()
            self.shaped = None
