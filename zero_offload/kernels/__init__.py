"""Numba CPU kernels (shipped as zero_offload.kernels): pure functions over arrays. Muon's
step (``muon.py``) calls torch for its matrix products (Newton–Schulz) between two numba
passes.

Every kernel takes 1-D contiguous CPU arrays (torch tensors or numpy arrays; a numpy uint16
array holds bf16 bit patterns), works on an optional tile ``[start, stop)``, keeps no state,
and validates all arguments before writing anything; ``muon_step_torch`` alone takes
tensors on any one device (a resident bucket's too), and ``muon_step`` and
``adafactor_step`` keep a reused scratch buffer per calling thread.
"""

from .threading_layer import configure_threads

# Before any kernel launches: Note [a thread-safe threading layer], and Note [no spinning
# team beside another] in thread_budget.py.
configure_threads()

from .accumulate import (  # noqa: E402
    AccumulateRanges,
    accumulate_grad,
    accumulate_grad_ranges,
    plan_accumulate_ranges,
)
from .adafactor import adafactor_step, adafactor_update_cap  # noqa: E402
from .adagrad import adagrad_step  # noqa: E402
from .adam import adam_step  # noqa: E402
from .convert import cast_fp32  # noqa: E402
from .lion import lion_step  # noqa: E402
from .muon import muon_step, muon_step_torch, newton_schulz  # noqa: E402
from .stats import StatsRanges, grad_stats, grad_stats_ranges, plan_stats_ranges  # noqa: E402
from .warmup import warmup  # noqa: E402


def release_scratch() -> None:
    """Free the calling thread's reused kernel buffers (Adafactor's column partials, Muon's
    update: Note [pass 1's partials are reused], Note [Muon's host passes]); the next step
    on this thread makes them again."""
    from .adafactor_stats import release_column_partials
    from .muon import release_update_buffer

    release_column_partials()
    release_update_buffer()


__all__ = [
    "AccumulateRanges",
    "StatsRanges",
    "accumulate_grad",
    "accumulate_grad_ranges",
    "adafactor_step",
    "adafactor_update_cap",
    "adagrad_step",
    "adam_step",
    "cast_fp32",
    "grad_stats",
    "grad_stats_ranges",
    "lion_step",
    "muon_step",
    "muon_step_torch",
    "newton_schulz",
    "plan_accumulate_ranges",
    "plan_stats_ranges",
    "release_scratch",
    "warmup",
]
