"""What this machine offers the library: the facts behind ``zero-offload info``.

In four sections, each a function, cheapest first: the machine's (CPU, RAM: no torch), then
torch's and the accelerator's (imports torch, seconds), then numba's (imports numba), then
the thread budget and the wait policy (Note [one thread budget] and Note [no spinning team
beside another] in ``thread_budget.py``). Only the last three import torch or numba, when
called.
"""

from __future__ import annotations

import platform
from collections.abc import Callable
from typing import Any

import psutil

__all__ = [
    "SECTIONS",
    "collect_info",
    "collect_machine_info",
    "collect_numba_info",
    "collect_thread_info",
    "collect_torch_info",
    "format_info",
]

_SIMD_FLAGS = ("sse4_2", "avx", "avx2", "fma", "avx512f", "avx512bw", "avx512_bf16", "amx_bf16")


def _cpu_facts() -> dict[str, Any]:
    try:
        import cpuinfo

        info = cpuinfo.get_cpu_info()
    except Exception as exc:  # py-cpuinfo shells out on some platforms; never fail `info`
        info = {"brand_raw": f"unknown ({type(exc).__name__}: {exc})", "flags": []}
    flags = set(info.get("flags", []))
    return {
        "cpu_model": info.get("brand_raw") or platform.processor() or "unknown",
        "cpu_arch": info.get("arch_string_raw") or platform.machine(),
        "simd_flags": [flag for flag in _SIMD_FLAGS if flag in flags],
        "physical_cores": psutil.cpu_count(logical=False),
        "logical_cores": psutil.cpu_count(logical=True),
    }


def collect_numba_info() -> dict[str, Any]:
    """numba's version, threading layer (with why) and pool size; imports numba, without
    loading its layer (``numba.get_num_threads()`` would)."""
    try:
        import numba
    except ImportError as exc:
        return {"numba_version": f"not importable: {exc}"}
    from .thread_budget import numba_layer_choice

    layer, why = numba_layer_choice()
    return {
        "numba_version": numba.__version__,
        "numba_threading_layer": layer,
        "numba_threading_layer_reason": why,
        "numba_threads": numba.config.NUMBA_NUM_THREADS,
    }


def collect_machine_info() -> dict[str, Any]:
    """Python, the CPU and the RAM; imports neither torch nor numba."""
    from .memory.host_ram import cgroup_memory

    memory = psutil.virtual_memory()
    limit = cgroup_memory()  # a container's (Note [host RAM in a container])
    return {
        "python": platform.python_version(),
        **_cpu_facts(),
        "host_ram_total": memory.total,
        "host_ram_available": memory.available,
        # The pools and host_budget="auto" size themselves by these where set.
        "container_ram_limit": None if limit is None else limit[0],
        "container_ram_used": None if limit is None else limit[1],
    }


def collect_torch_info() -> dict[str, Any]:
    """torch's build, the accelerator the library would choose, the GPU and pinned memory;
    imports torch."""
    import torch

    from .accelerator import choose_accelerator, get_accelerator

    name, reason = choose_accelerator()
    accelerator = get_accelerator()
    info: dict[str, Any] = {
        "torch_version": torch.__version__,
        "torch_build": f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU",
        "torch_threads": torch.get_num_threads(),
        "accelerator": name,
        "accelerator_reason": reason,
        "gpu_name": None,
        "gpu_memory_total": None,
        "pinned_memory_available": accelerator.pinned_memory_available,
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        info["gpu_name"] = props.name
        info["gpu_memory_total"] = props.total_memory
    info.update(accelerator.describe())
    return info


def collect_thread_info() -> dict[str, Any]:
    """The thread budget, numba's threading layer and the OpenMP wait policy, each with why;
    imports torch and numba."""
    from .thread_budget import (
        numba_layer_choice,
        thread_budget,
        torch_uses_openmp,
        wait_policy_report,
    )

    budget = thread_budget()
    layer, _ = numba_layer_choice()
    wait = wait_policy_report(
        numba_layer=layer, torch_openmp=torch_uses_openmp(), cores=budget.cores
    )
    return {
        "thread_cores": budget.cores,
        "thread_cores_reason": budget.cores_reason,
        "thread_numba_alone": budget.numba_alone,
        "thread_numba_beside_torch": budget.numba_beside,
        "thread_numba_beside_gpu_launches": budget.numba_beside_launcher,
        "thread_host_pass": budget.host_pass,
        "thread_split_reason": budget.split_reason,
        "omp_wait_policy": wait.torch_policy,
        "omp_wait_spins": wait.spins,
        "omp_wait_reason": wait.reason,
    }


#: ``info``'s sections in the order printed: the first imports neither torch nor numba.
SECTIONS: tuple[Callable[[], dict[str, Any]], ...] = (
    collect_machine_info,
    collect_torch_info,
    collect_numba_info,
    collect_thread_info,
)


def collect_info() -> dict[str, Any]:
    """Everything ``zero-offload info`` prints, as a JSON-friendly dict."""
    info: dict[str, Any] = {}
    for collect in SECTIONS:
        info.update(collect())
    return info


def format_info(info: dict[str, Any], *, width: int = 0) -> str:
    """The ``info`` dict as ``key value`` lines, keys padded to ``width`` or the longest,
    sizes in binary units."""
    from .config import format_bytes

    width = max(width, *(len(key) for key in info))
    lines = []
    for key, value in info.items():
        if (
            isinstance(value, int)
            and not isinstance(value, bool)
            and key.endswith(("_total", "_available", "_budget"))
        ):
            shown = f"{format_bytes(value)} ({value} bytes)"
        elif isinstance(value, list):
            shown = " ".join(value) or "(none)"
        else:
            shown = "-" if value is None else str(value)
        lines.append(f"{key.ljust(width)}  {shown}")
    return "\n".join(lines)
