"""The pool sizes activation offload needs for checkpointed layers: arithmetic only, so the
estimator (which imports no torch) and ``ActivationOffloadConfig.for_checkpoints`` share it.
"""

from __future__ import annotations

__all__ = [
    "DEFAULT_DEVICE_POOL_BYTES",
    "DEFAULT_HOST_POOL_BYTES",
    "LAYOUT_ALIGN",
    "POOL_ALIGN",
    "checkpoint_pool_bytes",
]

#: Bytes modulo which a reloaded activation's data pointer matches the saved one's (a cache
#: line; torch's CPU allocator aligns to it). See Note [saved layout comes back] in
#: activations/layout.py.
LAYOUT_ALIGN = 64
#: The alignment of the activation pools' blocks (``TieredMemoryManager.create_pool``'s).
POOL_ALIGN = 512
#: ``ActivationOffloadConfig``'s pools when not sized: 1 GiB of host, 256 MiB of device.
DEFAULT_HOST_POOL_BYTES = 1 << 30
DEFAULT_DEVICE_POOL_BYTES = 256 << 20


# Note [pools sized for checkpointed layers]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# With ``checkpoint`` around each of ``layers`` layers, the host pool holds every layer's
# saved input from the forward until backward reloads it: ``layers`` blocks. (One forward at
# a time: with micro-batches, each backward frees its forward's blocks before the next
# forward.) The device pool holds the reloaded inputs alive at once: the one recomputing and
# the ``prefetch_depth`` prefetched ahead of it, ``prefetch_depth + 1`` blocks; one fewer and
# prefetches are dropped (``prefetch_skipped``), waited for later as demand loads. A block is
# the input's bytes, plus up to ``LAYOUT_ALIGN - 1`` on the device to restore its pointer's
# alignment (Note [saved layout comes back] in activations/layout.py), rounded up to the pools'
# 512-byte alignment. tests/test_activation_pool_sizes.py runs a model at exactly these
# sizes, and one block fewer. The estimator's activation-offload rows count the same bytes
# (``zero-offload estimate`` prints the config; ``ActivationOffloadConfig.for_checkpoints``
# builds it).


def checkpoint_pool_bytes(
    checkpoint_bytes: int, layers: int, *, prefetch_depth: int = 1
) -> tuple[int, int]:
    """``(host_pool_bytes, device_pool_bytes)`` for ``layers`` checkpointed layers whose
    saved input is ``checkpoint_bytes`` each (Note [pools sized for checkpointed layers])."""
    for name, value, low in (
        ("checkpoint_bytes", checkpoint_bytes, 1),
        ("layers", layers, 1),
        ("prefetch_depth", prefetch_depth, 0),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    block = -(-(checkpoint_bytes + LAYOUT_ALIGN - 1) // POOL_ALIGN) * POOL_ALIGN
    return layers * block, min(layers, prefetch_depth + 1) * block
