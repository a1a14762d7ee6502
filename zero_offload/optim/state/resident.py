"""Device-resident state: the fp32 master and the rule's state on the device, stepped there
by the rule (torch's fused AdamW for Adam(W)); the share ``1 - offload_fraction`` of the
parameters; nothing crosses a tier. The gradients
stay on the device too (``grads.on_device.DeviceGradients``), and the update writes
``weights_dev`` in place (``optim.publish.WrittenInPlace``)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from ...accelerator import Event
from ...memory.block import Block
from ...memory.pool import BlockPool
from ...partition import BucketLayout
from ...views import ParamViews
from ..grads.on_device import DeviceGradients
from ..grads.path import GradSource
from ..publish import Publish, WrittenInPlace
from ..rule.base import Hyper, OptimizerRule, StateFields
from .store import StateStore, TileFn, refuse_take_written, stream_tensors

__all__ = ["ResidentState"]


class ResidentState(StateStore):
    """State on the device, updated there by the rule's ``device_tile_step``.

    Device fields (all ``(padded_numel,)`` fp32, device pool): the rule's ``fields``, the
    master first, in ``state`` by name. The gradient is ``gradients.grad_acc``: a resident
    bucket needs no gradient buffer of its own.
    """

    resident = True
    location = "device"

    def __init__(
        self,
        layout: BucketLayout,
        views: ParamViews,
        *,
        device_pool: BlockPool,
        gradients: DeviceGradients,
        rule: OptimizerRule,
        fields: StateFields,
        tile_elements: int = 1 << 20,
    ) -> None:
        self.layout = layout
        self.tile_elements = tile_elements
        self._ledger = device_pool.accelerator.ledger
        self.gradients = gradients
        self.publication = WrittenInPlace()
        self.views = views
        self.dtype = views.dtype
        self.rule = rule
        self.fields = fields
        n = layout.padded_numel
        self._blocks: dict[str, Block] = {}
        self.state: dict[str, torch.Tensor] = {}  # the rule's fields, master first
        try:
            for name, dtype in fields.pairs():
                block = device_pool.alloc(n * dtype.itemsize, owner=f"bucket{layout.index}.{name}")
                self._blocks[name] = block
                block.on_move(
                    lambda b, name=name, dtype=dtype: self.state.__setitem__(
                        name, b.view(dtype, (n,))
                    )
                )
                tensor = block.view(dtype, (n,))
                tensor.fill_(fields.initial(name))
                self.state[name] = tensor
        except BaseException:
            self.close()
            raise
        # A step count as a tensor on the parameters' device, for rules whose device step
        # takes one (torch's fused AdamW); one per bucket, refilled in place.
        self._state_step = torch.zeros((), dtype=torch.float32, device=self.master.device)
        self.reconcile_master()

    @property
    def master(self) -> torch.Tensor:
        """The fp32 master, ``(padded_numel,)``."""
        return self.state["master"]

    # Note [resident temporaries are counted]
    # The rule's device step (scaling a gradient, Adam's coupled decay) and reconciling the
    # master allocate device temporaries that no pool holds. They are bounded to one tile (tile_elements) at
    # a time and reserved in the device ledger while they live, so the budget sees them and
    # a step near the budget fails with the ledger's error, not the caching allocator's OOM.
    # A rule that reads whole parameters is bounded by its largest parameter instead, which
    # placement leaves room for (Note [whole parameters stepped on the device] in
    # whole_resident.py).

    @contextlib.contextmanager
    def _temporaries(self, nbytes: int, what: str) -> Iterator[None]:
        self._ledger.reserve(nbytes, what=f"bucket{self.layout.index} {what}")
        try:
            yield
        finally:
            self._ledger.release(nbytes)

    def _tiles(self, runs: list[tuple[int, int, int]]) -> Iterator[tuple[int, int, int]]:
        for start, stop, step in runs:
            for lo in range(start, stop, self.tile_elements):
                yield lo, min(lo + self.tile_elements, stop), step

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
        refuse_take_written(self, take_written)
        weights = self.views.weights_dev
        # Note [resident temporaries are counted]: what the rule says its step allocates.
        nbytes = self.rule.device_temporary_bytes(hyper, grad_scale, self.tile_elements)
        with self._temporaries(nbytes, "step temporaries"):
            for start, stop, step in self._tiles(runs):
                self.rule.device_tile_step(
                    {name: tensor[start:stop] for name, tensor in self.state.items()},
                    self.gradients.grad_acc[start:stop],
                    step=step,
                    hyper=hyper,
                    grad_scale=grad_scale,
                    step_tensor=self._state_step,
                )
                weights[start:stop].copy_(self.master[start:stop])

    def publish_all_from_master(self) -> None:
        self.views.weights_dev.copy_(self.master)

    def reconcile_master(self) -> None:
        if self.dtype == torch.float32:
            super().reconcile_master()
            return
        # Rare (construction, loading, weights written outside the optimizer); tile by tile,
        # an fp32 tile, a training-dtype tile and a mask at once (Note [resident temporaries
        # are counted]).
        n = self.layout.padded_numel
        with self._temporaries(7 * min(self.tile_elements, n), "reconcile temporaries"):
            super().reconcile_master()

    def final_weights(self) -> torch.Tensor:
        return self.views.weights_dev  # written on the compute stream, in order

    def weights_out(self) -> torch.Tensor:
        return self.views.weights_dev

    def span(self) -> tuple[int, int]:
        return 0, self.layout.padded_numel

    def field_dtypes(self) -> list[tuple[str, torch.dtype]]:
        return self.fields.pairs()

    def field_initial(self, name: str) -> float:
        return self.fields.initial(name)

    def stream_fields(self, fn: TileFn, *, read: bool = True, write: bool = False) -> None:
        stream_tensors(
            self.state_tensors(),
            self.layout.real_in(0, self.layout.padded_numel),
            self.tile_elements,
            fn,
        )

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return dict(self.state)

    def close(self) -> None:
        for block in self._blocks.values():
            block.free()
        self._blocks.clear()
