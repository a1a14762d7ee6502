"""Page-aligned host buffers for pinning: anonymous ``mmap``, faulted in by all cores.

Note [pinned buffers are page-aligned mmaps]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``cudaHostRegister`` pins whole pages. Registering memory from the ordinary allocator
(``np.empty``) pins the pages it *shares* with neighbouring allocations too, and a second
registration that touches one of those pages fails with
``cudaErrorHostMemoryAlreadyRegistered``: small pools (later parameter groups, 512-byte
pools, the link probe) hit that. So every pinned buffer is its own anonymous ``mmap``: page
aligned, its exact size rounded up to whole pages, sharing no page with anything.

Registration faults every page in, on one thread, inside the driver. The pages are faulted
in first by ``tensor.zero_()``, which torch spreads over its intra-op threads, so the
driver only pins resident pages. Pools of at least ``HUGE_PAGE_MIN`` bytes ask the kernel
for transparent huge pages (``madvise(MADV_HUGEPAGE)``), which cuts page faults and TLB
misses by 512x where the kernel allows it; refusal is harmless.

Torch's own pinned allocator (``pin_memory=True``) was the alternative: even with
``pinned_use_cuda_host_register`` it rounds each request up to a power of two (up to 2x
the host RAM asked for) and caches the block for reuse, so pools would not have their exact
size. ``benchmarks/gpu_check.py`` measures both registration rates on a GPU.

Each mapping is ``madvise(MADV_DONTFORK)``: a forked child (a ``DataLoader`` worker under
the ``fork`` start method) does not inherit it. Inherited, every pinned page would become
copy-on-write shared with the child, and the parent's next write to it would move the
parent to a fresh physical page while the GPU's DMA still targets the old one (kernels
without pinned-page copy-on-fork), so copies would read or write stale memory. The child
never needs the optimizer's pinned state; touching it there faults at once instead.

The buffer is unregistered (``unregister(ptr)``) just before the mapping goes away, which is
when the last tensor viewing it dies; see ``PinnedBuffer``. The locked-memory limit
(``ulimit -l``, ``RLIMIT_MEMLOCK``) is reported with every failure, with the numbers.
"""

from __future__ import annotations

import contextlib
import mmap
import resource
import weakref
from collections.abc import Callable

import numpy as np
import torch

from ..config import format_bytes

__all__ = [
    "HUGE_PAGE_MIN",
    "PAGE_SIZE",
    "memlock_limit",
    "page_aligned_buffer",
    "registration_error",
]

#: The host page size, bytes.
PAGE_SIZE = mmap.PAGESIZE
#: Buffers at least this large (bytes) ask for transparent huge pages.
HUGE_PAGE_MIN = 64 << 20

#: CUDA runtime error codes a registration can return, by name (cuda_runtime_api.h).
_CUDA_ERRORS = {
    1: "cudaErrorInvalidValue",
    2: "cudaErrorMemoryAllocation",
    712: "cudaErrorHostMemoryAlreadyRegistered",
    801: "cudaErrorNotSupported",
}


def memlock_limit() -> int | None:
    """The soft locked-memory limit (``ulimit -l``) in bytes; None when unlimited."""
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return None if soft == resource.RLIM_INFINITY else int(soft)


def page_aligned_buffer(
    nbytes: int, *, register: Callable[[int, int], int], unregister: Callable[[int], object]
) -> torch.Tensor:
    """A flat ``(nbytes,) uint8`` CPU tensor over its own page-aligned mapping, registered.

    ``register(ptr, length)`` pins the mapping and returns a CUDA status (0 on success);
    ``unregister(ptr)`` runs when the last view of the buffer dies, before the unmap.
    Raises ``MemoryError`` with ``registration_error``'s message on failure. See Note
    [pinned buffers are page-aligned mmaps]. Hidden cost: faults in and pins every page.
    """
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
        raise ValueError(f"nbytes must be an int > 0, got {nbytes!r}")
    length = -(-nbytes // PAGE_SIZE) * PAGE_SIZE
    mapping = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_DONTFORK"):  # Linux; see the module doc for why
        mapping.madvise(mmap.MADV_DONTFORK)
    if length >= HUGE_PAGE_MIN and hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError):  # an optimisation; the kernel may refuse it
            mapping.madvise(mmap.MADV_HUGEPAGE)
    array = np.frombuffer(mapping, dtype=np.uint8)  # keeps the mapping alive
    tensor = torch.from_numpy(array)  # keeps the array alive, and so the mapping
    tensor.zero_()  # hidden cost: faults every page in, on torch's intra-op threads
    ptr = array.ctypes.data
    status = int(register(ptr, length))
    if status != 0:
        raise MemoryError(registration_error(nbytes, length, status))
    # The array dies with the last tensor viewing its storage; its weakref callbacks run
    # before it drops the mapping, so the pages are unpinned before they are unmapped.
    weakref.finalize(array, unregister, ptr)
    return tensor[:nbytes]


def registration_error(nbytes: int, length: int, status: int) -> str:
    """The message for a failed ``cudaHostRegister`` of ``length`` bytes (``nbytes`` asked)."""
    name = _CUDA_ERRORS.get(status, "a CUDA error")
    limit = memlock_limit()
    limit_text = "unlimited" if limit is None else f"{format_bytes(limit)} ({limit} bytes)"
    if status == 712:
        cause = (
            "part of this range is already registered: a bug, since each pinned buffer is "
            "its own page-aligned mapping (Note [pinned buffers are page-aligned mmaps])"
        )
    elif limit is not None and length > limit:
        cause = (
            f"the locked-memory limit (ulimit -l) is {limit_text}, below the "
            f"{format_bytes(length)} asked for; raise it (ulimit -l unlimited, or memlock in "
            "/etc/security/limits.conf), or lower the host pool size"
        )
    else:
        cause = (
            f"the locked-memory limit (ulimit -l) is {limit_text}, so it is not the cause; "
            "the host is likely short of memory that can be pinned: lower the host pool "
            "size (bucket_bytes, host_pool_bytes) or free host RAM"
        )
    return (
        f"pinning {format_bytes(nbytes)} ({nbytes} bytes, {length} after rounding to "
        f"{PAGE_SIZE}-byte pages) with cudaHostRegister failed with {name} ({status}): {cause}"
    )
