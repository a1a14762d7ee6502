"""Consolidated optimizer checkpoints: save with N ranks, load with any M (M = 1 included).

``OffloadAdamW.state_dict()`` on each of several ranks holds that rank's shard only
(Note [sharded state dicts] in ``optim/checkpoint/state_dict.py``). These helpers gather the shards to
one rank in the one-rank layout (torch's, shaped like the parameters) and load it back on
any world size::

    save_consolidated(opt, "opt.pt")      # every rank calls it; rank 0 writes the file
    load_consolidated(opt, "opt.pt")      # every rank calls it; each keeps its own pieces

Model weights are every rank's whole parameters: save them from rank 0 as usual
(``model.state_dict()``) and load them on every rank before ``load_consolidated``.

Note [checkpoints are gathered on the CPU]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The gather pickles each rank's shard into a byte tensor on the group's collective device
(``collectives.gather_bytes``: ``gather_object``'s exchange with the optimizer's
``collective_timeout``, so a rank that never arrives is named: Note [collective
deadlines]). On an NCCL group that is the GPU: every shard of the optimizer state (16 bytes
per parameter with fp32 moments) would pass through the destination GPU's memory, the very
memory offload exists to spare, and could OOM it. So the gather runs over a CPU (gloo)
group with the same ranks: the optimizer's own group when it has a gloo backend, else a
gloo twin made once per group with ``use_local_synchronization=True`` (only the group's
ranks take part in creating it, so a subgroup works too) and kept for later checkpoints.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
from typing import Any

import torch
import torch.distributed as dist

from .collectives import Comm, Pending, gather_bytes, wait_work
from .errors import StorageFull
from .fileio import save_torch
from .optim import OffloadOptimizer

__all__ = ["consolidated_state_dict", "load_consolidated", "merge_shards", "save_consolidated"]

# Gloo twins of non-CPU groups, by the group's global ranks: Note [checkpoints are gathered
# on the CPU]. Kept for the process's life (a checkpoint per N steps reuses its twin).
_cpu_groups: dict[tuple[int, ...], dist.ProcessGroup] = {}


#: What a rank that never reaches a consolidated checkpoint's collective has probably done.
_TOGETHER = (
    "Every rank must call consolidated_state_dict / save_consolidated with the same dst, at "
    "the same point of the loop."
)


def cpu_group(comm: Comm) -> dist.ProcessGroup | None:
    """A group with ``comm``'s ranks whose collectives run on the CPU (gloo).

    ``None`` means the default group, when that is gloo already. A collective the first time
    for a non-gloo group: every rank of ``comm`` must call it.
    """
    group = comm.group
    backend = str(dist.get_backend(group))
    if "gloo" in backend:
        return group
    ranks = tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
    twin = _cpu_groups.get(ranks)
    if twin is None:
        twin = dist.new_group(ranks=list(ranks), backend="gloo", use_local_synchronization=True)
        _cpu_groups[ranks] = twin
    return twin


def merge_shards(shards: list[dict[str, Any]]) -> dict[str, Any]:
    """The one-rank state dict from every rank's ``state_dict()`` (in any order)."""
    if not shards:
        raise ValueError("merge_shards needs the state dicts of every rank, got none")
    infos = [shard.get("zero_offload", {}).get("shard") for shard in shards]
    if any(info is None for info in infos):
        raise ValueError("merge_shards takes sharded state dicts (from several ranks) only")
    world_size = infos[0]["world_size"]
    ranks = sorted(info["rank"] for info in infos)
    if ranks != list(range(world_size)):
        raise ValueError(
            f"merge_shards needs one state dict per rank 0..{world_size - 1}, got {ranks}"
        )
    state: dict[int, dict[str, torch.Tensor]] = {}
    for shard, info in zip(shards, infos, strict=True):
        for index, entry in shard["state"].items():
            shape = tuple(info["shapes"][index])
            lo, hi = info["pieces"][index]
            merged = state.setdefault(index, {"step": entry["step"]})
            shaped = info.get("shaped", {}).get(index, ())  # whole, from the owner
            for name, piece in entry.items():
                if name == "step":
                    continue
                if name in shaped:
                    merged[name] = piece.clone()
                    continue
                if name not in merged:
                    merged[name] = torch.zeros(shape, dtype=piece.dtype)
                merged[name].view(-1)[lo:hi] = piece
    extra = {key: value for key, value in shards[0]["zero_offload"].items() if key != "shard"}
    # What else a shard holds (keys a state-dict post-hook added: Note [torch's state-dict
    # hooks] in optim/checkpoint/torch_hooks.py) is the first shard's, as its param_groups are.
    known = ("state", "param_groups", "zero_offload")
    others = {key: value for key, value in shards[0].items() if key not in known}
    return {
        **others,
        "state": state,
        "param_groups": shards[0]["param_groups"],
        "zero_offload": extra,
    }


