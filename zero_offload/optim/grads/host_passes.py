"""The host worker's passes over a gradient that landed in host staging: the window's
statistics, and the fp32 accumulation of a window with several flushes.

Pure functions over host tensors (the kernels do the arithmetic); ``HostGradients``
(``to_host.py``) decides when each runs, on which buffer, and declares what it reads and
writes. Note [no accumulator for one backward] and Note [a bucket's gradient lifecycle]
say which pass a flush gets; Note [the norm does not depend on the bucketing]
(``stat_cells.py``) says how its statistics are cut, so the norm is bitwise the same for
every bucket and tile size.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import NamedTuple

import torch

from ...accelerator import Event
from ...kernels import (
    AccumulateRanges,
    StatsRanges,
    accumulate_grad,
    accumulate_grad_ranges,
    grad_stats_ranges,
    plan_accumulate_ranges,
    plan_stats_ranges,
)
from ...memory.manager import TieredMemoryManager
from ...partition import BucketLayout
from ..access import declare_cpu
from .buffers import host_pass_threads
from .landing import Landing
from .path import SumSqParts
from .stat_cells import Cut, pieces

__all__ = ["HostPasses", "TileRanges", "fold", "pass_tile", "tile_ranges"]


def fold(acc: torch.Tensor, staging: torch.Tensor, real: int) -> None:
    """``acc[:real] = staging[:real]`` in fp32: the window's first gradient, folded into
    the accumulator when a second flush arrives."""
    accumulate_grad(acc, staging, overwrite=True, stop=real, num_threads=host_pass_threads())


class TileRanges(NamedTuple):
    """What the pass over one tile reads, cut into pieces (``stat_cells.pieces``): the
    ranges whose statistics a statistics-only pass sums (``grad_stats_ranges``), and the
    pieces with the statistics each yields for an accumulating pass
    (``accumulate_grad_ranges``)."""

    stats: tuple[tuple[int, int], ...]
    acc: tuple[tuple[int, int, tuple[int, int] | None], ...]


def tile_ranges(layout: BucketLayout, shard: tuple[int, int], lo: int, hi: int) -> TileRanges:
    """The ranges of the shard-local tile ``[lo, hi)`` of ``layout``'s bucket, for either
    pass: a function of the layout, the shard and the tile alone (Note [a tile's ranges are
    cut once])."""
    stats: list[tuple[int, int]] = []
    acc: list[tuple[int, int, tuple[int, int] | None]] = []
    for piece in pieces(layout.slots, shard, lo, hi):
        if piece.cut is Cut.CELLS:
            # a run of whole cells: counted as it is accumulated
            stats.append((piece.lo, piece.hi))
            acc.append((piece.lo, piece.hi, (piece.lo, piece.hi)))
        elif piece.cut is Cut.LAST and piece.cell is not None:
            # a cell's last piece counts the whole cell (begun in an earlier tile), re-read
            # once accumulated
            stats.append(piece.cell)
            acc.append((piece.lo, piece.hi, piece.cell))
        else:
            acc.append((piece.lo, piece.hi, None))  # part of a cell, or a gap: not counted
    return TileRanges(tuple(stats), tuple(acc))


class TilePlans(NamedTuple):
    """A tile's ``TileRanges`` planned for the kernels over arrays of the shard's length
    (Note [ranges planned once] in kernels/_validate.py)."""

    stats: StatsRanges
    acc: AccumulateRanges


def tile_plans(layout: BucketLayout, shard: tuple[int, int], lo: int, hi: int, n: int) -> TilePlans:
    """``tile_ranges``, checked and cut into the kernels' blocks for arrays of ``n``
    elements."""
    cut = tile_ranges(layout, shard, lo, hi)
    return TilePlans(plan_stats_ranges(cut.stats, n), plan_accumulate_ranges(cut.acc, n))


# Note [a tile's ranges are cut once]
# Cutting a tile into its pieces (``stat_cells.pieces``) walks the bucket's slots in
# Python: about 3 ms a tile for a bucket of 400 small parameters, on the host worker, at
# every flush of every step, beside a launch of about 1.3 ms. The cut depends only on the
# layout, the shard and the tile's bounds, all fixed for a bucket's ``HostPasses`` (tiles
# land at the same bounds every step), so it is cut once per tile and kept: O(tiles) tuples
# per bucket, the memory of the ranges themselves. It is kept planned for the kernels
# (``TilePlans``; Note [ranges planned once] in kernels/_validate.py), so a launch does not
# check and cut its ranges again either: 1.3 ms of numpy a launch at 600 ranges, before.


def pass_tile(
    layout: BucketLayout,
    shard: tuple[int, int],
    staging: torch.Tensor,
    acc: torch.Tensor | None,
    *,
    overwrite: bool,
    lo: int,
    hi: int,
    partials: list[float],
    ranges: TileRanges | TilePlans | None = None,
) -> None:
    """The pass over ``staging[lo:hi]`` (shard elements of ``layout``'s bucket) once it
    landed. Without an accumulator (``acc`` None): the window's only pass over a lone
    flush, its statistics. With one: the tile added into ``acc`` (``overwrite``: the
    window's first flush), and the same pass yields the statistics of the accumulated
    gradient. Each cell's float64 sum of squares is appended to ``partials``. ``ranges``:
    the tile's ``tile_ranges`` or ``tile_plans``, cut here when None."""
    threads = host_pass_threads()
    cut = ranges if ranges is not None else tile_ranges(layout, shard, lo, hi)
    if acc is None:
        # Statistics only: every counted range of the tile in one launch, the partials in
        # the order the pieces give them (Note [one launch for many ranges] in
        # kernels/stats.py).
        grad_stats_ranges(staging, cut.stats, num_threads=threads, partials=partials)
        return
    # Accumulation: every piece of the tile in one launch, with the statistics the pieces
    # call for (Note [one accumulation launch for many ranges] in kernels/accumulate.py).
    accumulate_grad_ranges(
        acc, staging, cut.acc, overwrite=overwrite, num_threads=threads, partials=partials
    )


class HostPasses:
    """One bucket's passes on the host worker (``fold``, ``pass_tile``), each declaring
    what it reads and writes and counting its host bytes (``TrafficCounters.add_pass``),
    and the statistics of the window's last flush or landing.

    Fields (host worker):
        stats: ``(sum of squares, non-finite)`` of the window.
        partials: the float64 partial sums of that sum, per cell (Note [the norm does not
            depend on the bucketing] in ``stat_cells.py``).
    """

    def __init__(
        self, manager: TieredMemoryManager, layout: BucketLayout, shard: tuple[int, int]
    ) -> None:
        self.manager = manager
        self.layout = layout
        self.shard = shard
        self.stats = (0.0, False)
        self.partials: list[float] = []
        # each landed tile's pieces, by its bounds (Note [a tile's ranges are cut once])
        self._ranges: dict[tuple[int, int, int], TilePlans] = {}

    def _declare(self, tensor: torch.Tensor, *, write: bool, what: str) -> None:
        declare_cpu(self.manager, tensor, bucket=self.layout.index, write=write, what=what)

    def _count(self, name: str, *, read: int, written: int) -> None:
        self.manager.counters.add_pass(name, read=read, written=written)

    def fold(self, acc: torch.Tensor, staging: Callable[[], torch.Tensor], real: int) -> None:
        """The window's first gradient, from staging into the accumulator."""
        src = staging()  # looked up now: a block may have moved since the pass was queued
        self._declare(src, write=False, what="fold reads staging")
        self._declare(acc, write=True, what="fold writes the accumulator")
        fold(acc, src, real)
        self._count("fold", read=real * src.element_size(), written=4 * real)

    def staging_tile(
        self,
        staging: Callable[[], torch.Tensor],
        acc: torch.Tensor | None,
        overwrite: bool,
        lo: int,
        hi: int,
        *,
        partials: list[float],
    ) -> None:
        """Once ``staging[lo:hi]`` landed: its statistics, or its accumulation (``pass_tile``)."""
        src = staging()  # looked up now, as in ``fold``
        if acc is None:
            self._declare(src[lo:hi], write=False, what="statistics read staging")
        else:
            self._declare(src[lo:hi], write=False, what="accumulation reads staging")
            self._declare(acc[lo:hi], write=True, what="accumulation writes the accumulator")
        key = (lo, hi, src.shape[0])
        ranges = self._ranges.get(key)
        if ranges is None:
            ranges = self._ranges[key] = tile_plans(self.layout, self.shard, lo, hi, key[2])
        pass_tile(self.layout, self.shard, src, acc, overwrite=overwrite, lo=lo, hi=hi,
                  partials=partials, ranges=ranges)  # fmt: skip
        n, k = hi - lo, src.element_size()
        if acc is None:
            self._count("statistics", read=k * n, written=0)
        else:
            self._count("accumulation", read=(k if overwrite else k + 4) * n, written=4 * n)

    def follow(
        self,
        landing: Landing,
        staging: Callable[[], torch.Tensor],
        acc: torch.Tensor | None,
        *,
        overwrite: bool,
    ) -> Event:
        """Queue ``staging_tile`` on the host worker behind each tile of ``landing`` (into
        ``staging``), then ``summed``; the worker's event after them."""
        worker = self.manager.host_worker
        partials: list[float] = []
        task = functools.partial(self.staging_tile, staging, acc, overwrite, partials=partials)
        landing.follow(worker, self.layout.real_in(*self.shard), task)
        worker.submit(functools.partial(self.summed, partials))
        return worker.record_event()

    def summed(self, partials: list[float]) -> None:
        """After the last tile: the window's statistics (float64 sums, added exactly; the
        policy adds every bucket's partials the same way)."""
        total = math.fsum(partials) if partials else 0.0
        self.partials = list(partials)
        self.stats = (total, not math.isfinite(total))

    def sumsq(self) -> SumSqParts:
        return SumSqParts(self.partials, self.stats[1])
