"""``save_pretrained``: the trained weights as a Hugging Face safetensors checkpoint, written
tensor by tensor from where they live, loadable by ``transformers``' ``from_pretrained``
without zero-offload.

Note [an export is streamed]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The safetensors format is a JSON header (every tensor's dtype, shape and byte range) and then
the raw bytes, in order. The header needs shapes and dtypes only, so it is written first and
each tensor follows on its own: read from its bucket's slot (the device block, or the pinned
home with parameter offload), copied to the host when it lives on a GPU, written, dropped.
The host holds one tensor at a time, never a shard or the model.

Note [an export replaces the previous one whole]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A directory may hold an earlier export, and a new one with as many shards has the same file
names (``model-00001-of-00004.safetensors``...). Replacing each shard as it is written would
leave, after a failure half-way (a full disk, an exception while reading a weight), new
shards beside old ones under the old index: a model that loads, silently mixed. So every
weight file and the index is first written whole to a hidden staged sibling
(``.<name>.staged-<token>``, itself written atomically: Note [atomic replacement] in
``fileio.py``). Only when all are durable are they renamed to their names, the index last;
then files of the earlier export that the new one does not name are removed. A failure
before the renames removes the staged files and leaves the earlier export as it was. What
remains is the renames themselves (no I/O, microseconds): a process killed among them can
leave shards of both exports. Staged files of a killed export are removed by the next
export there.

Note [an export from sharded homes]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Under ZeRO-3 (parameter offload on several ranks, Note [a sharded unit] in
``params/sharded_fetch.py``) no rank holds a whole parameter: each one's weights are read
by gathering its unit, a collective every rank makes in the same order. So the export is
collective there: every rank calls ``save_pretrained`` with the same arguments, every rank
reads the tensors in ``state_dict`` order (one unit gathered at a time, one tensor on the
host at a time), and rank 0 alone writes the files, in the one layout ``transformers``
reads (one file, or shards and their index), as a one-rank export would. A write that fails
on rank 0 stops its writing, not its reads: it takes part in the gathers left, so the other
ranks finish theirs, and every rank raises the failure (rank 0's outcome, all-gathered).
Both of the export's own collectives (one at its start, whose all-gather meets the other
ranks' training collectives when rank 0 alone calls it, and the outcome at its end) keep
``collective_timeout`` (Note [collective deadlines] in ``collectives.py``): a rank that
never calls it makes the others raise ``CollectiveError`` naming the export instead of
hanging. With stage 2 every rank holds the whole weights: rank 0 alone writes, whichever
ranks call it (Note [an export from whole weights on several ranks]).
"""

from __future__ import annotations

import functools
import json
import os
import re
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .collectives import Comm, all_gather_bytes
from .config import parse_bytes_with_unit
from .fileio import atomic_file, make_private_dirs, write_text
from .optim import OffloadOptimizer
from .weights.checkpoint import (
    DTYPE_NAMES,
    INDEX_NAME,
    SINGLE_NAME,
    checkpoint_name,
    nbytes_of,
    original_module,
)

__all__ = ["save_pretrained"]

_SHARD_RE = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")
_STAGED = ".staged-"  # see Note [an export replaces the previous one whole]
#: What a rank that never reaches an export's collective has probably done.
_ADVICE = (
    "Under ZeRO-3 (parameter offload or partitioning on several ranks) every rank calls "
    "save_pretrained with the same arguments: no rank holds whole weights, so each one's "
    "are gathered from every rank's shard. Call it outside `if rank == 0:`."
)


class _Entry:
    """One tensor to export: its key, shape, dtype and how to read it."""

    __slots__ = ("dtype", "key", "read", "shape")

    def __init__(
        self,
        key: str,
        tensor: torch.Tensor,
        read: Callable[[], torch.Tensor],
        dtype: torch.dtype | None = None,
    ) -> None:
        self.key = key
        self.shape = tuple(tensor.shape)
        self.dtype = tensor.dtype if dtype is None else dtype
        self.read = read

    @property
    def nbytes(self) -> int:
        return nbytes_of(self.shape, self.dtype)


