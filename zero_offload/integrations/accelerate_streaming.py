"""accelerate's ``save_state`` / ``load_state`` with an offload optimizer's state on NVMe:
the stand-in that streams it (``Streamed``) and the checks before a load.

Note [optimizer state on NVMe in save_state]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
accelerate's ``save_state`` takes every prepared optimizer's ``state_dict()`` (on every
process) and writes it to ``optimizer{_i}.bin`` from the main one; ``load_state`` hands
what it reads to ``load_state_dict``. State that may be on NVMe (``nvme_dir`` set:
``state_on_nvme`` in ``_optim.py``) cannot be handed out as tensors
(``StateNotInHostRam``). So for the length of ``save_state`` such an optimizer's place
in accelerate's list holds a stand-in (``Streamed``), at its own index, wherever any
rank's config sets ``nvme_dir`` (agreed by an all-gather, so that every rank takes part
in the streaming's collectives): a save pre-hook, which gets the folder accelerate
settled on (automatic checkpoint naming included), has every rank stream its shard to
``zero_offload_optimizer{_i}/`` there, as OffloadTrainer does (``streaming_name``), and
the stand-in's ``state_dict()`` is a marker naming that folder, which accelerate writes
as ``optimizer{_i}.bin``: every file keeps its index, and the checkpoint says how it
was saved. During ``load_state`` every offload optimizer has a stand-in, and
``optimizer{_i}.bin`` decides (not the folder: a stale one may remain from an earlier
save to the same folder): a load pre-hook, which runs before accelerate loads
anything, first checks every optimizer, every rank refusing if one does (a marker
whose folder is missing or was saved by another number of processes, state on NVMe now
and a state dict in the checkpoint), then streams back each marked one into whatever
placement it has now. The stand-in then takes the marker (loaded already) or passes a
state dict on to the optimizer (a checkpoint saved without ``nvme_dir``: accelerate's
route, as before). accelerate's list is swapped for the call and restored after,
whatever happens: nothing of accelerate is patched.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from ..optim.checkpoint.streaming import world_mismatch
from ..optim.rank_agreement import share_outcome
from ._optim import each_rank, state_on_nvme, streaming_name

__all__ = ["Streamed", "behind", "streams_on_any_rank"]


#: The key of the marker a streamed optimizer leaves in ``optimizer{_i}.bin`` (Note
#: [optimizer state on NVMe in save_state]); its value is the folder's name.
_MARKER = "zero_offload_streamed"


class Streamed:
    """An offload optimizer's stand-in in accelerate's list during ``save_state`` and
    ``load_state`` (Note [optimizer state on NVMe in save_state]): ``state_dict()`` is a
    marker naming the folder its state streams to; ``load_state_dict`` takes the marker, or
    passes a state dict on to the optimizer."""

    def __init__(self, wrapper: Any, index: int) -> None:
        self.wrapper = wrapper
        self.index = index  # in accelerate's list: optimizer{_i}.bin
        self.name = streaming_name(index)  # the folder, in the checkpoint folder
        self.file = "optimizer.bin" if index == 0 else f"optimizer_{index}.bin"
        self.streamed = False  # whether the checkpoint's optimizer{_i}.bin is our marker
        self.loaded = False  # whether load() streamed the state back

    def save(self, output_dir: str | os.PathLike[str]) -> None:
        self.wrapper.optimizer.save_streaming(os.path.join(output_dir, self.name))

    def check(self, input_dir: str | os.PathLike[str]) -> None:
        """Refuse, before anything is loaded, what cannot load: a marker whose folder is
        missing or was saved by another number of processes, and NVMe state whose
        checkpoint is a state dict. ``optimizer{_i}.bin`` decides, not the folder (a stale
        one may remain from an earlier save to the same folder)."""
        opt = self.wrapper.optimizer
        folder = os.path.join(input_dir, self.name)
        self.streamed = _holds_marker(os.path.join(input_dir, self.file))
        where = f"load_state({str(input_dir)!r})"
        if self.streamed and not os.path.isdir(folder):
            raise ValueError(
                f"{where}: {self.file} says optimizer number {self.index}'s state was "
                f"streamed to {self.name}/ in the checkpoint folder, which is missing: copy "
                "the checkpoint folder whole, every rank's folder in it; nothing was loaded"
            )
        if self.streamed:
            world = 1 if opt.comm is None else opt.comm.world_size
            mismatch = world_mismatch(folder, world)
            if mismatch is not None:
                raise ValueError(f"{where}: {mismatch}")
        elif opt.placement.nvme > 0:
            raise ValueError(
                f"{where}: {type(opt).__name__} number {self.index} keeps state on NVMe "
                f"(OffloadConfig.nvme_dir={str(opt.config.nvme_dir)!r}), and the checkpoint's "
                f"{self.file} is a state dict (saved without nvme_dir), which state on NVMe "
                "cannot take in host RAM. Load such a checkpoint into an optimizer built "
                "without nvme_dir (or with a host_budget the state fits), then save_state "
                "with nvme_dir set; nothing was loaded"
            )

    def check_on_every_rank(self, input_dir: str | os.PathLike[str]) -> None:
        """``check``, every rank refusing where one does (Note [a rank that fails alone]),
        and every rank having read the same ``optimizer{_i}.bin`` (a marker or a state dict):
        where they read different ones (node-local checkpoint folders) some would stream
        and wait for the others. A collective with several ranks."""
        inner = self.wrapper.optimizer
        failed: ValueError | None = None
        try:
            self.check(input_dir)
        except ValueError as exc:
            failed = exc
        what = f"load_state's check of {self.file}"
        share_outcome(failed, comm=inner.comm, what=what, owner=type(inner).__name__)
        if failed is not None:
            raise failed
        streamed = each_rank(self.streamed, inner, f"whether each rank's {self.file} is a marker")
        if len(set(streamed)) > 1:
            marked = [rank for rank, flag in enumerate(streamed) if flag]
            raise ValueError(
                f"{inner.comm.where()}: load_state({str(input_dir)!r}): {self.file} is a "
                f"streamed marker on ranks {marked} and a state dict on the others: every rank "
                "must read the same checkpoint folder (one every rank can reach, or copies of "
                "it whole); nothing was loaded"
            )

    def load(self, input_dir: str | os.PathLike[str]) -> None:
        if self.streamed:
            self.wrapper.optimizer.load_streaming(os.path.join(input_dir, self.name))
            self.loaded = True

    def state_dict(self) -> dict[str, str]:
        return {_MARKER: self.name}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """The marker of a state ``load`` streamed back, or a state dict for the optimizer."""
        if _MARKER not in state_dict:
            self.wrapper.load_state_dict(state_dict)
        elif not self.loaded:  # check() read another file than accelerate's: a bug
            raise RuntimeError(
                f"load_state: {self.file} holds the marker of a streamed state that was not "
                "streamed back (zero-offload bug: please report it)"
            )


#: The largest ``optimizer{_i}.bin`` read to see whether it is a marker: a marker is a few
#: hundred bytes, a state dict of any real model far more.
_MARKER_FILE_BYTES = 1 << 16


def _holds_marker(path: str) -> bool:
    """Whether ``path`` is the marker a streamed optimizer leaves (Note [optimizer state on
    NVMe in save_state]); a state dict, or no file, is not."""
    try:
        if os.path.getsize(path) > _MARKER_FILE_BYTES:
            return False
        saved = torch.load(path, map_location="cpu", weights_only=True)
    except Exception:
        return False
    return isinstance(saved, dict) and _MARKER in saved


def streams_on_any_rank(wrapper: Any) -> bool:
    """Whether ``save_state`` streams this optimizer: where any rank's config puts its state
    on NVMe (``nvme_dir`` may be set on some ranks only), every rank streams, so that all
    take part in ``save_streaming``'s collectives (Note [a rank that fails alone]). A
    collective with several ranks."""
    opt = wrapper.optimizer
    what = "whether save_state streams the optimizer state (nvme_dir set) on each rank"
    return any(each_rank(state_on_nvme(opt), opt, what))


def behind(opt: Any) -> Any:
    """The optimizer a ``Streamed`` stands in for; any other optimizer itself."""
    return opt.wrapper if isinstance(opt, Streamed) else opt
