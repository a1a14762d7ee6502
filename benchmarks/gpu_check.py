"""The CUDA check: one script, under six minutes on one GPU, a row per result.

    python benchmarks/gpu_check.py [--gpt-1b] [--skip-tests] [--skip-benchmarks] [--budget-s S]
    python benchmarks/gpu_check.py --only parity --phase-timeout parity-nvme=200  # a part
    python benchmarks/gpu_check.py --cpu-smoke   # every phase on the host accelerator, tiny
    python benchmarks/gpu_check.py --north-star --skip-tests --skip-benchmarks --budget-s 480
    python benchmarks/gpu_check.py --cpu-smoke --inject-failure pinned  # the guards themselves

It runs from a checkout with nothing installed: the checkout and ``benchmarks/`` go first on
``sys.path``, ahead of any installed copy. Phases, numbers first; each row is printed as
soon as it is measured (the runs themselves are in ``_runs.py``):

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
- ``north-star`` (``--north-star``; about 6 minutes): ``north_star.py``, issue 39's table:
  no offload, OffloadAdamW plain, announced and ``overlap_step`` under a 24 GiB cap, and
  DeepSpeed ZeRO-2 with CPU offload, at 1.15B and 2.69B, 4 micro-batches and 1.
- ``cuda-tests``, ``cuda-tests-sanitizer``: ``cuda_suite.py``'s selection, the CUDA forms
  of ``TEST_FILES`` (named, so a file that cannot be collected shows), then again under
  ``TORCH_CUDA_SANITIZER=1``, each inside its own budget (docs/gpu.md: the estimate).
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
import datetime
import importlib.util
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
# This checkout's package, not an installed one; then the benchmark helpers.
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

import cuda_suite  # noqa: E402
from _common import time_rounds  # noqa: E402
from _environment import environment  # noqa: E402
from _phases import Faults, Phase, PhaseRunner, Report, Status  # noqa: E402
from _runs import (  # noqa: E402
    BETAS,
    CUDA_SIZES,
    FP32_ATOL,
    LR,
    MODES,
    STEP_VARIANTS,
    TINY_SIZES,
    WEIGHT_DECAY,
    Sizes,
    Target,
    parity_run,
    step_comparison,
    torch_spread,
)

#: The test files with CUDA forms (``accel_kind``, the ``cuda`` mark, or a declared
#: ``cuda_form``: tests/conftest.py), run by name under ``--accelerator=cuda -m cuda_form``;
#: tests/test_gpu_check.py keeps the list complete. docs/gpu.md: the forms by file, the
#: estimated GPU minutes, how the selection was cut.
TEST_FILES = (
    "tests/test_cuda_parity.py",
    "tests/test_cuda_path.py",
    "tests/test_accelerator.py",
    "tests/test_pool.py",
    "tests/test_activations.py",
    "tests/test_offload_adamw_parity.py",
    "tests/test_offload_adamw_features.py",
    "tests/test_grad_lifecycle.py",
    "tests/test_step_during_backward.py",
    "tests/test_interrupts_step.py",
    "tests/test_optim_conventions.py",
    "tests/test_rule_seam.py",
    "tests/test_atomic_saves.py",
    "tests/test_optim_db.py",
    "tests/test_offload_adamw_errors.py",
    "tests/test_nvme.py",
    "tests/test_resume_keeps_writes.py",
    "tests/test_write_check_in_update.py",
    "tests/test_errors_clear.py",
    "tests/test_properties.py",
    "tests/test_lion_adagrad.py",
    "tests/test_param_offload.py",
    "tests/test_param_offload_device.py",
    "tests/test_param_offload_user_code.py",
    "tests/test_param_offload_nvme.py",
    "tests/test_param_offload_reads.py",
    "tests/test_param_nvme_weights.py",
    "tests/test_build_anywhere.py",
    "tests/test_construct_host_peak.py",
    "tests/test_staging_in_flight.py",
    "tests/test_staging_in_flight_loops.py",
    "tests/test_step_bytes.py",
    "tests/test_mixed_dtypes.py",
    "tests/test_state_dict_save.py",
    "tests/test_hf_export.py",
    "tests/test_adafactor.py",
    "tests/test_muon.py",
    "tests/test_whole_rules_nvme.py",
    "tests/test_device_accumulation.py",
    "tests/test_host_syncs.py",
    "tests/test_rules_param_offload.py",
    "tests/test_whole_rules_streaming.py",
    "tests/test_whole_rules_resident.py",
    "tests/test_overlap_queue.py",
    "tests/test_overlap_shadow.py",
    "tests/test_overlap_landing.py",
    "tests/test_step_costs.py",
    # the integrations: Trainer, accelerate, PEFT, TRL and Lightning on cuda:0 (issue 36)
    "tests/test_integration_transformers.py",
    "tests/test_integration_accelerate.py",
    "tests/test_integration_peft.py",
    "tests/test_integration_trl.py",
    "tests/test_integration_lightning.py",
    # every rule through them: Trainer by optim name, accelerate and Lightning given one
    "tests/test_integration_rules.py",
    # fp16 backwards that carry the loss scale, and a clip in the middle of a window
    "tests/test_scaled_backward.py",
    "tests/test_window_clip.py",
)
#: The part of ``TEST_FILES`` that also runs under ``TORCH_CUDA_SANITIZER=1`` (about 6x
#: slower: 19 tests took 11 s plain and 64 s under it on the H200, shared/gpu-runs/): the
#: files with their own streams and events (the accelerator, the pool, activations, the CUDA
#: path) and the modes that order copies across streams (parity in every mode, announced and
#: speculative steps, overlap_step, parameter offload on resume). docs/gpu.md: the cut.
SANITIZER_FILES = (
    "tests/test_cuda_parity.py",
    "tests/test_cuda_path.py",
    "tests/test_accelerator.py",
    "tests/test_pool.py",
    "tests/test_activations.py",
    "tests/test_offload_adamw_parity.py",
    "tests/test_step_during_backward.py",
    "tests/test_resume_keeps_writes.py",
    "tests/test_overlap_landing.py",  # compute waits per bucket, in the forward
)
#: 1.15B parameters: 20 blocks of 12 * 2048^2 (50.3M each), a 32768 x 2048 embedding and
#: head, 2048 positions.
GPT_1B = {"vocab_size": 32768, "seq_len": 2048, "layers": 20, "hidden": 2048, "heads": 16}


def _fmt_bytes(nbytes: float | None) -> str:
    if nbytes is None:
        return "n/a"
    from zero_offload.config import format_bytes

    return format_bytes(nbytes)


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
            f"{phase.data[f'{name}_gb_s']:.3g}",
        )


# -- a training step: offloaded against resident ----------------------------------------------


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


def north_star_phase(phase: Phase, target: Target) -> None:
    import north_star

    result = north_star.run_for(target, budget_s=330.0, emit=print)
    phase.data["north_star"] = result
    for name, value in north_star.report_rows(result["rows"], smoke=not target.cuda):
        phase.row(name, value)


# -- the test suite's CUDA cases, and the benchmarks ---------------------------------------------


def cuda_tests(phase: Phase, target: Target, *, sanitizer: bool, out_dir: Path | None) -> None:
    """``cuda_suite.py``'s selection (``pytest --accelerator=cuda -m cuda_form``) on
    ``TEST_FILES`` (``SANITIZER_FILES`` under the sanitizer), inside the phase's budget; on
    the host accelerator, collection only (the forms skip without a GPU, but a file that
    fails to import still shows)."""
    names = SANITIZER_FILES if sanitizer else TEST_FILES
    missing = [name for name in names if not (ROOT / name).is_file()]
    if missing:
        phase.row("test files", f"missing from this checkout: {', '.join(missing)}", ok=False)
    files = [name for name in names if name not in missing]
    if importlib.util.find_spec("pytest") is None or not files:
        phase.row("pytest", "not installed (pip install pytest)" if files else "no files", ok=False)
        return
    log = None if out_dir is None else out_dir / f"{phase.name}.log"
    code = cuda_suite.run(phase, sanitizer=sanitizer, cuda=target.cuda, files=files, log=log)
    if code == 124:
        raise TimeoutError(f"{phase.name}: the selection ran past its budget (log: {log})")


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
        *(  # issue 39's workload (north_star.py); only when asked: about 6 GPU minutes
            [Planned("north-star", lambda p: north_star_phase(p, target), 420, 120)]
            if args.north_star
            else []
        ),
        Planned(
            "cuda-tests",
            lambda p: cuda_tests(p, target, sanitizer=False, out_dir=out_dir),
            420,  # estimated 3-6 GPU minutes (docs/gpu.md)
            60,
            skip="--skip-tests" if args.skip_tests else None,
        ),
        Planned(
            "cuda-tests-sanitizer",
            lambda p: cuda_tests(p, target, sanitizer=True, out_dir=out_dir),
            300,  # estimated 3-5 GPU minutes (docs/gpu.md)
            60,
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
    parser.add_argument("--north-star", action="store_true", help="issue 39's north_star.py")
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
        ("stuck", "sleep in PHASE with SIGALRM ignored: only the hard timeout ends it"),
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
    runner.run("environment", lambda p: environment(p, Path(args.nvme_dir)), timeout_s=60)
    if mode == "no-gpu":
        print(
            "gpu_check: no CUDA GPU visible to torch; nothing more to check here "
            "(--cpu-smoke runs every phase on the host accelerator at tiny sizes)"
        )
    for planned in plan(args, target, out_dir) if mode != "no-gpu" else []:
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
