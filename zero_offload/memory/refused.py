"""A pool's memory the OS refused: Note [an allocation the OS refused]."""

from __future__ import annotations

import contextlib
import errno

from ..config import format_bytes

__all__ = ["allocation_refused", "refused_by_the_os"]

# Note [an allocation the OS refused]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A pool's memory is taken from the OS once, whole, when it is created (``create_pool``);
# the host RAM check before pinning (``host_ram.py``) does not see the process's own
# address-space limit (``ulimit -v``, RLIMIT_AS: batch schedulers set it), under which the
# allocation fails with torch's "DefaultCPUAllocator: can't allocate memory: you tried to
# allocate N bytes" (a pinned buffer's mmap: ENOMEM), naming neither the pool nor what to
# change. So a refusal is raised here as ``PoolExhausted`` naming the pool, its tier and
# bytes, the limit and what is mapped already, and the settings that would make it fit.


def refused_by_the_os(exc: BaseException) -> bool:
    """Whether ``exc`` is the OS refusing memory (torch's CPU allocator, or an mmap's
    ENOMEM): Note [an allocation the OS refused]."""
    if isinstance(exc, OSError):
        return exc.errno == errno.ENOMEM
    return isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc)


def _address_space() -> tuple[int | None, int | None]:
    """The soft RLIMIT_AS (None: unlimited or unknown) and the bytes mapped now (None:
    unknown; Linux's ``VmSize``)."""
    limit = None
    with contextlib.suppress(ImportError, OSError, ValueError):
        import resource  # POSIX only

        soft, _ = resource.getrlimit(resource.RLIMIT_AS)
        limit = None if soft == resource.RLIM_INFINITY else int(soft)
    mapped = None
    with contextlib.suppress(OSError, ValueError, IndexError), open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                mapped = int(line.split()[1]) * 1024
    return limit, mapped


def allocation_refused(name: str, tier: str, capacity: int, exc: BaseException) -> str:
    """The message for pool ``name``'s ``capacity`` bytes (in ``tier``) refused by the OS with ``exc``
    (Note [an allocation the OS refused])."""
    limit, mapped = _address_space()
    asked = f"{format_bytes(capacity)} ({capacity} bytes)"
    head = (
        f"cannot create pool {name!r} ({tier} tier): the OS refused its {asked} "
        f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__}). "
    )
    now = f"{format_bytes(mapped)} are mapped already" if mapped is not None else ""
    if limit is not None:
        room = f", so about {format_bytes(max(limit - mapped, 0))} more fit" if now else ""
        cause = (
            f"The process's address-space limit (RLIMIT_AS, ulimit -v) is "
            f"{format_bytes(limit)} ({limit} bytes){' and ' + now if now else ''}{room}. "
        )
        raise_it = (
            "; or raise the limit (ulimit -v, resource.setrlimit(resource.RLIMIT_AS, ...), "
            "or the scheduler's memory request)"
        )
    else:
        cause = (
            "The process has no address-space limit (RLIMIT_AS), so the host is short of "
            f"memory{' (' + now + ')' if now else ''}. "
        )
        raise_it = "; or free host memory"
    return (
        head + cause + "Make the pools smaller: a lower OffloadConfig.bucket_bytes (an "
        "optimizer's pools are sized by its buckets) or ActivationOffloadConfig's "
        "host_pool_bytes/device_pool_bytes (an activation offloader's); keep the optimizer "
        "state on NVMe (OffloadConfig(nvme_dir=..., host_budget=...))" + raise_it + "."
    )
