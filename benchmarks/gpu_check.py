"""The CUDA check: one script, under six minutes on one GPU, a row per result.

    python benchmarks/gpu_check.py [--gpt-1b] [--skip-tests] [--skip-benchmarks] [--budget-s S]
    python benchmarks/gpu_check.py --cpu-smoke   # every phase on the host accelerator, tiny

It runs from a checkout with nothing installed (the checkout goes first on ``sys.path``).
Phases, numbers first; each row is printed as soon as it is measured:

- ``environment``: Python, torch, CUDA (build, device, driver from torch and ``nvidia-smi``),
  numba and its threading layer, the CPU model (py-cpuinfo), ``nproc`` (CPU affinity), host
  RAM (and a container limit), the locked-memory limit, free space in the temp dir.
- ``import``: which ``zero_offload`` is imported; it must be this checkout's.
- ``kernels``: the first call of the fp32 CPU Adam kernel (a compile, or a load from numba's
  cache) and the threading layer numba then runs.
- ``parity-torch``: torch's own AdamW, for-loop against fused, on the parity model: the
  spread of float rounding that the parity rows are held to.
- ``parity-<mode>``: ``OffloadAdamW`` against ``torch.optim.AdamW``, fp32, a small GPT, N
  steps: the largest weight difference and the step-time ratio (and peak device memory on
  CUDA), one row each, for ``plain``, ``announced`` (``opt.backward(loss, step=True)``),
  ``overlap_step`` (against torch AdamW with the same one-step delay), ``param_offload``,
  ``activation_offload`` (each block's input checkpointed to the host) and ``nvme``.
- ``device-budget``, ``pinned``, ``bandwidth``: the default device budget next to
  ``mem_get_info``; the pinning rate of our buffers against torch's pinned allocator;
  pinned host-to-device and device-to-host bandwidth.
- ``step-100m``: a 100M GPT in bf16, offloaded against resident (fp32 master weights and
  moments on the device, fused AdamW): step time and peak device memory, the peak reset
  after construction and one warm-up step.
- ``step-1b`` (``--gpt-1b``; a few minutes on its own): issue 15's 1.15B GPT, plain,
  announced and ``overlap_step`` against no offload; the target is offloaded <= 1.1x.
- ``cuda-tests``, ``cuda-tests-sanitizer``: the CUDA cases of ``TEST_FILES`` (named, so a
  file that cannot be collected shows), then again under ``TORCH_CUDA_SANITIZER=1``.
- ``benchmarks``: ``bench_cpu_adam --quick`` and ``bench_offload_step --quick``.

Each phase runs under ``_phases.PhaseRunner`` (Note [a phase never takes the script down]):
an exception or a timeout becomes a row and the next phase runs; a phase that needs more
than what is left of ``--budget-s`` is skipped with a row saying so. With ``$OUT`` set, the
rows and every phase's data go to ``$OUT/gpu_check.json`` and ``gpu_check.md`` after each
row, the test logs beside them. Exit status 1 when any phase failed, raised or timed out.

Without a GPU it prints the environment and says so (exit 0); ``--cpu-smoke`` runs every
phase that has a CPU form on the host accelerator at tiny sizes (tests/test_gpu_check.py).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
# This checkout's package, not an installed one; then the benchmark helpers.
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

from _common import machine, time_rounds  # noqa: E402
from _phases import Faults, Phase, PhaseRunner, Report, Status  # noqa: E402

#: The test files holding CUDA cases, run by name (``pytest -m cuda``).
TEST_FILES = (
    "tests/test_cuda_parity.py",
    "tests/test_cuda_path.py",
    "tests/test_accelerator.py",
    "tests/test_pool.py",
    "tests/test_activations.py",
)
#: 1.15B parameters: 20 blocks of 12 * 2048^2 (50.3M each), a 32768 x 2048 embedding and
#: head, 2048 positions.
GPT_1B = {"vocab_size": 32768, "seq_len": 2048, "layers": 20, "hidden": 2048, "heads": 16}
#: The parity runs' AdamW, on both sides.
LR, BETAS, WEIGHT_DECAY = 1e-3, (0.9, 0.95), 0.1
#: fp32 parity floor: a few ulp per step from the kernel's evaluation order
#: (tests/test_offload_adamw_parity.py); the bar is this or twice torch's own spread.
FP32_ATOL = 1e-5
MODES = ("plain", "announced", "overlap_step", "param_offload", "activation_offload", "nvme")
STEP_VARIANTS = ("resident", "offload", "offload_announced", "offload_overlap_step")
MiB = 1 << 20


@dataclass(frozen=True)
class Sizes:
    """How big each phase's work is: real on a GPU, tiny for the CPU smoke run."""

    parity_model: dict[str, int]  # GPTConfig fields
    parity_batch: int  # sequences a step
    parity_steps: int  # the first is a warm-up, the rest are timed
    bucket_bytes: int
    tile_elements: int
    step_model: dict[str, int]  # the step-100m comparison
    step_batch: int
    step_rounds: int
    pinned_bytes: int
    bandwidth_bytes: int


