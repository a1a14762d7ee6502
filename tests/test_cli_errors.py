"""Errors from the command: one line on stderr, non-zero exit, traceback only with --debug."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from zero_offload import cli
from zero_offload.cli import command
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


@pytest.mark.parametrize(
    ("argv", "needles", "absent"),
    [
        # A flag's value is a string: no int is offered, and a large number is offered as
        # the bytes it likely means, spelled with a unit.
        (
            ["--params", "7B", "--host-memory", "abc"],
            ["--host-memory='abc' is not a byte count", "'8GiB'"],
            ["integer"],
        ),
        (
            ["--params", "7B", "--host-memory", "25769803776"],
            ["--host-memory='25769803776' has no unit", "'24GiB'", "'25769803776B'"],
            ["25769803776GiB"],
        ),
        # The shape's rules name the flags, not ModelShape's fields.
        (
            ["--layers", "2", "--hidden", "64", "--heads", "5"],
            ["--heads 5", "--hidden 64", "e.g. 4"],
            ["ModelShape", "head_dim"],
        ),
        (
            ["--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "3"],
            ["--kv-heads 3", "--heads 4"],
            ["ModelShape"],
        ),
        # Nodes are whole: ranks per node at most the world size, and dividing it.
        (
            ["--params", "7B", "--world-size", "2", "--ranks-per-node", "8"],
            ["--ranks-per-node 8", "--world-size 2"],
            ["ranks_per_node", "world_size"],
        ),
        (
            ["--params", "7B", "--ranks-per-node", "2"],
            ["--ranks-per-node 2", "--world-size 1 (the default)"],
            ["ranks_per_node"],
        ),
        (
            ["--params", "7B", "--world-size", "3", "--ranks-per-node", "2"],
            ["--world-size 3 is not a multiple of --ranks-per-node 2", "--world-size 4"],
            ["world_size"],
        ),
        # The fixed questions refuse the flags they would ignore, by name.
        (["--north-star", "--params", "7B"], ["--north-star", "ignore --params"], []),
        (
            ["--north-star", "--json", "--seq-len", "1024", "--tied"],
            ["ignore --tied, --seq-len"],
            ["--json"],
        ),
        (["--zero-table", "--world-size", "4"], ["--zero-table", "ignore --world-size"], []),
        (["--zero-table", "--json"], ["ignore --json"], []),
        (["--north-star", "--zero-table"], ["one of --north-star and --zero-table"], []),
    ],
)
def test_estimate_errors_name_the_flags(
    argv: list[str], needles: list[str], absent: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["estimate", *argv]) == 2
    err = _one_line_error(capsys, *needles)
    for word in absent:
        assert word not in err, err


def test_estimate_refuses_partial_nodes_from_python_too() -> None:
    """The host and disk are per node of ranks_per_node ranks: a partial node is not
    modelled, so estimate() refuses it as the command does."""
    from zero_offload.estimate import estimate

    with pytest.raises(ValueError, match="world_size=3 is not a multiple of ranks_per_node=2"):
        estimate(10**9, world_size=3, ranks_per_node=2, device_memory="8GiB", host_memory="8GiB")
    assert estimate(10**9, world_size=4, ranks_per_node=2, host_memory="8GiB").ranks_per_node == 2


def test_demo_refuses_an_unwritable_out_before_training(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """--out is checked before the first step, not after the last, and named."""
    (tmp_path / "a-file").write_text("")
    out = tmp_path / "a-file" / "demo"  # a folder under a file cannot be created
    assert cli.main(["demo", *TINY, "--out", str(out)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""  # nothing trained, nothing printed
    err = captured.err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert f"--out {str(out)!r}" in err and "Not a directory" in err, err


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
    monkeypatch.setattr(command, "_BENCH_DIR", tmp_path)
    assert cli.main(["bench", "pools"]) == 2
    _one_line_error(capsys, "bench_pool.py", "not available")


def test_bench_all_lists_the_missing_ones(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    (tmp_path / "bench_pool.py").write_text(
        "def main(argv=None):\n    print('pool table', argv)\n    return {}\n"
    )
    monkeypatch.setattr(command, "_BENCH_DIR", tmp_path)
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


@pytest.mark.parametrize("words", [["info"], ["estimate", "--north-star"]])
def test_a_reader_that_went_away_ends_the_command_quietly(words: list[str]) -> None:
    """``zero-offload ... | head`` (Note [a reader that went away]): the reader's end is
    closed before the command starts, so its first print meets a broken pipe. It used to
    print "error: [Errno 32] Broken pipe" and exit 2; now it says nothing and exits 141."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader went away before anything was printed
    try:
        done = subprocess.run(
            [sys.executable, "-m", "zero_offload", *words],
            stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=300, check=False,
        )  # fmt: skip
    finally:
        os.close(write_end)
    assert done.stderr == ""
    assert done.returncode == 141


def test_the_cli_package_runs_as_a_module() -> None:
    """``python -m zero_offload.cli`` worked while the CLI was one module; the package keeps it."""
    done = subprocess.run(
        [sys.executable, "-m", "zero_offload.cli", "--help"],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "estimate" in done.stdout
