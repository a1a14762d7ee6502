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

from ...accelerator import Event
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
from .nvme_plan import whole_parameter_tiles
from .shaped import KeepsShapedState, ShapedState, whole_parameters
from .store import TileFn, refuse_take_written

__all__ = ["WholeParameterHostState"]


class WholeParameterHostState(KeepsShapedState, HostState):
    """``HostState`` for a rule that is not elementwise; see the module docstring.

    Host fields beyond ``HostState``'s:
        _shaped: the shaped state (the rule's ``param_state``) of the slots in this rank's
            shard, slot after slot, each slot's fields in order, in one fp32 block of the
            host pool (``ShapedState``; none for another rank's slot).
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
        rule: OptimizerRule,
        fields: StateFields,
        tile_elements: int,
    ) -> None:
        self._shaped = ShapedState(layout, fields.fields_of, shard=shard, rule=rule.name)
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
        self.allocate_shaped(host_pool, bucket=layout.index)

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
        """As ``HostState.update``, one whole parameter per call of the rule: each slot in
        the runs (``whole_parameters``). ``take_written`` only where the home is the fp32
        master (nothing to take: ``reconciles_in_update``)."""
        if take_written and not self.reconciles_in_update():
            refuse_take_written(self, take_written)
        tiles = RuleTiles(
            self.rule,
            self.gradients,
            self.publication,
            hyper,
            grad_scale,
            source=source,
            publish=publish,
            after=after,
            take_written=take_written,
        )
        bucket = self.layout.index
        spans = clip_runs(runs, *self.shard)
        if spans:  # the gradient first: that wait orders the writes declared next
            tiles.wait(min(lo for lo, _, _ in spans), max(hi for _, hi, _ in spans))
        written = dict(self.state_tensors())
        if self.weights_staging is not None:
            written["weights"] = self.weights_staging
        if self._shaped.flat is not None:
            written["param_state"] = self._shaped.flat
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
        for index, slot, lo, hi, step in whole_parameters(self.layout, spans, self.shard[0]):
            tiles.step_parameter(
                lo,
                hi,
                step,
                {name: tensor[lo:hi] for name, tensor in state.items()},
                self.param_state(index),
                shape=slot.shape,
                out=None if out is None else out[lo:hi],
            )

    def stream_fields(self, fn: TileFn, *, read: bool = True, write: bool = False) -> None:
        """As ``HostState.stream_fields``, in the tiles the NVMe store keeps (runs of whole
        parameters, Note [NVMe tiles follow whole parameters] in ``nvme_plan.py``), so a
        bucket streams the same tiles in either placement (a streamed checkpoint moves
        between them). On several ranks (no NVMe there) in ``tile_elements`` tiles, as
        ``HostState``."""
        if self.shard != (0, self.layout.padded_numel):
            super().stream_fields(fn, read=read, write=write)
            return
        state, real, lo = self.state_tensors(), self.layout.real_in(*self.shard), 0
        for count in whole_parameter_tiles(self.layout, self.tile_elements):
            hi = min(lo + count, real)
            fn(lo, hi, {name: tensor[lo:hi] for name, tensor in state.items()})
            lo = hi
