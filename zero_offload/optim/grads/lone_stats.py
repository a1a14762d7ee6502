"""A gradient's statistics taken on the device: each parameter's float64 norm, left there.

``piece_norms`` cuts a bucket's shard into its parameters' pieces and takes their norms in
one ``_foreach_norm``: for a window summed on the device as it lands (Note [micro-batches add
up on the device] in ``device_acc.py``), and for the lone flush of a window the delayed
update will read (``HostGradients._lone_norms`` in ``to_host.py``, below).

Note [a lone window's statistics are taken on the device]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
With ``overlap_step`` and one micro-batch a step, window k+1's gradient stays in staging
(Note [the delayed update reads one buffer, the next backward fills the other] in
``staging.py``), and its statistics were the host worker's pass over each landed tile. The
one worker is first in, first out, and update k occupies it while backward k+1 runs: that
pass queued behind Adam k (issue 39: nothing of the next backward queues behind the
delayed update), and it read the whole gradient once more on the host, ``k`` bytes a
parameter a step (fp32 4, bf16 2). So a lone flush with ``HostGradients(delayed_update=
True)`` takes its statistics on the device instead, where the bytes already are: at the
flush, on the compute stream, in order after the backward that wrote it and beside the
copy to staging, each parameter's float64 norm of its piece (``piece_norms``), kept as
the window's ``DeviceWindow.norms`` and read with every bucket's in one copy when the step
needs them. The flush queues nothing on the host worker: CPU Adam follows the copies
themselves (Note [Adam follows the gradient in] in ``landing.py``), and the staging buffer's
last reader is the update, recorded at the window's end as before. A second flush in the
window after all (a second micro-batch) folds the lone flush into the accumulator; the fold
then waits on the worker for the flush's last copy, since no pass did, and the window's
statistics are the accumulation passes' again (``norms`` dropped).
The semantics are the device accumulator's: the norm is the float64 sum of per-parameter
norms squared, not the host's exactly added cells (Note [the norm does not depend on the
bucketing] in ``stat_cells.py``); the two agree to about 1e-16, so a step whose clip binds
may differ from the host's statistics (the plain step, several micro-batches on the host)
in the last bit of a few weights, and an unclipped one is bitwise equal. On the host
accelerator the norm is exactly ``sqrt(fsum(n_p ** 2))`` of torch's
``linalg.vector_norm(g_p, dtype=float64)`` over the parameters ``p``
(tests/test_overlap_lone_stats.py). A NaN or an infinity makes its
parameter's norm non-finite (squares of finite values cannot overflow float64), so the
overflow flag is exact. The device holds ``(parameters,)`` float64 per bucket until the
step: 8 bytes a parameter tensor, not a parameter element.
With several ranks the shard is this rank's only once the reduce-scatter ends, on the
communication stream: norms on the compute stream would make compute wait for every
bucket's reduce-scatter (on CUDA it would no longer overlap backward: 13 waits a backward
for 13 buckets, backward 0.39 -> 0.58 s with a 40 ms reduce-scatter on the host
accelerator). There the host pass stays, behind the delayed update, as before.
"""

from __future__ import annotations

import torch

from ...memory.manager import TieredMemoryManager
from ...partition import BucketLayout
from ..access import declare_compute

__all__ = ["piece_norms"]


def piece_norms(
    manager: TieredMemoryManager, layout: BucketLayout, shard: tuple[int, int], src: torch.Tensor
) -> torch.Tensor | None:
    """(pieces,) float64 on the device, left there: the L2 norm of each parameter's piece of
    ``shard`` in ``src`` (the shard's elements from its start, or a lone parameter's), None
    for none; one ``_foreach_norm`` on the current stream."""
    start, stop = shard
    views = []
    for slot in layout.slots:
        lo, hi = layout.owned_piece(slot, start, stop)
        if hi > lo:
            first = slot.offset + lo - start
            views.append(src[first : first + hi - lo])
    if not views:
        return None
    declare_compute(manager, src, bucket=layout.index, write=False, what="norms")
    return torch.stack(torch._foreach_norm(views, 2, dtype=torch.float64))
