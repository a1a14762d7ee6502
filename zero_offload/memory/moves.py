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
"""

from __future__ import annotations

import torch

__all__ = ["DIRECT_CHUNK_MIN", "STAGING_BYTES", "move_within"]

#: Overlapping moves shorter than this (bytes) bounce through staging, see the Note above.
DIRECT_CHUNK_MIN = 1 << 20
#: Largest staging buffer a defragmentation allocates, bytes.
STAGING_BYTES = 4 << 20


def move_within(
    buffer: torch.Tensor, dst: int, src: int, nbytes: int, *, staging: torch.Tensor | None
) -> None:
    """Copy ``buffer[src:src+nbytes]`` to ``buffer[dst:dst+nbytes]`` for ``dst <= src``.

    Overlap-safe; see Note [overlap-safe moves]. ``staging`` (flat uint8, same device) is
    used for short overlapping moves when given.
    """
    distance = src - dst
    if distance < 0:
        raise ValueError(f"move_within moves toward lower offsets only, got {src} -> {dst}")
    if distance == 0 or nbytes == 0:
        return
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