def _trained(optimizer: OffloadOptimizer) -> dict[int, Callable[[], torch.Tensor]]:
    """How to read each trained parameter's weights where they are authoritative, by id:
    its slot of the bucket's device block, or with parameter offload its pinned home (where
    a released unit's parameters have no storage of their own), or a copy read from its
    home's weight file on NVMe, one parameter at a time (Note [homes on NVMe])."""
    out: dict[int, Callable[[], torch.Tensor]] = {}
    for bucket in optimizer.buckets:
        views = bucket.views
        # zero_offload.params' views: a home on NVMe, or a shard (a gathered host copy,
        # collective: Note [an export from sharded homes])
        if getattr(views, "nvme_home", None) is not None or _sharded(views):
            for i, param in enumerate(bucket.params):
                out[id(param)] = functools.partial(views.home_view, i)
            continue
        flat = getattr(views, "home", None)  # zero_offload.params' WindowedViews
        if flat is None:
            flat = views.weights_dev
        for slot, param in zip(bucket.layout.slots, bucket.params, strict=True):
            view = flat[slot.offset : slot.end].view(slot.shape)
            out[id(param)] = lambda view=view: view.detach()
    return out


def _sharded(views: Any) -> bool:
    """Whether ``views``' home holds this rank's shard only (Note [a sharded unit])."""
    span = getattr(views, "home_span", None)
    return getattr(views, "home", None) is not None and span != (0, views.layout.padded_numel)


class _Masters:
    """The fp32 master of one bucket at a time on the host, read tile by tile
    (``stream_fields``, from host RAM, NVMe or the device) when one of its parameters is
    asked for: one bucket's fp32 on the host, whatever the model."""

    def __init__(self, optimizer: OffloadOptimizer) -> None:
        self._slot = {
            id(param): (bucket, slot)
            for bucket in optimizer.buckets
            for slot, param in zip(bucket.layout.slots, bucket.params, strict=True)
        }
        self._bucket: Any = None
        self._flat = torch.empty(0, dtype=torch.float32)  # (span,) fp32, host

    def has(self, tensor: torch.Tensor) -> bool:
        return id(tensor) in self._slot

    def read(self, tensor: torch.Tensor) -> torch.Tensor:
        bucket, slot = self._slot[id(tensor)]
        start = bucket.store.span()[0]
        if bucket is not self._bucket:
            self._bucket = None
            flat = torch.empty(bucket.store.span()[1] - start, dtype=torch.float32)

            def take(lo: int, hi: int, fields: dict[str, torch.Tensor]) -> None:
                flat[lo:hi].copy_(fields["master"])  # a host sync per tile on a GPU

            bucket.store.stream_fields(take, read=True, write=False)
            self._bucket, self._flat = bucket, flat
        return self._flat[slot.offset - start : slot.end - start].view(slot.shape)


def _entries(
    model: torch.nn.Module, optimizer: OffloadOptimizer | None, *, master: bool
) -> list[_Entry]:
    """The model's ``state_dict`` keys once each (a tied weight under its first name, as
    ``save_pretrained`` does), in ``state_dict`` order."""
    trained = _trained(optimizer) if optimizer is not None else {}
    masters = _Masters(optimizer) if master and optimizer is not None else None
    entries = []
    seen: set[int] = set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        key = checkpoint_name(name)  # Note [a compiled model is its original module]
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        if tensor.is_meta and id(tensor) not in trained:
            raise ValueError(
                f"model tensor {key!r} is still on the meta device (never loaded): build the "
                "optimizer over it, or load it, before exporting"
            )
        if tensor.dtype not in DTYPE_NAMES:
            raise TypeError(f"model tensor {key!r} has dtype {tensor.dtype}, not exportable")
        if masters is not None and masters.has(tensor):
            entries.append(
                _Entry(key, tensor, lambda t=tensor: masters.read(t), dtype=torch.float32)
            )
            continue
        read = trained.get(id(tensor), lambda t=tensor: t.detach())
        entries.append(_Entry(key, tensor, read))
    return entries


def _shards(entries: list[_Entry], max_shard_size: int) -> list[list[_Entry]]:
    """Consecutive entries per shard, each at most ``max_shard_size`` bytes unless a single
    tensor is larger (it gets a shard of its own), as ``save_pretrained`` splits."""
    shards: list[list[_Entry]] = [[]]
    size = 0
    for entry in entries:
        if shards[-1] and size + entry.nbytes > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += entry.nbytes
    return shards


