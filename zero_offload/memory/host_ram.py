"""How much host RAM a pool may pin: what is available now, less a safety margin.

Pinned memory cannot be swapped out, so pinning more than the machine (or the container)
can spare hands the process to the OOM killer. Every pinned or pageable host pool asks
``check_host_ram`` first.

Note [host RAM in a container]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``/proc/meminfo`` (psutil's ``available``) describes the machine, not the container: a job
limited to 64 GiB on a 1 TiB node sees 1 TiB available, pins past its limit, and is killed.
So the figure used is the smaller of the machine's available RAM and the cgroup's headroom
(limit less usage): cgroup v2's ``memory.max`` - ``memory.current``, or v1's
``memory.limit_in_bytes`` - ``memory.usage_in_bytes``, looked up first under the path
``/proc/self/cgroup`` names and then at the mount's root (a container usually sees its own
cgroup there). "max" or a v1 limit near 2**63 means no limit.
"""

from __future__ import annotations

import os

import psutil

from ..config import format_bytes
from ..errors import PoolExhausted

__all__ = [
    "HOST_RAM_MARGIN_FRACTION",
    "HOST_RAM_MARGIN_MIN",
    "available_host_ram",
    "cgroup_headroom",
    "check_host_ram",
]

#: Host RAM left free when sizing a host pool: the larger of this fraction of total RAM...
HOST_RAM_MARGIN_FRACTION = 0.05
#: ...and this many bytes, for the interpreter, torch, the data loader and the page cache.
HOST_RAM_MARGIN_MIN = 1 << 30
#: A cgroup v1 limit at or above this many bytes means "no limit" (the kernel's page-rounded
#: LONG_MAX).
_NO_LIMIT = 1 << 60


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    if text == "max":
        return _NO_LIMIT
    try:
        return int(text)
    except ValueError:
        return None


def _cgroup_paths(proc_cgroup: str) -> tuple[str | None, str | None]:
    # (v2 path, v1 memory-controller path) from /proc/self/cgroup lines "id:controllers:path".
    v2 = v1 = None
    try:
        with open(proc_cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        return None, None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":
            v2 = path
        elif "memory" in controllers.split(","):
            v1 = path
    return v2, v1


def cgroup_headroom(
    root: str = "/sys/fs/cgroup", proc_cgroup: str = "/proc/self/cgroup"
) -> int | None:
    """Bytes the process's memory cgroup may still grow by, or None without a limit.

    See Note [host RAM in a container]. ``root`` and ``proc_cgroup`` are for tests.
    """
    v2_path, v1_path = _cgroup_paths(proc_cgroup)
    candidates: list[tuple[str, str, str]] = []
    for base, rel, limit, usage in (
        (root, v2_path, "memory.max", "memory.current"),
        (os.path.join(root, "memory"), v1_path, "memory.limit_in_bytes", "memory.usage_in_bytes"),
    ):
        if rel:
            candidates.append((os.path.join(base, rel.lstrip("/")), limit, usage))
        candidates.append((base, limit, usage))
    for directory, limit_file, usage_file in candidates:
        limit = _read_int(os.path.join(directory, limit_file))
        usage = _read_int(os.path.join(directory, usage_file))
        if limit is None or usage is None:
            continue
        if limit >= _NO_LIMIT:
            return None
        return max(limit - usage, 0)
    return None


def available_host_ram() -> tuple[int, int, str]:
    """(available bytes, total bytes, where the figure came from): the machine's available
    RAM, or the container's headroom when that is smaller (Note [host RAM in a container])."""
    memory = psutil.virtual_memory()
    headroom = cgroup_headroom()
    if headroom is not None and headroom < memory.available:
        return headroom, memory.total, "the container's memory limit (cgroup) leaves"
    return memory.available, memory.total, "host RAM available is"


def check_host_ram(nbytes: int, *, what: str, sized_by: str) -> None:
    """Raise ``PoolExhausted`` unless ``nbytes`` fit in the host RAM available now.

    Available means the smaller of ``psutil.virtual_memory().available`` and the
    container's headroom (Note [host RAM in a container]), less a safety margin of
    max(``HOST_RAM_MARGIN_FRACTION`` of total RAM, ``HOST_RAM_MARGIN_MIN``), so that
    pinning a pool (which cannot be swapped out) never hands the process to the OOM killer.
    """
    available, total, source = available_host_ram()
    margin = max(int(total * HOST_RAM_MARGIN_FRACTION), HOST_RAM_MARGIN_MIN)
    allowed = available - margin
    if nbytes > allowed:
        raise PoolExhausted(
            f"refusing to allocate {what} of {format_bytes(nbytes)} ({nbytes} bytes): "
            f"{source} only {format_bytes(available)} "
            f"(host RAM total {format_bytes(total)}), and {format_bytes(margin)} is kept free as a "
            f"safety margin, leaving {format_bytes(max(allowed, 0))}. Lower {sized_by}, or "
            f"free host memory (other pools, processes) before building the pool."
        )
