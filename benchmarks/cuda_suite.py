"""The CUDA selection of the test suite, as a phase of a GPU check (issue 36).

``pytest --accelerator=cuda -m cuda_form`` runs every test with a CUDA form on ``cuda:0``
(tests/conftest.py says which tests have one); with ``sanitizer=True`` it runs under
``TORCH_CUDA_SANITIZER=1``. Without a GPU the phase collects only, so a test that cannot be
collected on CUDA still shows. ``run`` takes a ``_phases.Phase`` (rows, ``remaining()``,
``data``), for ``gpu_check.py`` to call as two phases with budgets of their own, on the files
it names (``gpu_check.TEST_FILES``: named, so a file missing from the checkout shows); run
alone, on every file::

    python benchmarks/cuda_suite.py [--sanitizer] [--budget-s 300]

docs/gpu.md has the estimated GPU minutes of the selection and how it was cut.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

__all__ = ["command", "run"]


def command(*, cuda: bool, files: Sequence[str] = ()) -> list[str]:
    """The pytest command line of the selection (collection only without a GPU), on
    ``files`` (every test file when empty)."""
    base = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    base += ["--accelerator=cuda", "-m", "cuda_form"]
    base += ["-rfEs", "--durations=15"] if cuda else ["--collect-only"]
    return [*base, *files]


def run(
    phase: Any,
    *,
    sanitizer: bool,
    cuda: bool,
    files: Sequence[str] = (),
    log: Path | None = None,
) -> int:
    """Run the selection inside ``phase``'s remaining time; a row with pytest's last line,
    the whole output in ``log`` and its tail on stdout.

    Returns pytest's exit status (124 when it ran out of time, as ``timeout`` says).
    """
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    if sanitizer:
        env["TORCH_CUDA_SANITIZER"] = "1"
    argv = command(cuda=cuda, files=files)
    try:
        proc = subprocess.run(
            argv,
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
        code = 124
    print("\n".join(output.splitlines()[-25:]), flush=True)
    if log is not None:
        log.write_text(output)
    lines = [line for line in output.splitlines() if line.strip()]
    summary = lines[-1] if lines else "(no output)"
    phase.data.update(returncode=code, summary=summary, command=" ".join(argv), log=str(log))
    what = "pytest --accelerator=cuda -m cuda_form"
    what += f", {len(files)} files" if files else ""
    what += " (TORCH_CUDA_SANITIZER=1)" if sanitizer else ""
    what += "" if cuda else " (collect only: no GPU)"
    status = "out of time" if code == 124 else f"exit {code}"
    phase.row(what, f"{summary} ({status})", ok=code == 0)
    return code


class _Alone:
    """The least of a ``_phases.Phase`` that ``run`` uses, for a run of this script alone."""

    def __init__(self, budget_s: float) -> None:
        self._end = time.monotonic() + budget_s
        self.data: dict[str, Any] = {}

    def remaining(self) -> float:
        return self._end - time.monotonic()

    def row(self, what: str, value: str, *, ok: bool = True) -> None:
        print(f"{'ok ' if ok else 'FAIL'} | {what} | {value}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sanitizer", action="store_true", help="TORCH_CUDA_SANITIZER=1")
    parser.add_argument("--budget-s", type=float, default=300.0, help="seconds (default 300)")
    args = parser.parse_args(argv)
    if args.budget_s <= 5:
        parser.error(f"--budget-s must be more than 5 seconds, got {args.budget_s}")
    import torch

    return run(_Alone(args.budget_s), sanitizer=args.sanitizer, cuda=torch.cuda.is_available())


if __name__ == "__main__":
    sys.exit(main())
