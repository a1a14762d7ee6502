"""benchmarks/gpu_check.py works before it meets a GPU: it runs from a bare copy of the
checkout with nothing installed, every phase has a CPU form (``--cpu-smoke``: the host
accelerator, tiny sizes), and its guards hold: a phase that raises or hangs becomes a row
and the phases after it still run, a phase stuck where Python cannot interrupt it ends the
process at the hard timeout with the report already in ``$OUT``.

The bare copy brings numba's cache from this checkout (``zero_offload/kernels/__pycache__``;
its entries are keyed by source content, not path), so the run loads the kernels instead of
compiling them; in a checkout that never ran them the first run compiles (a minute or two).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import _common  # noqa: E402
import gpu_check  # noqa: E402
from _phases import PhaseRunner, Report, Status  # noqa: E402
from _runs import MODES, Target, step_comparison  # noqa: E402

PARITY = [f"parity-{mode}" for mode in MODES]
#: Every phase of a --cpu-smoke run, in order.
PHASES = [
    "environment",
    "import",
    "kernels",
    "parity-torch",
    *PARITY,
    "device-budget",
    "pinned",
    "bandwidth",
    "step-100m",
    "step-1b",
    "cuda-tests",
    "cuda-tests-sanitizer",
    "benchmarks",
]


def _bare_checkout(tmp: Path) -> Path:
    """The package, the benchmarks, the tests and pyproject.toml; no install, no bytecode."""
    root = tmp / "checkout"
    skip = shutil.ignore_patterns("*.pyc", "results", ".pytest_cache")
    for name in ("zero_offload", "benchmarks", "tests"):
        shutil.copytree(ROOT / name, root / name, ignore=skip)
    shutil.copy2(ROOT / "pyproject.toml", root / "pyproject.toml")
    return root


def _run(script: Path, out: Path, *args: str, timeout: float) -> subprocess.CompletedProcess:
    """The script in a fresh interpreter with a clean environment: no PYTHONPATH, run from
    outside the checkout, so only the script's own path setup can find the package. One
    thread for torch and numba: tiny sizes gain nothing from more, and on a loaded machine
    every parallel region would wait for a descheduled thread."""
    env = {
        "PATH": os.environ["PATH"],
        "HOME": os.environ.get("HOME", "/"),
        "OUT": str(out),
        "OMP_NUM_THREADS": "1",
        "NUMBA_NUM_THREADS": "1",
    }
    return subprocess.run(
        [sys.executable, str(script), *args],
        cwd=out.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_cpu_smoke_run_from_a_bare_checkout_reports_every_phase(tmp_path: Path) -> None:
    root = _bare_checkout(tmp_path)
    out = tmp_path / "out"
    start = time.monotonic()
    proc = _run(
        root / "benchmarks" / "gpu_check.py",
        out,
        "--cpu-smoke",
        "--nvme-dir",
        str(tmp_path),
        "--inject-failure",
        "device-budget",  # raises: an ERROR row, and pinned still runs
        "--inject-hang",
        "pinned",  # sleeps: cut at its soft timeout, and bandwidth still runs
        "--phase-timeout",
        "pinned=2",
        timeout=600,
    )
    seconds = time.monotonic() - start
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["mode"] == "cpu-smoke" and report["exit_status"] == 1
    assert report["running"] is None
    phases = {phase["name"]: phase for phase in report["phases"]}
    assert [phase["name"] for phase in report["phases"]] == PHASES

    # The package came from the copy, not from the editable install of the main checkout.
    imported = Path(phases["import"]["data"]["file"])
    assert imported.is_relative_to(root), imported

    # The environment is printed first, before anything imports zero_offload.
    printed = [line for line in proc.stdout.splitlines() if line.startswith("gpu_check: ")]
    assert printed[1].startswith("gpu_check: python: ")
    names = [row["name"] for row in report["rows"]]
    for name in ("torch", "CUDA device", "numba", "CPU", "nproc (CPU affinity) / logical CPUs"):
        assert names.index(name) < names.index("zero_offload")
    assert phases["environment"]["data"]["nproc"] == len(os.sched_getaffinity(0))

    # The injected failures became rows; every other phase ran, the later ones included.
    failed = phases["device-budget"]
    assert failed["status"] == "ERROR" and "injected" in failed["error"]
    assert "RuntimeError" in failed["traceback"]
    hung = phases["pinned"]
    assert hung["status"] == "TIMEOUT" and 2 <= hung["seconds"] < 30
    traces = (out / "gpu_check_tracebacks.txt").read_text()
    assert "phase 'pinned': soft timeout" in traces and "_inject" in traces
    skipped = {"step-1b", "cuda-tests-sanitizer", "benchmarks"}  # CUDA, or asked for only
    for name in set(PHASES) - {"device-budget", "pinned"} - skipped:
        assert phases[name]["status"] == "ok", (name, phases[name])
    assert all(phases[name]["status"] == "skipped" for name in skipped)

    # The numbers: each mode trained to parity with torch AdamW, and was timed.
    for name in PARITY:
        data = phases[name]["data"]
        assert 0 <= data["max_abs_diff"] <= data["tolerance"] == 1e-5, (name, data)
        assert data["ours_step_s"] > 0 and data["torch_step_s"] > 0
        assert data["step_ratio"] == data["ours_step_s"] / data["torch_step_s"]
    assert phases["step-100m"]["data"]["offload_ratio"] > 0
    # Collection of the named CUDA test files works without a GPU (and without expecttest).
    assert "tests collected" in phases["cuda-tests"]["data"]["summary"]
    assert (out / "cuda-tests.log").is_file()
    table = (out / "gpu_check.md").read_text()  # one row per line, the cells' pipes escaped
    assert "| parity-nvme | nvme: max \\|w - w_torch\\| after 4 steps | " in table
    assert len(table.splitlines()) == 2 + len(report["rows"])
    assert seconds < 300  # the budget is 320 s; tiny sizes take well under one


def test_a_phase_stuck_in_c_code_is_ended_by_the_hard_timeout(tmp_path: Path) -> None:
    out = tmp_path / "out"
    start = time.monotonic()
    proc = _run(
        BENCHMARKS / "gpu_check.py",
        out,
        "--cpu-smoke",
        "--only",
        "environment",
        "--inject-stuck",
        "environment",  # SIGALRM ignored: the soft timeout cannot act
        "--phase-timeout",
        "environment=1",
        "--hard-grace-s",
        "1",
        timeout=120,
    )
    assert time.monotonic() - start < 60
    assert proc.returncode != 0
    report = json.loads((out / "gpu_check.json").read_text())
    # The report on disk names the phase that was running when the process was ended.
    assert report["running"]["name"] == "environment" and report["exit_status"] is None
    assert report["running"]["hard_timeout_s"] == 2
    assert "Timeout (0:00:02)!" in proc.stderr and "_inject" in proc.stderr  # the stacks


def test_a_phase_that_does_not_fit_the_budget_is_skipped_with_the_reason(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    report = Report("check", out_dir=tmp_path, meta={})
    runner = PhaseRunner(report, started=time.monotonic(), budget_s=30, hard_grace_s=5)
    ran: list[str] = []
    assert runner.run("fits", lambda phase: ran.append(phase.name), timeout_s=5) is Status.OK
    status = runner.run("large", lambda phase: ran.append(phase.name), timeout_s=60, needs_s=45)
    assert status is Status.SKIPPED and ran == ["fits"]
    assert (
        "needs about 45 s" in report.rows[-1].value
        and "of the 30 s budget" in report.rows[-1].value
    )

    def check(phase):  # a check that does not hold: the phase runs on, and is FAILED
        phase.row("a number", "too large", ok=False)
        phase.row("another", "fine")

    assert runner.run("checked", check, timeout_s=5) is Status.FAILED
    assert [row.status for row in report.rows[-2:]] == [Status.FAILED, Status.OK]
    saved = json.loads((tmp_path / "check.json").read_text())
    assert [phase["status"] for phase in saved["phases"]] == ["ok", "skipped", "FAILED"]
    assert "check: a number: too large  [FAILED]" in capsys.readouterr().out


def test_a_soft_timeout_without_out_dumps_the_stacks_to_stderr(
    capfd: pytest.CaptureFixture[str],
) -> None:
    report = Report("check", out_dir=None, meta={})
    runner = PhaseRunner(report, started=time.monotonic(), budget_s=30, hard_grace_s=30)

    def waits_forever(phase):
        while True:
            time.sleep(0.01)

    assert runner.run("waits", waits_forever, timeout_s=0.3) is Status.TIMEOUT
    assert runner.run("after", lambda phase: phase.row("next", "ran"), timeout_s=5) is Status.OK
    err = capfd.readouterr().err
    assert "phase 'waits': soft timeout" in err and "waits_forever" in err
    assert report.rows[0].value.startswith("TIMEOUT after 0.3 s: no result within 0.3 s")


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU, main() runs the whole check")
def test_without_a_gpu_it_reports_the_environment_and_exits_0(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OUT", str(tmp_path))
    assert gpu_check.main([]) == 0
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["mode"] == "no-gpu" and report["exit_status"] == 0
    assert [phase["name"] for phase in report["phases"]] == ["environment"]
    assert report["phases"][0]["status"] == "ok"


def test_the_named_test_files_are_every_file_with_cuda_cases() -> None:
    """A new file with CUDA cases (the ``accel_kind`` fixture, the ``cuda`` mark or a
    declared ``cuda_form``, which the last pattern also finds) must be named in
    gpu_check.TEST_FILES, or the GPU run would never run it."""
    marks = ("accel_kind", "ACCELERATOR_KINDS", "pytest.mark.cuda")
    with_cuda = {
        f"tests/{path.name}"
        for path in (ROOT / "tests").glob("test_*.py")
        if path.name != Path(__file__).name and any(mark in path.read_text() for mark in marks)
    }
    assert with_cuda == set(gpu_check.TEST_FILES)


def test_time_rounds_syncs_the_device_around_every_timed_call() -> None:
    events: list[str] = []
    fns = {"a": lambda: events.append("a"), "b": lambda: events.append("b")}
    seconds = _common.time_rounds(fns, rounds=2, warmup=1, sync=lambda: events.append("sync"))
    assert set(seconds) == {"a", "b"} and all(s >= 0 for s in seconds.values())
    # Warm-up calls untimed, then each timed call between two syncs.
    assert events == ["a", "b"] + ["sync", "a", "sync", "sync", "b", "sync"] * 2
    with pytest.raises(ValueError, match="rounds >= 1"):
        _common.time_rounds(fns, rounds=0)


def test_step_comparison_runs_on_a_tiny_gpt() -> None:
    from zero_offload.demo.model import GPTConfig, TinyGPT

    config = GPTConfig(vocab_size=256, seq_len=16, layers=2, hidden=64, heads=4)
    out = step_comparison(config, micro=2, batch=2, rounds=1, target=Target("host"))
    for name in ("offload", "offload_announced", "offload_overlap_step"):
        assert out[f"{name}_step_s"] > 0
        assert out[f"{name}_ratio"] == out[f"{name}_step_s"] / out["resident_step_s"]
    assert "resident_peak_bytes" not in out  # torch counts no device bytes off CUDA
    # The 1B shape is what it says.
    with torch.device("meta"):
        big = TinyGPT(GPTConfig(**gpu_check.GPT_1B))
    assert 1.0e9 < sum(p.numel() for p in big.parameters()) < 1.2e9
