"""The parameter window as the optimizer builds it (``WindowBuild``, mixed into
``ParamOffloader`` in ``offloader.py``): the blocks it is given (``checked_blocks``), the
families split so that no bucket holds parameters of two units, each bucket placed at an
offset of its unit's slot and the window allocated (``plan``), each bucket's views in the
slot (``views_for``) and their homes (``adopt``), the bounce ring for homes on NVMe
(``open_bounce``), and the hooks (``install``). How the window then moves is Note [the
parameter window] in ``offloader.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ..memory.align import aligned
from ..memory.manager import TieredMemoryManager
from ..partition import BucketLayout
from ..views import Family
from . import hooks
from .home_store import Bounce, bounce_bytes
from .live_units import LiveUnits
from .state_dict_entries import owners
from .unit import ParamUnit
from .units import UnitSpec, default_layers
from .window import Window, plan_slots
from .windowed_views import WindowedViews

__all__ = ["WindowBuild", "checked_blocks"]


def checked_blocks(model: Any, layers: Any) -> list[nn.Module]:
    """The blocks parameter offload splits ``model`` into: ``layers`` (None: found by
    ``default_layers``), refused unless a non-empty sequence of modules."""
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"model must be the nn.Module whose parameters are offloaded, got "
            f"{type(model).__name__}"
        )
    if layers is None:
        layers = default_layers(model)
    elif isinstance(layers, nn.Module) and not isinstance(layers, nn.ModuleList):
        raise TypeError(
            f"layers must be the blocks (an nn.ModuleList or a list of modules), got one "
            f"{type(layers).__name__}; pass e.g. layers=model.transformer.h"
        )
    blocks = list(layers)
    if not blocks or not all(isinstance(b, nn.Module) for b in blocks):
        raise TypeError(f"layers must be a non-empty sequence of nn.Module blocks, got {layers!r}")
    return blocks


class WindowBuild:
    """``ParamOffloader``'s construction, called by the optimizer while it builds its
    buckets: ``split_families``, ``plan``, ``views_for``, ``adopt``, ``open_bounce`` and
    ``install``. Uses the offloader's fields (``ParamOffloader.__init__`` says what each
    holds)."""

    #: The class of each unit (several ranks: ``sharded_homes.ShardedParamUnit``).
    unit_class: type[ParamUnit] = ParamUnit

    model: nn.Module
    manager: TieredMemoryManager
    prefetch: int
    name: str
    specs: list[UnitSpec]
    _index_of_param: dict[int, int]
    units: list[ParamUnit]
    live: LiveUnits[ParamUnit]
    window: Window | None
    _place: dict[int, tuple[int, int]]
    _handles: list[Any]
    bounce: Bounce | None

    def split_families(self, families: Sequence[Family], params: Sequence[Any]) -> list[Family]:
        """Each family split by unit, so no bucket holds parameters of two units."""
        out = []
        for family in families:
            by_unit: dict[int, list[tuple[int, tuple[int, ...]]]] = {}
            for index, shape in family.members:
                by_unit.setdefault(self._index_of_param[id(params[index])], []).append(
                    (index, shape)
                )
            out.extend(Family(family.group, family.dtype, members) for members in by_unit.values())
        return out

    def plan(
        self, layouts: Sequence[BucketLayout], params: Sequence[Any], *, alignment: int
    ) -> None:
        """Place each bucket in its unit's slot and allocate the window (device)."""
        unit_bytes = [0] * len(self.specs)
        for layout in layouts:
            unit = self._index_of_param[id(params[layout.slots[0].index])]
            itemsize = params[layout.slots[0].index].element_size()
            self._place[layout.index] = (unit, unit_bytes[unit])
            unit_bytes[unit] += aligned(layout.padded_numel * itemsize, alignment)
        slot_of, slot_bytes = plan_slots(
            unit_bytes, [s.tied for s in self.specs], prefetch_layers=self.prefetch
        )
        self.window = Window(
            self.manager, slot_bytes, name=f"{self.name}.window", alignment=alignment
        )
        self.units = [
            self.unit_class(
                spec,
                i,
                self.window.slots[slot_of[i]],
                manager=self.manager,
                materialize=hooks.materializer(self, i),
                live=self.live,
            )
            for i, spec in enumerate(self.specs)
        ]

    def unit_index(self, layout: BucketLayout) -> int:
        """The index in ``units`` of the unit holding bucket ``layout`` (after ``plan``)."""
        return self._place[layout.index][0]

    def views_for(self, layout: BucketLayout, params: Sequence[nn.Parameter]) -> WindowedViews:
        """The bucket's parameter views, at its offset of its unit's slot."""
        index, offset = self._place[layout.index]
        unit = self.units[index]
        region = unit.slot.region(offset, layout.padded_numel, params[0].dtype)
        views = self._new_views(layout, params, unit, region)
        unit.views.append(views)
        return views

    def _new_views(
        self,
        layout: BucketLayout,
        params: Sequence[nn.Parameter],
        unit: ParamUnit,
        region: torch.Tensor,
    ) -> WindowedViews:
        """The views of one bucket (the whole bucket's home; several ranks override)."""
        return WindowedViews(layout, params, unit, region)

    def adopt(self, views: WindowedViews, backend: Any) -> None:
        """The bucket's backend is built: its home (``weights_home()``) holds the weights
        while the unit is released, and the parameters hold their placeholders."""
        home = getattr(backend, "home", None)  # a weight file: Note [homes on NVMe]
        if home is not None:
            views.adopt_nvme_home(home, self.manager)
            unit = self.units[self._place[views.layout.index][0]]
            home.owner = f"unit {unit.index} ({unit.spec.name}) bucket {views.layout.index}"
            return
        views.adopt_home(*backend.weights_home())

    def install(self, optimizer: torch.optim.Optimizer) -> None:
        """Register the hooks (``hooks.py``; each holds the offloader weakly, Note
        [lifetimes without close] in ``optim/lifetime.py``); ``open_bounce`` ran before.
        Allocates nothing: it follows the build's last check across the ranks (Note [a
        rank that fails alone] in ``optim/rank_agreement.py``)."""
        self._handles.extend(hooks.install(self, optimizer, owners(self.model, self.units)))

    def open_bounce(self) -> None:
        """The bounce ring, when a bucket's home is on NVMe (Note [homes on NVMe are
        fetched through a bounce ring] in ``home_store.py``); ``close`` frees it."""
        if self.window is None or not any(v.nvme_home for u in self.units for v in u.views):
            return
        sizes = bounce_bytes([(u.slot.index, u.views) for u in self.units], len(self.window.slots))
        self.bounce = Bounce(self.manager, sizes, name=f"{self.name}.bounce")
        for unit in self.units:
            unit.bounce = self.bounce