CUDA_SIZES = Sizes(
    parity_model={"vocab_size": 8192, "seq_len": 256, "layers": 6, "hidden": 512, "heads": 8},
    parity_batch=8,
    parity_steps=10,
    bucket_bytes=4 * MiB,
    tile_elements=1 << 18,
    step_model={"vocab_size": 8192, "seq_len": 32, "layers": 12, "hidden": 768, "heads": 12},
    step_batch=4,
    step_rounds=5,
    pinned_bytes=1 << 30,
    bandwidth_bytes=256 * MiB,
)
TINY_SIZES = Sizes(
    parity_model={"vocab_size": 64, "seq_len": 16, "layers": 2, "hidden": 32, "heads": 4},
    parity_batch=2,
    parity_steps=4,
    bucket_bytes=8192,
    tile_elements=1024,
    step_model={"vocab_size": 256, "seq_len": 16, "layers": 2, "hidden": 64, "heads": 4},
    step_batch=2,
    step_rounds=2,
    pinned_bytes=MiB,
    bandwidth_bytes=MiB,
)


@dataclass(frozen=True)
class Target:
    """Where the check runs: ``"cuda"`` (the GPU) or ``"host"`` (the host accelerator)."""

    kind: str

    @property
    def cuda(self) -> bool:
        return self.kind == "cuda"

    @property
    def device(self) -> torch.device:
        return (
            torch.device("cuda", torch.cuda.current_device()) if self.cuda else torch.device("cpu")
        )

    def accelerator(self, **config: Any) -> Any:
        """A fresh accelerator of this kind with the given ``AcceleratorConfig`` fields."""
        from zero_offload import AcceleratorConfig, CudaAccelerator, HostAccelerator

        cls = CudaAccelerator if self.cuda else HostAccelerator
        return cls(AcceleratorConfig(**config))

    def sync(self) -> None:
        """Wait for the device's queued work (CUDA kernels run asynchronously)."""
        if self.cuda:
            torch.cuda.synchronize()

    def reset_peak(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()

    def peak_bytes(self) -> int | None:
        """Peak device bytes torch allocated since ``reset_peak`` (None off CUDA: the host
        accelerator's "device" is ordinary memory that torch does not count)."""
        return torch.cuda.max_memory_allocated() if self.cuda else None

    def release(self) -> None:
        if self.cuda:
            torch.cuda.empty_cache()


def _fmt_bytes(nbytes: float | None) -> str:
    if nbytes is None:
        return "n/a"
    from zero_offload.config import format_bytes

    return format_bytes(nbytes)


# -- environment ---------------------------------------------------------------------------


def environment(phase: Phase) -> None:
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
        driver = getattr(torch._C, "_cuda_getDriverVersion", lambda: 0)()
        phase.row(
            "CUDA device",
            f"{props.name}, compute {props.major}.{props.minor}, "
            f"{props.total_memory / 2**30:.1f} GiB, {torch.cuda.device_count()} visible; "
            f"driver API {driver // 1000}.{driver % 1000 // 10}",
        )
        phase.data["gpu"] = props.name
    else:
        phase.row("CUDA device", "none visible to torch")
    smi = shutil.which("nvidia-smi")
    if smi is None:
        phase.row("nvidia-smi", "not on PATH")
    else:
        query = "--query-gpu=name,driver_version,memory.total,memory.used,power.limit"
        proc = subprocess.run(
            [smi, query, "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=min(20.0, max(1.0, phase.remaining() - 1)),
            check=False,
        )
        out = (proc.stdout or proc.stderr).strip().replace("\n", "; ")
        phase.row("nvidia-smi (name, driver, memory, used, power)", out, ok=proc.returncode == 0)
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
    tmp = tempfile.gettempdir()
    phase.row(f"free disk in {tmp} (NVMe phase)", f"{shutil.disk_usage(tmp).free / 2**30:.1f} GiB")


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


# -- the package and its kernels -------------------------------------------------------------


def import_package(phase: Phase) -> None:
    """Import ``zero_offload`` and say from where: this checkout, or it fails."""
    import zero_offload

    path = Path(zero_offload.__file__).resolve().parent
    phase.data["file"] = str(Path(zero_offload.__file__).resolve())
    ours = path.is_relative_to(ROOT)
    where = "this checkout" if ours else f"NOT this checkout ({ROOT}): an installed copy shadows it"
    phase.row("zero_offload", f"{zero_offload.__version__} from {path} ({where})", ok=ours)


def kernels(phase: Phase) -> None:
    """The fp32 CPU Adam kernel's first call, and the threading layer it brought up."""
    import numba
    import numpy as np

    from zero_offload.kernels import adam_step
    from zero_offload.kernels.threading_layer import THREADSAFE_LAYERS, threading_layer_in_use

    n = 1 << 16
    arrays = [np.zeros(n, np.float32) for _ in range(4)]
    hyper = {"lr": LR, "beta1": BETAS[0], "beta2": BETAS[1], "eps": 1e-8}
    seconds = []
    for step in (1, 2):
        start = time.perf_counter()
        adam_step(*arrays, step=step, weight_decay=WEIGHT_DECAY, **hyper)
        seconds.append(time.perf_counter() - start)
    cached = len(list((ROOT / "zero_offload" / "kernels" / "__pycache__").glob("*.nbi")))
    phase.data.update(first_call_s=seconds[0], second_call_s=seconds[1], cache_indexes=cached)
    phase.row(
        "CPU Adam kernel (fp32): first call / second call",
        f"{seconds[0]:.2f} s / {seconds[1] * 1e3:.2f} ms (the first compiles or loads from "
        f"numba's cache: {cached} kernel indexes in the checkout's cache)",
    )
    layer = threading_layer_in_use()
    phase.row(
        "numba threading layer in use",
        f"{layer}, {numba.get_num_threads()} threads",
        ok=layer in THREADSAFE_LAYERS,
    )


# -- parity: OffloadAdamW against torch.optim.AdamW, fp32 -----------------------------------


@dataclass(frozen=True)
class ParityResult:
    """One mode's run against its torch reference, same model, same batches."""

    mode: str
    steps: int
    max_abs_diff: float  # largest |w_ours - w_torch| over every weight, after all steps
    ours_step_s: float  # median of the timed steps (all but the first)
    torch_step_s: float
    ours_peak_bytes: int | None  # peak device bytes in the timed steps (CUDA only)
    torch_peak_bytes: int | None

    @property
    def step_ratio(self) -> float:
        return self.ours_step_s / self.torch_step_s


def _gpt(shape: dict[str, int], target: Target, dtype: torch.dtype = torch.float32) -> Any:
    from zero_offload.demo.model import GPTConfig, TinyGPT

    torch.manual_seed(0)
    with target.device:  # built where it trains: a large model never sits on the CPU first
        return TinyGPT(GPTConfig(**shape)).to(dtype)


def _batches(shape: dict[str, int], batch: int, n: int, target: Target) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [
        torch.randint(0, shape["vocab_size"], (batch, shape["seq_len"]), generator=gen).to(
            target.device
        )
        for _ in range(n)
    ]


def _timed(step: Callable[[], None], steps: int, target: Target) -> tuple[float, int | None]:
    """Run ``step`` ``steps`` times: one warm-up (kernel compiles, allocator and pool
    growth), the peak reset, then the rest timed with a device sync around each. Returns the
    median seconds and the peak device bytes of the timed steps."""
    step()
    target.reset_peak()
    seconds = time_rounds({"step": step}, rounds=steps - 1, warmup=0, sync=target.sync)["step"]
    return seconds, target.peak_bytes()


def _torch_run(
    sizes: Sizes, target: Target, data: list[torch.Tensor], *, delayed: bool = False, **impl: Any
) -> tuple[Any, float, int | None]:
    """torch.optim.AdamW over ``data``; returns the trained weights, step seconds, peak.

    ``delayed``: overlap_step's semantics by hand (Note [delayed parameter update]): each
    forward sees weights one update behind the fp32 master; the master is returned."""
    model = _gpt(sizes.parity_model, target)
    master = copy.deepcopy(model) if delayed else model
    opt = torch.optim.AdamW(
        master.parameters(), lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY, **impl
    )
    batches = iter(data)
    pending: list[torch.Tensor] = []

    def step() -> None:
        ids = next(batches)
        model(ids, ids).backward()
        if pending:
            with torch.no_grad():
                for p, q in zip(model.parameters(), pending, strict=True):
                    p.copy_(q)  # the previous step's update reaches the forward's weights
        if delayed:
            for p, q in zip(master.parameters(), model.parameters(), strict=True):
                p.grad, q.grad = q.grad, None
        opt.step()
        opt.zero_grad()
        if delayed:
            pending[:] = [p.detach().clone() for p in master.parameters()]

    seconds, peak = _timed(step, len(data), target)
    return master, seconds, peak


def _ours_run(
    mode: str, sizes: Sizes, target: Target, data: list[torch.Tensor], workdir: Path
) -> tuple[Any, float, int | None]:
    """OffloadAdamW in ``mode`` over ``data``; the weights after ``close()`` (which publishes
    a pending delayed update and leaves offloaded parameters in place), step seconds, peak."""
    from zero_offload import (
        ActivationOffloadConfig,
        ActivationOffloader,
        OffloadAdamW,
        OffloadConfig,
        checkpoint,
    )

    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    model = _gpt(sizes.parity_model, target)
    config: dict[str, Any] = {
        "bucket_bytes": sizes.bucket_bytes,
        "tile_elements": sizes.tile_elements,
    }
    extra: dict[str, Any] = {}
    if mode == "overlap_step":
        config["overlap_step"] = True
    elif mode == "param_offload":
        config["offload_parameters"] = True
        extra["model"] = model
    elif mode == "nvme":
        config.update(nvme_dir=str(workdir), host_budget=1)  # every bucket's state on disk
    opt = OffloadAdamW(
        model.parameters(),
        lr=LR,
        betas=BETAS,
        weight_decay=WEIGHT_DECAY,
        config=OffloadConfig(**config),
        accelerator=target.accelerator(),
        **extra,
    )
    offloader = None
    try:
        if mode == "activation_offload":
            shape = sizes.parity_model
            # One checkpointed block input per layer, fp32, plus a pool alignment each.
            layer_bytes = sizes.parity_batch * shape["seq_len"] * shape["hidden"] * 4 + 4096
            offloader = ActivationOffloader(
                manager=opt.manager,
                config=ActivationOffloadConfig(
                    min_bytes=0,
                    host_pool_bytes=shape["layers"] * layer_bytes,
                    device_pool_bytes=3 * layer_bytes,  # prefetch depth 1: two in, one spare
                ),
            )
            model.runner = lambda block, x: checkpoint(block, x, offloader=offloader)
        announce = mode == "announced"
        batches = iter(data)

        def step() -> None:
            ids = next(batches)
            loss = model(ids, ids)
            if announce:
                opt.backward(loss, step=True)
            else:
                loss.backward()
            opt.step()
            opt.zero_grad()

        seconds, peak = _timed(step, len(data), target)
        if offloader is not None:
            stats = offloader.stats()
            if stats["offloaded_tensors"] == 0:
                raise RuntimeError("activation_offload: no activation was offloaded (a bug)")
    finally:
        opt.close()
        if offloader is not None:
            offloader.close()
    return model, seconds, peak


def _max_abs_diff(a: Any, b: Any) -> float:
    return max(
        (x.detach().float() - y.detach().float()).abs().max().item()
        for x, y in zip(a.parameters(), b.parameters(), strict=True)
    )


def parity_run(mode: str, target: Target, sizes: Sizes, *, workdir: Path) -> ParityResult:
    """OffloadAdamW in ``mode`` against torch.optim.AdamW (default implementation) on the
    same fp32 GPT and batches; ``overlap_step`` against the same one-step delay by hand."""
    data = _batches(sizes.parity_model, sizes.parity_batch, sizes.parity_steps, target)
    ours, ours_s, ours_peak = _ours_run(mode, sizes, target, data, workdir)
    target.release()
    ref, torch_s, torch_peak = _torch_run(sizes, target, data, delayed=mode == "overlap_step")
    diff = _max_abs_diff(ours, ref)
    del ours, ref
    target.release()
    return ParityResult(mode, len(data), diff, ours_s, torch_s, ours_peak, torch_peak)


def torch_spread(target: Target, sizes: Sizes) -> float:
    """Largest weight difference between torch's for-loop and fused AdamW on the parity
    run: float rounding's own spread, the yardstick of every parity row."""
    data = _batches(sizes.parity_model, sizes.parity_batch, sizes.parity_steps, target)
    loop, _, _ = _torch_run(sizes, target, data, foreach=False)
    fused, _, _ = _torch_run(sizes, target, data, fused=True)
    return _max_abs_diff(loop, fused)


def parity_phase(
    mode: str, target: Target, sizes: Sizes, context: dict[str, Any], nvme_root: Path
) -> Callable[[Phase], None]:
    def run(phase: Phase) -> None:
        workdir = Path(tempfile.mkdtemp(prefix="gpu_check_nvme_", dir=nvme_root))
        try:
            result = parity_run(mode, target, sizes, workdir=workdir)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        tolerance = max(FP32_ATOL, 2 * context.get("spread", 0.0))
        phase.data.update(asdict(result), step_ratio=result.step_ratio, tolerance=tolerance)
        phase.row(
            f"{mode}: max |w - w_torch| after {result.steps} steps",
            f"{result.max_abs_diff:.2e} (tolerance {tolerance:.0e})",
            ok=result.max_abs_diff <= tolerance,
        )
        phase.row(
            f"{mode}: step time ours / torch",
            f"{result.step_ratio:.2f} ({result.ours_step_s * 1e3:.1f} / "
            f"{result.torch_step_s * 1e3:.1f} ms)",
        )
        if result.ours_peak_bytes is not None:
            phase.row(
                f"{mode}: peak device memory ours / torch",
                f"{_fmt_bytes(result.ours_peak_bytes)} / {_fmt_bytes(result.torch_peak_bytes)}",
            )

    return run


# -- the device: budget, pinned memory, bandwidth ---------------------------------------------


def device_budget(phase: Phase, target: Target) -> None:
    acc = target.accelerator()
    budget = acc.ledger.budget
    phase.data.update(budget=budget, source=acc.ledger.budget_source)
    if not target.cuda:
        phase.row("default device budget", f"{_fmt_bytes(budget)} ({acc.ledger.budget_source})")
        return
    free, total = torch.cuda.mem_get_info(acc.device)
    cached = torch.cuda.memory_reserved(acc.device) - torch.cuda.memory_allocated(acc.device)
    phase.row("device memory free / total", f"{_fmt_bytes(free)} / {_fmt_bytes(total)}")
    phase.row(
        "default device budget (<= free + torch's unused cache)",
        f"{_fmt_bytes(budget)} ({acc.ledger.budget_source})",
        ok=budget <= free + cached,
    )


def pinned(phase: Phase, target: Target, nbytes: int) -> None:
    """Pinning rate (GB/s) of our page-aligned buffers and, on CUDA, of torch's pinned
    allocator, which rounds sizes up to a power of two."""
    from zero_offload.accelerator.pinned import memlock_limit

    acc = target.accelerator()
    phase.row("pinned memory available", str(acc.pinned_memory_available))
    for size in (nbytes, nbytes + 4096):  # an exact power of two, and just above one
        start = time.perf_counter()
        ours = acc.allocate_host(size, pinned=True)
        ours_s = time.perf_counter() - start
        text = f"{size / ours_s / 1e9:.2f}"
        if target.cuda:
            held = torch.cuda.memory.host_memory_stats().get("allocated_bytes.current", 0)
            start = time.perf_counter()
            theirs = torch.empty(size, dtype=torch.uint8, pin_memory=True)
            torch_s = time.perf_counter() - start
            rounded = torch.cuda.memory.host_memory_stats().get("allocated_bytes.current", 0) - held
            text += f" / {size / torch_s / 1e9:.2f} (torch pinned {_fmt_bytes(rounded)} for it)"
            del theirs
        who = "ours / torch" if target.cuda else "ours"
        phase.row(f"pinning {size:,} bytes: {who} GB/s", text)
        del ours
        target.sync()
    limit = memlock_limit()
    phase.row("locked-memory limit", "unlimited" if limit is None else _fmt_bytes(limit))


def bandwidth(phase: Phase, target: Target, nbytes: int, rounds: int = 5) -> None:
    """Host-to-device and device-to-host copies between a pinned buffer and device memory,
    each timed between device syncs."""
    acc = target.accelerator()
    host = acc.allocate_host(nbytes, pinned=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=acc.device)
    seconds = time_rounds(
        {
            "h2d": lambda: dev.copy_(host, non_blocking=True),
            "d2h": lambda: host.copy_(dev, non_blocking=True),
        },
        rounds=rounds,
        sync=target.sync,
    )
    for name in ("h2d", "d2h"):
        phase.data[f"{name}_gb_s"] = nbytes / seconds[name] / 1e9
        phase.row(
            f"pinned {name.upper()} GB/s ({_fmt_bytes(nbytes)})",
            f"{phase.data[f'{name}_gb_s']:.1f}",
        )


# -- a training step: offloaded against resident ----------------------------------------------


def step_comparison(
    config: Any,
    *,
    micro: int,
    batch: int,
    rounds: int,
    target: Target,
    variants: tuple[str, ...] = STEP_VARIANTS,
) -> dict[str, float]:
    """Median step seconds (and, on CUDA, peak device bytes) of each variant on a bf16
    ``TinyGPT(config)``, ``micro`` micro-batches of ``batch`` sequences a step: ``resident``
    is the no-offload loop (fp32 master weights and moments on the device, fused AdamW); the
    others are OffloadAdamW plain, announced and with ``overlap_step``. Peaks are reset
    after construction and one warm-up step. Ratios are against ``resident``."""
    from bench_offload_step import TorchMixed

    from zero_offload import OffloadAdamW, OffloadConfig

    unknown = set(variants) - set(STEP_VARIANTS)
    if "resident" not in variants or unknown:
        raise ValueError(
            f"variants must include 'resident' and come from {STEP_VARIANTS}, got {variants}"
        )
    shape = {k: getattr(config, k) for k in ("vocab_size", "seq_len", "layers", "hidden", "heads")}
    data = [_batches(shape, batch, micro, target) for _ in range(rounds + 1)]
    out: dict[str, float] = {}
    for name in variants:
        target.release()
        model = _gpt(shape, target, torch.bfloat16)
        if name == "resident":
            opt: Any = TorchMixed(model)
        else:
            opt = OffloadAdamW(
                model.parameters(),
                lr=1e-4,
                config=OffloadConfig(overlap_step=name == "offload_overlap_step"),
                accelerator=target.accelerator(),
            )
        out.setdefault("parameters", sum(p.numel() for p in model.parameters()))
        announce = name == "offload_announced"
        batches = iter(data)

        def step(
            model: Any = model,
            opt: Any = opt,
            name: str = name,
            announce: bool = announce,
            steps: Iterator[list[torch.Tensor]] = batches,
        ) -> None:
            for i, ids in enumerate(next(steps)):
                loss = model(ids, ids)
                if name == "resident":
                    loss.backward()
                else:
                    opt.backward(loss, step=announce and i == micro - 1)
            opt.step()
            opt.zero_grad()

        out[f"{name}_step_s"], peak = _timed(step, rounds + 1, target)
        if peak is not None:
            out[f"{name}_peak_bytes"] = peak
        if name != "resident":
            opt.close()
        del model, opt, step
    for name in variants:
        if name != "resident":
            out[f"{name}_ratio"] = out[f"{name}_step_s"] / out["resident_step_s"]
    target.release()
    return out


def step_100m(phase: Phase, target: Target, sizes: Sizes) -> None:
    from zero_offload.demo.model import GPTConfig

    config = GPTConfig(**sizes.step_model)
    both = step_comparison(
        config,
        micro=1,
        batch=sizes.step_batch,
        rounds=sizes.step_rounds,
        target=target,
        variants=("resident", "offload"),
    )
    phase.data.update(both)
    what = f"{both['parameters']:,} parameters, bf16"
    phase.row(
        f"step time offload / resident ({what})",
        f"{both['offload_ratio']:.2f} ({both['offload_step_s'] * 1e3:.1f} / "
        f"{both['resident_step_s'] * 1e3:.1f} ms)",
    )
    if "resident_peak_bytes" in both:
        phase.row(
            "peak device memory resident / offload",
            f"{both['resident_peak_bytes'] / both['offload_peak_bytes']:.2f}x "
            f"({_fmt_bytes(both['resident_peak_bytes'])} / {_fmt_bytes(both['offload_peak_bytes'])})",
        )


def step_1b(phase: Phase, target: Target, *, tokens: int, micro: int) -> None:
    from zero_offload.demo.model import GPTConfig

    config = GPTConfig(**GPT_1B)
    batch = max(1, tokens // (micro * config.seq_len))
    big = step_comparison(config, micro=micro, batch=batch, rounds=3, target=target)
    phase.data.update(big, micro=micro, batch=batch)
    phase.row(
        f"no-offload step ms (1.15B GPT, bf16, {micro} x {batch} x {config.seq_len} tokens)",
        f"{big['resident_step_s'] * 1e3:.0f}",
    )
    for name in STEP_VARIANTS[1:]:
        phase.row(
            f"{name} step ms, / no-offload (target <= 1.1)",
            f"{big[f'{name}_step_s'] * 1e3:.0f}, {big[f'{name}_ratio']:.2f}",
        )


# -- the test suite's CUDA cases, and the benchmarks ---------------------------------------------


def cuda_tests(phase: Phase, target: Target, *, sanitizer: bool, out_dir: Path | None) -> None:
    """``pytest -m cuda`` on ``TEST_FILES``; on the host accelerator, collection only (the
    cases skip without a GPU, but a file that fails to import still shows)."""
    missing = [name for name in TEST_FILES if not (ROOT / name).is_file()]
    if missing:
        phase.row("test files", f"missing from this checkout: {', '.join(missing)}", ok=False)
    files = [name for name in TEST_FILES if name not in missing]
    if importlib.util.find_spec("pytest") is None or not files:
        phase.row("pytest", "not installed (pip install pytest)" if files else "no files", ok=False)
        return
    command = [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider"]
    command += ["-rfEs", *files] if target.cuda else ["--collect-only", *files]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    if sanitizer:
        env["TORCH_CUDA_SANITIZER"] = "1"
    log = None if out_dir is None else out_dir / f"{phase.name}.log"
    try:
        proc = subprocess.run(
            command,
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=max(1.0, phase.remaining() - 5),  # leave time to report
            check=False,
        )
        output, code = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:
        output = "".join(
            part.decode(errors="replace") if isinstance(part, bytes) else part or ""
            for part in (exc.stdout, exc.stderr)
        )
        _keep_log(output, log)
        raise
    _keep_log(output, log)
    lines = [line for line in output.splitlines() if line.strip()]
    summary = lines[-1] if lines else "(no output)"
    phase.data.update(returncode=code, summary=summary, command=" ".join(command), log=str(log))
    what = "pytest -m cuda" + (" (collect only: no GPU)" if not target.cuda else "")
    phase.row(f"{what}, {len(files)} files", f"{summary} (exit {code})", ok=code == 0)


def _keep_log(output: str, log: Path | None) -> None:
    """The tail on stdout, the whole log in ``$OUT``."""
    tail = output.splitlines()[-25:]
    print("\n".join(tail), flush=True)
    if log is not None:
        log.write_text(output)


def benchmarks(phase: Phase) -> None:
    import bench_cpu_adam
    import bench_offload_step

    adam = bench_cpu_adam.main(["--quick"])
    step = bench_offload_step.main(["--quick"])
    phase.data.update(
        step_over_kernel=step["step_over_kernel"], device_cut=step["device_cut_vs_mixed"]
    )
    phase.row("CPU Adam benchmark", f"{len(adam)} result groups (tables above)")
    phase.row("step / bare kernel (20M)", f"{step['step_over_kernel']:.2f}")
    phase.row("device cut vs mixed (20M)", f"{step['device_cut_vs_mixed']:.1f}x")


# -- the plan ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Planned:
    """One phase of the run: its function, soft timeout and the least time it needs, or
    why it does not run here."""

    name: str
    fn: Callable[[Phase], None]
    timeout_s: float = 60.0
    needs_s: float = 0.0
    skip: str | None = None


def plan(args: argparse.Namespace, target: Target, out_dir: Path | None) -> list[Planned]:
    """Every phase after ``environment``, in order: numbers first, then the tests."""
    sizes = TINY_SIZES if not target.cuda else CUDA_SIZES
    context: dict[str, Any] = {}  # what later phases read from earlier ones
    nvme_root = Path(args.nvme_dir)
    no_cuda = "needs CUDA (--cpu-smoke runs on the host accelerator)"

    def spread(phase: Phase) -> None:
        context["spread"] = torch_spread(target, sizes)
        phase.data["spread"] = context["spread"]
        phase.row(
            f"torch AdamW for-loop vs fused, max |dw| after {sizes.parity_steps} steps",
            f"{context['spread']:.2e} (float rounding's own spread)",
        )

    phases = [
        Planned("import", import_package, 60),
        Planned("kernels", kernels, 180),
        Planned("parity-torch", spread, 60, 10),
        *(
            Planned(
                f"parity-{mode}", parity_phase(mode, target, sizes, context, nvme_root), 120, 10
            )
            for mode in MODES
        ),
        Planned("device-budget", lambda p: device_budget(p, target), 30),
        Planned("pinned", lambda p: pinned(p, target, sizes.pinned_bytes), 60, 10),
        Planned("bandwidth", lambda p: bandwidth(p, target, sizes.bandwidth_bytes), 30, 5),
        Planned("step-100m", lambda p: step_100m(p, target, sizes), 120, 30),
        Planned(
            "step-1b",
            lambda p: step_1b(p, target, tokens=args.gpt_1b_tokens, micro=args.gpt_1b_micro),
            300,
            150,
            skip=None
            if args.gpt_1b and target.cuda
            else (no_cuda if args.gpt_1b else "not asked for (--gpt-1b)"),
        ),
        Planned(
            "cuda-tests",
            lambda p: cuda_tests(p, target, sanitizer=False, out_dir=out_dir),
            180,
            30,
            skip="--skip-tests" if args.skip_tests else None,
        ),
        Planned(
            "cuda-tests-sanitizer",
            lambda p: cuda_tests(p, target, sanitizer=True, out_dir=out_dir),
            150,
            30,
            skip="--skip-tests" if args.skip_tests else (None if target.cuda else no_cuda),
        ),
        Planned(
            "benchmarks",
            benchmarks,
            150,
            60,
            skip="--skip-benchmarks"
            if args.skip_benchmarks
            else (None if target.cuda else "--cpu-smoke (they time this machine; run them alone)"),
        ),
    ]
    return phases


def _selected(name: str, only: list[str]) -> bool:
    return not only or any(name == o or name.startswith(o + "-") for o in only)


def _name_value(text: str) -> tuple[str, float]:
    name, sep, value = text.partition("=")
    try:
        return name, float(value) if sep else float("nan")
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected NAME=SECONDS, got {text!r}") from None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu-smoke", action="store_true", help="host accelerator, tiny sizes")
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument("--skip-benchmarks", action="store_true")
    parser.add_argument("--gpt-1b", action="store_true", help="issue 15's 1.15B GPT comparison")
    parser.add_argument("--gpt-1b-tokens", type=int, default=65536, help="tokens per step")
    parser.add_argument("--gpt-1b-micro", type=int, default=4, help="micro-batches per step")
    parser.add_argument(
        "--budget-s", type=float, default=320.0, help="seconds for every phase (default 320)"
    )
    parser.add_argument(
        "--hard-grace-s",
        type=float,
        default=15.0,
        help="after a phase's soft timeout, seconds until the process is ended (default 15)",
    )
    parser.add_argument(
        "--phase-timeout",
        type=_name_value,
        action="append",
        default=[],
        metavar="PHASE=SECONDS",
        help="override one phase's soft timeout",
    )
    parser.add_argument(
        "--only", action="append", default=[], metavar="PHASE", help="run these (and environment)"
    )
    parser.add_argument("--nvme-dir", default=tempfile.gettempdir(), help="for the nvme phase")
    for what, help_ in (
        ("failure", "raise at the start of PHASE"),
        ("hang", "sleep in PHASE past its soft timeout"),
        ("stuck", "sleep in PHASE with SIGALRM blocked: only the hard timeout ends it"),
    ):
        parser.add_argument(
            f"--inject-{what}",
            action="append",
            default=[],
            metavar="PHASE",
            help=f"check the guards: {help_}",
        )
    args = parser.parse_args(argv)
    for name, seconds in args.phase_timeout:
        if not seconds > 0:
            parser.error(f"--phase-timeout {name}= needs seconds > 0, got {seconds}")
    return args


def main(argv: list[str] | None = None) -> int:
    started = time.monotonic()
    args = parse_args(argv)
    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    cuda = torch.cuda.is_available() and not args.cpu_smoke
    target = Target("cuda" if cuda else "host")
    mode = "cuda" if cuda else ("cpu-smoke" if args.cpu_smoke else "no-gpu")
    report = Report(
        "gpu_check",
        out_dir=out_dir,
        meta={
            "argv": sys.argv if argv is None else argv,
            "mode": mode,
            "root": str(ROOT),
            "budget_s": args.budget_s,
            "started_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        },
    )
    runner = PhaseRunner(
        report,
        started=started,
        budget_s=args.budget_s,
        hard_grace_s=args.hard_grace_s,
        timeouts=dict(args.phase_timeout),
        faults=Faults(
            fail=frozenset(args.inject_failure),
            hang=frozenset(args.inject_hang),
            stuck=frozenset(args.inject_stuck),
        ),
    )
    print(f"gpu_check: {mode} run of {ROOT}, budget {args.budget_s:.0f} s", flush=True)
    runner.run("environment", environment, timeout_s=60)
    if mode == "no-gpu":
        print(
            "gpu_check: no CUDA GPU visible to torch; nothing to check here "
            "(--cpu-smoke runs every phase on the host accelerator at tiny sizes)"
        )
        report.exit_status = 0
        report.write()
        return 0
    for planned in plan(args, target, out_dir):
        if not _selected(planned.name, args.only):
            continue
        if planned.skip is not None:
            runner.skip(planned.name, planned.skip)
            continue
        runner.run(planned.name, planned.fn, timeout_s=planned.timeout_s, needs_s=planned.needs_s)
    # ERROR and TIMEOUT phases add a row of their status, FAILED ones have a FAILED row.
    status = int(
        any(row.status in (Status.FAILED, Status.ERROR, Status.TIMEOUT) for row in report.rows)
    )
    print(f"\n{report.table()}\n\ngpu_check: {time.monotonic() - started:.0f} s, exit {status}")
    report.exit_status = status
    report.write()
    return status


if __name__ == "__main__":
    sys.exit(main())
