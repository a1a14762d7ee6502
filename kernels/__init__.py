"""Numba CPU kernels (shipped as zero_offload.kernels): pure functions over arrays."""
