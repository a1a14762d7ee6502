"""Checkpoints that never hold the optimizer state in host RAM: saved and loaded bucket by
bucket, tile by tile (``save_streaming`` / ``load_streaming``).

``state_dict()`` hands the state out as tensors, which an optimizer with state on NVMe
cannot do without exhausting the RAM it did not fit in (``nvme.StateNotInHostRam`` names
these calls). These work for every placement (device-resident, host, NVMe): the host RAM
they use is one tile of every field at a time, whatever the model.

Layout, under ``path/rank{r}/`` (each rank writes its own shard, Note [sharded state dicts]
in ``state_dict.py``):

- ``bucket{i}.bin``: bucket ``i``'s tiles in order, then, for a rule that reads whole
  parameters, its shaped state (``bucket_file.py``, Note [shaped state in a streamed
  checkpoint] there);
- ``meta.pt`` (``torch.save`` of plain data, loaded with ``weights_only=True``): the
  format version, the rule's name, rank and world size, ``param_groups`` (as
  ``state_dict()``), the loss scaler, ``skipped_steps``, whether an ``overlap_step`` update
  was pending, and per bucket its fingerprint (index, shard, parameter sizes, fields and
  dtypes, the shaped state's names and shapes, tile size), its slots' offsets, step
  counts, each tile's ``(lo, hi, xxh3-64)`` and each shaped record's xxh3-64
  (``stream_meta.py`` reads and checks it).

Each rank's directory is replaced whole (Note [atomic replacement] in ``fileio.py``): a save
that fails or is killed leaves the previous checkpoint at ``path`` loadable.

Note [one save across the ranks]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Each rank replaces only its own directory, so a save that failed or was killed on some
ranks leaves their previous checkpoint next to the others' new one, and directories copied
together from different runs look alike. Each ``meta.pt`` therefore records a save id, 96
random bits drawn by rank 0 and shared by one all-reduce in ``save``; ``load`` exchanges
every rank's id (one all-reduce, which also carries the world size each rank's metadata
records; a rank whose metadata cannot be read takes part with none) and, before anything
changes, every rank refuses alike, naming the ranks whose files come from another save than
rank 0's. On another world size than rank 0's metadata records, every rank reads every saved
rank's metadata and compares all their ids instead (Note [a streamed checkpoint on another
world size] in ``reshard.py``). Checkpoints written before save ids existed carry none on
any rank and load as before.

A checkpoint loads back into an optimizer built the same way (the same parameters,
``bucket_bytes``, ``tile_elements`` and moments dtype) on the world size that saved it or, but
for a rule that reads whole parameters, another (``reshard.py``), whatever the placement of
each bucket now: a bucket saved from NVMe loads into host RAM when the new ``host_budget`` allows,
and back. Everything is checked first, every tile's checksum included (a pass over the
files; on another world size, of the tiles each rank reads): a mismatch raises and leaves
the optimizer as it was. A copy cut short after that
(Ctrl-C) is recorded, and the steps refuse until the load is called again (Note [a load cut
short] in ``update/resume.py``). A checkpoint that records
the rule's name loads only into an optimizer whose rule is of the same state family
(``OptimizerRule.state_family``: Adam and AdamW load each other's, as torch's do; those
written before the name was recorded load as before, by their fields).
"""

from __future__ import annotations

import os
import re
import secrets
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from ...collectives import Comm, all_reduce_stats, collective_device
from ...fileio import atomic_directory, private_file, recover_directory
from ...progress import progress
from ..flat_bucket import FlatBucket
from ..update.loss_scaler import LossScaler
from ..update.resume import LoadGuard
from . import reshard
from .bucket_file import check_bucket_file, load_bucket, save_bucket
from .loaded_fields import check_skipped_steps
from .reshard import reads_whole, whole_rule_refusal
from .state_dict import LoadedState, group_entries
from .stream_meta import (
    FORMAT_VERSION,
    META,
    check_fingerprint,
    check_header,
    fingerprint,
    read_meta,
)


class Streamable(Protocol):
    """An optimizer that streams its state (``OffloadAdamW``; a protocol, so this module
    stays below the facade that calls ``save``/``load``)."""

    def save_streaming(self, path: str | os.PathLike[str]) -> None: ...

    def load_streaming(self, path: str | os.PathLike[str]) -> None: ...


__all__ = ["load", "load_streaming", "save", "save_streaming", "world_mismatch"]


def save_streaming(opt: Streamable, path: str | os.PathLike[str]) -> None:
    """``opt.save_streaming(path)``: write the state under ``path/rank{r}/`` bucket by
    bucket, tile by tile; see the module docstring. Every rank calls it."""
    opt.save_streaming(path)


def load_streaming(opt: Streamable, path: str | os.PathLike[str]) -> None:
    """``opt.load_streaming(path)``: load what ``save_streaming`` wrote, tile by tile."""
    opt.load_streaming(path)


