"""Resident bucket state: fp32 master, moments and accumulator on the device, torch's fused
AdamW (the share ``1 - offload_fraction`` of the parameters; nothing crosses a tier)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
from torch.optim.adamw import adamw as torch_adamw

from ...accelerator import Event
from ...memory.block import Block
from ...partition import BucketLayout
from ...views.param_views import ParamViews
from ..ranks import Ranks
from .store import AdamHyper, BucketPools, UpdateBackend

__all__ = ["ResidentState"]


class ResidentState(UpdateBackend):
    """State on the device, updated there by torch's fused AdamW.

    Device fields (all ``(padded_numel,)`` fp32, device pool): master, exp_avg, exp_avg_sq,
    max_exp_avg_sq (amsgrad only), grad_acc. Gradients add straight into ``grad_acc``: a
    resident bucket needs no gradient buffer of its own.
    """

    resident = True

    def __init__(
        self,
        layout: BucketLayout,
        views: ParamViews,
        *,
        pools: BucketPools,
        amsgrad: bool,
        tile_elements: int = 1 << 20,
    ) -> None:
        self.layout = layout
        self.tile_elements = tile_elements
        self._ledger = pools.device.accelerator.ledger
        self.views = views
        self.dtype = views.dtype
        n = layout.padded_numel
        names = ["master", "exp_avg", "exp_avg_sq", "grad_acc"]
        if amsgrad:
            names.append("max_exp_avg_sq")
        self._blocks: dict[str, Block] = {}
        self.max_exp_avg_sq: torch.Tensor | None = None
        try:
            for name in names:
                block = pools.device.alloc(4 * n, owner=f"bucket{layout.index}.{name}")
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

    def open_grad(self, *, new_window: bool, grow: bool = False) -> None:
        if new_window:
            self.grad_acc.zero_()

    def add_grad(self, slot_index: int, grad: torch.Tensor) -> None:
        slot = self.layout.slots[slot_index]
        self.grad_acc[slot.offset : slot.end].add_(grad)

    def flush(self, *, overwrite: bool, ranks: Ranks) -> None:
        return None  # the gradients are already in the accumulator, on the device

    def discard_grad(self) -> None:
        return None  # the accumulator is zeroed when the next window opens

    def window_source(self) -> str:
        return "grad_acc"

    def grad_sumsq(self) -> tuple[float, bool]:
        grad = self.grad_acc[: self.layout.numel]
        # Synchronisation point: .item() waits for the device to finish the reduction. In
        # float64 the squares of finite fp32 values cannot overflow, so the norm is
        # non-finite exactly when some gradient is.
        norm = float(torch.linalg.vector_norm(grad, dtype=torch.float64).item())
        return norm * norm, not math.isfinite(norm)

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
        source: str | None = None,
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
        grad = self.grad_acc[start:stop]
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

    def publish(self) -> list[Event]:
        return []  # update() writes weights_dev in place: nothing crosses a tier

    def drop_unpublished(self) -> None:
        return None  # every update is written in place at once: nothing waits

    def publish_all_from_master(self) -> None:
        self.views.weights_dev.copy_(self.master)

    def reconcile_master(self) -> None:
        weights = self.views.weights_dev
        if self.dtype == torch.float32:
            self.master.copy_(weights)
            return
        # Rare (construction, loading, weights written outside the optimizer); tile by tile,
        # an fp32 tile, a training-dtype tile and a mask at once (Note [resident temporaries
        # are counted]).
        n = self.layout.padded_numel
        with self._temporaries(7 * min(self.tile_elements, n), "reconcile temporaries"):
            for lo in range(0, n, self.tile_elements):
                hi = min(lo + self.tile_elements, n)
                master, tile = self.master[lo:hi], weights[lo:hi]
                written = tile != master.to(self.dtype)
                master.copy_(torch.where(written, tile.float(), master))

    def state_tensors(self) -> dict[str, torch.Tensor]:
        out = {"master": self.master, "exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}
        if self.max_exp_avg_sq is not None:
            out["max_exp_avg_sq"] = self.max_exp_avg_sq
        return out

    def close(self) -> None:
        for block in self._blocks.values():
            block.free()
        self._blocks.clear()
