"""Numba CPU kernels (shipped as zero_offload.kernels): pure functions over arrays.

Every kernel takes 1-D contiguous CPU arrays (torch tensors or numpy arrays; a numpy uint16
array holds bf16 bit patterns), works on an optional tile ``[start, stop)``, keeps no state,
and validates all arguments before writing anything.
"""

from .accumulate import accumulate_grad
from .adam import adam_step
from .convert import cast_fp32
from .stats import grad_stats
from .warmup import warmup

__all__ = ["accumulate_grad", "adam_step", "cast_fp32", "grad_stats", "warmup"]
