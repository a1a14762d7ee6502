"""Every rank starts from rank 0's weights, as under DDP: Note [every rank starts from rank
0's weights].

Note [every rank starts from rank 0's weights]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Each rank builds the master, the moments' shard and (ZeRO-3) its shard of every unit from the
weights it holds at construction. Ranks that built the model without a common seed (as users
do who rely on DDP, accelerate or Trainer copying rank 0's weights to the others) would
silently train a mix: rank r's shard of every bucket would come from rank r's own initial
weights, and the first all-gather would hand the mix to every rank. So with several ranks each
build broadcasts rank 0's values of the trainable parameters it takes into every rank's
parameters (``start_from_rank0``), in place, after the ranks agreed on their shapes and
dtypes (Note [the ranks build alike] in ``rank_agreement.py``) and before any bucket reads
them: every construction route (stage 2, ZeRO-3 with the shards on the device or offloaded,
NVMe) and every ``add_param_group`` then builds from the same values. What the optimizer
does not take stays the user's, as DDP's parameters are not its buffers: frozen parameters,
parameters left out of the groups, and buffers.

Skipped: parameters on the meta device, which the build reads from their checkpoint
(``load_pretrained``), the same file on every rank.

Memory: on gloo (CPU collectives) the broadcast writes into the parameters themselves, which
are on the CPU by then (Note [originals on the device leave first] in ``weights/source.py``):
nothing is allocated beyond a contiguous copy of a parameter that is not contiguous. Where
collectives run on the GPU (NCCL) each parameter passes through one device staging buffer
of at most ``OffloadConfig.bucket_bytes``, chunk by chunk, before any pool is allocated (a
bucket's worth, inside the "final footprint plus one bucket" of Note [construction holds
one copy] in ``construction.py``).

The cost: one broadcast of the trainable weights per build (as DDP's at its construction),
issued together and waited with ``collective_timeout`` (Note [collective deadlines] in
``collectives.py``): a rank that never gets there makes the others raise
``CollectiveError`` naming it, and the build is undone as after any failure.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from ..collectives import Comm, Pending, collective_device, wait_all, wait_work

__all__ = ["start_from_rank0"]

#: What a rank that never reaches the broadcast has probably done.
_ADVICE = (
    "Every rank must construct the optimizer (and call add_param_group) alike, at the same "
    "point of the program; a rank whose construction raised before it says why in its log."
)


def start_from_rank0(
    params: Sequence[torch.Tensor], *, comm: Comm | None, chunk_bytes: int, owner: str
) -> int:
    """Give every rank of ``comm`` rank 0's values of ``params`` (in place; each once, meta
    parameters skipped); nothing with one rank. ``params`` are on the CPU or meta;
    ``chunk_bytes``: the most a device staging buffer holds where collectives run on the GPU;
    ``owner``: the optimizer's class, for errors. Returns the elements broadcast. A
    collective: every rank calls it with the same parameters (in shapes and dtypes). See
    Note [every rank starts from rank 0's weights]."""
    if comm is None:
        return 0
    device = collective_device(comm)
    src = 0 if comm.group is None else dist.get_global_rank(comm.group, 0)
    seen: set[int] = set()
    pending: list[Pending] = []
    staging: torch.Tensor | None = None  # (bytes,) uint8 on ``device``, shared by _staged
    sent = 0
    with torch.no_grad():
        for index, param in enumerate(params):
            if id(param) in seen or param.is_meta or param.numel() == 0:
                continue
            seen.add(id(param))
            data = param.detach()
            what = (
                f"{owner}'s broadcast of rank 0's initial weights of parameter {index} "
                f"{tuple(data.shape)} (Note [every rank starts from rank 0's weights])"
            )
            sent += data.numel()
            if device.type == data.device.type and data.is_contiguous():
                work = dist.broadcast(data, src=src, group=comm.group, async_op=True)
                pending.append(Pending(work, what, data.is_cuda, _ADVICE))
                continue
            staging = _staged(
                data, staging, comm=comm, src=src, device=device, chunk_bytes=chunk_bytes, what=what
            )
    wait_all(pending, comm)
    return sent


def _staged(
    data: torch.Tensor,
    staging: torch.Tensor | None,
    *,
    comm: Comm,
    src: int,
    device: torch.device,
    chunk_bytes: int,
    what: str,
) -> torch.Tensor:
    """Broadcast ``data`` (not contiguous, or not where collectives run) through a staging
    buffer on ``device`` of at most ``chunk_bytes``, chunk by chunk, and write it back.
    ``staging``: the bytes an earlier parameter staged through (None before the first),
    reused, and grown only when this parameter needs more; returns the buffer used."""
    whole = data if data.is_contiguous() else data.contiguous()  # a copy if not contiguous
    flat = whole.view(-1)
    step = max(1, chunk_bytes // max(1, flat.element_size()))
    need = min(step, flat.numel()) * flat.element_size()
    if staging is None or staging.numel() < need:
        staging = torch.empty(need, dtype=torch.uint8, device=device)
    typed = staging[:need].view(flat.dtype)
    for lo in range(0, flat.numel(), step):
        piece = flat[lo : lo + step]
        buffer = typed[: piece.numel()]
        buffer.copy_(piece)
        work = dist.broadcast(buffer, src=src, group=comm.group, async_op=True)
        wait_work(Pending(work, what, buffer.is_cuda, _ADVICE), comm)
        # Synchronisation point on a GPU: the copy back to the host waits for the broadcast.
        piece.copy_(buffer)
    if whole is not data:
        data.copy_(whole)
    return staging
