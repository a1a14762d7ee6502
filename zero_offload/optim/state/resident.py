"""Device-resident state: fp32 master and moments on the device, torch's fused AdamW (the
share ``1 - offload_fraction`` of the parameters; nothing crosses a tier). The gradients
stay on the device too (``grads.on_device.DeviceGradients``), and the update writes
``weights_dev`` in place (``optim.publish.WrittenInPlace``)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.optim.adamw import adamw as torch_adamw

from ...accelerator import Event
from ...memory.block import Block
from ...memory.pool import BlockPool
from ...partition import BucketLayout
from ...views import ParamViews
from ..grads.on_device import DeviceGradients
from ..grads.path import GradSource
from ..publish import WrittenInPlace
from ..rule.adamw import AdamHyper
from .store import StateStore, TileFn, stream_tensors

__all__ = ["ResidentState"]


class ResidentState(StateStore):
    """State on the device, updated there by torch's fused AdamW.

    Device fields (all ``(padded_numel,)`` fp32, device pool): master, exp_avg, exp_avg_sq,
    max_exp_avg_sq (amsgrad only). The gradient is ``gradients.grad_acc``: a resident
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
        amsgrad: bool,
        tile_elements: int = 1 << 20,
    ) -> None:
        self.layout = layout
        self.tile_elements = tile_elements
        self._ledger = device_pool.accelerator.ledger
        self.gradients = gradients
        self.publication = WrittenInPlace()
        self.views = views
        self.dtype = views.dtype
        n = layout.padded_numel
        names = ["master", "exp_avg", "exp_avg_sq"]
        if amsgrad:
            names.append("max_exp_avg_sq")
        self._blocks: dict[str, Block] = {}
        self.max_exp_avg_sq: torch.Tensor | None = None
        try:
            for name in names:
                block = device_pool.alloc(4 * n, owner=f"bucket{layout.index}.{name}")
                self._blocks[name] = block
                block.on_move(lambda b, name=name: setattr(self, name, b.view(torch.float32, (n,))))
                tensor = block.view(torch.float32, (n,))
                tensor.zero_()
                setattr(self, name, tensor)
        except BaseException:
            self.close()
            raise
        # torch's fused AdamW takes the step count as a tensor on the parameters' device;
        # one per bucket, refilled in place (no host-to-device copy per step).
        self._state_step = torch.zeros((), dtype=torch.float32, device=self.master.device)
        self.reconcile_master()

    # Note [resident temporaries are counted]
    # Scaling a gradient, adding Adam's coupled decay and reconciling the master allocate
    # device temporaries that no pool holds. They are bounded to one tile (tile_elements) at
    # a time and reserved in the device ledger while they live, so the budget sees them and
    # a step near the budget fails with the ledger's error, not the caching allocator's OOM.

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
        hyper: AdamHyper,
        grad_scale: float,
        runs: list[tuple[int, int, int]],
        *,
        publish: bool,
        source: GradSource | None = None,
        after: list[Event] | None = None,
    ) -> None:
        weights = self.views.weights_dev
        scaled = grad_scale != 1.0 or (not hyper.decoupled and hyper.weight_decay != 0)
        # Note [resident temporaries are counted]: up to two fp32 tiles at once.
        nbytes = 8 * self.tile_elements if scaled else 0
        with self._temporaries(nbytes, "step temporaries"):
            for start, stop, step in self._tiles(runs):
                self._update_tile(hyper, grad_scale, start, stop, step, weights)

    def _update_tile(
        self,
        hyper: AdamHyper,
        grad_scale: float,
        start: int,
        stop: int,
        step: int,
        weights: torch.Tensor,
    ) -> None:
        grad = self.gradients.grad_acc[start:stop]
        if grad_scale != 1.0:
            # A scaled copy: grad_acc must stay as accumulated (a second step() on the
            # same gradients, like torch, must see them unscaled); a tile-sized temporary.
            grad = grad * grad_scale
        master = self.master[start:stop]
        maximize = hyper.maximize
        if not hyper.decoupled and hyper.weight_decay != 0:
            # Adam's coupled L2 decay (torch.optim.Adam): the sign flip of maximize
            # comes first, then the decay term; a tile-sized temporary.
            grad = (-grad if maximize else grad) + hyper.weight_decay * master
            maximize = False
        # torch's fused kernel counts the step itself: it adds 1 before using it.
        state_step = self._state_step.fill_(float(step - 1))
        torch_adamw(
            [master],
            [grad],
            [self.exp_avg[start:stop]],
            [self.exp_avg_sq[start:stop]],
            [self.max_exp_avg_sq[start:stop]] if hyper.amsgrad else [],
            [state_step],
            fused=True,
            amsgrad=hyper.amsgrad,
            beta1=hyper.beta1,
            beta2=hyper.beta2,
            lr=hyper.lr,
            weight_decay=hyper.weight_decay if hyper.decoupled else 0.0,
            eps=hyper.eps,
            maximize=maximize,
        )
        weights[start:stop].copy_(master)

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
        return [(name, tensor.dtype) for name, tensor in self.state_tensors().items()]

    def stream_fields(self, fn: TileFn, *, read: bool = True, write: bool = False) -> None:
        stream_tensors(
            self.state_tensors(),
            self.layout.real_in(0, self.layout.padded_numel),
            self.tile_elements,
            fn,
        )

    def state_tensors(self) -> dict[str, torch.Tensor]:
        out = {"master": self.master, "exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}
        if self.max_exp_avg_sq is not None:
            out["max_exp_avg_sq"] = self.max_exp_avg_sq
        return out

    def close(self) -> None:
        for block in self._blocks.values():
            block.free()
        self._blocks.clear()
