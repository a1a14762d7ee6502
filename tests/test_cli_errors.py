"""Errors from the command: one line on stderr, non-zero exit, traceback only with --debug."""

from __future__ import annotations

from pathlib import Path

import pytest

from zero_offload import cli
from zero_offload.errors import DeviceBudgetExceeded

TINY = ["--steps", "1", "--layers", "1", "--hidden", "32", "--batch", "2", "--seq-len", "8"]


def _one_line_error(capsys: pytest.CaptureFixture[str], *needles: str) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "error:" in err and "Traceback" not in err
    for needle in needles:
        assert needle in err, err
    return err


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["demo", "--steps", "0"], "--steps"),
        (["demo", "--steps", "ten"], "not an integer"),
        (["demo", "--offload-fraction", "1.5"], "[0, 1]"),
        (["demo", "--device-budget", "lots"], "not a byte count"),
        (["demo", "--hidden", "30", "--heads", "4"], "multiple"),
        (["estimate", "--params", "many"], "parameter count"),
        (["estimate"], "nothing to estimate"),
        (["estimate", "--params", "7B", "--layers", "2"], "not both"),
        (["estimate", "--hf-config", "gpt2", "--vocab", "100"], "not both"),
        (["estimate", "--layers", "2", "--hidden", "64"], "--heads"),
        (["estimate", "--hf-config", "gpt-9"], "known model"),
        (
            ["estimate", "--params", "7B", "--device-memory", "24"],
            "--device-memory='24' has no unit",
        ),
        (["estimate", "--params", "7B", "--host-memory", "lots"], "not a byte count"),
        (["demo", "--device-budget", "8"], "'8GiB'"),
        (["bench", "everything"], "invalid choice"),
        (["frobnicate"], "invalid choice"),
    ],
)
def test_bad_values_exit_2_with_one_line(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(argv) == 2
    _one_line_error(capsys, needle)


def test_budget_too_small_is_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    argv = ["demo", *TINY, "--device-budget", "4KiB", "--out", str(tmp_path)]
    assert cli.main(argv) == 2
    _one_line_error(capsys, "zero-offload demo: error:", "device budget")


def test_debug_shows_the_exception(tmp_path: Path) -> None:
    argv = ["--debug", "demo", *TINY, "--device-budget", "4KiB", "--out", str(tmp_path)]
    with pytest.raises(DeviceBudgetExceeded):
        cli.main(argv)


def test_multi_rank_launch_without_torchrun_env_is_one_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    for name in ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    assert cli.main(["demo", *TINY, "--out", str(tmp_path)]) == 2
    _one_line_error(capsys, "WORLD_SIZE=2", "MASTER_ADDR", "torchrun")


def test_multi_rank_batch_must_split_evenly(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    env = {"WORLD_SIZE": "3", "RANK": "1", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1"}
    for name, value in {**env, "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(name, value)
    assert cli.main(["demo", *TINY, "--out", str(tmp_path)]) == 2  # --batch 2, 3 ranks
    _one_line_error(capsys, "rank 1", "--batch 2", "3 ranks")


def test_missing_benchmark_is_one_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(cli, "_BENCH_DIR", tmp_path)
    assert cli.main(["bench", "pools"]) == 2
    _one_line_error(capsys, "bench_pool.py", "not available")


def test_bench_all_lists_the_missing_ones(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    (tmp_path / "bench_pool.py").write_text(
        "def main(argv=None):\n    print('pool table', argv)\n    return {}\n"
    )
    monkeypatch.setattr(cli, "_BENCH_DIR", tmp_path)
    assert cli.main(["bench", "all"]) == 0
    out = capsys.readouterr().out
    assert "pool table ['--quick']" in out and "bench_offload_step.py" in out


def test_estimate_prints_a_table(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["estimate", "--layers", "24", "--hidden", "1024", "--heads", "16"]
    argv += ["--device-memory", "16GiB"]
    assert cli.main([*argv, "--host-memory", "64GiB"]) == 0
    out = capsys.readouterr().out
    assert "ZeRO-Offload + activation offload" in out and "16.00 GiB" in out


def test_help_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["demo", "--help"]) == 0
    assert "--activation-offload" in capsys.readouterr().out
