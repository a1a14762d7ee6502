"""Host-RAM state: the fp32 master and the rule's state in the host pool, updated on the CPU.

The rule's CPU kernel updates the master tile by tile (``rule/tiles.py``), reading the
gradient through the bucket's gradient path (``grads/path.py``; ``HostGradients`` of
``grads/to_host.py`` here), and each updated tile goes back
to the device (H2D on the ``h2d`` stream, ``publish.py``) while the next tile is
computed. With several ranks every field covers this rank's shard of the bucket,
``shard_numel`` elements (Note [who owns which shard] in ``partition.py``); after the
update each rank copies its updated shard into its slice of ``weights_dev`` and the
optimizer all-gathers the bucket.
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
from ..publish import Publish, WeightCopies
from ..rule.base import Hyper, OptimizerRule, StateFields
from ..rule.tiles import RuleTiles
from .store import (
    StateStore,
    TileFn,
    WeightsHome,
    refuse_take_written,
    republish_from_master,
    stream_tensors,
    weights_into_home,
)

__all__ = ["HostState"]


class HostState(StateStore):
    """State in host RAM, updated by the CPU kernel; see the module docstring.

    Host fields (all ``(shard_numel,)``, the elements of ``shard``; host pool, pinned where
    available):
        the rule's ``fields``: the fp32 master weights first, then the rule's own state
            (its moments in fp32 or bf16), in ``state``, by name.
        weights_staging: training dtype (absent for fp32: the master is the weights' home),
            the kernel's fused copy-out and the H2D copy's source.
        host_home: ``WeightsHome``, the weights' home (weights_staging, or the master) and its
            block, as the publication reads it. ``close`` drops every view.
    """

    resident = False
    location = "host"

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
        self.layout = layout
        self.views = views
        self.manager = manager
        self.gradients = gradients
        self.shard = shard
        self.dtype = views.dtype
        self.tile_elements = tile_elements
        self.rule = rule
        self.fields = fields
        self._blocks: dict[str, Block] = {}  # state and staging blocks by field name
        self.state: dict[str, torch.Tensor] = {}  # the rule's fields, master first
        self.weights_staging: torch.Tensor | None = None
        # weights_staging, or the fp32 master itself: Note [a publication does not hold its
        # store] in store.py
        self.host_home = WeightsHome(f"bucket {layout.index}")
        self._home_field = "master" if self.dtype == torch.float32 else "weights_staging"
        self.publication = WeightCopies(
            manager, views, bucket=layout.index, offset=shard[0], home=self.host_home
        )
        blocks = fields.pairs()
        if self.dtype != torch.float32:
            blocks.append(("weights_staging", self.dtype))
        n = layout.shard_numel
        try:
            for name, dtype in blocks:
                block = host_pool.alloc(n * dtype.itemsize, owner=f"bucket{layout.index}.{name}")
                self._blocks[name] = block
                block.on_move(
                    lambda b, name=name, dtype=dtype: self._bind(name, b.view(dtype, (n,)))
                )
                tensor = block.view(dtype, (n,))
                tensor.fill_(fields.initial(name) if name in fields.names else 0.0)
                self._bind(name, tensor)
            self.reconcile_master()  # fp32 master from the model's initial weights
        except BaseException:
            self.close()
            raise

    def _bind(self, name: str, tensor: torch.Tensor) -> None:
        """Point field ``name`` at ``tensor`` (at allocation, and when its block moves)."""
        if name == "weights_staging":
            self.weights_staging = tensor
        else:
            self.state[name] = tensor
        if name == self._home_field:
            self.host_home.bind(tensor, self._blocks[name])

    @property
    def master(self) -> torch.Tensor:
        """The fp32 master, ``(shard_numel,)``."""
        return self.state["master"]

    def weights_home(self) -> tuple[torch.Tensor, Block]:
        """The pinned training-dtype copy CPU Adam writes, ``(shard_numel,)``, and its block:
        ``weights_staging``, or the fp32 master itself for an fp32 bucket (with parameter
        offload the weights live there between uses, ``zero_offload.params``)."""
        return self.host_home()

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
        state = self.state_tensors()
        out = self.weights_staging
        written = {**state, **({} if out is None else {"weights": out})}

        def declare(lo: int, hi: int) -> None:
            # What the launch writes, once its gradient was waited for: that wait orders
            # it after the copies before it (the master's refresh at construction, too).
            for name, tensor in written.items():
                declare_cpu(
                    self.manager,
                    tensor[lo:hi],
                    bucket=bucket,
                    write=True,
                    what=f"the CPU update writes {name}",
                )

        for start, stop, step in clip_runs(runs, *self.shard):
            lo = start
            while lo < stop:  # Note [a launch spans the tiles that landed] (rule/tiles.py)
                hi = tiles.launch_end(lo, stop, self.tile_elements)
                fields = {name: tensor[lo:hi] for name, tensor in state.items()}
                view = None if out is None else out[lo:hi]
                tiles.step(lo, hi, step, fields, out=view, declare=declare)
                lo = hi

    def reconciles_in_update(self) -> bool:
        """Where the parameters are views of the home the update writes (parameter
        offload, this rank's shard of it under ZeRO-3), and the rule takes written weights in its pass or the home is the fp32
        master itself (Note [the write check in the update] in ``update/reconcile.py``)."""
        if self.weights_staging is not None and not self.rule.takes_written:
            return False
        return self._params_view_home()

    def weights_are_master(self) -> bool:
        """The home is the fp32 master and the parameters are views of it (parameter
        offload with fp32 weights)."""
        return self.weights_staging is None and self._params_view_home()

    def _params_view_home(self) -> bool:
        """Whether the parameters are views of the weights' home (parameter offload)."""
        home = self.weights_home()[0]
        bound = self.views.bound_to()
        if bound.device != home.device or bound.dtype != home.dtype:
            return False
        at = self.shard[0] - self.views.bound_start()  # the shard's first element in bound
        return at >= 0 and home.data_ptr() == bound.data_ptr() + at * bound.element_size()

    def span(self) -> tuple[int, int]:
        return self.shard

    def field_dtypes(self) -> list[tuple[str, torch.dtype]]:
        return self.fields.pairs()

    def field_initial(self, name: str) -> float:
        return self.fields.initial(name)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return dict(self.state)

    def stream_fields(self, fn: TileFn, *, read: bool = True, write: bool = False) -> None:
        stream_tensors(
            self.state_tensors(), self.layout.real_in(*self.shard), self.tile_elements, fn
        )

    def final_weights(self) -> torch.Tensor:
        return weights_into_home(
            self.views, self.manager, self.shard, self.weights_home(), bucket=self.layout.index
        )

    def weights_out(self) -> torch.Tensor:
        return self.weights_home()[0]

    def publish_all_from_master(self) -> None:
        republish_from_master(self, self.publication)

    def close(self) -> None:
        # The views go with the blocks: Note [a publication does not hold its store].
        self.host_home.clear()
        self.state.clear()
        self.weights_staging = None
        for block in self._blocks.values():
            block.free()
        self._blocks.clear()
