"""What this machine offers the library: the facts behind ``zero-offload info``."""

from __future__ import annotations

import platform
from typing import Any

import psutil
import torch

from .accelerator import choose_accelerator, get_accelerator

__all__ = ["collect_info", "format_info"]

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


def _numba_facts() -> dict[str, Any]:
    try:
        import numba

        try:
            layer = numba.threading_layer()
        except ValueError:
            layer = f"not yet chosen (configured: {numba.config.THREADING_LAYER})"
        return {
            "numba_version": numba.__version__,
            "numba_threading_layer": layer,
            "numba_threads": numba.get_num_threads(),
        }
    except ImportError as exc:
        return {"numba_version": f"not importable: {exc}"}


def collect_info() -> dict[str, Any]:
    """Everything ``zero-offload info`` prints, as a JSON-friendly dict."""
    name, reason = choose_accelerator()
    accelerator = get_accelerator()
    memory = psutil.virtual_memory()
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch_version": torch.__version__,
        "torch_build": f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU",
        "torch_threads": torch.get_num_threads(),
        "accelerator": name,
        "accelerator_reason": reason,
        "gpu_name": None,
        "gpu_memory_total": None,
        "pinned_memory_available": accelerator.pinned_memory_available,
        "host_ram_total": memory.total,
        "host_ram_available": memory.available,
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        info["gpu_name"] = props.name
        info["gpu_memory_total"] = props.total_memory
    info.update(accelerator.describe())
    info.update(_cpu_facts())
    info.update(_numba_facts())
    return info


def format_info(info: dict[str, Any]) -> str:
    """The ``info`` dict as aligned ``key: value`` lines, sizes in binary units."""
    from .config import format_bytes

    width = max(len(key) for key in info)
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
