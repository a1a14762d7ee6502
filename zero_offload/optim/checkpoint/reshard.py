"""A streamed checkpoint loaded on another number of ranks than saved it (``load_streaming``
through ``streaming.load``): each rank reads, bucket by bucket, only the slices of the saved
ranks' files that fall in its own shard.

Note [a streamed checkpoint on another world size]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
An elementwise rule's bucket layout does not follow the world size but for the padding at
each bucket's end (Note [padding stays at the end] in ``partition.py``): the parameters and
their alignment gaps occupy ``[0, numel)`` at the same offsets on any number of ranks; only
``padded_numel``, and so each shard's bounds, change. Saved rank ``r``'s ``bucket{i}.bin``
holds bucket elements ``[start_r, start_r + real_r)`` (its shard before the padding: the
fingerprint's ``shard`` and ``real``), tile after tile, each tile its fields one after the
other, so the tiles' ``(lo, hi)`` in the metadata give every element's byte offset. A rank of
the new world size walks the real elements of its own shard tile by tile (``stream_fields``,
as any load) and fills each tile from the saved files that hold it, reading the slices it
needs field by field (the lowest saved rank that holds an element supplies it). The padding
is in no file and no shard reads it (a shard's real elements lie in ``[0, numel)``); the gaps
are copied as saved (zero, or the field's initial value). So every element loads as the saved
ranks held it: what a consolidated checkpoint of the same save loads, bitwise.

Before anything changes, every rank reads every saved rank's ``meta.pt`` (plain data and one
checksum per tile) and checks what a load on the saved world size checks, but for the shard
bounds: each saved rank's format, rule family and fingerprints against its buckets; that the
saved shards of each bucket hold ``[0, numel)`` and end at this bucket's ``numel``; the slot
offsets (recorded since this load exists); the save ids of all the saved ranks, not only of
those this world has (Note [one save across the ranks] in ``streaming.py``); the loss scaler
and the skip count; and the checksum of every saved tile its shard overlaps (the ranks
together read every tile). Then one all-gather of the outcomes: where a rank refused, every
rank raises, naming that rank and the saved file, and nothing was loaded anywhere. Host RAM:
one saved tile, every field of it, while checking; one slice of one field (at most a tile)
while copying, besides the store's own tile; never a bucket.

A rule that reads whole parameters lays each parameter inside its owner's shard (Note [a
whole parameter has one owner] in ``partition.py``): its layout follows the world size and
its shaped state is kept by the owner. Its streamed checkpoint loads on the world size that
saved it only; another is refused naming the rule and the consolidated route.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch
import xxhash

from ...collectives import Comm, all_gather_bytes
from ..flat_bucket import FlatBucket
from ..rule import RULES
from ..update.loss_scaler import LossScaler
from .loaded_fields import check_skipped_steps
from .stream_meta import META, WORLD_KEYS, check_fingerprint, check_header, read_meta

__all__ = ["Resharded", "SavedFile", "load_bucket", "prepare", "whole_rule_refusal"]


def whole_rule_refusal(where: Path, saved: object, world: int, rule: str) -> str:
    """Why a streamed checkpoint of a rule that reads whole parameters, saved on ``saved``
    ranks, does not load on ``world``, and what would (Note [a streamed checkpoint on
    another world size])."""
    return (
        f"{where}: saved with {saved} ranks, this optimizer has {world}: the {rule!r} rule "
        f"reads whole parameters, so each bucket's layout follows the number of ranks (Note "
        f"[a whole parameter has one owner]) and its streamed checkpoint resumes on {saved} "
        f"ranks only. To change the world size, load it on {saved} ranks and save a "
        "consolidated checkpoint (zero_offload.save_consolidated), which loads on any number "
        "of ranks (zero_offload.load_consolidated); nothing was loaded"
    )


def reads_whole(rule: str) -> bool:
    """Whether the rule named ``rule`` reads whole parameters (an unknown name: no)."""
    known = RULES.get(rule)
    return known is not None and not known.elementwise


@dataclass(frozen=True)
class SavedFile:
    """One saved rank's ``bucket{i}.bin``: the bucket elements it holds and where each
    tile's bytes start (Note [a streamed checkpoint on another world size])."""

    rank: int  # the saved rank that wrote it
    path: Path
    start: int  # bucket element of its first element (the saved shard's start)
    real: int  # elements it holds
    tiles: list[tuple[int, int, int]]  # (lo, hi, xxh3-64), file-local elements
    offsets: list[int]  # byte offset of each tile
    row: int  # bytes of one element, every field

    def overlapping(self, lo: int, hi: int) -> range:
        """The tiles holding bucket elements of ``[lo, hi)`` (empty tiles among them are
        skipped by the callers). The tiles are contiguous, so their byte offsets ascend."""
        first = bisect.bisect_right(self.offsets, (lo - self.start) * self.row) - 1
        return range(max(first, 0), bisect.bisect_left(self.offsets, (hi - self.start) * self.row))

    def check(self, lo: int, hi: int) -> None:
        """Read each tile holding elements of ``[lo, hi)`` whole, against its checksum."""
        with _opened(self) as handle:
            for t in self.overlapping(lo, hi):
                t_lo, t_hi, expected = self.tiles[t]
                if t_hi == t_lo:
                    continue
                handle.seek(self.offsets[t])
                data = _read(handle, (t_hi - t_lo) * self.row, self)
                if xxhash.xxh3_64_intdigest(memoryview(data)) != expected:
                    raise ValueError(
                        f"{self.path} (saved rank {self.rank}): tile [{t_lo}, {t_hi}) fails "
                        "its checksum (corrupted or torn checkpoint); nothing was loaded"
                    )


