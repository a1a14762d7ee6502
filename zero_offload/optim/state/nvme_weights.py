"""NVMe state whose bucket's *home* is on NVMe too: the training-dtype weights in a weight
file (``weights/nvme_home.py``), never in host RAM (Note [homes on NVMe] in
``nvme_plan.py``).

``NvmeHomeState`` is an ``NvmeState`` without ``weights_staging``. Its step streams the
state records as ``NvmeState`` does (Note [the step streams the state] in ``nvme.py``); for
each updated tile it also reads that tile's weight record into one of the segment's weight
tile buffers (``HomeTiles``; the next tile's read is issued before this one is waited for),
runs the same kernel with the buffer as the training-dtype output (the fp32 master copied
there for fp32), and writes the record back, so the tile's bits are those ``NvmeState``
would put in its staging: bitwise the same training. Untouched tiles are neither read nor
written. Nothing is copied to the device: the parameters are offloaded, and the unit's next
fetch reads the weight file (``params/home_store.py``); the update marks the unit's slot
stale (``HomeWritten``).

The master's reconciliation with weights written outside the optimizer (a written slot
copied home, Note [a write to a resident unit reaches its home] in ``params/slot_writes.py``)
and the republication from the master stream both files tile by tile the same way.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from ...accelerator import Event
from ...errors import StorageError
from ...memory.block import Block
from ...memory.pool import BlockPool
from ...memory.storage import IOBuffer
from ...weights.nvme_home import HomeTiles, WeightFile
from ..grads.path import GradSource
from ..publish import Publish, WeightCopies
from ..rule.base import Hyper
from .nvme import NvmeState
from .store import refuse_take_written, take_written

__all__ = ["HomeWritten", "NvmeHomeState"]


class HomeWritten(WeightCopies):
    """The publication of a bucket whose home is on NVMe: nothing to copy (the parameters
    are offloaded, and the next fetch reads the file); a written tile makes the unit's
    slot stale (``views.home_rewritten``), at once or, for an update run during backward
    (``Publish.LATER``), in ``publish()`` once every unit was released: Note [stepping
    during backward with parameter offload] in ``update/eager.py``."""

    can_shadow = False  # nothing crosses the link: the next fetch reads the file

    def prepare(
        self, *, publish: Publish, after: list[Event] | None, fingerprint: bool = True
    ) -> list[Event]:
        return []

    def tile_written(self, lo: int, hi: int, *, publish: Publish, after: list[Event]) -> None:
        if (
            publish is Publish.LATER
        ):  # during backward: the unit may be resident, its slot still read
            self._unpublished.append((lo, hi))
            return
        self.views.home_rewritten()  # type: ignore[attr-defined]

    def mark_unpublished(self, lo: int, hi: int) -> None:
        self.views.home_rewritten()  # type: ignore[attr-defined]

    def publish(self) -> list[Event]:
        if self._unpublished:
            self.views.home_rewritten()  # type: ignore[attr-defined]
            self._unpublished = []
        return []

    def drop_unpublished(self) -> None:
        self._unpublished = []


class NvmeHomeState(NvmeState):
    """NVMe state and an NVMe home; see the module docstring.

    Fields (beyond ``NvmeState``'s, whose ``weights_staging`` is None here): ``home``: the
    ``WeightFile`` (disk: ``(real,)`` training dtype in tile records); ``tiles``' ring is
    ``home_tiles``.
    """

    def __init__(self, *args: object, home_tiles: HomeTiles, **kwargs: object) -> None:
        self.home_tiles = home_tiles
        self.home: WeightFile | None = None
        home_tiles.users += 1
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        try:
            home_tiles.settle_all()  # the initial weight records are written
        except BaseException:
            self.close()
            raise
        self.publication = HomeWritten(
            self.manager,
            self.views,
            bucket=self.layout.index,
            offset=self.shard[0],
            home=self.host_home,  # never bound: nothing is read from host memory
        )

    # -- construction --------------------------------------------------------------------

    def _make_staging(self, host_pool: BlockPool, name: str) -> None:
        """No staging: the weight file is created instead (and filled by ``_initial_tile``)."""
        self.home = WeightFile(
            self.tier,
            name,
            real=self.real,
            dtype=self.dtype,
            tile_elements=self.tile_elements,
            owner=f"bucket {self.layout.index}",
        )

    def weights_home(self) -> tuple[torch.Tensor, Block]:
        raise RuntimeError(
            f"bucket {self.layout.index}: its home is the weight file "
            f"{self.home.path if self.home else '(closed)'}, not host memory (bug)"
        )

    def _load_weights(self) -> None:
        # Synchronisation point (construction): the slot's bytes are final before the D2H
        # copies of ``_initial_tile`` read them.
        self.manager.synchronize()

    def _initial_tile(self, tile: int, fields: dict[str, torch.Tensor]) -> None:
        """The tile's weights from the slot (D2H into a weight buffer, waited), written to
        the weight file; the master from them, the moments zero."""
        home = self._home()
        lo, hi = self._disk().tile_range(tile)
        buffer = self.home_tiles.next(home)
        weights = buffer.data[: (hi - lo) * self.dtype.itemsize].view(self.dtype)
        done = self.views.copy_out(
            self.manager,
            self.shard[0] + lo,
            self.shard[0] + hi,
            weights,
            self._ring_block(),
            label=f"bucket{self.layout.index}[tile {tile}] home",
        )
        if done is not None:
            done.synchronize()  # Synchronisation point (construction): read on the CPU next
        for name, view in fields.items():
            if name == "master":
                view.copy_(weights)
            else:
                view.fill_(self.record.initial(name))
        home.write(self.manager, tile, buffer)

    def _ring_block(self) -> Block:
        if self.home_tiles.block is None:
            raise RuntimeError(f"bucket {self.layout.index}: weight tiles freed (bug)")
        return self.home_tiles.block

    def _home(self) -> WeightFile:
        if self.home is None:
            raise RuntimeError(f"bucket {self.layout.index}: NVMe home used after close (bug)")
        return self.home

    # -- streaming both files --------------------------------------------------------------

    def _with_weights(
        self,
        tiles: list[int],
        fn: Callable[[int, dict[str, torch.Tensor], torch.Tensor], None],
        *,
        write_state: bool,
        read_weights: bool = True,
        write_weights: bool = True,
        prefetch_next: bool = False,
    ) -> None:
        """``fn(tile, fields, weights)`` over ``tiles``: the state streamed as ``_stream``
        does, and the tile's weight record read first (the next one's read issued before
        this one is waited for) and written back after."""
        home = self._home()
        issued: dict[int, IOBuffer] = {}

        def issue(position: int) -> None:
            if read_weights and position < len(tiles) and tiles[position] not in issued:
                buffer = self.home_tiles.next(home)
                home.read(self.manager, tiles[position], buffer)
                issued[tiles[position]] = buffer

        position_of = {tile: i for i, tile in enumerate(tiles)}

        def each(tile: int, fields: dict[str, torch.Tensor]) -> None:
            position = position_of[tile]
            issue(position)
            buffer = issued.pop(tile, None)
            if buffer is None:  # not read: the caller fills every element
                buffer = self.home_tiles.next(home)
            issue(position + 1)  # the next tile's read, while this one is computed
            if read_weights:
                home.settle(buffer)  # Synchronisation point: the CPU needs the record
            lo, hi = self._disk().tile_range(tile)
            fn(tile, fields, buffer.data[: (hi - lo) * self.dtype.itemsize].view(self.dtype))
            if write_weights:
                home.write(self.manager, tile, buffer)

        try:
            self._stream(each, tiles, write=write_state, prefetch_next=prefetch_next)
            self.home_tiles.settle_all()  # the update is complete when its writes are
        except BaseException:
            # Each weight record holds the old or the new tile, checksummed; the state
            # file's FAILED mark refuses the next step (Note [a failed write leaves the
            # others intact] in nvme.py), and a failed write marks this file itself.
            with contextlib.suppress(StorageError):
                self.home_tiles.settle_all()
            raise

    # -- update ------------------------------------------------------------------------------

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
        tiles = self._rule_tiles(hyper, grad_scale, source=source, publish=publish, after=after)
        pieces = self._disk().pieces(runs)
        fp32 = self.dtype == torch.float32

        def step_tile(tile: int, fields: dict[str, torch.Tensor], weights: torch.Tensor) -> None:
            base = tile * self.tile_elements
            for lo, hi, step in pieces[tile]:
                a, b = lo - base, hi - base
                tiles.step(
                    lo,
                    hi,
                    step,
                    {name: view[a:b] for name, view in fields.items()},
                    out=None if fp32 else weights[a:b],
                    copy_master_to=weights[a:b] if fp32 else None,
                )

        self._with_weights(sorted(pieces), step_tile, write_state=True, prefetch_next=True)

    def reconcile_master(self) -> None:
        """Note [weights written outside the optimizer]: each tile's master takes the
        weights written into the file (``take_written``), both files streamed."""

        def take(tile: int, fields: dict[str, torch.Tensor], weights: torch.Tensor) -> None:
            take_written(fields["master"], weights)

        self._with_weights(list(range(self.tiles)), take, write_state=True, write_weights=False)
        self.publication.drop_unpublished()

    def publish_all_from_master(self) -> None:
        """Every tile's weights from the master (rounded to nearest even), into the file."""

        def take(tile: int, fields: dict[str, torch.Tensor], weights: torch.Tensor) -> None:
            weights.copy_(fields["master"])

        self._with_weights(list(range(self.tiles)), take, write_state=False, read_weights=False)
        self.views.home_rewritten()  # type: ignore[attr-defined]

    def final_weights(self) -> torch.Tensor:
        raise RuntimeError(
            f"bucket {self.layout.index}: its weights are on NVMe; they are streamed tile by "
            "tile, never whole in host RAM (bug)"
        )

    def weights_out(self) -> torch.Tensor:
        return self.final_weights()

    def close(self) -> None:
        try:
            super().close()
        finally:
            if self.home is not None:
                with contextlib.suppress(StorageError):
                    self.home_tiles.settle_all()
                self.home.close()
                self.home = None
            self.home_tiles.release()