#: What a rank that never reaches a streamed checkpoint's collective has probably done.
_TOGETHER = (
    "Every rank must call save_streaming (and load_streaming) with the same path, at the "
    "same point of the loop."
)

#: Bits in each of the save id's two halves (exact in a float64 all-reduce).
_ID_BITS = 48


def _new_save_id(comm: Comm | None, path: str | os.PathLike[str]) -> str:
    """A save id every rank shares: rank 0's random bits, summed with the others' zeros.
    See Note [one save across the ranks]."""
    draw = [secrets.randbits(_ID_BITS), secrets.randbits(_ID_BITS)]
    if comm is None:
        return f"{draw[0]:012x}{draw[1]:012x}"
    mine = torch.tensor(draw if comm.rank == 0 else [0, 0], dtype=torch.float64)
    total = all_reduce_stats(
        mine,
        comm=comm,
        device=collective_device(comm),
        what=f"the save id of save_streaming({str(path)!r})",
        advice=_TOGETHER,
    )
    return f"{int(total[0]):012x}{int(total[1]):012x}"


def _save_id_halves(save_id: object) -> tuple[int, int]:
    """The two halves of a save id; ``(-1, -1)`` for none (or not one of ours)."""
    if isinstance(save_id, str) and len(save_id) == 24:
        try:
            return int(save_id[:12], 16), int(save_id[12:], 16)
        except ValueError:
            pass
    return -1, -1


def _exchange(
    comm: Comm | None, path: str | os.PathLike[str], save_id: object, saved_world: object
) -> list[tuple[tuple[int, int], int]]:
    """Every rank's save id halves (``(-1, -1)``: none) and the world size its own metadata
    records (-1: none), in rank order: one all-reduce with several ranks. See Note [one save
    across the ranks]."""
    world = saved_world if isinstance(saved_world, int) and saved_world > 0 else -1
    if comm is None:
        return [(_save_id_halves(save_id), world)]
    mine = torch.zeros(3 * comm.world_size, dtype=torch.float64)
    mine[3 * comm.rank : 3 * comm.rank + 3] = torch.tensor([*_save_id_halves(save_id), world])
    total = all_reduce_stats(
        mine,
        comm=comm,
        device=collective_device(comm),
        what=f"every rank's save id of the checkpoint load_streaming reads ({str(path)!r})",
        advice=_TOGETHER,
    )
    values = [int(v) for v in total.tolist()]
    return [((values[3 * r], values[3 * r + 1]), values[3 * r + 2]) for r in range(comm.world_size)]


def _check_one_save(
    comm: Comm | None, path: str | os.PathLike[str], halves: list[tuple[int, int]]
) -> None:
    """Refuse, on every rank alike, files of different saves under ``path`` (``halves``:
    every rank's, from ``_exchange``): Note [one save across the ranks]."""
    if comm is None or all(h == (-1, -1) for h in halves):
        return  # one rank, or saved before save ids existed
    shown = [f"{a:012x}{b:012x}" if a >= 0 else "none" for a, b in halves]
    others = [r for r in range(1, comm.world_size) if halves[r] != halves[0]]
    if halves[0] == (-1, -1):
        others = [0, *others]
    if others:
        raise ValueError(
            f"{comm.where()}: {path}: the files of rank(s) {others} are from another save "
            f"than rank 0's (save ids by rank: {shown}; 'none': no finished save there). "
            "A save that failed or was killed on some ranks leaves their previous "
            "checkpoint, and directories copied from different runs mix too: load a "
            "checkpoint that every rank finished saving; nothing was loaded"
        )


def _recover(root: Path, rank: int, world: int) -> None:
    """Finish or undo the directory swaps a killed save left half done (Note [atomic
    replacement] in ``fileio.py``): this rank's own directory, and of the saved ranks'
    beyond this world size those whose number is ``rank`` modulo ``world``, so that each
    is recovered by one rank only, before the first collective of ``load`` (after which the
    ranks read each other's)."""
    recover_directory(root / f"rank{rank}")
    try:
        names = [entry.name for entry in os.scandir(root)]
    except OSError:
        return  # ``load`` says what is missing
    for name in names:
        match = _OLD_RANK.fullmatch(name)
        if match and int(match.group(1)) >= world and int(match.group(1)) % world == rank:
            recover_directory(root / name.removesuffix(".old"))


#: A rank directory that a killed save left moved aside (``fileio``'s ``.old`` suffix).
_OLD_RANK = re.compile(r"rank(\d+)\.old")


def _rank_dir(comm: Comm | None, path: str | os.PathLike[str]) -> tuple[Path, int, int]:
    rank = comm.rank if comm is not None else 0
    world = comm.world_size if comm is not None else 1
    return Path(path) / f"rank{rank}", rank, world


