"""NVMe bucket state: fp32 master and moments in files of the storage tier, streamed tile
by tile under the CPU Adam; gradients and weight staging stay in host RAM.

A bucket whose optimizer state does not fit ``OffloadConfig.host_budget`` gets an
``NvmeState`` (``plan_nvme`` in ``nvme_plan.py`` decides which, buckets whole). Its gradient
path is the host one, unchanged (``grads.to_host.HostGradients``: device buffer, D2H into
staging, the host worker's fp32 accumulation and statistics), composed with this store as
with ``host.HostState``; the store allocates only the weight staging in host RAM, and the
master and moments live in one ``StorageFile`` per bucket (``memory/storage.py``), one
record per tile.

Note [the step streams the state]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The shard's real elements are cut into tiles of ``tile_elements``; record ``t`` of the
bucket's file holds tile ``t``'s state fields (the rule's: the master first), each
field at a 4 KiB-aligned offset (``RecordLayout``; a short last tile packs its fields at its
own length). A step visits the tiles that hold updated elements in order, over the tier's
ring of ``B`` I/O buffers (4 by default), taken round robin (``StorageTier.next_buffer``):
at tile ``i`` the read of tile ``i + B - 2`` is issued, the CPU waits for tile ``i``'s read
(issued ``B - 2`` tiles ago), runs the same rule kernel on it that
``host.HostState`` runs (``rule/tiles.py``; elementwise, so tile boundaries do not change a bit: bitwise equal
to the in-RAM state), writes the training-dtype weights into ``weights_staging`` and issues
their H2D copy, then issues the write of tile ``i``. A buffer is read into only after the
write it last carried completed (``IOBuffer.settle``): that write was issued two tiles
earlier, so in steady state the CPU does not wait on it and the step is bounded by the disk
(read + write) or by the CPU Adam, whichever is slower.

Across buckets (``StreamGroup`` in ``stream_group.py``, the segment's NVMe buckets in
bucket order, the order every update mode steps them in): at the end of its update a bucket
issues the reads of the next NVMe bucket's first ``B - 2`` tiles, and only then waits for
its own last writes, so the disk is not idle between buckets; the last bucket waits for its
writes first and then reads the first bucket's first tiles for the next step, during the
forward and backward in
between (issued earlier they would slow the step's last writes), so the disk is not idle at
the start of a step either. A read
of a record waits for a pending write of the same record first. A bucket's update returns when its own writes are done:
an I/O error surfaces in the update of the bucket that caused it, never later or elsewhere.
A prefetched read the next update does not use (its first tiles got no gradient; another
stream came first) is dropped. Each updated tile is read once and written once per step;
tiles with no updated element are not touched.

Note [a failed write leaves the others intact]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A read error, a bad checksum or a write error in a bucket's step leaves that bucket's file
partly stepped (tiles before the failure updated, tiles after it not): the file is marked
FAILED and refuses further I/O, and the ``StorageError`` names the bucket, the file and the
way out (reload from the last checkpoint). Other buckets' files were not being written and
are intact; their state can still be saved (``streaming.save_streaming`` skips nothing,
so it refuses a FAILED file, naming it). Two things keep that true when the loop goes on:
- a failure is the failing bucket's own: a read of the next bucket issued ahead by this
  one's update (``StreamGroup.prefetch_after``) never raises here; it is dropped when it
  cannot be issued (that bucket's file failed) or when nobody uses it (its error goes with
  it), and a failed read surfaces when that bucket's own update waits for the tile (its
  ``_stream``, naming it);
- a later ``step()`` (after ``zero_grad()``, a new backward) refuses before any bucket
  changes while a file is FAILED (``NvmeState.check_usable``): stepping again would step
  the buckets before the broken one a second time and fail in the same place. Reloading
  (``load_streaming`` rewrites every record) makes the file whole again.

The file, its tiles and their streaming through the tier's ring are ``nvme_stream.py``'s
``TileStream``; the planning (which buckets, their bytes, the record layout) is in
``nvme_plan.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ...accelerator import Event
from ...config import format_bytes
from ...errors import StorageError
from ...memory.block import Block
from ...memory.manager import TieredMemoryManager
from ...memory.pool import BlockPool
from ...memory.storage import StorageFile, StorageState
from ...partition import BucketLayout
from ...views import ParamViews
from ..access import declare_cpu
from ..grads.path import GradientPath, GradSource
from ..publish import Publish, WeightCopies
from ..rule.base import Hyper, OptimizerRule
from ..rule.tiles import RuleTiles
from .nvme_plan import RecordLayout
from .nvme_stream import TileStream
from .store import (
    StateStore,
    TileFn,
    WeightsHome,
    refuse_take_written,
    republish_from_master,
    weights_into_home,
)
from .stream_group import StreamGroup

__all__ = ["NvmeState", "StateNotInHostRam"]


class StateNotInHostRam(RuntimeError):
    """The optimizer state of a bucket lives on NVMe: it cannot be handed out as tensors
    (``state_dict``, ``opt.state[p]``); the message names the streaming calls."""


class NvmeState(StateStore):
    """State on NVMe, streamed under the CPU kernel; see the module docstring.

    Host field: weights_staging, ``(shard_numel,)`` training dtype (fp32 included), host
    pool: the kernel's copy-out and the H2D copies' source; ``host_home`` holds it and its
    block for the publication (Note [a publication does not hold its store] in store.py).
    Disk: ``disk``, the ``TileStream`` of ``file``, one ``RecordLayout`` record per tile of
    the shard's real elements (None until it is created). The master and moments are never
    host tensors here; the gradient is ``gradients``' (host staging, or the fp32
    accumulator).
    """

    supports_speculation = False  # the state is on disk: no copy to restore from
    on_storage_tier = True

    resident = False
    location = "nvme"

    def __init__(
        self,
        layout: BucketLayout,
        views: ParamViews,
        *,
        manager: TieredMemoryManager,
        host_pool: BlockPool,
        gradients: GradientPath,
        shard: tuple[int, int],
        record: RecordLayout,
        group: StreamGroup,
        name: str,
        rule: OptimizerRule,
    ) -> None:
        self.layout = layout
        self.rule = rule
        self.views = views
        self.manager = manager
        self.gradients = gradients
        self.shard = shard
        self.dtype = views.dtype
        self.tile_elements = record.tile_elements
        self.record = record
        self.tier = group.tier
        self.real = layout.real_in(*shard)  # shard elements before the sharding padding
        self.disk: TileStream | None = None
        # Note [a publication does not hold its store] in store.py
        self.host_home = WeightsHome(f"bucket {layout.index}")  # weights_staging, its block
        self.publication: WeightCopies = WeightCopies(
            manager, views, bucket=layout.index, offset=shard[0], home=self.host_home
        )
        self._staging_block: Block | None = None
        self.weights_staging: torch.Tensor | None = None
        try:
            self._make_staging(host_pool, name)
            self.disk = TileStream(
                layout, manager=manager, shard=shard, record=record, group=group, name=name
            )
            self._load_weights()
            self._stream(self._initial_tile, range(self.tiles), read=False)
            self.disk.join()
        except BaseException:
            self.close()
            raise

    def _make_staging(self, host_pool: BlockPool, name: str) -> None:
        """``weights_staging``, ``(shard_numel,)`` training dtype, from the host pool."""
        n = self.layout.shard_numel
        block = host_pool.alloc(
            n * self.dtype.itemsize, owner=f"bucket{self.layout.index}.weights_staging"
        )
        self._staging_block = block
        block.on_move(lambda b: self._bind_staging(b.view(self.dtype, (n,)), b))
        self._bind_staging(block.view(self.dtype, (n,)), block)
        block.view(self.dtype, (n,)).zero_()

    def _bind_staging(self, tensor: torch.Tensor, block: Block) -> None:
        """``weights_staging`` is ``tensor``, a view of ``block`` (at allocation, and when
        the block moves)."""
        self.weights_staging = tensor
        self.host_home.bind(tensor, block)

    def weights_home(self) -> tuple[torch.Tensor, Block]:
        """``weights_staging`` and its block: what the H2D copies read."""
        if self._staging_block is None or self.weights_staging is None:
            raise RuntimeError(f"bucket {self.layout.index}: NVMe state used after close (bug)")
        return self.weights_staging, self._staging_block

    def check_usable(self) -> None:
        """Refuse a step while this bucket's file is FAILED (Note [a failed write leaves the
        others intact])."""
        if self.file is not None and self.file.state is StorageState.FAILED:
            raise StorageError(
                f"bucket {self.layout.index}: its NVMe state file {self.file.path} failed in "
                "an earlier step (an I/O error or a bad checksum), so step() refuses before "
                "changing anything: stepping again would step the buckets before it twice "
                "and fail here again. The state of every other bucket is intact. Call "
                "opt.zero_grad(), then reload the optimizer with opt.load_streaming(path) "
                "from the last opt.save_streaming(path) (it rewrites this file), or rebuild it"
            )

    @property
    def file(self) -> StorageFile | None:
        """The bucket's state file (``disk``'s); None before it is created and once closed."""
        return self.disk.file if self.disk is not None else None

    @property
    def tiles(self) -> int:
        """Records in the file (tiles of the shard's real elements)."""
        return self.disk.tiles if self.disk is not None else 0

    def _disk(self) -> TileStream:
        if self.disk is None:
            raise RuntimeError(f"bucket {self.layout.index}: NVMe state used after close (bug)")
        return self.disk

    def _stream(
        self,
        fn: Callable[[int, dict[str, torch.Tensor]], None],
        tiles: Sequence[int] | range,
        **how: bool,
    ) -> None:
        """``fn(tile, fields)`` over ``tiles``, streamed by ``disk`` (``how``: read, write,
        prefetch_next; ``TileStream.stream``, Note [the step streams the state])."""
        self._disk().stream(fn, tiles, **how)

    def _load_weights(self) -> None:
        """The shard's weights into ``weights_staging``: D2H from ``weights_dev``, waited, or
        nothing under parameter offload (the staging is their home)."""
        weights_into_home(
            self.views, self.manager, self.shard, self.weights_home(), bucket=self.layout.index
        )

    def _initial_tile(self, tile: int, fields: dict[str, torch.Tensor]) -> None:
        lo, hi = self._disk().tile_range(tile)
        for name, view in fields.items():
            if name == "master":
                view.copy_(self.weights_staging[lo:hi])
            else:
                view.fill_(self.record.initial(name))

    # -- update ------------------------------------------------------------------------

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
        declare_cpu(
            self.manager,
            self.weights_staging,
            bucket=self.layout.index,
            write=True,
            what="the CPU update writes weights",
        )
        disk = self._disk()
        pieces = disk.pieces(runs)
        fp32 = self.dtype == torch.float32

        def step_tile(tile: int, fields: dict[str, torch.Tensor]) -> None:
            base = disk.starts[tile]
            for lo, hi, step in pieces[tile]:
                a, b = lo - base, hi - base
                staging = self.weights_staging[lo:hi]
                tiles.step(
                    lo,
                    hi,
                    step,
                    {name: view[a:b] for name, view in fields.items()},
                    out=None if fp32 else staging,
                    copy_master_to=staging if fp32 else None,
                )

        self._stream(step_tile, sorted(pieces), prefetch_next=True)

    def _rule_tiles(self, hyper: Hyper, grad_scale: float, **how: object) -> RuleTiles:
        """As HostState.update's (``how``: source, publish, after): the gradient is staging
        or the accumulator (Note [no accumulator for one backward]); the weight copies wait
        for compute issued so far."""
        return RuleTiles(self.rule, self.gradients, self.publication, hyper, grad_scale, **how)  # type: ignore[arg-type]

    def final_weights(self) -> torch.Tensor:
        self._load_weights()
        return self.weights_staging

    def weights_out(self) -> torch.Tensor:
        return self.weights_staging

    def publish_all_from_master(self) -> None:
        republish_from_master(self, self.publication)

    def span(self) -> tuple[int, int]:
        return self.shard

    # -- state -------------------------------------------------------------------------

    def state_tensors(self) -> dict[str, torch.Tensor]:
        path = self.file.path if self.file is not None else "(closed)"
        raise StateNotInHostRam(
            f"bucket {self.layout.index}'s optimizer state lives on NVMe ({path}, "
            f"{format_bytes(self.file.nbytes if self.file is not None else 0)}): it did not fit "
            "OffloadConfig.host_budget, so state_dict(), load_state_dict() and opt.state[p] "
            "cannot hand it out as tensors without exhausting host RAM. Save and load "
            "bucket by bucket with zero_offload.optim.checkpoint.streaming.save_streaming(opt, path) "
            "and load_streaming(opt, path) (the same as opt.save_streaming(path), "
            "opt.load_streaming(path))"
        )

    def field_dtypes(self) -> list[tuple[str, torch.dtype]]:
        """The state fields this bucket keeps (on disk), without reading them."""
        return [(name, dtype) for name, dtype, _ in self.record.fields]

    def field_initial(self, name: str) -> float:
        return self.record.initial(name)

    def stream_fields(self, fn: TileFn, *, read: bool = True, write: bool = False) -> None:
        """``fn(lo, hi, fields)`` for every tile in order (shard-local ``[lo, hi)``, the
        state fields' views of that tile): read from disk first (``read``; else ``fn``
        must fill every field) and written back after (``write``). For checkpoints: a
        pass that writes every tile without reading makes a FAILED file whole again."""
        if self.file is not None and write and not read:
            self.file.rewrite_all()
        self._stream(
            lambda t, fields: fn(*self._disk().tile_range(t), fields),
            range(self.tiles),
            read=read,
            write=write,
        )

    def close(self) -> None:
        # The views go with the block: Note [a publication does not hold its store].
        self.host_home.clear()
        self.weights_staging = None
        try:
            if self._staging_block is not None:
                self._staging_block.free()
                self._staging_block = None
        finally:
            if self.disk is not None:
                self.disk.close()
