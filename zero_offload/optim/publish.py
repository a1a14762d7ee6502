"""Weight publication: how a bucket's updated training-dtype weights reach ``weights_dev``.

A store whose state lives on the host writes each updated tile's weights into a pinned home
(``weights_staging``, or the fp32 master itself) and its copy to the device is issued as
soon as the tile is written (``Publish.NOW``), or later, all at once (``Publish.LATER``,
then ``publish()``: a delayed update, Note [delayed parameter update] in ``modes.py``):
``WeightCopies``. A store on the device writes ``weights_dev`` in place as it updates:
``WrittenInPlace``. The update modes ask only ``publish()`` for the events the next forward
waits on.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Callable

import torch

from ..accelerator import Event
from ..accelerator.host_syncs import synchronize
from ..memory.block import Block
from ..memory.manager import TieredMemoryManager
from ..views import ParamViews
from .access import declare_compute

__all__ = ["Publication", "Publish", "WeightCopies", "WrittenInPlace"]


class Publish(enum.Enum):
    """When an update's weight copies to ``weights_dev`` are issued (the update's caller
    decides; the stores, ``RuleTiles`` and the publications carry it)."""

    #: Each tile's H2D copy is issued as soon as the tile's weights are written into the
    #: pinned home, ordered after the update's ``after`` events; the copies' end events wait
    #: in ``_issued`` for ``publish()``. ``weights_dev`` is rewritten while the update runs.
    NOW = "now"
    #: The updated tiles are only remembered (``_unpublished``): the home holds the new
    #: weights and ``weights_dev`` keeps the old ones until ``publish()`` copies them all.
    #: The delayed update (Note [delayed parameter update] in ``update/modes.py``) and a step
    #: run during backward with parameter offload (Note [stepping during backward with
    #: parameter offload] in ``update/eager.py``).
    LATER = "later"


class Publication(ABC):
    """How one bucket's updated weights reach the device."""

    @abstractmethod
    def publish(self) -> list[Event]:
        """Issue the weight copies not yet issued; the end events of every copy issued
        since the last ``publish`` (the next forward waits on them)."""

    @abstractmethod
    def drop_unpublished(self) -> None:
        """Forget updated tiles not yet copied (the weights were written since: they win)."""

    @abstractmethod
    def declare_weight_readers(self) -> None:
        """Kernels queued on compute so far read the weights (what the weight copies are
        ordered behind)."""


class WrittenInPlace(Publication):
    """A device-resident store's update writes ``weights_dev`` itself, on the compute
    stream, in order: no copy is ever pending, so none is issued or forgotten."""

    def publish(self) -> list[Event]:
        return []

    def drop_unpublished(self) -> None:
        return None

    def declare_weight_readers(self) -> None:
        raise RuntimeError(
            "a device-resident bucket is stepped in step() only (bug: Note [stepping during "
            "backward] in update/eager.py lists what refuses it)"
        )


class WeightCopies(Publication):
    """The H2D copies of a host-side store's updated tiles, from its pinned weights home.

    Fields:
        _issued: end events of weight copies issued and not yet handed out by ``publish``.
        _unpublished: ``(lo, hi)`` shard-local tiles updated but not copied yet.
        _source_readers: end events of the last published copies; they read the home the
            next update rewrites.
    """

    def __init__(
        self,
        manager: TieredMemoryManager,
        views: ParamViews,
        *,
        bucket: int,
        offset: int,
        home: Callable[[], tuple[torch.Tensor, Block]],
    ) -> None:
        self.manager = manager
        self.views = views
        self.bucket = bucket
        self.offset = offset  # the shard's first element in weights_dev
        self.home = home  # (shard_numel,) training dtype, pinned, and its block
        self._issued: list[Event] = []
        self._unpublished: list[tuple[int, int]] = []
        self._source_readers: list[Event] = []

    def prepare(self, *, publish: Publish, after: list[Event] | None) -> list[Event]:
        """Before an update rewrites the home: the last step's copies out of it are done;
        returns the events the new copies wait for (``after``, or compute issued so far)."""
        for event in self._source_readers:
            # Synchronisation point (rare: two steps with no backward between, or a device
            # far behind): the last step's weight copies read the staging about to be
            # rewritten. Usually long done, and then no wait.
            synchronize(event)
        self._source_readers = []
        # Note [one cold hash per step] in views/param_views.py: fingerprint the tiles as
        # they are published, while they are in cache.
        now = publish is Publish.NOW
        if now:
            self.views.begin_published()
        else:
            self.views.drop_published()
        # The weight copies overwrite weights_dev: they wait for compute issued so far
        # (a forward or a weight-reading kernel still queued), write-after-read; a step
        # run during backward passes the event recorded when the bucket was complete.
        if after is None:
            if now:
                self.declare_weight_readers()
            after = [self.manager.compute_ready()] if now else []
        return after

    def tile_written(self, lo: int, hi: int, *, publish: Publish, after: list[Event]) -> None:
        """Tile ``[lo, hi)`` of the home holds new weights: copy it now, or remember it."""
        if publish is Publish.LATER:
            self._unpublished.append((lo, hi))
            return
        event = self._copy_tile(lo, hi, after)
        if event is not None:  # None: the source is the weights' home
            self._issued.append(event)
        # The bytes the copy reads, hashed while they are in cache (the copy only reads them
        # too): Note [one cold hash per step].
        self.views.published_tile(self.offset + lo, self.offset + hi, self.home()[0][lo:hi])

    def mark_unpublished(self, lo: int, hi: int) -> None:
        """Tile ``[lo, hi)`` of the home holds weights the device lacks (resuming)."""
        self.views.drop_published()
        self._unpublished.append((lo, hi))

    def _copy_tile(self, lo: int, hi: int, after: list[Event]) -> Event | None:
        source, block = self.home()
        return self.views.copy_in(
            self.manager,
            self.offset + lo,
            self.offset + hi,
            source[lo:hi],
            block,
            after=after,
            label=f"bucket{self.bucket}[{lo}:{hi}]",
        )

    def declare_weight_readers(self) -> None:
        declare_compute(
            self.manager,
            self.views.weights_dev,
            bucket=self.bucket,
            write=False,
            what="kernels queued on compute read weights",
        )

    def publish(self) -> list[Event]:
        after = []
        if self._unpublished:
            self.views.drop_published()  # copies of tiles never fed
            self.declare_weight_readers()
            after = [self.manager.compute_ready()]
        else:
            self.views.finish_published()
        copies = [self._copy_tile(lo, hi, after) for lo, hi in self._unpublished]
        events = self._issued + [event for event in copies if event is not None]
        self._issued, self._unpublished = [], []
        self._source_readers = list(events)
        return events

    def drop_unpublished(self) -> None:
        self.views.drop_published()
        self._unpublished = []
