"""One bucket's file in a streamed checkpoint (``bucket{i}.bin``): what is written in it,
in which order, and how it is read back and checked. ``streaming.py`` owns the directory:
it opens the file (inside its atomic replacement), keeps the checksums in the metadata and
checks the fingerprint before anything is read.

The file is the bucket's tiles in order (each tile its fields' raw bytes for the tile's
elements, field after field, in the rule's order, the master first), then the shaped state
of a rule that reads whole parameters, one record per parameter. Each tile and each record
carries an xxh3-64 checksum, which ``streaming.py`` keeps in the metadata; a tile's bytes
are read and written a tile at a time, never the whole bucket. The tiles are contiguous and
each is ``hi - lo`` elements of every field, so the metadata's ``(lo, hi)`` give any
element's byte offset: a load on another world size reads just the slices its shard needs
(Note [a streamed checkpoint on another world size] in ``reshard.py``).

Note [shaped state in a streamed checkpoint]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A rule that reads whole parameters (Adafactor, Muon) keeps, beside its per-element fields,
state shaped by each parameter (Note [rules that read a whole parameter] in
``rule/base.py``), which the store shows per slot (``param_state``) as ``state_dict()``
reads it. After a bucket's tiles, its file holds one record per slot that has such state,
in slot order: its fields' raw fp32 bytes, field after field in the rule's order. The
bucket's fingerprint lists each slot's ``[name, shape]`` pairs (``shaped_layout``), so a
checkpoint of another rule or of other shapes is refused naming the first parameter that
differs, and each record carries its own checksum. The shaped state lives in memory, host
RAM or a resident bucket's device pool (such a rule refuses NVMe state), so a record is read
and written whole: the RAM a save or
load adds is one parameter's shaped state, at most the parameter's size in fp32 (Muon's
momentum buffer). An elementwise rule's fingerprint has no shaped-state entry and its file
no records, as before the records existed.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch
import xxhash

from ..flat_bucket import FlatBucket

__all__ = ["check_bucket_file", "load_bucket", "save_bucket", "shaped_layout"]

#: ``(lo, hi, xxh3-64)`` of each tile, in order.
TileChecksums = list[tuple[int, int, int]]


def shaped_layout(bucket: FlatBucket) -> list[list[list[Any]]]:
    """Per slot, ``[name, shape]`` of each field of its shaped state (empty lists for an
    elementwise rule): the fingerprint's ``param_state``."""
    return [
        [[name, list(view.shape)] for name, view in bucket.param_state(i).items()]
        for i in range(len(bucket.layout.slots))
    ]


def _shaped_records(bucket: FlatBucket) -> list[dict[str, torch.Tensor]]:
    """The shaped state of each slot that has some, in slot order: the records of Note
    [shaped state in a streamed checkpoint]."""
    records = (bucket.param_state(i) for i in range(len(bucket.layout.slots)))
    return [views for views in records if views]


def save_bucket(bucket: FlatBucket, out: BinaryIO) -> tuple[TileChecksums, list[int]]:
    """Write one bucket's tiles, then its shaped records, to ``out`` (the file
    ``streaming.py`` opened): each tile's ``(lo, hi, xxh3-64)``, each record's xxh3-64."""
    checksums: TileChecksums = []

    def write(views: Iterable[torch.Tensor]) -> int:
        digest = xxhash.xxh3_64()
        for view in views:
            data = view.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
            digest.update(memoryview(data))
            out.write(memoryview(data))
        return digest.intdigest()

    bucket.store.stream_fields(
        lambda lo, hi, fields: checksums.append((lo, hi, write(fields.values()))),
        read=True,
        write=False,
    )
    return checksums, [write(views.values()) for views in _shaped_records(bucket)]


def load_bucket(bucket: FlatBucket, source: Path) -> None:
    """Stream ``source``'s tiles and shaped records (checked already by
    ``check_bucket_file``) into the bucket's state."""
    fields = bucket.store.field_dtypes()
    with open(source, "rb") as handle:

        def load(lo: int, hi: int, views: dict[str, torch.Tensor]) -> None:
            arrays = _read_tile(handle, fields, hi - lo)
            if hi == lo:  # a shard of padding only (several ranks): no element to copy, and
                return  # an empty array's stride is 0, which a view as another dtype refuses
            for (name, dtype), data in zip(fields, arrays, strict=True):
                views[name].copy_(torch.from_numpy(data).view(dtype))

        bucket.store.stream_fields(load, read=False, write=True)
        for views in _shaped_records(bucket):
            for view, data in zip(views.values(), _read_record(handle, views), strict=True):
                view.copy_(torch.from_numpy(data).view(view.dtype).view(view.shape))


def check_bucket_file(
    source: Path, bucket: FlatBucket, tiles: TileChecksums, shaped: list[int]
) -> None:
    """Read ``source`` through, tiles then shaped records, against their checksums
    (``tiles``, ``shaped``: what ``save_bucket`` returned); the bucket's fingerprint
    matched already. Raises ``ValueError`` naming the first that fails."""
    fields = bucket.store.field_dtypes()
    records = _shaped_records(bucket)
    if len(shaped) != len(records):
        raise ValueError(
            f"{source}: the metadata records {len(shaped)} shaped-state checksums for "
            f"{len(records)} parameters with shaped state in bucket {bucket.layout.index} "
            "(a corrupted checkpoint); nothing was loaded"
        )
    with open(source, "rb") as handle:
        for lo, hi, expected in tiles:
            if _digest(_read_tile(handle, fields, hi - lo)) != expected:
                raise ValueError(
                    f"{handle.name}: tile [{lo}, {hi}) fails its checksum (corrupted or "
                    "torn checkpoint); nothing was loaded"
                )
        for j, (views, expected) in enumerate(zip(records, shaped, strict=True)):
            if _digest(_read_record(handle, views)) != expected:
                raise ValueError(
                    f"{handle.name}: shaped-state record {j} ({list(views)}) fails its "
                    "checksum (corrupted or torn checkpoint); nothing was loaded"
                )


def _read_tile(handle: Any, fields: list[tuple[str, torch.dtype]], count: int) -> list[np.ndarray]:
    return [_read_bytes(handle, count * dtype.itemsize) for _, dtype in fields]


def _read_record(handle: Any, views: dict[str, torch.Tensor]) -> list[np.ndarray]:
    """One shaped record's fields, as raw bytes."""
    return [_read_bytes(handle, view.numel() * view.element_size()) for view in views.values()]


def _read_bytes(handle: Any, nbytes: int) -> np.ndarray:
    data = np.empty(nbytes, dtype=np.uint8)
    if handle.readinto(memoryview(data)) != data.nbytes:
        raise ValueError(f"{handle.name} ends early: truncated checkpoint")
    return data


def _digest(arrays: list[np.ndarray]) -> int:
    digest = xxhash.xxh3_64()
    for data in arrays:
        digest.update(memoryview(data))
    return digest.intdigest()
