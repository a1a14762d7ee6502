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
  dtypes, the shaped state's names and shapes, tile size), step counts, each tile's
  ``(lo, hi, xxh3-64)`` and each shaped record's xxh3-64.

Each rank's directory is replaced whole (Note [atomic replacement] in ``fileio.py``): a save
that fails or is killed leaves the previous checkpoint at ``path`` loadable.

Note [one save across the ranks]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Each rank replaces only its own directory, so a save that failed or was killed on some
ranks leaves their previous checkpoint next to the others' new one, and directories copied
together from different runs look alike. Each ``meta.pt`` therefore records a save id, 96
random bits drawn by rank 0 and shared by one all-reduce in ``save``; ``load`` exchanges
every rank's id (one all-reduce; a rank whose metadata cannot be read takes part with
none) and, before anything changes, every rank refuses alike, naming the ranks whose
files come from another save than rank 0's. Checkpoints written before save ids existed
carry none on any rank and load as before.

A checkpoint loads back into an optimizer built the same way (the same parameters, world
size, ``bucket_bytes``, ``tile_elements`` and moments dtype), whatever the placement of each
bucket now: a bucket saved from NVMe loads into host RAM when the new ``host_budget`` allows,
and back. Everything is checked first, every tile's checksum included (a pass over the
files): a mismatch raises and leaves the optimizer as it was. A copy cut short after that
(Ctrl-C) is recorded, and the steps refuse until the load is called again (Note [a load cut
short] in ``update/resume.py``). A checkpoint that records
the rule's name loads only into an optimizer whose rule is of the same state family
(``OptimizerRule.state_family``: Adam and AdamW load each other's, as torch's do; those
written before the name was recorded load as before, by their fields).
"""

from __future__ import annotations

import os
import pickle
import secrets
from collections.abc import Sequence
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
from .bucket_file import check_bucket_file, load_bucket, save_bucket, shaped_layout
from .loaded_fields import check_skipped_steps
from .state_dict import LoadedState, group_entries


class Streamable(Protocol):
    """An optimizer that streams its state (``OffloadAdamW``; a protocol, so this module
    stays below the facade that calls ``save``/``load``)."""

    def save_streaming(self, path: str | os.PathLike[str]) -> None: ...

    def load_streaming(self, path: str | os.PathLike[str]) -> None: ...


__all__ = ["load", "load_streaming", "save", "save_streaming", "world_mismatch"]

_FORMAT_VERSION = 1
_META = "meta.pt"


def save_streaming(opt: Streamable, path: str | os.PathLike[str]) -> None:
    """``opt.save_streaming(path)``: write the state under ``path/rank{r}/`` bucket by
    bucket, tile by tile; see the module docstring. Every rank calls it."""
    opt.save_streaming(path)


def load_streaming(opt: Streamable, path: str | os.PathLike[str]) -> None:
    """``opt.load_streaming(path)``: load what ``save_streaming`` wrote, tile by tile."""
    opt.load_streaming(path)


def _fingerprint(bucket: FlatBucket, tile_elements: int) -> dict[str, Any]:
    store = bucket.store
    fingerprint = {
        "index": bucket.layout.index,
        "shard": tuple(store.span()),
        # Elements of this rank's state that hold parameters (before the sharding padding).
        "real": bucket.layout.real_in(*store.span()),
        "params": [slot.numel for slot in bucket.layout.slots],
        "fields": [(name, str(dtype)) for name, dtype in store.field_dtypes()],
        "tile_elements": tile_elements,
    }
    shaped = shaped_layout(bucket)
    if any(shaped):  # Note [shaped state in a streamed checkpoint] in bucket_file.py
        fingerprint["param_state"] = shaped
    return fingerprint


#: Fingerprint keys that only some buckets have (Note [shaped state in a streamed
#: checkpoint] in ``bucket_file.py``): compared when either side has them.
_OPTIONAL_KEYS = ("param_state",)


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


def _check_one_save(comm: Comm | None, path: str | os.PathLike[str], save_id: object) -> None:
    """Refuse, on every rank alike, files of different saves under ``path``: Note [one
    save across the ranks]. Every rank calls it (a collective)."""
    if comm is None:
        return
    ids = torch.zeros(2 * comm.world_size, dtype=torch.float64)
    ids[2 * comm.rank : 2 * comm.rank + 2] = torch.tensor(_save_id_halves(save_id))
    total = all_reduce_stats(
        ids,
        comm=comm,
        device=collective_device(comm),
        what=f"every rank's save id of the checkpoint load_streaming reads ({str(path)!r})",
        advice=_TOGETHER,
    )
    halves = [(int(total[2 * r]), int(total[2 * r + 1])) for r in range(comm.world_size)]
    if all(h == (-1, -1) for h in halves):
        return  # saved before save ids existed
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
            entry = _fingerprint(bucket, tile_elements)
            entry["steps"] = bucket.steps.tolist()
            entry["tiles"] = checksums
            if shaped:
                entry["shaped"] = shaped
            entries.append(entry)
        meta = {
            "version": _FORMAT_VERSION,
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
        with private_file(staging / _META) as out:
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
    """Everything ``load`` relies on, before anything changes (the world size is checked
    already)."""
    if meta.get("version") != _FORMAT_VERSION:
        raise ValueError(
            f"{directory / _META}: format version {meta.get('version')!r}, expected "
            f"{_FORMAT_VERSION}"
        )
    # Saved before the rule was recorded: no check here (the fingerprints still compare the
    # state's fields). Adam and AdamW load each other's, as torch's optimizers do.
    if "rule" in meta and meta.get("family", meta["rule"]) != family:
        raise ValueError(
            f"{directory / _META}: saved by an optimizer with the {meta['rule']!r} rule, this "
            f"one steps with the {rule!r} rule: load it into an optimizer of the rule that "
            "saved it; nothing was loaded"
        )
    saved = meta["buckets"]
    if len(saved) != len(buckets) or len(meta["param_groups"]) != len(param_groups):
        raise ValueError(
            f"{directory}: {len(saved)} buckets and {len(meta['param_groups'])} param groups "
            f"saved, this optimizer has {len(buckets)} and {len(param_groups)}: build "
            "it over the same parameters with the same OffloadConfig.bucket_bytes"
        )
    checking = zip(saved, buckets, strict=True)
    for entry, bucket in progress(checking, desc="checking the checkpoint", total=len(buckets)):
        _check_fingerprint(directory, entry, bucket, tile_elements)
        source = directory / f"bucket{bucket.layout.index}.bin"
        check_bucket_file(source, bucket, entry["tiles"], entry.get("shaped", []))
    scaler.check_state(meta.get("loss_scaler") or {})


def _check_fingerprint(
    directory: Path, entry: dict[str, Any], bucket: FlatBucket, tile_elements: int
) -> None:
    """Refuse a bucket saved from other parameters, fields or shaped state."""
    mine = _fingerprint(bucket, tile_elements)
    keys = [*mine, *(key for key in _OPTIONAL_KEYS if key in entry and key not in mine)]
    theirs = {key: entry.get(key) for key in keys}
    theirs["shard"] = tuple(theirs["shard"])
    diff = sorted(key for key in keys if theirs[key] != mine.get(key))
    if diff:
        shown = "; ".join(
            f"{k}: {_shown(k, theirs[k], mine.get(k))} saved, {_shown(k, mine.get(k), theirs[k])} "
            "here"
            for k in diff
        )
        raise ValueError(
            f"{directory}: bucket {bucket.layout.index} was saved with different {diff} "
            f"({shown}): build the optimizer "
            "with the same rule over the same parameters (the same shapes) with the same "
            "bucket_bytes, tile_elements and moments_dtype; nothing was loaded"
        )


def _shown(key: str, value: Any, other: Any) -> Any:
    """``value`` for a mismatch message; for the shaped state, only the first parameter of
    the bucket where ``value`` and ``other`` differ (the whole list is long)."""
    if key != "param_state":
        return value
    if value is None:
        return "no shaped state"
    other = other or []
    for j in range(max(len(value), len(other))):
        mine = value[j] if j < len(value) else None
        if mine != (other[j] if j < len(other) else None):
            return f"parameter {j} of the bucket: {mine}"
    return value


def _other_world(where: Path, saved: object, world: int) -> str:
    """Why a streamed checkpoint of ``saved`` ranks does not load on ``world``, and what
    would (Note [sharded state dicts] in ``state_dict.py``)."""
    return (
        f"{where}: saved with {saved} ranks, this optimizer has {world}: a streamed "
        f"checkpoint holds each rank's own shard and resumes on {saved} ranks only. To "
        f"change the world size, load it on {saved} ranks and save a consolidated "
        "checkpoint (zero_offload.save_consolidated), which loads on any number of ranks "
        "and stages (zero_offload.load_consolidated); nothing was loaded"
    )


def world_mismatch(path: str | os.PathLike[str], world: int) -> str | None:
    """Why the streamed checkpoint under ``path`` cannot load on ``world`` ranks, or None
    (it can, or rank 0's metadata cannot be read: ``load`` then says why). For callers
    that check several loads before starting any."""
    saved = _saved_world(Path(path))
    return None if saved is None or saved == world else _other_world(Path(path), saved, world)


def _saved_world(path: Path) -> int | None:
    """The world size rank 0's metadata under ``path`` records (None: unreadable)."""
    try:
        size = _read_meta(path / "rank0" / _META).get("world_size")
    except (OSError, ValueError, RuntimeError):
        return None
    return size if isinstance(size, int) else None


def _read_meta(path: Path) -> dict[str, Any]:
    """``meta.pt`` with ``weights_only=True``: plain data and tensors, never code."""
    try:
        meta = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise ValueError(
            f"{path} holds objects other than plain data (numbers, strings, lists, dicts, "
            "tensors), which save_streaming never writes: refusing to unpickle it, since "
            f"that could run arbitrary code; nothing was loaded ({exc})"
        ) from exc
    if not isinstance(meta, dict):
        raise ValueError(f"{path} is not a save_streaming metadata file; nothing was loaded")
    return meta


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
    ``param_groups``, tile by tile; checks everything first (the loss scaler's state too,
    and that a rule of ``family`` saved it, ``rule`` naming ours in the message): a mismatch
    raises and changes nothing. ``guard`` records the copy bucket by bucket, ``call`` being
    the call that redoes it (Note [a load cut short] in ``update/resume.py``). Returns what
    the caller applies, as ``state_dict.load_optimizer_state`` does."""
    directory, _, world = _rank_dir(comm, path)
    meta: dict[str, Any] = {}
    unreadable: BaseException | None = None
    try:
        recover_directory(directory)  # a save killed mid-swap: Note [atomic replacement]
        if not (directory / _META).exists():
            saved = _saved_world(Path(path))
            if saved is not None and saved != world:  # a rank the save did not have
                raise ValueError(_other_world(directory, saved, world))
            raise FileNotFoundError(
                f"{directory / _META} does not exist: not a streamed checkpoint, or its save "
                "did not finish (save_streaming writes it last)"
            )
        meta = _read_meta(directory / _META)
        if meta.get("world_size") != world:
            raise ValueError(_other_world(directory, meta.get("world_size"), world))
    except (OSError, ValueError) as exc:
        unreadable = exc  # raised after the other ranks learn this one has no save
    try:
        _check_one_save(comm, path, meta.get("save_id") if unreadable is None else None)
    except ValueError:
        if unreadable is None:
            raise
    if unreadable is not None:  # this rank's own reason, rather than "another save"
        raise unreadable
    _check(buckets, param_groups, scaler, tile_elements, rule, family, directory, meta)
    skipped = check_skipped_steps(str(directory / _META), meta.get("skipped_steps"))

    written = set(meta.get("written_since_step", ()))
    # Checked: from here on nothing raises on the checkpoint's data. A copy cut short
    # (Ctrl-C) is recorded bucket by bucket: Note [a load cut short] in update/resume.py.
    guard.start(call, [bucket.layout.index for bucket in buckets])
    loading = zip(meta["buckets"], buckets, strict=True)
    for position, (entry, bucket) in enumerate(
        progress(loading, desc="load_streaming", total=len(buckets), unit="bucket")
    ):
        guard.begin(position)
        load_bucket(bucket, directory / f"bucket{bucket.layout.index}.bin")
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
