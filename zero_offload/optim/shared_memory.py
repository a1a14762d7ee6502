"""Parameters that share memory: refused at construction and in ``add_param_group``, naming
both (see the Note below). Called by ``checks.check_new_params``."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

__all__ = ["refuse_shared_memory"]


# Note [parameters that share memory]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Each trained parameter gets a slot of its own in a flat bucket and its ``.data`` is
# re-pointed there, so two Parameter objects over one storage (``nn.Parameter(w)`` twice,
# or overlapping views of one tensor) would be updated apart and silently stop being
# equal, where torch keeps them tied. Such pairs are refused at construction and by
# ``add_param_group``, naming both, before anything changes. A weight tied the usual way
# (HF's ``tie_weights``: one Parameter object in two modules) appears once in
# ``model.parameters()`` and is trained once. Memory is compared by address, per device
# (so storages that alias one buffer, ``torch.from_numpy`` twice, are caught too): spans
# that overlap are checked element by element when either tensor is not contiguous, so
# interleaved views that share no element (``w[0::2]`` and ``w[1::2]``) pass. Pairs where
# neither trains (frozen or empty) are left alone, as are tensors with no memory (meta, or
# released under parameter offload).


def _span(param: torch.Tensor) -> tuple[int, int] | None:
    """``[first, end)`` byte addresses of ``param``'s elements, or None without memory.

    Read below ``__torch_function__``: a parameter another optimizer's parameter offload
    released must not be fetched back by looking (that moved its window, and the address
    read was the shared slot's, soon another unit's: two untied parameters were refused as
    sharing memory before the real refusal, that the other optimizer trains them)."""
    with torch._C.DisableTorchFunctionSubclass():
        if param.numel() == 0 or param.device.type == "meta" or param.layout is not torch.strided:
            return None
        if param.untyped_storage().nbytes() == 0 or param.data_ptr() == 0:
            return None  # released (storage resized to 0 under parameter offload)
        last = sum(
            (size - 1) * stride for size, stride in zip(param.shape, param.stride(), strict=True)
        )
        start = param.data_ptr()
        return start, start + (last + 1) * param.element_size()


def _share_elements(a: torch.Tensor, b: torch.Tensor, low: int, end: int) -> bool:
    """Whether ``a`` and ``b``, whose byte spans overlap within ``[low, end)``, share an
    element."""
    item = a.element_size()
    if a.is_contiguous() and b.is_contiguous():
        return True  # contiguous spans that overlap share bytes
    if b.element_size() != item or (a.data_ptr() - b.data_ptr()) % item:
        return True  # bytes of different element grids: taken as shared
    # Hidden cost: one bool per element of the two spans, on this rare path only.
    marks = torch.zeros((end - low) // item, dtype=torch.bool)
    marks.as_strided(a.shape, a.stride(), (a.data_ptr() - low) // item).fill_(True)
    return bool(marks.as_strided(b.shape, b.stride(), (b.data_ptr() - low) // item).any())


def refuse_shared_memory(
    every: Sequence[torch.Tensor], *, first: int, describe: Callable[[int], str]
) -> None:
    """Note [parameters that share memory]: refuse a new parameter (flat index ``first``
    on, in ``every``: the existing parameters, then the new ones) whose memory overlaps
    another new one's or an existing one's; ``describe(index)`` names a parameter."""
    spans = []  # (device, first byte, end byte, flat index) of every tensor with memory
    for index, param in enumerate(every):
        span = _span(param)
        if span is not None:
            spans.append((str(param.device), *span, index))
    spans.sort()
    reach: list[tuple[str, int, int, int]] = []  # earlier spans that reach past this start
    for span in spans:
        device, start, end, index = span
        reach = [r for r in reach if r[0] == device and r[2] > start]
        for other in reach:
            i, j = sorted((other[3], index))
            a, b = every[i], every[j]
            if j < first or not (a.requires_grad or b.requires_grad):
                continue  # two existing ones (accepted before), or neither trains
            if _share_elements(a, b, other[1], max(end, other[2])):
                raise ValueError(
                    f"{describe(i)} and {describe(j)} share memory (two "
                    "Parameters over one storage, or overlapping views of one tensor). The "
                    "optimizer gives each parameter a slot of its own, so they would be "
                    "updated apart and stop being tied, where torch keeps them equal. Tie "
                    "them as one Parameter object (b = a, as tie_weights does), or give "
                    "each its own memory (nn.Parameter(w.clone()))"
                )
        reach.append(span)