def save(
    path: str | os.PathLike[str],
    buckets: Sequence[FlatBucket],
    param_groups: Sequence[dict[str, Any]],
    *,
    comm: Comm | None,
    scaler: LossScaler,
    skipped_steps: int,
    pending_update: bool,
    tile_elements: int,
    rule: str,
    family: str,
    written: Sequence[int] = (),
) -> None:
    """Write the state of ``buckets`` under ``path/rank{r}/``; the caller made it final
    (``OffloadAdamW.save_streaming``). ``rule``: the rule's name, ``family`` its state's
    (``OptimizerRule.state_family``), which ``load`` checks;
    ``written``: as in ``state_dict.optimizer_state``."""
    directory, rank, world = _rank_dir(comm, path)
    save_id = _new_save_id(comm, path)  # Note [one save across the ranks]
    nbytes = sum(
        b.layout.real_in(*b.store.span()) * sum(d.itemsize for _, d in b.store.field_dtypes())
        + b.store.param_state_bytes()
        for b in buckets
    )
    # Written aside and swapped in whole: see Note [atomic replacement] in fileio.py.
    with atomic_directory(directory, what="save_streaming", nbytes=nbytes) as staging:
        entries = []
        for bucket in progress(buckets, desc="save_streaming", unit="bucket"):
            target = staging / f"bucket{bucket.layout.index}.bin"
            with private_file(target) as out:
                checksums, shaped = save_bucket(bucket, out)
            entry = fingerprint(bucket, tile_elements)
            # Note [a streamed checkpoint on another world size] in reshard.py
            entry["offsets"] = [slot.offset for slot in bucket.layout.slots]
            entry["steps"] = bucket.steps.tolist()
            entry["tiles"] = checksums
            if shaped:
                entry["shaped"] = shaped
            entries.append(entry)
        meta = {
            "version": FORMAT_VERSION,
            "rule": rule,
            "family": family,
            "rank": rank,
            "world_size": world,
            "param_groups": group_entries(param_groups),
            "loss_scaler": scaler.state_dict(),
            "skipped_steps": skipped_steps,
            "pending_update": bool(pending_update),
            "written_since_step": [int(index) for index in written],
            "buckets": entries,
            "save_id": save_id,
        }
        with private_file(staging / META) as out:
            torch.save(meta, out)


def _check(
    buckets: Sequence[FlatBucket],
    param_groups: Sequence[dict[str, Any]],
    scaler: LossScaler,
    tile_elements: int,
    rule: str,
    family: str,
    directory: Path,
    meta: dict[str, Any],
) -> None:
    """Everything ``load`` on the saved world size relies on, before anything changes."""
    check_header(directory / META, meta, rule, family)
    saved = meta["buckets"]
    if len(saved) != len(buckets) or len(meta["param_groups"]) != len(param_groups):
        raise ValueError(
            f"{directory}: {len(saved)} buckets and {len(meta['param_groups'])} param groups "
            f"saved, this optimizer has {len(buckets)} and {len(param_groups)}: build "
            "it over the same parameters with the same OffloadConfig.bucket_bytes"
        )
    checking = zip(saved, buckets, strict=True)
    for entry, bucket in progress(checking, desc="checking the checkpoint", total=len(buckets)):
        check_fingerprint(directory, entry, bucket, tile_elements)
        source = directory / f"bucket{bucket.layout.index}.bin"
        check_bucket_file(source, bucket, entry["tiles"], entry.get("shaped", []))
    scaler.check_state(meta.get("loss_scaler") or {})


def _other_world(where: Path, saved: object, world: int) -> str:
    """Why this rank's metadata, of ``saved`` ranks, does not belong to a checkpoint that
    rank 0's says ``world`` ranks saved."""
    return (
        f"{where}: saved with {saved} ranks, while rank 0's metadata says {world} ranks saved "
        "this checkpoint: directories of different checkpoints mixed. Load a checkpoint "
        "whose every rank directory comes from one save; nothing was loaded"
    )


def world_mismatch(path: str | os.PathLike[str], world: int) -> str | None:
    """Why the streamed checkpoint under ``path`` cannot load on ``world`` ranks, or None
    (it can, or rank 0's metadata cannot be read: ``load`` then says why). Another world
    size loads (Note [a streamed checkpoint on another world size] in ``reshard.py``) but
    for a rule that reads whole parameters. For callers that check several loads before
    starting any."""
    try:
        meta = read_meta(Path(path) / "rank0" / META)
    except (OSError, ValueError, RuntimeError):
        return None
    saved, rule = meta.get("world_size"), meta.get("rule")
    if not isinstance(saved, int) or saved == world or not isinstance(rule, str):
        return None
    return whole_rule_refusal(Path(path), saved, world, rule) if reads_whole(rule) else None


