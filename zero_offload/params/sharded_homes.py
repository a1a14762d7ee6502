"""A unit whose homes hold this rank's shard of each bucket only, under ZeRO-3 with offload
(Note [a sharded unit] in ``sharded_fetch.py``): each bucket's views
(``ShardedWindowedViews``: the home's fingerprints are of the shard; reads, state-dict
entries and the private copies at close are of the gathered bucket) and the unit
(``ShardedParamUnit``: whether its slot needs a gather is the same on every rank)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import xxhash
from torch import nn

from ..partition import BucketLayout
from .released import restore
from .unit import ParamUnit
from .windowed_views import WindowedViews

__all__ = ["ShardedParamUnit", "ShardedWindowedViews"]


class ShardedWindowedViews(WindowedViews):
    """A bucket's views whose home holds this rank's shard only (Note [a sharded unit] in
    ``sharded_fetch.py``).

    Fields (beyond ``WindowedViews``'): ``home_span`` is ``layout.shard_range(rank)``."""

    def __init__(
        self,
        layout: BucketLayout,
        params: Sequence[nn.Parameter],
        unit: ParamUnit,
        region: torch.Tensor,
        *,
        shard: tuple[int, int],
    ) -> None:
        super().__init__(layout, params, unit, region)
        self.home_span = shard
        self.unbound = False  # the parameters hold private copies (``unbind``)

    def _fingerprint(self, flat: torch.Tensor, streamed: Any = None) -> list[int] | torch.Tensor:
        """The home's fingerprints are of each parameter's piece in this rank's shard (an
        empty piece hashes as empty), always hashed afresh (``streamed``, the hashes of the
        published tiles, are of whole slots: Note [one cold hash per step]); the slot's are
        the base class's."""
        if self.home is None or flat.data_ptr() != self.home.data_ptr():
            return super()._fingerprint(flat, streamed)
        lo, hi = self.home_span
        raw = flat.detach().view(torch.uint8).numpy()  # pinned host memory: no copy
        size = flat.element_size()
        out = []
        for slot in self.layout.slots:
            start, stop = max(slot.offset, lo) - lo, min(slot.end, hi) - lo
            piece = raw[start * size : stop * size] if start < stop else raw[:0]
            out.append(xxhash.xxh3_64_intdigest(piece))
        return out

    def gather_source(self) -> torch.Tensor | None:
        """Where this rank's shard is gathered from: None, its slice of the slot, which the
        fetch's H2D copy filled (``params/device_shards.py`` gathers from a device home)."""
        return None

    def _gathered(self) -> torch.Tensor:
        """The whole bucket on the device, gathered (collective; Note [a sharded unit]):
        the unit is fetched if it is not resident, and compute waits for its gather."""
        self.unit.materialize()
        return self.weights_dev

    def home_view(self, index: int) -> torch.Tensor:
        """Parameter ``index``'s weights as a host copy of the gathered bucket: no rank's
        home holds the whole parameter. Collective: every rank must ask in the same order."""
        slot = self.layout.slots[index]
        flat = self._gathered()
        return flat[slot.offset : slot.end].view(slot.shape).detach().to("cpu", copy=True)

    def unbind(self) -> None:
        """Every parameter still ours gets a private device copy of its gathered weights
        (collective at close: every rank closes its optimizer)."""
        if self.home is None and self.nvme_home is None:
            super().unbind()
            return
        if self.unbound:
            return
        replaced = {i for i, _ in self.detached()}
        flat = self._gathered()
        for i, (slot, param) in enumerate(zip(self.layout.slots, self.params, strict=True)):
            if i not in replaced:
                restore(param, flat[slot.offset : slot.end].view(slot.shape).clone())
        self.unbound = True

    def write_home(self, index: int, values: torch.Tensor) -> None:
        """Nothing: a state-dict entry is a copy of the gathered parameter, which does not
        reach the model (Note [a sharded unit]); the weight file holds a shard only."""


class ShardedParamUnit(ParamUnit):
    """A unit whose homes are shards (Note [a sharded unit] in ``sharded_fetch.py``)."""

    @property
    def homes_written(self) -> bool:
        """Never, here: whether a slot needs a gather must be the same on every rank, and a
        home's version counter is its host pool's (every host-pool view shares the pool
        tensor's counter), which moves with each rank's own gradient staging. Under ZeRO-3
        the homes are written by the step (which makes every slot stale, ``before_step``)
        and by a write-back of the slot itself, which then holds what the home does; state
        dict entries are copies, not views of the homes."""
        return False
