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

import torch

from ...kernels import accumulate_grad, grad_stats
from ...partition import BucketLayout
from .buffers import host_pass_threads
from .stat_cells import Cut, pieces

__all__ = ["fold", "pass_tile"]


def fold(acc: torch.Tensor, staging: torch.Tensor, real: int) -> None:
    """``acc[:real] = staging[:real]`` in fp32: the window's first gradient, folded into
    the accumulator when a second flush arrives."""
    accumulate_grad(acc, staging, overwrite=True, stop=real, num_threads=host_pass_threads())


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
) -> None:
    """The pass over ``staging[lo:hi]`` (shard elements of ``layout``'s bucket) once it
    landed. Without an accumulator (``acc`` None): the window's only pass over a lone
    flush, its statistics. With one: the tile added into ``acc`` (``overwrite``: the
    window's first flush), and the same pass yields the statistics of the accumulated
    gradient. Each cell's float64 sum of squares is appended to ``partials``."""
    threads = host_pass_threads()
    for piece in pieces(layout.slots, shard, lo, hi):
        counted = partials if piece.cut is Cut.CELLS else None
        if acc is not None:
            accumulate_grad(
                acc,
                staging,
                overwrite=overwrite,
                start=piece.lo,
                stop=piece.hi,
                num_threads=threads,
                partials=counted,
            )
        elif counted is not None:
            grad_stats(
                staging, start=piece.lo, stop=piece.hi, num_threads=threads, partials=counted
            )
        if piece.cut is Cut.LAST and piece.cell is not None:
            cell_lo, cell_hi = piece.cell
            source = staging if acc is None else acc
            grad_stats(source, start=cell_lo, stop=cell_hi, num_threads=1, partials=partials)