def load(
    path: str | os.PathLike[str],
    buckets: Sequence[FlatBucket],
    param_groups: list[dict[str, Any]],
    *,
    comm: Comm | None,
    scaler: LossScaler,
    tile_elements: int,
    rule: str,
    family: str,
    guard: LoadGuard,
    call: str,
) -> LoadedState:
    """Load what ``save`` wrote under ``path/rank{r}/`` into ``buckets`` and
    ``param_groups``, tile by tile, on the world size that saved it or another (Note [a
    streamed checkpoint on another world size] in ``reshard.py``); checks everything first
    (the loss scaler's state too, and that a rule of ``family`` saved it, ``rule`` naming
    ours in the message): a mismatch raises on every rank and changes nothing. ``guard``
    records the copy bucket by bucket, ``call`` being the call that redoes it (Note [a load
    cut short] in ``update/resume.py``). Returns what the caller applies, as
    ``state_dict.load_optimizer_state`` does."""
    directory, rank, world = _rank_dir(comm, path)
    meta: dict[str, Any] = {}
    unreadable: BaseException | None = None
    try:
        _recover(Path(path), rank, world)  # a save killed mid-swap: Note [atomic replacement]
        if not (directory / META).exists():
            raise FileNotFoundError(
                f"{directory / META} does not exist: not a streamed checkpoint, or its save "
                "did not finish (save_streaming writes it last)"
            )
        meta = read_meta(directory / META)
    except (OSError, ValueError) as exc:
        unreadable = exc  # raised after the other ranks learn this one has no save
    ranks = _exchange(comm, path, meta.get("save_id"), meta.get("world_size"))
    saved_world = ranks[0][1]  # as rank 0's metadata records it (-1: unreadable)
    buckets = list(buckets)
    if saved_world > 0 and saved_world != world:
        # Note [a streamed checkpoint on another world size] in reshard.py
        resharded = reshard.prepare(
            Path(path),
            saved_world,
            buckets,
            param_groups,
            comm=comm,
            scaler=scaler,
            tile_elements=tile_elements,
            rule=rule,
            family=family,
        )
        pieces = resharded.pieces
        return _copy(
            resharded.meta,
            resharded.skipped,
            buckets,
            param_groups,
            lambda position, bucket: reshard.load_bucket(bucket, pieces[position]),
            guard=guard,
            call=call,
        )
    if unreadable is None and meta.get("world_size") != world:
        unreadable = ValueError(_other_world(directory, meta.get("world_size"), world))
    try:
        _check_one_save(comm, path, [halves for halves, _ in ranks])
    except ValueError:
        if unreadable is None:
            raise
    if unreadable is not None:  # this rank's own reason, rather than "another save"
        raise unreadable
    _check(buckets, param_groups, scaler, tile_elements, rule, family, directory, meta)
    skipped = check_skipped_steps(str(directory / META), meta.get("skipped_steps"))
    return _copy(
        meta,
        skipped,
        buckets,
        param_groups,
        lambda _, bucket: load_bucket(bucket, directory / f"bucket{bucket.layout.index}.bin"),
        guard=guard,
        call=call,
    )


def _copy(
    meta: dict[str, Any],
    skipped: int | None,
    buckets: list[FlatBucket],
    param_groups: list[dict[str, Any]],
    fill: Callable[[int, FlatBucket], None],
    *,
    guard: LoadGuard,
    call: str,
) -> LoadedState:
    """The copy of a checked load: ``fill(position, bucket)`` streams each bucket's state
    in; the step counts, groups and the rest come from ``meta`` (rank 0's, on another world
    size: the saved ranks share them)."""
    written = set(meta.get("written_since_step", ()))
    # Checked: from here on nothing raises on the checkpoint's data. A copy cut short
    # (Ctrl-C) is recorded bucket by bucket: Note [a load cut short] in update/resume.py.
    guard.start(call, [bucket.layout.index for bucket in buckets])
    loading = zip(meta["buckets"], buckets, strict=True)
    for position, (entry, bucket) in enumerate(
        progress(loading, desc="load_streaming", total=len(buckets), unit="bucket")
    ):
        guard.begin(position)
        fill(position, bucket)
        bucket.steps[:] = np.asarray(entry["steps"], dtype=np.int64)
        bucket.kept_at_zero.clear()  # a streamed checkpoint keeps no unstepped entries
        bucket.store.publication.drop_unpublished()
        # Note [a loaded state claims no weights] in state_dict.py
        bucket.loaded(i for i, slot in enumerate(bucket.layout.slots) if slot.index in written)
        guard.done(position)
    for saved, group in zip(meta["param_groups"], param_groups, strict=True):
        for key, value in saved.items():
            if key != "params":
                group[key] = value
    return LoadedState(
        meta.get("loss_scaler") or {},
        skipped,
        bool(meta.get("pending_update")),
    )
