"""SlotWrites: whether user code wrote a unit's slot while it was resident (the write check),
one per unit; ``ParamUnit.write_back`` copies the buckets it finds written home.

Note [a write to a resident unit reaches its home]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
While a unit is on the device its parameters are views of the slot, and user code may write
them: ``model.load_state_dict`` after an eval forward or between forward and backward, an
in-place op, ``p.data.copy_``, or anything after ``materialize`` brought the unit back for
user code. Such a write must reach the home, or the next fetch (or step) would silently undo
it. At each release the unit asks its ``SlotWrites`` whether the slot was written and, if
so, copies it home (``ParamUnit.write_back``: D2H through the memory manager, waited for: the
home is read by the next fetch and written by the next step) before the parameters are
released; the optimizer then sees the home
changed by value and reconciles (Note [weights written outside the optimizer] in
``views/param_views.py``).

How it decides, cheaply: a write through the parameter (``copy_``, ``mul_``, what
``load_state_dict`` does) moves its version counter, compared with the versions at the
fetch (a tuple compare). A write through ``.data`` moves a counter nobody sees, so a unit
that user code could have touched, one that was *exposed* (still resident when a forward of
the model returned, or brought back by ``materialize``), is also fingerprinted: its slot's
fingerprint (``WindowedViews.slot_fingerprint``: xxh3 on a host, a device reduction on a
GPU) is taken when it is exposed and again at its release. Cost: the version compare at every
release; the fingerprints of the units still resident after each forward (``prefetch_layers
+ 1`` of them) once per step, with one host synchronisation each on a GPU when they are
released. A write made *during* a forward by code between two units' hooks, through
``.data``, to a unit that then leaves in the same forward, is not seen.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..views.param_views import moved_versions
from .windowed_views import WindowedViews

__all__ = ["SlotWrites"]


class SlotWrites:
    """The write check of one unit's slot; Note [a write to a resident unit reaches its home].

    Fields:
        views: the unit's ``WindowedViews``, one per bucket (the unit's own list: buckets
            join it while the optimizer builds).
        versions: per bucket, the parameters' version counters when the unit was bound to
            the device weights (``ParamUnit.use``) or its writes last went home.
        exposed: per bucket, the slot's fingerprint when user code could first touch it
            (None: not exposed).
    """

    def __init__(self, views: list[WindowedViews]) -> None:
        self.views = views
        self.versions: list[tuple[int, ...]] = []
        self.exposed: list[list[int] | torch.Tensor] | None = None

    def bound(self) -> None:
        """The parameters view the slot now: writes count from here."""
        self.versions = [views.current_versions() for views in self.views]

    def stepped(self, views: WindowedViews, flags: Sequence[bool]) -> None:
        """The step moved the version counters of ``views``' parameters where ``flags``:
        not a write (Note [a step moves the version counters] in views/param_views.py)."""
        for i, mine in enumerate(self.views):
            if mine is views and i < len(self.versions):
                self.versions[i] = moved_versions(self.versions[i], flags)

    def expose(self) -> None:
        """User code may touch the slot next (compute waited for the fetch): fingerprint it,
        unless it is exposed already."""
        if self.exposed is None:
            self.exposed = [views.slot_fingerprint() for views in self.views]

    def forget(self) -> None:
        """The parameters hold their placeholders (a release, a fetch, a recovery)."""
        self.exposed = None

    def written(self) -> list[WindowedViews]:
        """The buckets whose slot range user code wrote since ``bound`` (or ``went_home``)."""
        out = []
        for i, views in enumerate(self.views):
            written = views.current_versions() != self.versions[i]
            if not written and self.exposed is not None:
                written = _differ(views.slot_fingerprint(), self.exposed[i])
            if written:
                out.append(views)
        return out

    def went_home(self) -> None:
        """The written buckets are home: the slot as it is now is the unwritten state."""
        self.bound()
        if self.exposed is not None:
            self.exposed = [views.slot_fingerprint() for views in self.views]


def _differ(now: list[int] | torch.Tensor, before: list[int] | torch.Tensor) -> bool:
    if isinstance(now, torch.Tensor) and isinstance(before, torch.Tensor):
        # Synchronisation point (GPU): the comparison's result is read on the host.
        return bool((now != before).any().item())
    return now != before
