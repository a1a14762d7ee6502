"""Compile (or load from numba's on-disk cache) every kernel specialisation ahead of use."""

from __future__ import annotations

import itertools
import time

import numpy as np

from ..progress import progress
from .accumulate import accumulate_grad, accumulate_grad_ranges
from .adam import adam_step
from .convert import cast_fp32
from .stats import grad_stats, grad_stats_ranges


def warmup() -> dict[str, float]:
    """Trigger compilation of every kernel specialisation and return seconds per kernel.

    The first call in a fresh install compiles with LLVM (tens of seconds in total); later
    processes load the machine code from numba's cache (zero_offload/kernels/__pycache__) in well under
    a second. Keys name the specialisation, e.g. ``"adam[grad=uint16,moments=float32,amsgrad=False,out=bf16]"`` (uint16 = bf16/fp16 bits);
    ``"total"`` is the sum. Calling it again in the same process costs microseconds.
    """
    times: dict[str, float] = {}
    n = 8
    hyper = {"step": 1, "lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8}
    # grad: fp32 | 16-bit (bf16 and fp16 share one specialisation); moments: fp32 | bf16;
    # amsgrad buffer absent | present; out absent | bf16 | fp16: 24 specialisations.
    outs = {"none": None, "bf16": np.uint16, "fp16": np.float16}
    # A cold compile takes about a minute: a bar says so (Note [waits say what they wait
    # for] in progress.py).
    for grad_dtype, moment_dtype, amsgrad, out_name in progress(
        itertools.product((np.float32, np.uint16), (np.float32, np.uint16), (False, True), outs),
        desc="compiling CPU Adam kernels",
        total=24,
        unit="kernel",
    ):
        out_dtype = outs[out_name]
        t0 = time.perf_counter()
        adam_step(
            np.zeros(n, np.float32),
            np.zeros(n, grad_dtype),
            np.zeros(n, moment_dtype),
            np.zeros(n, moment_dtype),
            max_exp_avg_sq=np.zeros(n, moment_dtype) if amsgrad else None,
            out=None if out_dtype is None else np.zeros(n, out_dtype),
            weight_decay=0.0,
            num_threads=1,
            **hyper,
        )
        key = (
            f"adam[grad={np.dtype(grad_dtype)},moments={np.dtype(moment_dtype)},"
            f"amsgrad={amsgrad},out={out_name}]"
        )
        times[key] = time.perf_counter() - t0
    for grad_dtype in (np.float32, np.uint16):
        t0 = time.perf_counter()
        grad_stats(np.zeros(n, grad_dtype), num_threads=1)
        times[f"grad_stats[grad={np.dtype(grad_dtype)}]"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        grad_stats_ranges(np.zeros(n, grad_dtype), [(0, n)], num_threads=1)
        times[f"grad_stats_ranges[grad={np.dtype(grad_dtype)}]"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        accumulate_grad(np.zeros(n, np.float32), np.zeros(n, grad_dtype), overwrite=True)
        times[f"accumulate_grad[src={np.dtype(grad_dtype)}]"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        accumulate_grad_ranges(
            np.zeros(n, np.float32), np.zeros(n, grad_dtype), [(0, n, (0, n))], overwrite=True
        )
        times[f"accumulate_grad_ranges[src={np.dtype(grad_dtype)}]"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    cast_fp32(np.zeros(n, np.float32), np.zeros(n, np.uint16), num_threads=1)
    times["cast_fp32"] = time.perf_counter() - t0
    times["total"] = sum(times.values())
    return times
