"""Where a pool's one buffer comes from, and how it goes back.

``BlockPool.host`` and ``BlockPool.device`` each take one buffer of exactly the pool's
capacity, here, once: host RAM (checked against what the host has available now, then
pinned, or faulted in when pinning is not available) or device memory counted in the
device budget. With the buffer come the staging a compaction moves bytes through (Note
[overlap-safe moves] in ``moves.py``) and the call that gives the bytes back, which the
pool runs only after the last copy touching them (Note [a pool outlives its copies] in
``buffer_lifetime.py``). Nothing here allocates after construction.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from ..accelerator import Accelerator
from .host_ram import check_host_ram
from .moves import Scratch, device_scratch, no_scratch

__all__ = ["PoolBuffer", "device_buffer", "host_buffer"]


class PoolBuffer(NamedTuple):
    """One pool's buffer and what comes with it."""

    tensor: torch.Tensor  # (capacity,) uint8, host (pinned when available) or device
    kind: str  # "host, pinned" / "host, pageable" / "device", for messages
    scratch: Scratch  # staging for a compaction's overlapping moves
    release: Callable[[], None]  # gives the bytes back (device pools: to the budget)


def host_buffer(
    accelerator: Accelerator, capacity: int, *, name: str, pinned: bool, sized_by: str
) -> PoolBuffer:
    """``capacity`` bytes of host RAM for the pool ``name``, pinned when asked and possible.

    Checks ``capacity`` against the host RAM available (``check_host_ram``) before
    allocating. Hidden costs, paid here once and never in a step: pinning page-locks every
    page; a pageable buffer is zero-filled so its pages are faulted in now (and counted by
    the next pool's RAM check) rather than during a copy.
    """
    pin = bool(pinned) and accelerator.pinned_memory_available
    check_host_ram(capacity, what=f"host pool {name!r}", sized_by=sized_by)
    buffer = accelerator.allocate_host(capacity, pinned=pin)
    if not pin:
        buffer.zero_()  # hidden cost: faults in every page, once, at construction
    return PoolBuffer(
        buffer,
        "host, pinned" if pin else "host, pageable",
        no_scratch,  # CPU moves are memmoves, see Note [overlap-safe moves]
        _noop,
    )


def device_buffer(accelerator: Accelerator, capacity: int, *, name: str) -> PoolBuffer:
    """``capacity`` bytes of device memory for the pool ``name``, counted in the budget
    (``DeviceBudgetExceeded`` when it cannot hold them); the release returns them."""
    device = accelerator.allocate_device(capacity, what=f"block pool {name!r}")
    return PoolBuffer(device.tensor, "device", device_scratch(accelerator, name), device.release)


def _noop() -> None:
    return None