@dataclass(frozen=True)
class Resharded:
    """What ``prepare`` checked: rank 0's metadata (the groups, the loss scaler, the step
    counts...), its skip count, and each bucket's pieces ``(file, lo, hi)`` in bucket
    elements, in order, covering the real elements of this rank's shard."""

    meta: dict[str, Any]
    skipped: int | None
    pieces: list[list[tuple[SavedFile, int, int]]]


def prepare(
    root: Path,
    saved_world: int,
    buckets: list[FlatBucket],
    param_groups: list[dict[str, Any]],
    *,
    comm: Comm | None,
    scaler: LossScaler,
    tile_elements: int,
    rule: str,
    family: str,
) -> Resharded:
    """Check everything a load of ``root`` (saved on ``saved_world`` ranks) on this world
    size relies on, then share the outcome: every rank raises where one refused. A
    collective with several ranks; changes nothing."""
    failed: ValueError | TypeError | None = None
    resharded = None
    try:
        world = comm.world_size if comm is not None else 1
        resharded = _checked(
            root, (saved_world, world), buckets, param_groups, scaler, tile_elements, rule, family
        )
    except (ValueError, TypeError) as exc:
        failed = exc
    except (KeyError, IndexError) as exc:  # a saved rank's metadata lacks an entry
        failed = ValueError(
            f"{root}: a saved rank's metadata lacks {exc!r}, which save_streaming writes: a "
            "corrupted checkpoint; nothing was loaded"
        )
    except Exception as exc:  # an OSError reading a file, a MemoryError: this rank alone
        failed = ValueError(
            f"{root}: reading the saved ranks' files failed on this rank "
            f"({type(exc).__name__}: {exc}); nothing was loaded"
        )
        failed.__cause__ = exc
    _agree(root, saved_world, comm, failed)
    if resharded is None:
        raise RuntimeError("reshard.prepare: no plan and no refusal (a bug)")
    return resharded


def _agree(
    root: Path, saved_world: int, comm: Comm | None, failed: ValueError | TypeError | None
) -> None:
    """Raise on every rank where the checks refused on any (Note [a streamed checkpoint on
    another world size]): a rank's own reason there, the first failing rank's elsewhere."""
    if comm is None:
        if failed is not None:
            raise failed
        return
    reasons = all_gather_bytes(
        b"" if failed is None else str(failed).encode(),
        comm=comm,
        what=f"whether each rank can load {str(root)!r} (saved on {saved_world} ranks)",
        advice=(
            "Every rank must call load_streaming with the same path, at the same point of the loop."
        ),
    )
    failing = [r for r, reason in enumerate(reasons) if reason]
    if failed is not None:
        raise type(failed)(f"{comm.where()}: {failed}") from failed
    if failing:
        first = failing[0]
        raise ValueError(
            f"{comm.where()}: load_streaming({str(root)!r}) of a checkpoint saved on "
            f"{saved_world} ranks was refused on rank(s) {failing}, so on every rank; rank "
            f"{first}: {reasons[first].decode(errors='replace')}"
        )


