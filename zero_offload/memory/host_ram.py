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
``memory.limit_in_bytes`` - ``memory.usage_in_bytes``, at every level from the cgroup
``/proc/self/cgroup`` names up to the mount's root (a SLURM job sets its limit on the job's
cgroup, the steps and tasks below it say "max"; a container usually sees its own cgroup at
the root; v1 also reports the parents' limit as ``hierarchical_memory_limit``), the level
that leaves the least. "max" or a v1 limit near 2**63 means no limit. Usage counts the page
cache, which the kernel takes back before it kills anything, so the inactive part
(``inactive_file``, v1 ``total_inactive_file``) is not counted as used, as kubelet counts a
container's working set: a dataset read through the cache does not shrink the budget.

The container's limit is also the RAM the process may ever hold (``HostRam.total``): the
safety margin and ``host_budget="auto"``'s reserve, fractions of the total, are fractions of
the limit there. Of the node's total they would keep more free than the container holds (5%
of a 1 TiB node is 51 GiB, most of a 64 GiB job), and "auto" would place no state in RAM.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

import psutil

from ..config import format_bytes
from ..errors import PoolExhausted

__all__ = [
    "HOST_RAM_MARGIN_FRACTION",
    "HOST_RAM_MARGIN_MIN",
    "HostRam",
    "HostShare",
    "cgroup_headroom",
    "cgroup_memory",
    "check_host_ram",
    "host_identity",
    "host_ram",
    "local_processes",
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


def _stat(path: str, key: str) -> int:
    """``key``'s value in the cgroup's ``memory.stat`` (0 where absent)."""
    try:
        with open(path) as f:
            for line in f:
                name, _, value = line.partition(" ")
                if name == key:
                    return int(value)
    except (OSError, ValueError):
        pass
    return 0


def _levels(base: str, rel: str | None) -> list[str]:
    """The cgroup directories from the process's own up to ``base``, the mount's root
    (a limit set on any of them binds), each once, those that exist."""
    dirs = [base]
    if rel:
        parts = [p for p in rel.strip("/").split("/") if p]
        dirs = [os.path.join(base, *parts[:n]) for n in range(len(parts), 0, -1)] + dirs
    return [d for d in dict.fromkeys(dirs) if os.path.isdir(d)]


def cgroup_memory(
    root: str = "/sys/fs/cgroup", proc_cgroup: str = "/proc/self/cgroup"
) -> tuple[int, int] | None:
    """(limit, usage) in bytes of the memory cgroup that binds the process, or None without
    a limit: of each level from its own cgroup up to the root that sets one, the one that
    leaves the least headroom; usage less the page cache the kernel reclaims first.

    See Note [host RAM in a container]. ``root`` and ``proc_cgroup`` are for tests.
    """
    v2_path, v1_path = _cgroup_paths(proc_cgroup)
    found: list[tuple[int, int]] = []
    for directory in _levels(root, v2_path):  # cgroup v2
        limit = _read_int(os.path.join(directory, "memory.max"))
        usage = _read_int(os.path.join(directory, "memory.current"))
        if limit is None or usage is None or limit >= _NO_LIMIT:
            continue
        cache = _stat(os.path.join(directory, "memory.stat"), "inactive_file")
        found.append((limit, max(usage - cache, 0)))
    for directory in _levels(os.path.join(root, "memory"), v1_path):  # cgroup v1
        limit = _read_int(os.path.join(directory, "memory.limit_in_bytes"))
        usage = _read_int(os.path.join(directory, "memory.usage_in_bytes"))
        if limit is None or usage is None:
            continue
        stat = os.path.join(directory, "memory.stat")
        above = _stat(stat, "hierarchical_memory_limit")  # the parents' limits, v1's way
        if 0 < above < limit:
            limit = above
        if limit >= _NO_LIMIT:
            continue
        found.append((limit, max(usage - _stat(stat, "total_inactive_file"), 0)))
    if not found:
        return None
    return min(found, key=lambda level: level[0] - level[1])


def cgroup_headroom(
    root: str = "/sys/fs/cgroup", proc_cgroup: str = "/proc/self/cgroup"
) -> int | None:
    """Bytes the process's memory cgroup may still grow by, or None without a limit."""
    found = cgroup_memory(root, proc_cgroup)
    return None if found is None else max(found[0] - found[1], 0)


@dataclass(frozen=True)
class HostRam:
    """The host RAM this process may use (Note [host RAM in a container]).

    Fields:
        available: bytes it may still take now: the machine's available RAM, or the
            container's headroom where smaller.
        total: bytes it may ever hold: the machine's RAM, or the container's limit where
            smaller (the margins are fractions of this).
        source: for messages, what ``available`` is ("host RAM available is", or "the
            container's memory limit (cgroup) leaves").
        limited: whether ``total`` is a container's limit.
    """

    available: int
    total: int
    source: str
    limited: bool


def host_ram() -> HostRam:
    """The host RAM this process may use now; see ``HostRam``."""
    memory = psutil.virtual_memory()
    available, total = memory.available, memory.total
    source, limited = "host RAM available is", False
    found = cgroup_memory()
    if found is not None and found[0] < total:
        total, limited = found[0], True
    if found is not None and found[0] - found[1] < available:
        available = max(found[0] - found[1], 0)
        source = "the container's memory limit (cgroup) leaves"
    return HostRam(available, total, source, limited)


# Note [ranks that share a host's RAM]
# ``host_budget="auto"`` is the RAM this process may still take less a reserve. Eight ranks
# on one node, or in one container, each read the same free RAM before any of them pins
# anything, and each took all of it: together eight times what is there, so the ranks built
# last were refused by the pools' own check, or the node swapped and the OOM killer came.
# So at every build with several ranks, each rank sends the others what names its RAM
# (``host_identity``: the host name and the kernel's boot id, alike in every process of one
# machine or one container, and apart on two) and the RAM it sees available, in one
# all-gather before anything is allocated (``optim/ranks.py``, ``share_host``). "auto" is
# then (the most any rank of this RAM saw available, less the one reserve) / the number of
# those ranks, less this rank's own buffers: what ``estimate``'s rows assume with
# ``ranks_per_node`` (Note [what "auto" leaves each rank] in ``state/nvme_plan.py``).
# The optimizer's group may hold only some of the processes on a machine (a data-parallel
# group beside tensor parallelism: one rank a node), so the launcher's count of processes
# on this node (``LOCAL_WORLD_SIZE`` from torchrun and accelerate, ``SLURM_NTASKS_PER_NODE``)
# counts too, where larger (``local_processes``); it also splits "auto" for ranks that build
# before joining a group. Processes of another job on the machine are not counted: what they
# hold is already not available. Two containers with one host name and boot id (host
# networking) and limits of their own are counted together: each gets less than it could,
# never more.


@dataclass(frozen=True)
class HostShare:
    """The optimizer's ranks that draw on this process's host RAM (Note [ranks that share a
    host's RAM]).

    Fields:
        ranks: how many, this one included (at least 1): of the optimizer's group, or the
            launcher's count of processes on this node where larger.
        available: the most host RAM any of them saw available (``HostRam.available``) at
            the exchange, before any of them allocated for the build.
    """

    ranks: int
    available: int


def local_processes() -> int:
    """The processes the launcher started on this node (``LOCAL_WORLD_SIZE``, else
    ``SLURM_NTASKS_PER_NODE``), or 1 where neither says (Note [ranks that share a host's
    RAM])."""
    for name in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"):
        try:
            count = int(os.environ.get(name, ""))
        except ValueError:
            continue
        if count >= 1:
            return count
    return 1


def host_identity() -> str:
    """What names the RAM this process draws from: the host name and the kernel's boot id
    (the same in every process of one machine or container; Note [ranks that share a
    host's RAM])."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def check_host_ram(nbytes: int, *, what: str, sized_by: str) -> None:
    """Raise ``PoolExhausted`` unless ``nbytes`` fit in the host RAM available now.

    Available means the smaller of ``psutil.virtual_memory().available`` and the
    container's headroom (Note [host RAM in a container]), less a safety margin of
    max(``HOST_RAM_MARGIN_FRACTION`` of ``HostRam.total``, ``HOST_RAM_MARGIN_MIN``), so that
    pinning a pool (which cannot be swapped out) never hands the process to the OOM killer.
    """
    ram = host_ram()
    available, total, source = ram.available, ram.total, ram.source
    margin = max(int(total * HOST_RAM_MARGIN_FRACTION), HOST_RAM_MARGIN_MIN)
    allowed = available - margin
    if nbytes > allowed:
        what_total = "container limit" if ram.limited else "host RAM total"
        raise PoolExhausted(
            f"refusing to allocate {what} of {format_bytes(nbytes)} ({nbytes} bytes): "
            f"{source} only {format_bytes(available)} "
            f"({what_total} {format_bytes(total)}), and {format_bytes(margin)} is kept free as a "
            f"safety margin, leaving {format_bytes(max(allowed, 0))}. Lower {sized_by}, or "
            f"free host memory (other pools, processes) before building the pool."
        )
