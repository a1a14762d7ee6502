"""``gpu_check.py``'s first phase: everything about the machine that a number depends on.

It imports nothing from zero_offload, so it reports even when the package does not import.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import torch
from _common import machine
from _phases import Phase
from _runs import MiB


def environment(phase: Phase, nvme_dir: Path) -> None:
    """Everything about the machine that a number below depends on. Imports nothing from
    zero_offload, so it reports even when the package does not import."""
    phase.row("python", f"{platform.python_version()} ({sys.executable})")
    phase.row(
        "torch",
        f"{torch.__version__}, CUDA build {torch.version.cuda or 'none'}, "
        f"cuDNN {torch.backends.cudnn.version() if torch.version.cuda else 'none'}, "
        f"{torch.get_num_threads()} intra-op threads",
    )
    phase.data["torch"] = torch.__version__
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        phase.row(
            "CUDA device",
            f"{props.name}, compute {props.major}.{props.minor}, "
            f"{props.total_memory / 2**30:.1f} GiB, {torch.cuda.device_count()} visible; "
            f"driver API {_driver_api()}",
        )
        phase.data["gpu"] = props.name
    else:
        phase.row("CUDA device", "none visible to torch")
    smi = shutil.which("nvidia-smi")
    if smi is None:
        phase.row("nvidia-smi", "not on PATH")
    else:
        query = "--query-gpu=name,driver_version,memory.total,memory.used,power.limit"
        what = "nvidia-smi (name, driver, memory, used, power)"
        seconds = min(20.0, max(1.0, phase.remaining() - 1))
        try:
            proc = subprocess.run(
                [smi, query, "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=seconds,
                check=False,
            )
        except subprocess.TimeoutExpired:  # a wedged driver: say so, report the rest
            phase.row(what, f"no answer within {seconds:.0f} s", ok=False)
        else:
            out = (proc.stdout or proc.stderr).strip().replace("\n", "; ")
            phase.row(what, out, ok=proc.returncode == 0)
    try:
        import numba

        try:
            layer = numba.threading_layer()
        except ValueError:  # chosen at the first parallel launch (the kernels phase)
            layer = f"not chosen yet (configured {numba.config.THREADING_LAYER!r})"
        phase.row(
            "numba",
            f"{numba.__version__}, threading layer {layer}, {numba.get_num_threads()} threads",
        )
    except ImportError as exc:
        phase.row("numba", f"not importable: {exc}", ok=False)
    phase.row("CPU", _cpu_model())
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    phase.row("nproc (CPU affinity) / logical CPUs", f"{affinity} / {os.cpu_count()}")
    phase.data["nproc"] = affinity
    phase.row("host RAM total / available", _host_ram())
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    limit = "unlimited" if soft == resource.RLIM_INFINITY else f"{soft / MiB:.1f} MiB"
    phase.row("locked-memory limit (ulimit -l)", limit)
    free = shutil.disk_usage(nvme_dir).free
    phase.row(f"free disk in {nvme_dir} (the nvme phase, --nvme-dir)", f"{free / 2**30:.1f} GiB")


def _driver_api() -> str:
    """The CUDA version the driver supports, as the runtime reports it (nvidia-smi's
    driver version is the other row)."""
    try:
        version = torch._C._cuda_getDriverVersion()  # e.g. 12040; private, hence the guard
    except Exception as exc:
        return f"unknown ({type(exc).__name__}: {exc})"
    return f"{version // 1000}.{version % 1000 // 10}"


def _cpu_model() -> str:
    try:
        import cpuinfo

        info = cpuinfo.get_cpu_info()
    except Exception as exc:  # py-cpuinfo missing, or it failed: /proc/cpuinfo instead
        return f"{machine()['cpu']} (py-cpuinfo: {type(exc).__name__}: {exc})"
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")
    flags = ",".join(f for f in wanted if f in set(info.get("flags", []))) or "none of " + ",".join(
        wanted
    )
    return f"{info.get('brand_raw') or machine()['cpu']} ({info.get('arch', '?')}; {flags})"


def _host_ram() -> str:
    try:
        import psutil

        memory = psutil.virtual_memory()
        total, available = memory.total, memory.available
    except ImportError:  # /proc/meminfo counts in KiB
        fields = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
        total, available = (int(fields[k].split()[0]) * 1024 for k in ("MemTotal", "MemAvailable"))
    text = f"{total / 2**30:.1f} / {available / 2**30:.1f} GiB"
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            value = Path(path).read_text().strip()
        except OSError:
            continue
        if value.isdigit() and int(value) < total:
            text += f" (container limit {int(value) / 2**30:.1f} GiB)"
        break
    return text
