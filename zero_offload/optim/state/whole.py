"""Host-RAM state for a rule that reads whole parameters (Adafactor): ``HostState``'s fields,
plus the parameters' shaped state, stepped one whole parameter at a time.

Note [rules that read a whole parameter] in ``rule/base.py`` says why; this store is where
it is kept. Every parameter of the bucket lies whole in this rank's shard or wholly outside
it (one rank: the shard is the whole bucket; several: Note [a whole parameter has one
owner] in ``partition.py``), and the store keeps and steps the shaped state of the ones
inside, its own. With parameter offload (one rank) the host pool is its unit's, sized with
the shaped state as the segment's one pool is without it.
"""

from __future__ import annotations

import torch

from ...accelerator import Event
from ...memory.block import Block
from ...memory.manager import TieredMemoryManager
from ...memory.pool import BlockPool
from ...partition import BucketLayout, clip_runs
from ...views import ParamViews
from ..access import declare_cpu
from ..grads.path import GradientPath, GradSource
from ..publish import Publish
from ..rule.base import Hyper, OptimizerRule, StateFields
from ..rule.tiles import RuleTiles
from .host import HostState

__all__ = ["WholeParameterHostState"]


class WholeParameterHostState(HostState):
    """``HostState`` for a rule that is not elementwise; see the module docstring.

    Host fields beyond ``HostState``'s:
        param_state_flat: (param_state_numel,) fp32, host pool: the shaped state (the
            rule's ``param_state``) of the slots in this rank's shard, slot after slot,
            each slot's fields in order.
        _param_offsets: per slot, ``(name, offset, shape)`` of each of its fields there
            (none for another rank's slot).
    """

    # The shaped state is not in state_tensors(): a speculative step's copy would miss it
    # (Note [speculative steps] in update/eager.py), so such a bucket steps in step().
    supports_speculation = False

    def __init__(
        self,
        layout: BucketLayout,
        views: ParamViews,
        *,
        manager: TieredMemoryManager,
        host_pool: BlockPool,
        gradients: GradientPath,
        shard: tuple[int, int],
        rule: OptimizerRule,
        fields: StateFields,
        tile_elements: int,
    ) -> None:
        start, stop = shard
        self._param_offsets: list[tuple[tuple[str, int, tuple[int, ...]], ...]] = []
        offset = 0
        for slot in layout.slots:
            inside = start <= slot.offset and slot.end <= stop
            if not inside and slot.offset < stop and slot.end > start:
                raise RuntimeError(
                    f"bucket {layout.index}: the {rule.name} rule reads whole parameters but "
                    f"parameter {slot.index} ({slot.offset}, {slot.end}) straddles this "
                    f"rank's shard {shard} (a bug: Note [a whole parameter has one owner] "
                    "in partition.py)"
                )
            entries = []
            for f in fields.fields_of(slot.shape) if inside else ():
                entries.append((f.name, offset, f.shape))
                offset += f.numel
            self._param_offsets.append(tuple(entries))
        self._param_numel = offset
        self.param_state_flat: torch.Tensor | None = None
        self._param_block: Block | None = None
        super().__init__(
            layout,
            views,
            manager=manager,
            host_pool=host_pool,
            gradients=gradients,
            shard=shard,
            rule=rule,
            fields=fields,
            tile_elements=tile_elements,
        )
        if offset == 0:
            return
        try:
            block = host_pool.alloc(4 * offset, owner=f"bucket{layout.index}.param_state")
            self._param_block = block
            block.on_move(lambda b: self._bind_param_state(b.view(torch.float32, (offset,))))
            self._bind_param_state(block.view(torch.float32, (offset,)))
            self.param_state_flat.zero_()  # type: ignore[union-attr]
        except BaseException:
            self.close()
            raise

    def _bind_param_state(self, tensor: torch.Tensor) -> None:
        self.param_state_flat = tensor

    def param_state(self, slot_index: int) -> dict[str, torch.Tensor]:
        flat = self.param_state_flat
        if flat is None:
            return {}
        return {
            name: flat[offset : offset + _numel(shape)].view(shape)
            for name, offset, shape in self._param_offsets[slot_index]
        }

    def param_state_bytes(self) -> int:
        return 4 * self._param_numel

    def update(
        self,
        hyper: Hyper,
        grad_scale: float,
        runs: list[tuple[int, int, int]],
        *,
        publish: Publish,
        source: GradSource | None = None,
        after: list[Event] | None = None,
    ) -> None:
        """As ``HostState.update``, one whole parameter per call of the rule: each slot in
        the runs (the alignment gaps between them are not stepped: they hold zeros that no
        one reads, Note [a run spans the gaps between its slots])."""
        tiles = RuleTiles(
            self.rule,
            self.gradients,
            self.publication,
            hyper,
            grad_scale,
            source=source,
            publish=publish,
            after=after,
        )
        bucket = self.layout.index
        spans = clip_runs(runs, *self.shard)
        if spans:  # the gradient first: that wait orders the writes declared next
            tiles.wait(min(lo for lo, _, _ in spans), max(hi for _, hi, _ in spans))
        written = dict(self.state_tensors())
        if self.weights_staging is not None:
            written["weights"] = self.weights_staging
        if self.param_state_flat is not None:
            written["param_state"] = self.param_state_flat
        for name, tensor in written.items():
            declare_cpu(
                self.manager,
                tensor,
                bucket=bucket,
                write=True,
                what=f"the CPU update writes {name}",
            )
        state = self.state_tensors()
        out = self.weights_staging
        first = self.shard[0]
        for start, stop, step in spans:
            for index, slot in enumerate(self.layout.slots):
                lo, hi = slot.offset - first, slot.end - first  # shard elements
                if lo < start or hi > stop:  # another rank's, or not in this run
                    continue
                tiles.step_parameter(
                    lo,
                    hi,
                    step,
                    {name: tensor[lo:hi] for name, tensor in state.items()},
                    self.param_state(index),
                    shape=slot.shape,
                    out=None if out is None else out[lo:hi],
                )

    def close(self) -> None:
        if self._param_block is not None:
            self._param_block.free()
            self._param_block = None
        super().close()


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for dim in shape:
        n *= dim
    return n
