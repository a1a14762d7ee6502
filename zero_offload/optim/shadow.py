"""The weight shadow of a delayed update: a device copy of a bucket's next weights, filled
while the next forward and backward run, so the step that publishes them copies on the
device.

Note [the delayed update lands in a shadow]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
With ``overlap_step`` the update of step k runs on the host worker while step k+1's forward
and backward run on the weights of step k-1 (Note [delayed parameter update] in
``update/modes.py``), so its weights cannot go to ``weights_dev`` as its tiles are written:
the forward still reads them. Without a shadow they waited in the pinned home and step k+1
copied the whole bucket host to device before the next forward could start: a PCIe bubble
of 2 bytes per bf16 parameter every step (about 45 ms at 1.15B and 100 ms at 2.69B on the
H200 run's link), with the GPU idle. With room in the device budget a bucket keeps a
shadow instead (``WeightShadow``: its shard in the training dtype, ``2s`` device bytes for
``s`` bf16 elements): each tile the delayed update writes is copied host to device into the
shadow at once (``Publish.SHADOW``), on the ``h2d`` stream, from the host worker, while the
GPU computes; the step that publishes it waits for those copies on the compute stream and
copies the shadow into ``weights_dev`` there, device to device (about 1 ms per GB at HBM
speed). The bytes are the same bytes the home held, so the weights are bitwise those
without a shadow; only when they cross the link changes.

Order. A fill writes the shadow after the last device-to-device copy out of it (``read``,
its ``after``); the publishing copy runs on the compute stream after every fill (a stream
wait, not a host wait), and after every kernel issued so far, which read the old weights;
the next update rewrites the home once the fills that read it are done
(``WeightCopies.home_readers``). Weights written between the steps still win: the shadow
lands whole and the written parameters are put back after it, as without a shadow (Note
[delayed parameter update]). A publication dropped (a loaded state re-derives the master)
leaves the shadow's bytes unused, and the next fills overwrite them in stream order. A new
shadow's first fills wait for the compute issued before it was taken: on CUDA its bytes may
come from the caching allocator, still read by queued kernels.

Which buckets. The delayed update asks for a bucket's shadow at its first run, when the
backward has already taken its gradient buffers and accumulators: the shadow is taken when
the budget has its bytes plus a reserve left (a tenth of the budget, or two of the bucket's
gradient buffers if more), the same reserve as Note [micro-batches add up on the device].
Otherwise the bucket publishes from the home as before, and the first such bucket is logged
on the ``zero_offload`` logger and counted in the profiler's step notes. Only a bucket whose
updated weights cross the link get one: not a device-resident bucket, nor one whose weights
live on the host or NVMe between uses (parameter offload), which have nothing to copy.
"""

from __future__ import annotations

import logging

import torch

from ..accelerator import Event
from ..config import OverlapShadow
from ..memory.block import Block
from ..memory.manager import TieredMemoryManager
from ..memory.pool import BlockPool
from .grads.device_acc import pool_if_room

__all__ = ["WeightShadow", "WeightShadows"]

_log = logging.getLogger("zero_offload")


class WeightShadow:
    """One bucket's shadow of its shard's weights on the device.

    Fields:
        tensor: (shard_numel,) training dtype, device: the delayed update's weights, as
            they arrive.
        block: the block under ``tensor``, in ``pool``, a pool of its own.
        read: the event after the last device-to-device copy out of ``tensor`` (the next
            fills wait for it), or None.
    """

    def __init__(
        self,
        manager: TieredMemoryManager,
        pool: BlockPool,
        block: Block,
        *,
        numel: int,
        dtype: torch.dtype,
    ) -> None:
        self.manager = manager
        self.pool = pool
        self.block = block
        self.tensor = block.view(dtype, (numel,))
        block.on_move(lambda b: setattr(self, "tensor", b.view(dtype, (numel,))))
        self.read: Event | None = None

    def close(self) -> None:
        """Give the block and its pool back (the device budget with them)."""
        self.manager.discard_pool(self.pool)


class WeightShadows:
    """The delayed update's shadows: which buckets get one (Note [the delayed update lands
    in a shadow]).

    Fields:
        shadowed: how many buckets took one; refused: how many had no room.
    """

    def __init__(
        self,
        manager: TieredMemoryManager,
        *,
        setting: OverlapShadow = OverlapShadow.AUTO,
        name: str,
    ) -> None:
        self.manager = manager
        self.setting = setting
        self.name = name
        self.shadowed = 0
        self.refused = 0

    def take(
        self, *, bucket: int, numel: int, dtype: torch.dtype, buffer_bytes: int
    ) -> WeightShadow | None:
        """A shadow of ``numel`` elements of ``dtype`` for bucket ``bucket``, or None when
        the device budget has no room for it and its reserve (``buffer_bytes``: one of the
        bucket's gradient buffers); None, unasked, with ``OverlapShadow.OFF``."""
        if self.setting is OverlapShadow.OFF:
            return None
        nbytes = numel * dtype.itemsize
        pool, reserve, left = pool_if_room(
            self.manager,
            nbytes,
            buffer_bytes=buffer_bytes,
            name=f"{self.name}.bucket{bucket}.weight_shadow",
        )
        if pool is None:
            self._refused(bucket, nbytes, reserve, left)
            return None
        block = pool.alloc(max(nbytes, 1), owner=f"bucket{bucket}.weight_shadow")
        shadow = WeightShadow(self.manager, pool, block, numel=numel, dtype=dtype)
        # Its first fills wait for the compute issued so far (see the Note).
        shadow.read = self.manager.compute_ready()
        self.shadowed += 1
        self._note()
        return shadow

    def _refused(self, bucket: int, nbytes: int, reserve: int, left: int) -> None:
        if not self.refused:
            _log.warning(
                "zero-offload: overlap_step publishes bucket %d from the host: its device "
                "weight shadow (%d bytes) and a reserve of %d bytes do not fit the %d bytes "
                "left in the device budget, so its weights cross the link when the next "
                "step() publishes them (Note [the delayed update lands in a shadow]). Later "
                "buckets without room are counted in the profiler's step notes, not logged.",
                bucket,
                nbytes,
                reserve,
                left,
            )
        self.refused += 1
        self._note()

    def _note(self) -> None:
        notes = self.manager.step_notes
        notes[f"{self.name}.shadowed_buckets"] = self.shadowed
        if self.refused:
            notes[f"{self.name}.unshadowed_buckets"] = self.refused