def _checked(
    root: Path,
    worlds: tuple[int, int],
    buckets: list[FlatBucket],
    param_groups: list[dict[str, Any]],
    scaler: LossScaler,
    tile_elements: int,
    rule: str,
    family: str,
) -> Resharded:
    """``prepare``'s checks on this rank, in the order of Note [a streamed checkpoint on
    another world size]; raises the first that fails."""
    saved_world, world = worlds
    metas = [_saved_meta(root, r, saved_world, rule, family) for r in range(saved_world)]
    _check_one_save(root, metas)
    first = metas[0]
    shaped = any("param_state" in entry for meta in metas for entry in meta["buckets"])
    if shaped or reads_whole(rule) or reads_whole(str(first.get("rule", ""))):
        raise ValueError(whole_rule_refusal(root, saved_world, world, rule))
    if len(first["buckets"]) != len(buckets) or len(first["param_groups"]) != len(param_groups):
        raise ValueError(
            f"{root / 'rank0'}: {len(first['buckets'])} buckets and "
            f"{len(first['param_groups'])} param groups saved, this optimizer has "
            f"{len(buckets)} and {len(param_groups)}: build it over the same parameters with "
            "the same OffloadConfig.bucket_bytes; nothing was loaded"
        )
    scaler.check_state(first.get("loss_scaler") or {})
    skipped = check_skipped_steps(str(root / "rank0" / META), first.get("skipped_steps"))
    pieces = []
    for position, bucket in enumerate(buckets):
        files = [
            _saved_file(root, r, meta, position, bucket, tile_elements)
            for r, meta in enumerate(metas)
        ]
        steps = first["buckets"][position].get("steps")
        if not isinstance(steps, list) or len(steps) != len(bucket.layout.slots):
            raise ValueError(
                f"{root / 'rank0' / META}: bucket {bucket.layout.index}'s step counts are "
                f"{steps!r}, not one per parameter ({len(bucket.layout.slots)}): a corrupted "
                "checkpoint; nothing was loaded"
            )
        mine = _pieces(root, bucket, files)
        for file, lo, hi in mine:
            file.check(lo, hi)
        pieces.append(mine)
    return Resharded(first, skipped, pieces)


def _saved_meta(root: Path, rank: int, saved_world: int, rule: str, family: str) -> dict[str, Any]:
    """Saved rank ``rank``'s metadata, checked to be one of ``saved_world``'s."""
    where = root / f"rank{rank}" / META
    if not where.exists():
        raise ValueError(
            f"{where} does not exist: rank 0's metadata says {saved_world} ranks saved this "
            f"checkpoint, and saved rank {rank}'s files are missing (or its save did not "
            f"finish). Copy every directory rank0 to rank{saved_world - 1} of the checkpoint; "
            "nothing was loaded"
        )
    try:
        meta = read_meta(where)
    except (OSError, RuntimeError) as exc:
        raise ValueError(
            f"{where} (saved rank {rank}) cannot be read ({exc}); nothing was loaded"
        ) from exc
    check_header(where, meta, rule, family)
    if meta.get("rank") != rank or meta.get("world_size") != saved_world:
        raise ValueError(
            f"{where}: records rank {meta.get('rank')!r} of {meta.get('world_size')!r}, "
            f"expected rank {rank} of the {saved_world} rank 0's metadata names: directories "
            "of different checkpoints mixed; nothing was loaded"
        )
    if not isinstance(meta.get("buckets"), list) or not isinstance(meta.get("param_groups"), list):
        raise ValueError(f"{where} is not a save_streaming metadata file; nothing was loaded")
    return meta


def _check_one_save(root: Path, metas: list[dict[str, Any]]) -> None:
    """Refuse saved ranks' files of different saves (Note [one save across the ranks] in
    ``streaming.py``), all of the saved ranks' ids compared, not only this world's."""
    ids = [meta.get("save_id") for meta in metas]
    if all(save_id is None for save_id in ids):
        return  # saved before save ids existed
    others = [r for r, save_id in enumerate(ids) if save_id != ids[0] or save_id is None]
    if others:
        shown = [save_id if isinstance(save_id, str) else "none" for save_id in ids]
        raise ValueError(
            f"{root}: the files of saved rank(s) {others} are from another save than saved "
            f"rank 0's (save ids by saved rank: {shown}). A save that failed or was killed on "
            "some ranks leaves their previous checkpoint, and directories copied from "
            "different runs mix too: load a checkpoint that every rank finished saving; "
            "nothing was loaded"
        )


