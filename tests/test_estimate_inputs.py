"""The estimator's inputs: sizes need a unit (CLI and API alike), the shape flags, and bad
values refused naming the argument, the value and an example."""

from __future__ import annotations

import json

import pytest

from zero_offload import cli, estimate
from zero_offload.estimate import ModelShape, parse_size

GiB = 2**30


@pytest.mark.parametrize(
    ("text", "nbytes"),
    [
        ("24GiB", 24 * GiB),
        ("24GB", 24 * 10**9),
        ("512MiB", 512 * 2**20),
        ("1e9B", 10**9),
        (" 1.5 TiB ", int(1.5 * 2**40)),
        (2 * GiB, 2 * GiB),
    ],
)
def test_sizes_with_units(text: str | int, nbytes: int) -> None:
    assert parse_size(text, name="device_memory") == nbytes
    assert estimate(10**6, device_memory=text, host_memory="64GiB").device_memory == nbytes


@pytest.mark.parametrize(
    ("kwargs", "error", "needles"),
    [
        ({"device_memory": "24"}, ValueError, ["device_memory='24'", "no unit", "'24GiB'"]),
        ({"device_memory": 24}, ValueError, ["device_memory=24", "'24GiB'"]),
        ({"host_memory": "lots"}, ValueError, ["host_memory='lots'", "'8GiB'"]),
        ({"host_memory": True}, TypeError, ["host_memory"]),
        ({"bucket_bytes": "512"}, ValueError, ["bucket_bytes='512'", "no unit"]),
        ({"bucket_bytes": "16B"}, ValueError, ["bucket_bytes='16B'", "less than 1024"]),
        ({"seq_len": 0}, ValueError, ["seq_len"]),
        ({"dtype": "int8"}, ValueError, ["dtype", "'int8'"]),
    ],
)
def test_bad_sizes_are_refused_by_name(
    kwargs: dict[str, object], error: type[Exception], needles: list[str]
) -> None:
    with pytest.raises(error) as info:
        estimate(10**6, **{"device_memory": "8GiB", "host_memory": "8GiB", **kwargs})  # type: ignore[arg-type]
    for needle in needles:
        assert needle in str(info.value)


def test_estimate_returns_the_estimate_and_prints_nothing(
    capsys: pytest.CaptureFixture[str],
) -> None:
    result = estimate("gpt2", device_memory="24GiB", host_memory="64GiB")
    assert capsys.readouterr().out == ""
    assert result.params == 124_439_808 and "ZeRO-Offload" in result.table()


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    assert cli.main(["estimate", *argv]) == 0, capsys.readouterr().err
    return capsys.readouterr().out


def test_cli_config_and_flags_agree(capsys: pytest.CaptureFixture[str]) -> None:
    memory = ["--device-memory", "80GiB", "--host-memory", "512GiB", "--json"]
    by_name = json.loads(_run(capsys, "--hf-config", "llama-3-8b", *memory))
    flags = ["--arch", "llama", "--layers", "32", "--hidden", "4096", "--heads", "32"]
    flags += ["--kv-heads", "8", "--ffn", "14336", "--vocab", "128256"]
    by_flags = json.loads(_run(capsys, *flags, *memory))
    assert by_name["params"] == by_flags["params"] == 8_030_261_248
    assert by_name["rows"] == by_flags["rows"]
    assert by_name["shape"]["kv_heads"] == 8 and by_name["host_reserve"] == int(51.2 * GiB)


def test_cli_shape_flags_change_the_count(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["--layers", "2", "--hidden", "64", "--heads", "4", "--vocab", "100"]
    memory = ["--device-memory", "1GiB", "--host-memory", "4GiB", "--json"]

    def params(*extra: str) -> int:
        return json.loads(_run(capsys, *base, *extra, *memory))["params"]

    assert params() == ModelShape(layers=2, hidden=64, heads=4, vocab=100, seq_len=1024).params
    assert params() - params("--tied") == 100 * 64  # the head is the embedding
    # Two of four K/V heads: K and V (weights and biases) each lose half their width.
    assert params() - params("--kv-heads", "2") == 2 * 2 * (32 * 64 + 32)
    # A 96-wide MLP instead of 256: two matrices and one bias shrink per layer.
    assert params() - params("--ffn", "96") == 2 * (2 * 160 * 64 + 160)


def test_cli_table_states_the_reserve_and_the_family(capsys: pytest.CaptureFixture[str]) -> None:
    out = _run(capsys, "--hf-config", "gpt2", "--device-memory", "24GiB", "--host-memory", "64GiB")
    assert "124.44 M parameters" in out and "6.40 GiB kept free" in out
    assert "more or fewer layers" in out and "(" in out.splitlines()[6]
