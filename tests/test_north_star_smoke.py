"""benchmarks/north_star.py (issue 39's workload) runs in CI: ``--cpu-smoke`` takes the same
code path as the GPU run, at tiny sizes on the host accelerator, in a subprocess; and its
figures never pass for a GPU's. ``gpu_check.py --north-star`` runs the same as a phase."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import north_star  # noqa: E402

OFFLOADED = ("offload", "offload_announced", "offload_overlap_step", "offload_overlap_first_use")


def _run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, OUT=str(tmp_path), OMP_WAIT_POLICY="PASSIVE")
    return subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_cpu_smoke_runs_every_variant_and_says_it_is_no_gpu_figure(tmp_path: Path) -> None:
    done = _run(tmp_path, "benchmarks/north_star.py", "--cpu-smoke", "--sizes", "tiny-a")
    assert done.returncode == 0, done.stderr[-3000:]
    assert north_star.SMOKE_BANNER in done.stdout  # above and below the table
    result = json.loads((tmp_path / "north_star.json").read_text())
    assert result["gpu_figures"] is False and result["accelerator"] == "host"
    assert result["note"] == north_star.SMOKE_BANNER
    rows = {(r["variant"], r["micro"]): r for r in result["rows"]}
    assert set(rows) == {(v, m) for v in north_star.VARIANTS for m in north_star.MICRO}
    for micro in north_star.MICRO:
        assert rows[("no_offload", micro)]["vs_no_offload"] == 1.0
        for variant in OFFLOADED:
            row = rows[(variant, micro)]
            assert row["step_s"] > 0 and row["tflops"] > 0, row
            assert row["tokens"] == micro * 2 * north_star.SMOKE_SIZES["tiny-a"]["seq_len"]
            assert row["vs_no_offload"] > 0 and row["vs_deepspeed"] is None
            # Where the budget left room (the optimizer's step notes): the micro-batches of
            # the first (4 micro-batch) steps summed on the device; overlap_step's shadows.
            assert "sums on device 1/1" in row["placement"], row
            assert ("shadows 1/1" in row["placement"]) == (variant == "offload_overlap_step")
        assert "needs CUDA" in rows[("deepspeed", micro)]["skipped"]


def test_a_variant_over_the_budget_is_a_row() -> None:
    from _runs import Target

    lines: list[str] = []
    result = north_star.north_star(
        target=Target("host"),
        sizes={"tiny-a": north_star.SMOKE_SIZES["tiny-a"]},
        batch=1,
        rounds=1,
        budget_s=-1.0,  # spent before the first variant
        cap=None,
        emit=lines.append,
    )
    assert all("skipped" in row for row in result["rows"])
    assert any("budget" in row["skipped"] for row in result["rows"])
    assert lines and north_star.SMOKE_BANNER in lines[0]
    names = [name for name, _ in north_star.report_rows(result["rows"], smoke=True)]
    assert all("NOT a GPU figure" in name for name in names)
