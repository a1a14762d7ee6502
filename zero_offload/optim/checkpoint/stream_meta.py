"""A streamed checkpoint's ``meta.pt``: reading it safely, each bucket's fingerprint, and the
checks that both loads (``streaming.py`` on the saved world size, ``reshard.py`` on another)
make of it before anything changes. The layout is the module docstring of ``streaming.py``.
"""

from __future__ import annotations

import pickle
import zipfile
from pathlib import Path
from typing import Any

import torch

from ..flat_bucket import FlatBucket
from .bucket_file import shaped_layout

__all__ = [
    "FORMAT_VERSION",
    "META",
    "WORLD_KEYS",
    "check_fingerprint",
    "check_header",
    "fingerprint",
    "read_meta",
]

FORMAT_VERSION = 1
META = "meta.pt"

#: Fingerprint keys that only some buckets have (Note [shaped state in a streamed
#: checkpoint] in ``bucket_file.py``): compared when either side has them.
_OPTIONAL_KEYS = ("param_state",)

#: Fingerprint keys that follow the world size (the rank's shard, its elements before the
#: padding): a load on another world size checks them otherwise (``reshard.py``).
WORLD_KEYS = ("shard", "real")


def fingerprint(bucket: FlatBucket, tile_elements: int) -> dict[str, Any]:
    """What a bucket's state must match to load: its index, this rank's shard, the
    parameters' sizes, the fields and their dtypes, the shaped state, the tile size."""
    store = bucket.store
    entry = {
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
        entry["param_state"] = shaped
    return entry


def check_header(where: Path, meta: dict[str, Any], rule: str, family: str) -> None:
    """Refuse metadata of another format version or written by a rule of another state
    family (``OptimizerRule.state_family``; ``rule`` names ours in the message)."""
    if meta.get("version") != FORMAT_VERSION:
        raise ValueError(
            f"{where}: format version {meta.get('version')!r}, expected {FORMAT_VERSION}"
        )
    # Saved before the rule was recorded: no check here (the fingerprints still compare the
    # state's fields). Adam and AdamW load each other's, as torch's optimizers do.
    if "rule" in meta and meta.get("family", meta["rule"]) != family:
        raise ValueError(
            f"{where}: saved by an optimizer with the {meta['rule']!r} rule, this one steps "
            f"with the {rule!r} rule: load it into an optimizer of the rule that saved it; "
            "nothing was loaded"
        )


def check_fingerprint(
    directory: Path,
    entry: dict[str, Any],
    bucket: FlatBucket,
    tile_elements: int,
    *,
    ignore: tuple[str, ...] = (),
) -> None:
    """Refuse a bucket saved from other parameters, fields or shaped state; the keys in
    ``ignore`` are not compared (``WORLD_KEYS`` on another world size)."""
    mine = fingerprint(bucket, tile_elements)
    keys = [*mine, *(key for key in _OPTIONAL_KEYS if key in entry and key not in mine)]
    keys = [key for key in keys if key not in ignore]
    theirs = {key: entry.get(key) for key in keys}
    if "shard" in theirs:
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


def read_meta(path: Path) -> dict[str, Any]:
    """``meta.pt`` with ``weights_only=True``: plain data and tensors, never code; its zip
    records' CRC-32s checked first (Note [the metadata is checked too])."""
    _check_crc(path)
    try:
        meta = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise ValueError(
            f"{path} holds objects other than plain data (numbers, strings, lists, dicts, "
            "tensors), which save_streaming never writes: refusing to unpickle it, since "
            f"that could run arbitrary code; nothing was loaded ({exc})"
        ) from exc
    except (RuntimeError, UnicodeDecodeError, EOFError) as exc:
        raise ValueError(
            f"{path}: not a readable save_streaming metadata file (corrupted or truncated "
            f"checkpoint: {type(exc).__name__}: {exc}); nothing was loaded"
        ) from exc
    if not isinstance(meta, dict):
        raise ValueError(f"{path} is not a save_streaming metadata file; nothing was loaded")
    return meta


# Note [the metadata is checked too]
# Each tile of a bucket file carries an xxh3-64 in ``meta.pt``, but ``meta.pt`` itself held
# every step count, the groups' hyper-parameters and those checksums unprotected:
# ``torch.load`` does not check the zip records' CRC-32s, so a flipped bit in the saved lr
# loaded silently (17 of 40 flips in a probe) and changed training. ``torch.save`` writes
# a zip whose every record has its CRC-32, so the load reads them back first (the file is
# a few KiB): a damaged record is refused naming the file, as a damaged tile is. Files
# saved before this check have the same CRCs and load as before.


def _check_crc(path: Path) -> None:
    """Refuse ``path`` where a zip record fails its CRC-32 (Note [the metadata is checked
    too]); a file that is no zip is left to ``torch.load``'s own error."""
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except zipfile.BadZipFile as exc:
        raise ValueError(
            f"{path}: not a readable save_streaming metadata file (corrupted or truncated "
            f"checkpoint: {exc}); nothing was loaded"
        ) from exc
    if bad is not None:
        raise ValueError(
            f"{path}: record {bad!r} fails its CRC-32 (corrupted checkpoint metadata); "
            "nothing was loaded"
        )
