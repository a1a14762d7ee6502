"""Which saved tensors are offloaded: pure functions, no bookkeeping.

Note [never offload parameters]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Autograd saves weights too (``addmm`` saves ``weight.t()``, a view of the parameter). Moving
them would copy every weight out and back each step and free nothing, since the module still
holds them. So a saved tensor is kept on the device when it, or the tensor it is a view of,
is an ``nn.Parameter`` or a leaf that requires grad, or when its storage belongs to a tensor
or module the caller excluded (buffers, for instance, are not leaves requiring grad).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

__all__ = ["excluded_storages", "is_offloadable"]


def excluded_storages(exclude: Iterable[torch.Tensor | nn.Module]) -> frozenset[int]:
    """Storage addresses of the given tensors and of every parameter and buffer of modules."""
    if isinstance(exclude, (torch.Tensor, nn.Module)):
        exclude = [exclude]
    pointers = set()
    for item in exclude:
        if isinstance(item, nn.Module):
            tensors = [*item.parameters(), *item.buffers()]
        elif isinstance(item, torch.Tensor):
            tensors = [item]
        else:
            raise TypeError(
                f"exclude takes tensors and nn.Modules (whose parameters and buffers stay on "
                f"the device), got {type(item).__name__} {item!r}"
            )
        pointers.update(_storage_pointer(t) for t in tensors if t.numel() > 0)
    return frozenset(pointers)


def is_offloadable(
    tensor: torch.Tensor, *, device: torch.device, min_bytes: int, excluded: frozenset[int]
) -> bool:
    """Whether ``tensor`` (saved by autograd) should leave the device.

    No for tensors under ``min_bytes``, non-dense tensors (sparse, quantized, subclasses),
    and parameters; see Note [never offload parameters]. Raises ``ValueError`` for a tensor
    big enough to offload that lives on another device than the offloader's.
    """
    if type(tensor) is not torch.Tensor or tensor.layout is not torch.strided:
        return False  # nn.Parameter and tensor subclasses included: they own their storage
    if tensor.is_quantized:
        return False
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0 or nbytes < min_bytes:
        return False
    base = tensor._base if tensor._base is not None else tensor
    if isinstance(base, nn.Parameter) or (base.is_leaf and base.requires_grad):
        return False
    if tensor.device != device:
        raise ValueError(
            f"cannot offload a saved activation on device {tensor.device} (shape "
            f"{tuple(tensor.shape)}, {tensor.dtype}, {nbytes} bytes): this offloader's "
            f"accelerator works on {device}. Run the model on {device}, or build an "
            f"ActivationOffloader for an accelerator on {tensor.device}, or raise min_bytes "
            f"above {nbytes} to keep such tensors where they are."
        )
    return _storage_pointer(tensor) not in excluded


def _storage_pointer(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()
