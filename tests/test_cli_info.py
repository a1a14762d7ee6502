"""`zero-offload info` and `--json` run and print the fields."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from zero_offload.cli import main

FIELDS = (
    "torch_version",
    "torch_build",
    "accelerator",
    "accelerator_reason",
    "gpu_name",
    "cpu_model",
    "simd_flags",
    "physical_cores",
    "logical_cores",
    "host_ram_total",
    "host_ram_available",
    "container_ram_limit",
    "numba_version",
    "numba_threading_layer",
    "pinned_memory_available",
    "device_budget",
)


def test_info_prints_every_field(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    for field in FIELDS:
        assert field in out


def test_info_json_is_valid_and_complete(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ZERO_OFFLOAD_DEVICE_BUDGET", "3GiB")
    from zero_offload.accelerator import set_accelerator

    set_accelerator(None)
    try:
        assert main(["info", "--json"]) == 0
    finally:
        set_accelerator(None)
    info = json.loads(capsys.readouterr().out)
    assert set(FIELDS) <= set(info)
    assert info["host_ram_total"] > 0 and info["logical_cores"] >= 1
    if info["accelerator"] == "host":
        assert info["device_budget"] == 3 * 2**30


def test_console_entry_point_runs_as_a_module() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "zero_offload", "info", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "torch_version" in json.loads(result.stdout)


def test_bad_environment_is_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from zero_offload.accelerator import set_accelerator

    monkeypatch.setenv("ZERO_OFFLOAD_ACCELERATOR", "tpu")
    set_accelerator(None)
    try:
        assert main(["info"]) == 2
    finally:
        set_accelerator(None)
    err = capsys.readouterr().err.strip()
    assert err.startswith("zero-offload info: error:") and "'tpu'" in err
    assert "Traceback" not in err
