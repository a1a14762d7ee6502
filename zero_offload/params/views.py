"""A bucket's parameters under parameter offload: views of the unit's slot while the unit is
on the device, views of the pinned home otherwise.

``WindowedViews`` is the ``ParamViews`` of an offloaded-parameter bucket. What differs:
``weights_dev`` is a fixed range of the unit's slot (Note [a unit always returns to its
slot] in ``window.py``), not a block of the bucket's own, and the parameters are re-pointed
between it and the home as the unit comes and goes (Note [a unit's lifecycle] in
``unit.py``). The re-pointing goes through here, so ``detached()`` compares each parameter
with where it should point *now* and never takes the window's moves for a replacement behind
the optimizer (Note [parameters replaced behind the optimizer] in ``views/param_views.py``).

Construction copies the model's initial weights into the slot, exactly as ``ParamViews``
copies them into ``weights_dev``, so the backend's ``reconcile_master`` derives the fp32
master from them unchanged; ``adopt_home`` then moves the parameters onto the home, and the
slot is free for the next unit.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import torch

from ..memory.block import Block
from ..partition import BucketLayout
from ..views import ParamViews
from ..weights.source import fill
from .window import Slot

if TYPE_CHECKING:
    from ..accelerator import Event
    from ..memory.manager import TieredMemoryManager


class SlotHolder(Protocol):
    """What the views ask of their unit (``unit.ParamUnit``; a protocol, so this module
    stays below the unit that builds it)."""

    slot: Slot  # the window slot the unit's weights use while resident
    resident: bool  # the parameters point at the slot now
    content_valid: bool  # the slot holds the unit's current weights


__all__ = ["WindowedViews"]


class WindowedViews(ParamViews):
    """Fields (beyond ``ParamViews``'):
    weights_dev: (padded_numel,) training dtype, the unit's slot at this bucket's offset;
        holds this bucket's weights only while the unit is resident.
    block: the slot's block (copies record their events on it).
    home: (padded_numel,) training dtype, pinned host; the authoritative weights (None
        until ``adopt_home``); ``home_block`` its block.
    bound: the tensor the parameters are views of now (``weights_dev`` or ``home``).
    """

    def __init__(
        self,
        layout: BucketLayout,
        params: Sequence[torch.nn.Parameter],
        unit: SlotHolder,
        region: torch.Tensor,
    ) -> None:
        # Not ParamViews.__init__: the device bytes are the slot's, not a block of our own.
        self.layout = layout
        self.params = list(params)
        self.dtype = self.params[0].dtype
        self.unit = unit
        self.block: Block = unit.slot.block
        self.weights_dev = region
        self.home: torch.Tensor | None = None
        self.home_block: Block | None = None
        with torch.no_grad():
            region.zero_()  # see Note [padding stays at the end] in partition.py
            for slot, param in zip(layout.slots, self.params, strict=True):
                fill(param, region[slot.offset : slot.end])
        self.bound = region
        self._point_at(region)  # releases the original storage (one copy of the model)
        self.versions: tuple[int, ...] | None = None

    def _point_at(self, flat: torch.Tensor) -> None:
        for slot, param in zip(self.layout.slots, self.params, strict=True):
            param.data = flat[slot.offset : slot.end].view(slot.shape)
        self.bound = flat

    def _bind(self, block: Block) -> None:
        raise RuntimeError("a window slot never moves (its pool does not defragment) (bug)")

    def adopt_home(self, home: torch.Tensor, home_block: Block) -> None:
        """The backend is built and its home holds the weights: the parameters move there."""
        if home.numel() != self.layout.padded_numel or home.dtype != self.dtype:
            raise RuntimeError(
                f"bucket {self.layout.index}: home {tuple(home.shape)} {home.dtype} does not "
                f"match ({self.layout.padded_numel},) {self.dtype} (bug)"
            )
        self.home, self.home_block = home, home_block
        self._point_at(home)

    def home_pair(self) -> tuple[torch.Tensor, Block]:
        """``(home, home_block)``, the source of every fetch."""
        if self.home is None or self.home_block is None:
            raise RuntimeError(f"bucket {self.layout.index}: no home yet (bug)")
        return self.home, self.home_block

    def bind_device(self) -> None:
        """The unit is fetched: the parameters become views of the slot."""
        self._point_at(self.weights_dev)

    def bind_home(self) -> None:
        """The unit is released: the parameters become views of the home."""
        self._point_at(self.home_pair()[0])

    def unbind(self) -> None:
        for param in self.params:
            param.data = param.data.clone()

    def bound_to(self) -> torch.Tensor:
        """The slot while the unit is resident, the home otherwise (what ``detached()``
        compares each parameter with)."""
        return self.bound

    def copy_in(
        self,
        manager: TieredMemoryManager,
        lo: int,
        hi: int,
        source: torch.Tensor,
        source_block: Block,
        *,
        after: list[Event],
        label: str,
    ) -> Event | None:
        # The step wrote the home itself; the unit's next fetch brings it. A resident unit
        # would now hold stale weights: ParamOffloader.before_step released every unit.
        if self.unit.resident:
            raise RuntimeError(f"{self.unit!r}: stepped while on the device (bug)")
        if source_block is not self.home_block:
            raise RuntimeError(f"bucket {self.layout.index}: update outside the home (bug)")
        self.unit.content_valid = False
        return None

    def copy_out(
        self,
        manager: TieredMemoryManager,
        lo: int,
        hi: int,
        target: torch.Tensor,
        target_block: Block,
        *,
        label: str,
    ) -> Event | None:
        if self.home is None:  # construction: the weights are in the slot
            return super().copy_out(manager, lo, hi, target, target_block, label=label)
        if target_block is not self.home_block or self.unit.resident:
            raise RuntimeError(f"bucket {self.layout.index}: weights read off-home (bug)")
        return None  # the parameters are views of the home: writes landed there

    def close(self) -> None:
        """Nothing of its own to free: the slot is the window's, the home the backend's."""
        self.home = self.home_block = None
