"""Weight publication: how a bucket's updated training-dtype weights reach ``weights_dev``.

A store whose state lives on the host writes each updated tile's weights into a pinned home
(``weights_staging``, or the fp32 master itself) and its copy to the device is issued as
soon as the tile is written (``Publish.NOW``), or later, all at once (``Publish.LATER``,
then ``publish()``: a delayed update, Note [delayed parameter update] in ``modes.py``), or
into a device shadow at once and from there at ``publish()`` (``Publish.SHADOW``: Note [the
delayed update lands in a shadow] in ``shadow.py``): ``WeightCopies``. A store on the
device writes ``weights_dev`` in place as it updates: ``WrittenInPlace``. The update modes
ask only ``publish()`` for the events the next forward waits on.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Callable

import torch

from ..accelerator import Event, latest_per_stream
from ..accelerator.host_syncs import synchronize
from ..memory.block import Block
from ..memory.manager import TieredMemoryManager
from ..memory.traffic import Category, Direction
from ..views import ParamViews
from .access import declare_compute
from .shadow import WeightShadow, WeightShadows

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
    #: Each tile's H2D copy is issued as soon as it is written, into the bucket's device
    #: shadow (``WeightCopies.shadow``), not ``weights_dev``, which the next forward still
    #: reads; ``publish()`` copies the shadow into ``weights_dev`` on the compute stream.
    #: The delayed update with room for a shadow: Note [the delayed update lands in a
    #: shadow] in ``shadow.py``.
    SHADOW = "shadow"


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

    def home_readers(self) -> list[Event]:
        """End events of the issued copies that read the weights' home the next update
        rewrites (none where there is no home)."""
        return []

    def shadowed(self, shadows: WeightShadows, *, buffer_bytes: int) -> bool:
        """Whether a delayed update lands in a device shadow (``Publish.SHADOW``); the
        first call asks ``shadows`` for one (``buffer_bytes``: one of the bucket's gradient
        buffers, for the reserve). Note [the delayed update lands in a shadow]."""
        return False

    def close(self) -> None:
        """Give back what the publication holds on the device (a shadow)."""
        return None


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
        shadow: the device shadow a delayed update lands in, or None (Note [the delayed
            update lands in a shadow] in ``shadow.py``).
        _issued: end events of weight copies issued and not yet handed out by ``publish``.
        _unpublished: ``(lo, hi)`` shard-local tiles updated but not copied yet.
        _shadowed: ``(lo, hi)`` shard-local tiles copied into the shadow, not yet from it.
        _fills: end events of the copies into the shadow since the last ``publish``.
        _source_readers: end events of the last published copies; they read the home the
            next update rewrites.
    """

    #: Whether the updated weights cross the link, so that a shadow can take them early.
    can_shadow = True

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
        self.shadow: WeightShadow | None = None
        self._shadow_asked = False
        self._shadowed: list[tuple[int, int]] = []
        self._fills: list[Event] = []

    def prepare(
        self, *, publish: Publish, after: list[Event] | None, fingerprint: bool = True
    ) -> list[Event]:
        """Before an update rewrites the home: the last step's copies out of it are done;
        returns the events the new copies wait for (``after``, or compute issued so far).
        ``fingerprint``: the published tiles are hashed for the next write check (not where
        the update takes the written weights itself: Note [the update takes the written
        weights] in kernels/convert.py)."""
        for event in self._source_readers:
            # Synchronisation point (rare: two steps with no backward between, or a device
            # far behind): the last step's weight copies read the staging about to be
            # rewritten. Usually long done, and then no wait.
            synchronize(event)
        self._source_readers = []
        # Note [one cold hash per step] in views/param_views.py: fingerprint the tiles as
        # they are published, while they are in cache.
        now = publish is Publish.NOW
        if now and fingerprint:
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
        if publish is Publish.SHADOW:
            # The fills overwrite the shadow after the last copy out of it (Note [the
            # delayed update lands in a shadow]); the forward still reads weights_dev, not
            # the shadow, so nothing else orders them.
            shadow = self._the_shadow()
            after = after + ([] if shadow.read is None else [shadow.read])
        return after

    def tile_written(self, lo: int, hi: int, *, publish: Publish, after: list[Event]) -> None:
        """Tile ``[lo, hi)`` of the home holds new weights: copy it now, or remember it."""
        if publish is Publish.LATER:
            self._unpublished.append((lo, hi))
            return
        if publish is Publish.SHADOW:
            self._fill_shadow(lo, hi, after)
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
        self._drop_shadowed()  # the home is newer than the shadow
        self._unpublished.append((lo, hi))

    def _the_shadow(self) -> WeightShadow:
        if self.shadow is None:
            raise RuntimeError(
                f"bucket {self.bucket}: an update publishes into a shadow it lacks (a bug: "
                "Note [the delayed update lands in a shadow])"
            )
        return self.shadow

    def _fill_shadow(self, lo: int, hi: int, after: list[Event]) -> None:
        """Queue the copy of home tile ``[lo, hi)`` into the shadow."""
        shadow = self._the_shadow()
        source, block = self.home()
        self._fills.append(
            self.manager.copy(
                shadow.tensor[lo:hi],
                source[lo:hi],
                direction=Direction.H2D,
                category=Category.WEIGHTS,
                after=after,
                blocks=[shadow.block, block],
                label=f"bucket{self.bucket}[{lo}:{hi}] shadow",
            )
        )
        self._shadowed.append((lo, hi))

    def _land_shadow(self) -> Event:
        """Copy the shadowed tiles into ``weights_dev`` on the compute stream, after their
        fills (a stream wait); the event after the copies."""
        shadow = self._the_shadow()
        manager, bucket = self.manager, self.bucket
        manager.wait_for(latest_per_stream(self._fills), category=Category.WEIGHTS)
        weights = self.views.weights_dev
        declare_compute(manager, shadow.tensor, bucket=bucket, write=False, what="shadow read")
        for lo, hi in _merged(self._shadowed):
            target = weights[self.offset + lo : self.offset + hi]
            declare_compute(manager, target, bucket=bucket, write=True, what="shadow landing")
            target.copy_(shadow.tensor[lo:hi])
        shadow.read = manager.compute_ready()
        # Both ends, as a copy's: neither block is reused or moved while it is pending.
        shadow.block.record_event(shadow.read)
        self.views.block.record_event(shadow.read)
        self._shadowed = []
        return shadow.read

    def _drop_shadowed(self) -> None:
        """Forget the shadowed tiles; the fills still read the home until they end."""
        self._source_readers.extend(self._fills)
        self._fills, self._shadowed = [], []

    def shadowed(self, shadows: WeightShadows, *, buffer_bytes: int) -> bool:
        if not self._shadow_asked:
            self._shadow_asked = True
            if self.can_shadow and self.views.weights_cross_the_link:
                home, _ = self.home()
                self.shadow = shadows.take(
                    bucket=self.bucket,
                    numel=home.numel(),
                    dtype=home.dtype,
                    buffer_bytes=buffer_bytes,
                )
        return self.shadow is not None

    def home_readers(self) -> list[Event]:
        return list(self._source_readers)

    def close(self) -> None:
        shadow, self.shadow = self.shadow, None
        self._fills, self._shadowed = [], []
        if shadow is not None:
            shadow.close()

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
        fills, landed = self._fills, []
        if self._shadowed:
            landed.append(self._land_shadow())
        if self._unpublished or landed:
            self.views.drop_published()  # copies of tiles never fed
        if self._unpublished:
            self.declare_weight_readers()
            after = [self.manager.compute_ready()]
        elif not landed:
            self.views.finish_published()
        copies = [self._copy_tile(lo, hi, after) for lo, hi in self._unpublished]
        events = self._issued + [event for event in copies if event is not None]
        self._issued, self._unpublished, self._fills = [], [], []
        # The copies out of the home (and any dropped fills still reading it).
        self._source_readers = [*self._source_readers, *events, *fills]
        return events + landed

    def drop_unpublished(self) -> None:
        self.views.drop_published()
        self._drop_shadowed()
        self._unpublished = []


def _merged(tiles: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``tiles`` with each run of adjacent ones made one range, in order."""
    merged: list[tuple[int, int]] = []
    for lo, hi in tiles:
        if merged and merged[-1][1] == lo:
            merged[-1] = (merged[-1][0], hi)
        else:
            merged.append((lo, hi))
    return merged
