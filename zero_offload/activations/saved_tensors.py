"""``offload_activations``: saved-tensor hooks that send big activations to the host pool.

Compared with ``torch.autograd.graph.save_on_cpu``: the copy out is asynchronous (on the
copy stream, overlapping the forward), host memory comes from a pool pinned once instead
of a pinned allocation per tensor, parameters stay put (Note [never offload parameters]
in ``policy.py``), and backward prefetches the next activations while it computes.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from ..accelerator.capture import eager_only
from ..config import parse_bytes_with_unit
from ..hook_errors import reported
from .default import default_offloader
from .offloader import ActivationOffloader
from .policy import excluded_storages, is_offloadable
from .record import SavedActivation

__all__ = ["offload_activations", "offload_hooks"]


def offload_hooks(
    offloader: ActivationOffloader,
    *,
    min_bytes: int,
    excluded: frozenset[int] = frozenset(),
    group: int | None = None,
) -> torch.autograd.graph.saved_tensors_hooks:
    """Saved-tensor hooks offloading through ``offloader``.

    ``group``: the prefetch group of every tensor saved under the hooks (one checkpoint
    call); ``None`` gives each offloaded tensor a group of its own.
    """
    device = offloader.device

    def pack(tensor: torch.Tensor) -> torch.Tensor | SavedActivation:
        if not is_offloadable(tensor, device=device, min_bytes=min_bytes, excluded=excluded):
            return tensor
        return offloader.pack(tensor, group=offloader.new_group() if group is None else group)

    def unpack(saved: torch.Tensor | SavedActivation) -> torch.Tensor:
        return offloader.unpack(saved) if isinstance(saved, SavedActivation) else saved

    # Note [no graph capture of library work] in accelerator/capture.py; Note [errors raised
    # inside autograd hooks] in hook_errors.py
    return torch.autograd.graph.saved_tensors_hooks(
        eager_only(reported(pack)), eager_only(reported(unpack))
    )


@contextmanager
def offload_activations(
    *,
    min_bytes: int | str | None = None,
    offloader: ActivationOffloader | None = None,
    exclude: Iterable[torch.Tensor | nn.Module] = (),
) -> Iterator[ActivationOffloader]:
    """Offload the tensors autograd saves inside the block; yields the offloader.

    Args:
        min_bytes: saved tensors smaller than this stay on the device (bytes, or a string
            such as ``"1MiB"``). Default: the offloader's ``config.min_bytes``.
        offloader: the ``ActivationOffloader`` to use (share one with the optimizer via
            ``ActivationOffloader(manager=opt.manager)``). Default: the process-wide one.
        exclude: tensors and modules whose tensors (parameters and buffers) are never
            offloaded, on top of parameters and leaves requiring grad, which never are.

    Raises ``ValueError`` when a tensor to offload is on another device than the
    offloader's, and ``MemoryError`` (``PoolExhausted``) when the pools cannot hold it.
    """
    offloader = default_offloader() if offloader is None else offloader
    if not isinstance(offloader, ActivationOffloader):
        raise TypeError(f"offloader must be an ActivationOffloader, got {type(offloader).__name__}")
    threshold = (
        offloader.config.min_bytes
        if min_bytes is None
        else parse_bytes_with_unit(min_bytes, name="min_bytes")
    )
    hooks = offload_hooks(offloader, min_bytes=threshold, excluded=excluded_storages(exclude))
    with hooks:
        yield offloader
