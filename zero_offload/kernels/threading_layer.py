"""numba's threading layer, forced to a thread-safe one before any kernel launches.

Note [a thread-safe threading layer]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The optimizer launches kernels from the caller's thread (the step) and from its host
worker (gradient statistics and accumulation, a delayed update), and those can overlap.
numba's ``workqueue`` layer is not thread-safe: two threads launching parallel kernels at
once abort the whole process. ``omp`` and ``tbb`` are. So, at import of
``zero_offload.kernels``, numba's choice is narrowed to ``threadsafe`` (omp or tbb) unless
the user named a layer: a named thread-safe layer is kept; ``workqueue`` (named, or already
running because another library launched numba kernels first) is refused with what to do.
Then the layer is loaded at once, before any kernel launches: with torch's thread count put
back (Note [torch keeps the user's thread count]), asking for a passive wait policy, and a
spinning torch team is warned about (Note [no spinning team beside another]); both notes are
in ``thread_budget.py``.
"""

from __future__ import annotations

import os

import numba

from ..thread_budget import load_numba_layer_passive, warn_if_torch_spins

__all__ = [
    "THREADSAFE_LAYERS",
    "configure_threads",
    "ensure_threadsafe_layer",
    "threading_layer_in_use",
]

#: numba threading layers that tolerate concurrent launches from several threads.
THREADSAFE_LAYERS = ("omp", "tbb")

_ACCEPTED_CHOICES = ("threadsafe", "safe", *THREADSAFE_LAYERS)


def threading_layer_in_use() -> str | None:
    """The layer numba loaded, or None before its first parallel launch."""
    try:
        return numba.threading_layer()
    except ValueError:  # "Threading layer is not initialized."
        return None


def ensure_threadsafe_layer() -> None:
    """Narrow numba's choice to a thread-safe layer; see Note [a thread-safe threading layer].

    Raises ``RuntimeError`` when ``workqueue`` is named or already running."""
    running = threading_layer_in_use()
    if running is not None:
        if running not in THREADSAFE_LAYERS:
            raise RuntimeError(
                f"numba's threading layer is already {running!r}, which aborts the process "
                "when two threads launch kernels at once (zero-offload's host worker and "
                "the step do). Import zero_offload before other numba code, or set "
                "NUMBA_THREADING_LAYER=omp (or tbb) in the environment"
            )
        return
    chosen = str(numba.config.THREADING_LAYER).lower()
    if chosen == "default":
        numba.config.THREADING_LAYER = "threadsafe"
    elif chosen not in _ACCEPTED_CHOICES:
        named = os.environ.get("NUMBA_THREADING_LAYER", chosen)
        raise RuntimeError(
            f"NUMBA_THREADING_LAYER={named!r} is not thread-safe: zero-offload launches "
            "kernels from two threads at once. Use 'omp', 'tbb' or 'threadsafe'"
        )


def configure_threads() -> None:
    """At import of the kernels: a thread-safe layer (Note [a thread-safe threading layer]),
    loaded now with a passive wait policy and torch's thread count kept, and one warning if
    torch's team may spin beside it (Notes [torch keeps the user's thread count] and [no
    spinning team beside another] in ``thread_budget.py``)."""
    ensure_threadsafe_layer()
    load_numba_layer_passive()
    warn_if_torch_spins(threading_layer_in_use())
