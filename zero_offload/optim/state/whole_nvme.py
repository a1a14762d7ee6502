"""NVMe state for a rule that reads whole parameters (Adafactor, Muon): ``NvmeState``'s
records, whose tiles follow the parameters, and the shaped state in host RAM.

Note [NVMe tiles follow whole parameters] in ``nvme_plan.py`` says why and what it costs;
the stream is ``NvmeState``'s (Note [the step streams the state] in ``nvme.py``), and each
tile's parameters are stepped one whole parameter per call (``RuleTiles.step_parameter``),
as ``whole.WholeParameterHostState`` steps them in RAM. One rank only: the bucket's shard
is the whole bucket.
"""

from __future__ import annotations

import bisect

import torch

from ...accelerator import Event
from ...memory.manager import TieredMemoryManager
from ...memory.pool import BlockPool
from ...partition import BucketLayout
from ...views import ParamViews
from ..access import declare_cpu
from ..grads.path import GradientPath, GradSource
from ..publish import Publish
from ..rule.base import Hyper, OptimizerRule
from .nvme import NvmeState
from .nvme_plan import RecordLayout
from .shaped import KeepsShapedState, ShapedState
from .store import refuse_take_written
from .stream_group import StreamGroup

__all__ = ["WholeParameterNvmeState"]


class WholeParameterNvmeState(KeepsShapedState, NvmeState):
    """``NvmeState`` for a rule that is not elementwise; see the module docstring.

    Host fields beyond ``NvmeState``'s:
        _shaped: every slot's shaped state (the rule's ``param_state``) in one fp32 block of
            the host pool, ``ShapedState``.
        _slots_of: per tile, the indices of the slots it holds (whole, in order).
    """

    def __init__(
        self,
        layout: BucketLayout,
        views: ParamViews,
        *,
        manager: TieredMemoryManager,
        host_pool: BlockPool,
        gradients: GradientPath,
        shard: tuple[int, int],
        record: RecordLayout,
        group: StreamGroup,
        name: str,
        rule: OptimizerRule,
    ) -> None:
        if shard != (0, layout.padded_numel) or not record.whole:
            raise RuntimeError(
                f"bucket {layout.index}: the {rule.name} rule reads whole parameters but this "
                f"NVMe store holds the shard {shard} of {layout.padded_numel} elements in "
                f"records whole={record.whole} (a bug: several ranks are refused at "
                "construction, and the plan's record follows parameters for such a rule)"
            )
        self._shaped = ShapedState(layout, rule.param_state, shard=shard, rule=rule.name)
        super().__init__(
            layout,
            views,
            manager=manager,
            host_pool=host_pool,
            gradients=gradients,
            shard=shard,
            record=record,
            group=group,
            name=name,
            rule=rule,
        )
        try:
            self._slots_of: list[list[int]] = [[] for _ in range(self.tiles)]
            for index, slot in enumerate(layout.slots):
                tile = self._tile_of(slot.offset)
                lo, hi = self._disk().tile_range(tile)
                if not lo <= slot.offset < slot.end <= hi:
                    raise RuntimeError(
                        f"bucket {layout.index}: slot {index} [{slot.offset}, {slot.end}) "
                        f"crosses tile {tile} [{lo}, {hi}) (a bug: Note [NVMe tiles follow "
                        "whole parameters])"
                    )
                self._slots_of[tile].append(index)
            self._shaped.allocate(host_pool, owner=f"bucket{layout.index}.param_state")
        except BaseException:
            self.close()
            raise

    def _tile_of(self, element: int) -> int:
        """The tile holding shard element ``element``."""
        return bisect.bisect_right(self._disk().starts, element) - 1

    def update(
        self,
        hyper: Hyper,
        grad_scale: float,
        runs: list[tuple[int, int, int]],
        *,
        publish: Publish,
        source: GradSource | None = None,
        after: list[Event] | None = None,
        take_written: bool = False,
    ) -> None:
        """As ``NvmeState.update``, one whole parameter per call of the rule: each slot in
        the runs, where its tile's record lies in the I/O buffer (the alignment gaps are not
        stepped, as in ``WholeParameterHostState.update``)."""
        refuse_take_written(self, take_written)
        tiles = self._rule_tiles(hyper, grad_scale, source=source, publish=publish, after=after)
        written = {"weights": self.weights_staging}
        if self._shaped.flat is not None:
            written["param_state"] = self._shaped.flat
        for what, tensor in written.items():
            declare_cpu(
                self.manager,
                tensor,
                bucket=self.layout.index,
                write=True,
                what=f"the CPU update writes {what}",
            )
        pieces = self._disk().pieces(runs)
        fp32 = self.dtype == torch.float32
        slots = self.layout.slots

        def step_tile(tile: int, fields: dict[str, torch.Tensor]) -> None:
            base = self._disk().tile_range(tile)[0]
            for lo, hi, step in pieces[tile]:
                for index in self._slots_of[tile]:
                    slot = slots[index]
                    if slot.offset < lo or slot.end > hi:
                        continue
                    a, b = slot.offset - base, slot.end - base
                    staging = self.weights_staging[slot.offset : slot.end]
                    tiles.step_parameter(
                        slot.offset,
                        slot.end,
                        step,
                        {name: view[a:b] for name, view in fields.items()},
                        self.param_state(index),
                        shape=tuple(slot.shape),
                        out=None if fp32 else staging,
                        copy_master_to=staging if fp32 else None,
                    )

        self._stream(step_tile, sorted(pieces), prefetch_next=True)
