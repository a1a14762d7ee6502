"""Moving bytes within one buffer, for defragmentation: a pure function, no bookkeeping.

Note [overlap-safe moves]
~~~~~~~~~~~~~~~~~~~~~~~~~
Compaction slides every movable block toward lower addresses, in address order, so a
block's destination can overlap only its own source. ``tensor.copy_`` refuses partially
overlapping operands, so an overlapping move goes in chunks from low to high addresses:
with chunks no longer than the distance moved, a chunk's destination overlaps only source
bytes that earlier chunks already copied. When the distance is short (less than
``DIRECT_CHUNK_MIN``) such chunks would be tiny, so the move bounces through a staging
buffer of at most ``STAGING_BYTES`` instead (read a chunk out, write it back lower; the
bytes it overwrites were read before). The pool allocates that staging per compaction.

On the CPU none of this is needed: numpy's slice assignment is defined for overlapping
operands (a memmove) and runs on the calling thread, whereas torch's CPU ``copy_`` hands
every copy to its intra-op threads, a cost paid per block that made compaction 5-30x slower
than one big copy on a loaded 2-core machine.
Note [no compaction inside backward]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A pool's ``on_move`` callbacks re-point their owner's views (a parameter's ``.data``), but
not the views autograd saved for backward (a linear layer's transposed weight): those would
read the old bytes, overwritten by the next block. So a compaction requested on a thread
running a backward pass (an allocation from a gradient hook, say) raises
``DefragmentationRefused`` (a ``PoolExhausted``) instead of moving anything. Saved views
also live between a forward and its backward; owners of blocks autograd may save must
not compact then either (nothing here can see that window).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Protocol, TypeVar

import torch

from ..accelerator import Accelerator
from ..errors import DefragmentationRefused, DeviceBudgetExceeded

__all__ = [
    "DIRECT_CHUNK_MIN",
    "STAGING_BYTES",
    "Scratch",
    "device_scratch",
    "free_gaps",
    "move_chunked",
    "move_within",
    "no_scratch",
    "plan_compaction",
    "refuse_inside_backward",
    "staging_bytes",
]

#: Overlapping moves shorter than this (bytes) bounce through staging, see the Note above.
DIRECT_CHUNK_MIN = 1 << 20
#: Largest staging buffer a defragmentation allocates, bytes.
STAGING_BYTES = 4 << 20

#: Staging for overlapping moves: ``scratch(nbytes)`` gives (flat uint8 tensor, release), or
#: None when none can be had (the move then goes in short direct chunks).
Scratch = Callable[[int], "tuple[torch.Tensor, Callable[[], None]] | None"]


def no_scratch(nbytes: int) -> None:
    """A host pool's scratch: none is needed, CPU moves are memmoves (see the Note)."""
    return None


def device_scratch(accelerator: Accelerator, name: str) -> Scratch:
    """A device pool's scratch: staging from the device budget, or None when the budget
    cannot hold it (then short direct chunks, see Note [overlap-safe moves])."""

    def scratch(nbytes: int) -> tuple[torch.Tensor, Callable[[], None]] | None:
        try:
            staging = accelerator.allocate_device(nbytes, what=f"{name!r} defrag staging")
        except DeviceBudgetExceeded:
            return None
        return staging.tensor, staging.release

    return scratch


def move_within(
    buffer: torch.Tensor, dst: int, src: int, nbytes: int, *, staging: torch.Tensor | None
) -> None:
    """Copy ``buffer[src:src+nbytes]`` to ``buffer[dst:dst+nbytes]`` for ``dst <= src``.

    Overlap-safe; see Note [overlap-safe moves]. CPU buffers move in one memmove; others go
    through ``move_chunked`` with ``staging`` (flat uint8, same device, or None).
    """
    distance = src - dst
    if distance < 0:
        raise ValueError(f"move_within moves toward lower offsets only, got {src} -> {dst}")
    if distance == 0 or nbytes == 0:
        return
    if buffer.device.type == "cpu":
        host = buffer.numpy()
        host[dst : dst + nbytes] = host[src : src + nbytes]  # numpy: memmove, overlap-safe
    else:
        move_chunked(buffer, dst, src, nbytes, staging=staging)