def _saved_file(
    root: Path, rank: int, meta: dict[str, Any], position: int, bucket: FlatBucket, tile: int
) -> SavedFile:
    """Saved rank ``rank``'s file of ``bucket``, its fingerprint and tiles checked."""
    directory = root / f"rank{rank}"
    if len(meta["buckets"]) <= position:
        raise ValueError(
            f"{directory / META}: {len(meta['buckets'])} buckets saved, this optimizer has "
            "more: build it over the same parameters with the same OffloadConfig.bucket_bytes; "
            "nothing was loaded"
        )
    entry = meta["buckets"][position]
    check_fingerprint(directory, entry, bucket, tile, ignore=WORLD_KEYS)
    layout = bucket.layout
    offsets = entry.get("offsets")
    if offsets is not None and list(offsets) != [slot.offset for slot in layout.slots]:
        raise ValueError(
            f"{directory}: bucket {layout.index}'s parameters were laid out at offsets "
            f"{list(offsets)} when saved, at {[slot.offset for slot in layout.slots]} here: "
            "build the optimizer with the same rule over the same parameters with the same "
            "bucket_bytes; nothing was loaded"
        )
    start, stop = entry["shard"]
    real, tiles = entry["real"], [tuple(t) for t in entry["tiles"]]
    row = sum(dtype.itemsize for _, dtype in bucket.store.field_dtypes())
    at, offsets_out = 0, []
    for lo, hi, _ in tiles:
        if lo != at or hi < lo:
            break
        offsets_out.append(at * row)
        at = hi
    if len(offsets_out) != len(tiles) or at != real or not 0 <= real <= stop - start:
        raise ValueError(
            f"{directory / META}: bucket {layout.index}'s tiles {tiles[:4]}... do not tile "
            f"the saved shard's {real} elements: a corrupted checkpoint; nothing was loaded"
        )
    return SavedFile(
        rank, directory / f"bucket{layout.index}.bin", start, real, tiles, offsets_out, row
    )


def _pieces(
    root: Path, bucket: FlatBucket, files: list[SavedFile]
) -> list[tuple[SavedFile, int, int]]:
    """The ``(file, lo, hi)`` pieces that hold the real elements of this rank's shard of
    ``bucket``, in order: at each element, the lowest saved rank that holds it."""
    layout = bucket.layout
    saved = max((f.start + f.real for f in files if f.real), default=0)
    if saved != layout.numel:
        raise ValueError(
            f"{root}: bucket {layout.index} held {saved} elements before its padding when "
            f"saved, {layout.numel} here: build the optimizer over the same parameters with "
            "the same bucket_bytes; nothing was loaded"
        )
    start, stop = bucket.store.span()
    at, end, pieces = start, start + layout.real_in(start, stop), []
    while at < end:
        holder = next((f for f in files if f.start <= at < f.start + f.real), None)
        if holder is None:
            raise ValueError(
                f"{root}: no saved rank's file holds element {at} of bucket {layout.index} "
                "(the saved shards leave a hole: a corrupted checkpoint); nothing was loaded"
            )
        upto = min(end, holder.start + holder.real)
        pieces.append((holder, at, upto))
        at = upto
    return pieces


def load_bucket(bucket: FlatBucket, pieces: list[tuple[SavedFile, int, int]]) -> None:
    """Stream the checked ``pieces`` into the bucket's state, tile by tile, reading one
    slice of one field at a time (Note [a streamed checkpoint on another world size])."""
    fields = bucket.store.field_dtypes()
    start = bucket.store.span()[0]
    handles: dict[Path, BinaryIO] = {}

    def fill(lo: int, hi: int, views: dict[str, torch.Tensor]) -> None:
        lo, hi = start + lo, start + hi
        for file, p_lo, p_hi in pieces:
            a, b = max(lo, p_lo), min(hi, p_hi)
            if a >= b:
                continue
            handle = handles.get(file.path) or handles.setdefault(file.path, _opened(file))
            for t in file.overlapping(a, b):
                t_lo, t_hi, _ = file.tiles[t]
                x, y = max(a, file.start + t_lo), min(b, file.start + t_hi)
                if x >= y:
                    continue
                field_at = file.offsets[t]
                for name, dtype in fields:
                    handle.seek(field_at + (x - file.start - t_lo) * dtype.itemsize)
                    data = _read(handle, (y - x) * dtype.itemsize, file)
                    views[name][x - lo : y - lo].copy_(torch.from_numpy(data).view(dtype))
                    field_at += (t_hi - t_lo) * dtype.itemsize

    try:
        bucket.store.stream_fields(fill, read=False, write=True)
    finally:
        for handle in handles.values():
            handle.close()


def _opened(file: SavedFile) -> BinaryIO:
    try:
        return open(file.path, "rb")
    except OSError as exc:
        raise ValueError(
            f"{file.path} (saved rank {file.rank}) cannot be read ({exc}): copy every saved "
            "rank's directory of the checkpoint whole; nothing was loaded"
        ) from exc


def _read(handle: BinaryIO, nbytes: int, file: SavedFile) -> np.ndarray:
    data = np.empty(nbytes, dtype=np.uint8)
    if handle.readinto(memoryview(data)) != nbytes:
        raise ValueError(
            f"{file.path} (saved rank {file.rank}) ends early: a truncated checkpoint; "
            "nothing was loaded"
        )
    return data