def _write_shard(path: Path, entries: list[_Entry]) -> None:
    """One safetensors file, streamed (Note [an export is streamed]), written atomically."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for entry in entries:
        header[entry.key] = {
            "dtype": DTYPE_NAMES[entry.dtype],
            "shape": list(entry.shape),
            "data_offsets": [offset, offset + entry.nbytes],
        }
        offset += entry.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    with atomic_file(path, what="save_pretrained", nbytes=8 + len(raw) + offset) as handle:
        handle.write(len(raw).to_bytes(8, "little"))
        handle.write(raw)
        for entry in entries:
            # Hidden cost: a device-to-host copy of one tensor when it lives on a GPU.
            tensor = entry.read().to("cpu").contiguous()
            if tensor.numel():
                handle.write(memoryview(tensor.view(torch.uint8).reshape(-1).numpy()))


def _write_staged(directory: Path, shards: dict[str, list[_Entry]], index: str | None) -> None:
    """Write every shard (and the ``index`` text, if any) to a staged sibling, then rename
    them all into place, the index last: Note [an export replaces the previous one whole]."""
    for leftover in directory.glob(f".*{_STAGED}*"):  # of an export that was killed
        leftover.unlink(missing_ok=True)
    token = secrets.token_hex(4)
    names = [*shards, *([INDEX_NAME] if index is not None else [])]
    staged = {name: directory / f".{name}{_STAGED}{token}" for name in names}
    try:
        for name, entries in shards.items():
            _write_shard(staged[name], entries)
        if index is not None:
            write_text(staged[INDEX_NAME], index, what="save_pretrained index")
    except BaseException:
        for path in staged.values():
            path.unlink(missing_ok=True)
        raise
    for name, path in staged.items():
        os.replace(path, directory / name)
    # The renames survive a crash once the directory is durable.
    fd = os.open(directory, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_pretrained(
    model: torch.nn.Module,
    save_directory: str | os.PathLike[str],
    *,
    optimizer: OffloadOptimizer | None = None,
    max_shard_size: int | str = "5GB",
    master_weights: bool = False,
) -> list[Path]:
    """Write ``model``'s weights to ``save_directory`` as ``transformers``' ``save_pretrained``
    does (``model.safetensors``, or shards ``model-0000i-of-0000n.safetensors`` with
    ``model.safetensors.index.json`` above ``max_shard_size``), plus ``config.json`` (and
    ``generation_config.json``) when the model has a ``config``. Returns the weight files.

    ``optimizer``: the ``OffloadAdamW`` training ``model``; its parameters are read from
    their buckets (the device block, or the pinned home with parameter offload), after any
    pending ``overlap_step`` update is published. Without it every tensor is read from the
    model. Weights are written in their training dtype, tensor by tensor (Note [an export is
    streamed]). With several ranks and whole weights on each (stage 2) call it on rank 0 or
    on every rank: rank 0 writes and the others return the same paths without writing (Note
    [an export from whole weights on several ranks]). Under ZeRO-3 (parameter offload or
    partitioning on several ranks, where no rank holds whole weights) every rank calls it
    with the same arguments, the weights are gathered unit by unit and rank 0 writes the
    files (Note [an export from sharded homes]); every rank returns the paths written.

    ``master_weights=True`` (with ``optimizer``, one rank): the trained parameters are
    written as their fp32 master weights instead (read from wherever the optimizer keeps
    them: host RAM, NVMe or the device; one bucket's fp32 on the host at a time), so a
    bf16 run exports its full precision. Weights written into the model after the last
    step are not in the master until the next step reconciles them.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    model = original_module(model)  # Note [a compiled model is its original module]
    if optimizer is not None and not isinstance(optimizer, OffloadOptimizer):
        raise TypeError(
            f"optimizer must be the OffloadAdamW training the model, or None, got "
            f"{type(optimizer).__name__}"
        )
    if not isinstance(master_weights, bool):
        raise TypeError(f"master_weights must be a bool, got {master_weights!r}")
    if master_weights and optimizer is None:
        raise ValueError(
            "master_weights=True reads the fp32 master from the optimizer: pass optimizer=<the "
            "OffloadAdamW training the model>, or master_weights=False to export the model's "
            "weights in their training dtype"
        )
    if master_weights and optimizer is not None and optimizer.comm is not None:
        raise ValueError(
            f"{optimizer.comm.where()}: master_weights=True exports the fp32 master of an "
            f"optimizer on one rank; this one runs on {optimizer.comm.world_size} ranks, each "
            "holding a shard of the master. Export the training-dtype weights "
            "(master_weights=False), or save the whole fp32 state with "
            "zero_offload.save_consolidated(optimizer, path) on every rank"
        )
    limit = parse_bytes_with_unit(max_shard_size, name="max_shard_size")  # "5" is not 5 bytes
    if limit <= 0:
        raise ValueError(f"max_shard_size must be > 0 bytes, got {max_shard_size!r}")
    entries = _entries(
        model, optimizer, master=master_weights
    )  # refuses a model with meta tensors left
    if optimizer is not None:
        optimizer.flush_pending_update()
        # Synchronisation point: the step's weight copies into the slots must have landed.
        optimizer.manager.accelerator.synchronize()
    comm = optimizer.comm if optimizer is not None else None
    if comm is not None and any(_sharded(bucket.views) for bucket in optimizer.buckets):
        return _export_from_shards(model, save_directory, entries, limit, comm)
    if not _writes(comm):  # Note [an export from whole weights on several ranks]
        return [Path(save_directory) / name for name in _names(_shards(entries, limit))]
    return _export(model, make_private_dirs(save_directory), entries, limit)


# Note [an export from whole weights on several ranks]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Without ZeRO-3 every rank holds the whole weights, so any rank can write the export
# alone, and loops call it on rank 0 only or on every rank (as they call transformers'
# ``save_pretrained``). Several ranks writing one directory raced: each cleared the others'
# staged files (Note [an export replaces the previous one whole]) and a rename failed. So
# with several ranks only rank 0 (of the optimizer's group, or of the default group without
# an optimizer) writes; the others return the same paths at once, without a collective, so
# a call on rank 0 alone keeps working. A caller that reads the files on another rank waits
# for rank 0 first (a barrier), as after transformers' own.


def _writes(comm: Comm | None) -> bool:
    """Whether this rank writes an export of whole weights (Note [an export from whole
    weights on several ranks])."""
    if comm is not None:
        return comm.rank == 0
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.get_rank() == 0
    return True


def _names(shards: list[list[_Entry]]) -> list[str]:
    if len(shards) == 1:
        return [SINGLE_NAME]
    return [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]


def _export(
    model: torch.nn.Module, directory: Path, entries: list[_Entry], limit: int
) -> list[Path]:
    """Write ``entries`` to ``directory`` (one file, or shards and their index) and the
    model's configs; the weight files."""
    shards = _shards(entries, limit)
    names = _names(shards)
    index = None
    if len(shards) > 1:
        weight_map = {e.key: n for n, shard in zip(names, shards, strict=True) for e in shard}
        total = sum(e.nbytes for e in entries)
        index = json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
        index += "\n"
    _write_staged(directory, dict(zip(names, shards, strict=True)), index)
    # What an earlier export left that this one does not name would be read instead of it
    # (a stale index) or beside it.
    stale = [directory / INDEX_NAME] if len(shards) == 1 else [directory / SINGLE_NAME]
    stale += [p for p in directory.iterdir() if _SHARD_RE.match(p.name) and p.name not in names]
    for path in stale:
        path.unlink(missing_ok=True)
    for attribute in ("config", "generation_config"):
        config = getattr(model, attribute, None)
        if config is not None and hasattr(config, "save_pretrained"):
            config.save_pretrained(directory)
    return [directory / name for name in names]


def _export_from_shards(
    model: torch.nn.Module,
    save_directory: str | os.PathLike[str],
    entries: list[_Entry],
    limit: int,
    comm: Comm,
) -> list[Path]:
    """Every rank reads, rank 0 writes: Note [an export from sharded homes]."""
    began = [0]  # reads begun on this rank, in ``entries`` order

    def counted(read: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            began[0] += 1  # before the read: a read that failed mid-gather is not repeated
            return read()

        return run

    for entry in entries:
        entry.read = counted(entry.read)
    # Every rank is here, or the others raise naming who is not, within the deadline: a
    # call on rank 0 alone would gather against the other ranks' training collectives.
    all_gather_bytes(
        f"save_pretrained of {len(entries)} tensors, shards of {limit} bytes".encode(),
        comm=comm,
        what="the start of save_pretrained under ZeRO-3 (Note [an export from sharded homes])",
        advice=_ADVICE,
    )
    failure: BaseException | None = None
    if comm.rank == 0:
        try:
            _export(model, make_private_dirs(save_directory), entries, limit)
        except Exception as exc:  # still take part in the gathers left
            failure = exc
    for entry in entries[began[0] :]:  # every read on the other ranks
        entry.read()
    # Rank 0's outcome, to every rank, with the deadline (Note [collective deadlines]).
    outcome = b"" if failure is None else f"{type(failure).__name__}: {failure}".encode()
    outcomes = all_gather_bytes(
        outcome if comm.rank == 0 else b"",
        comm=comm,
        what="rank 0's outcome of save_pretrained (Note [an export from sharded homes])",
        advice=_ADVICE,
    )
    if failure is not None:
        raise failure
    if outcomes[0]:
        raise RuntimeError(
            f"{comm.where()}: save_pretrained failed on rank 0, which writes the files "
            f"(Note [an export from sharded homes]): {outcomes[0].decode(errors='replace')}"
        )
    return [Path(save_directory) / name for name in _names(_shards(entries, limit))]
