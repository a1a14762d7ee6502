"""The two copies of an offloaded activation: out to its host block, and back into a device
block with the saved layout.

Stateless transfer code: every byte goes through the manager (``TieredMemoryManager.copy``,
the one copy choke point); the offloader decides when each copy runs, holds what it reads
and counts it (``offloader.py``, ``outgoing.py``, ``stats.py``). Both copies pass
``held=True``: Note [holding, not record_stream] in ``offloader.py``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..accelerator import Event
from ..memory.block import Block
from ..memory.manager import TieredMemoryManager
from ..memory.traffic import Category, Direction
from .layout import saved_offset, tensor_over_block
from .record import OffloadedActivation

__all__ = ["copy_back", "copy_out"]


def copy_out(
    manager: TieredMemoryManager,
    host_view: torch.Tensor,
    source: torch.Tensor,
    *,
    host_block: Block,
    group: int,
) -> Event:
    """Queue the copy of ``source`` (a saved tensor's span, on the device) into
    ``host_view`` (over ``host_block``) on ``d2h``, after the compute issued so far; the
    event that marks its end. The caller holds ``source`` until then."""
    return manager.copy(
        host_view,
        source,
        direction=Direction.D2H,
        category=Category.ACTIVATIONS,
        after=[manager.compute_ready()],
        blocks=[host_block],
        label=f"activation group {group} out",
        held=True,  # Note [holding, not record_stream] in offloader.py
    )


def copy_back(
    manager: TieredMemoryManager,
    record: OffloadedActivation,
    block: Block,
    on_free: Callable[[], None],
) -> tuple[torch.Tensor, Event]:
    """Queue ``record``'s copy from its host block into ``block`` (of the device pool) on
    ``h2d``, after its copy out: the device tensor, with the saved shape and strides, and
    the event that marks the copy's end. ``on_free()`` runs when that tensor's storage dies
    (Note [device blocks live as long as their storage] in ``layout.py``)."""
    flat = tensor_over_block(
        block,
        record.dtype,
        (block.nbytes // record.host_view.element_size(),),
        on_free,
        accelerator=manager.accelerator,
        fill_stream=manager.h2d,  # Note [a reloaded view is built on the stream ...]
    )
    # Note [saved layout comes back] (layout.py): the saved strides and pointer alignment
    span = record.host_view.numel()
    pad = saved_offset(
        ptr_mod=record.ptr_mod,
        data_ptr=flat.data_ptr(),
        itemsize=flat.element_size(),
        span=span,
        nbytes=block.nbytes,
    )
    device_tensor = flat.as_strided(record.shape, record.stride, pad)
    end = manager.copy(
        flat[pad : pad + span],
        record.host_view,
        direction=Direction.H2D,
        category=Category.ACTIVATIONS,
        after=[record.out_event],
        blocks=[block, record.host_block],
        label=f"activation group {record.group} in",
        held=True,  # Note [holding, not record_stream] in offloader.py
    )
    return device_tensor, end
