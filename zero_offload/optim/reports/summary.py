"""Where an optimizer's state went: bytes per tier, pinned host bytes and the device budget,
for the one log line at construction and for the integrations' metrics.

Note [construction says where the state went]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A run with offload otherwise logs what a run without it logs, and a user cannot tell that
the state is on the host (or on NVMe), how much host memory was pinned, or how much of the
device budget is left. ``OffloadAdamW`` logs one INFO line on the ``zero_offload`` logger
when it is built (``placement_line``) and keeps the figures (``opt.placement``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ...accelerator import Accelerator
from ...config import format_bytes
from ...memory.manager import TieredMemoryManager
from ..flat_bucket import FlatBucket

__all__ = ["PlacementReport", "placement_line", "placement_of"]


@dataclass(frozen=True)
class PlacementReport:
    """Bytes of optimizer state (fp32 master and moments) per tier on this rank, and the
    memory the optimizer holds for it. After ``close()`` it holds none: every figure but the
    budget and ``device_in_use`` (the whole library's) is 0."""

    device: int  # state bytes on the device (device-resident buckets)
    host: int  # state bytes in host RAM
    nvme: int  # state bytes in the storage tier's files
    pinned: int  # bytes of pinned host pools (state, staging, accumulators)
    pageable: int  # bytes of pageable host pools
    device_pools: int  # bytes of the optimizer's device pools (weights, gradient buffers)
    device_budget: int  # the device budget, bytes
    device_in_use: int  # library-owned device bytes now (every optimizer and offloader)
    parameters: int  # trained elements on this rank's shard


def placement_of(
    buckets: Sequence[FlatBucket], manager: TieredMemoryManager, accelerator: Accelerator
) -> PlacementReport:
    """The figures of ``PlacementReport`` for ``buckets`` and the pools of ``manager``."""
    per_tier = {"device": 0, "host": 0, "nvme": 0}
    parameters = 0
    for bucket in buckets:
        store = bucket.store
        real = bucket.layout.real_in(*store.span())
        parameters += real
        per_tier[store.location] += real * sum(dtype.itemsize for _, dtype in store.field_dtypes())
        # Shaped state is on the device with a resident bucket's fields (Note [whole
        # parameters stepped on the device] in state/whole_resident.py), else in host RAM,
        # the NVMe store's too (Note [NVMe tiles follow whole parameters] in nvme_plan.py).
        per_tier["device" if store.resident else "host"] += store.param_state_bytes()
    pools = {"host, pinned": 0, "host, pageable": 0, "device": 0}
    # A closed manager's pools were given back with it (the optimizer's close, Note
    # [lifetimes without close] in optim/lifetime.py): it holds none, as it holds no state.
    for pool in () if manager.closed else manager.pools:
        pools[pool.kind] = pools.get(pool.kind, 0) + pool.capacity
    ledger = accelerator.memory_stats()
    return PlacementReport(
        device=per_tier["device"],
        host=per_tier["host"],
        nvme=per_tier["nvme"],
        pinned=pools["host, pinned"],
        pageable=pools["host, pageable"],
        device_pools=pools["device"],
        device_budget=ledger["budget"],
        device_in_use=ledger["in_use"],
        parameters=parameters,
    )


def placement_line(name: str, placement: PlacementReport, device: str) -> str:
    """One line: ``name`` and where its state went; see the Note above."""
    p = placement
    return (
        f"{name}: {p.parameters:,} parameters; optimizer state on device "
        f"{format_bytes(p.device)}, host {format_bytes(p.host)}, NVMe {format_bytes(p.nvme)}; "
        f"host pools {format_bytes(p.pinned)} pinned + {format_bytes(p.pageable)} pageable; "
        f"device pools {format_bytes(p.device_pools)}, {format_bytes(p.device_in_use)} of the "
        f"{format_bytes(p.device_budget)} budget on {device} in use by zero-offload"
    )
