"""The big-models issue's north star: the estimator finds a configuration for a Llama-3-8B
shape on one 24 GiB GPU with 128 GiB of host memory, and for a Llama-3-70B shape on one
24 GiB GPU with 256 GiB of host memory and 2 TB of NVMe; its bytes per tier are within the
limits."""

from __future__ import annotations

from pathlib import Path

import pytest

from zero_offload.cli import main
from zero_offload.config import parse_bytes
from zero_offload.estimate import KNOWN_MODELS, host_reserve
from zero_offload.estimate.north_star import NORTH_STARS, Answer, north_star

DOCS = Path(__file__).resolve().parent.parent / "docs" / "estimator.md"


@pytest.fixture(scope="module")
def answers() -> list[Answer]:
    return north_star()


def test_the_presets_are_the_published_shapes(answers: list[Answer]) -> None:
    eight, seventy = (a.estimate.shape for a in answers)
    assert eight is not None and seventy is not None
    assert (eight.layers, eight.hidden, eight.kv_heads, eight.ffn) == (32, 4096, 8, 14336)
    assert (seventy.layers, seventy.hidden, seventy.kv_heads, seventy.ffn) == (80, 8192, 8, 28672)
    assert eight.vocab == seventy.vocab == 128256
    assert eight.seq_len == seventy.seq_len == 4096
    assert {s.model for s in NORTH_STARS} <= set(KNOWN_MODELS)


@pytest.mark.parametrize("which", [0, 1])
def test_a_configuration_is_found_within_the_limits(answers: list[Answer], which: int) -> None:
    answer = answers[which]
    star, row = answer.star, answer.chosen
    assert row is not None, answer.estimate.table()
    assert row.fits and row.library in ("yes", "not yet")
    device, host = parse_bytes(star.device_memory), parse_bytes(star.host_memory)
    disk = parse_bytes(star.disk_memory) if star.disk_memory else 0
    assert row.device_total <= device
    assert row.host <= host - host_reserve(host)
    assert row.disk <= disk
    # A full fine-tune: every parameter's state is somewhere, 12 bytes each (fp32 master and
    # two moments) plus the 2-byte weights, between host and disk.
    assert row.host + row.disk >= 14 * answer.estimate.params
    if row.library != "yes":
        assert row.not_run  # says why the library does not run it yet


def test_the_answers(answers: list[Answer]) -> None:
    eight, seventy = answers
    # 8B: no NVMe, so nothing spills; the library's own rows miss by the gradient staging.
    assert eight.chosen is not None and eight.chosen.disk == 0
    assert eight.running is not None and not eight.running.fits
    # 70B: its 12 bytes per parameter of state (788 GiB) cannot be in 256 GiB of RAM.
    assert seventy.chosen is not None and seventy.chosen.disk > 500 * 2**30
    assert seventy.chosen.largest_fitting_params >= seventy.estimate.params  # type: ignore[operator]


def test_the_cli_and_the_docs_reproduce_both(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", "--north-star"]) == 0
    out = capsys.readouterr().out
    docs = DOCS.read_text()
    for star in NORTH_STARS:
        command = f"zero-offload estimate {star.command()}"
        assert command in out and command in docs
    assert "zero-offload estimate --north-star" in docs
    assert main(["estimate", *NORTH_STARS[1].command().split()]) == 0
    assert "params and state on NVMe" in capsys.readouterr().out