def consolidated_state_dict(opt: OffloadOptimizer, *, dst: int = 0) -> dict[str, Any] | None:
    """The one-rank layout of ``opt``'s state on rank ``dst`` of the optimizer's process
    group (``None`` on the others).

    A collective with several ranks: every rank must call it; a rank that does not within
    ``OffloadConfig.collective_timeout`` makes the others raise ``CollectiveError`` naming
    it (Note [collective deadlines]). With one rank it is ``opt.state_dict()``. Hidden
    cost: rank ``dst`` holds the whole optimizer state (16 bytes per parameter with fp32
    moments) in its memory at once, and each rank's pickled shard beside it.
    """
    local = opt.state_dict()
    comm = opt.comm
    if comm is None:
        return local
    # Never through the GPU (Note [checkpoints are gathered on the CPU]); the twin group has
    # the optimizer's ranks in the same order, and its deadline.
    cpu = dataclasses.replace(comm, group=cpu_group(comm))
    gathered = gather_bytes(
        pickle.dumps(local),
        comm=cpu,
        dst=dst,
        what=f"every rank's optimizer state for rank {dst}'s consolidated state dict",
        advice=_TOGETHER,
    )
    if gathered is None:
        return None
    # The ranks' own pickles, as gather_object would load them.
    return merge_shards([pickle.loads(shard) for shard in gathered])


def save_consolidated(opt: OffloadOptimizer, path: str | os.PathLike[str], *, dst: int = 0) -> None:
    """Write the consolidated state dict to ``path`` from rank ``dst``; every rank calls it
    and returns once the file is written (a barrier, so a following load sees it). A failed
    write leaves the previous file at ``path`` as it was."""
    state = consolidated_state_dict(opt, dst=dst)
    failure: BaseException | None = None
    if state is not None:
        try:
            # Replaces ``path`` only once complete: Note [atomic replacement] in fileio.py.
            save_torch(state, path, what="save_consolidated")
        except Exception as exc:  # still reach the barrier, so the other ranks are not stuck
            failure = exc
    comm = opt.comm
    if comm is not None:
        # With the deadline (Note [collective deadlines]): a rank that never arrives is named.
        work = dist.barrier(group=comm.group, async_op=True)
        wait_work(Pending(work, f"barrier after writing {str(path)!r}", False, _TOGETHER), comm)
    if failure is not None:
        where = f"{comm.where()}: " if comm is not None else ""
        if isinstance(failure, StorageFull):
            raise StorageFull(f"{where}{failure}") from failure
        raise OSError(
            f"{where}could not write the checkpoint to {str(path)!r}: {failure}"
        ) from failure


def load_consolidated(opt: OffloadOptimizer, path: str | os.PathLike[str]) -> None:
    """Load a consolidated (or one-rank, or ``torch.optim.AdamW``) checkpoint on any world
    size; every rank reads ``path`` and keeps the pieces it owns."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except (RuntimeError, OSError, EOFError) as exc:
        if isinstance(exc, FileNotFoundError):
            raise
        raise ValueError(
            f"{str(path)!r}: not a readable checkpoint (corrupted or truncated: "
            f"{type(exc).__name__}: {exc}); nothing was loaded"
        ) from exc
    opt.load_state_dict(state)