def staging_bytes(buffer: torch.Tensor, moves: list[tuple[int, int, int]]) -> int:
    """Bytes of staging that ``move_within`` can use for ``moves`` of ``(dst, src, nbytes)``.

    0 when no move is short and overlapping, or the buffer is on the CPU (memmove).
    """
    if buffer.device.type == "cpu":
        return 0
    short = [n for dst, src, n in moves if src - dst < min(n, DIRECT_CHUNK_MIN)]
    return min(max(short), STAGING_BYTES) if short else 0


def move_chunked(
    buffer: torch.Tensor, dst: int, src: int, nbytes: int, *, staging: torch.Tensor | None
) -> None:
    """``move_within`` with ``tensor.copy_`` only (any device); see Note [overlap-safe moves]."""
    distance = src - dst
    if distance >= nbytes:
        buffer[dst : dst + nbytes].copy_(buffer[src : src + nbytes])
        return
    if staging is None or distance >= DIRECT_CHUNK_MIN:
        for start in range(0, nbytes, distance):
            n = min(distance, nbytes - start)
            buffer[dst + start : dst + start + n].copy_(buffer[src + start : src + start + n])
        return
    chunk = staging.numel()
    for start in range(0, nbytes, chunk):
        n = min(chunk, nbytes - start)
        staging[:n].copy_(buffer[src + start : src + start + n])
        buffer[dst + start : dst + start + n].copy_(staging[:n])


K = TypeVar("K", bound=Hashable)


def plan_compaction(occupied: Sequence[tuple[K, int, int, int, bool]]) -> list[tuple[K, int]]:
    """Where each movable block goes when blocks slide toward the start.

    ``occupied``: (key, offset, size, align, movable) per occupied block, in address order,
    bytes. Returns (key, new offset) for the blocks that move, in address order: each
    movable block goes to the lowest offset aligned to its ``align`` after the block before
    it (moved or not), so a destination overlaps only the block's own source (Note
    [overlap-safe moves]). Blocks that cannot move stay where they are.
    """
    plan: list[tuple[K, int]] = []
    cursor = 0
    for key, offset, size, align, movable in occupied:
        dest = -(-cursor // align) * align
        if movable and dest < offset:
            plan.append((key, dest))
            cursor = dest + size
        else:
            cursor = offset + size
    return plan


def free_gaps(occupied: Sequence[tuple[int, int]], usable: int) -> list[tuple[int, int]]:
    """The free ranges (offset, size) of a buffer of ``usable`` bytes around ``occupied``
    (start, end) ranges given in address order."""
    gaps: list[tuple[int, int]] = []
    cursor = 0
    for start, end in occupied:
        if start > cursor:
            gaps.append((cursor, start - cursor))
        cursor = end
    if cursor < usable:
        gaps.append((cursor, usable - cursor))
    return gaps


class _Sized(Protocol):
    name: str
    sized_by: str
    capacity: int


def refuse_inside_backward(pool: _Sized, request: int | None) -> None:
    """Raise ``DefragmentationRefused`` when the calling thread runs a backward pass:
    Note [no compaction inside backward]. ``request``: the bytes of the allocation that
    needs the compaction, None for an explicit ``defragment()``."""
    if torch._C._current_graph_task_id() == -1:  # the autograd engine's, per thread
        return
    asked = "defragment()" if request is None else f"an allocation of {request} bytes"
    raise DefragmentationRefused(
        f"pool {pool.name!r}: {asked} needs compaction, refused while a backward pass runs "
        f"on this thread (blocks may be viewed by tensors autograd saved; see Note [no "
        f"compaction inside backward] in memory/moves.py). Size {pool.sized_by} (now "
        f"{pool.capacity} bytes) for the peak of backward, or free blocks sooner."
    )
