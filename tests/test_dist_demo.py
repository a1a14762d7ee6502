"""``torchrun --nproc_per_node=2 -m zero_offload demo`` on the host accelerator (gloo)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from .helpers.dist import free_port


def test_torchrun_demo_trains_on_two_ranks_and_prints_once(tmp_path: Path) -> None:
    argv = [
        *(sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2"),
        f"--master_port={free_port()}",
        *("-m", "zero_offload", "demo", "--steps", "6", "--layers", "1", "--hidden", "32"),
        *("--heads", "2", "--batch", "4", "--seq-len", "16", "--lr", "1e-2"),
        *("--out", str(tmp_path / "out")),
    ]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert sum(line.startswith("step ") for line in lines) == 6  # rank 0 alone prints
    assert "2 ranks (2 sequences each)" in done.stdout
    assert "reduce-scatter" in done.stdout and "all-gather" in done.stdout
    assert (tmp_path / "out" / "profile.json").exists()
