"""The big-models issue's north star: a Llama-3-8B shape on one 24 GiB GPU with 128 GiB of
host memory, and a Llama-3-70B shape on one 24 GiB GPU with 256 GiB of host memory and 2 TB
of NVMe. Both are found among rows the library runs with gradient staging for the buckets
in flight, which holds only where every step runs during backward (no clipping): the answer
says so, and names what runs with clipping (for 8B: nothing without a little NVMe, which the
answer sizes; for 70B: the weights and the state on NVMe, which the library runs)."""

from __future__ import annotations

from pathlib import Path

import pytest

from zero_offload.cli import main
from zero_offload.config import parse_bytes
from zero_offload.estimate import KNOWN_MODELS, estimate, host_reserve
from zero_offload.estimate.north_star import (
    NORTH_STARS,
    Answer,
    exceeded,
    north_star,
    north_star_text,
)

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


def test_the_70b_configuration_is_within_the_limits(answers: list[Answer]) -> None:
    answer = answers[1]
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
    p8, p70 = eight.estimate.params, seventy.estimate.params
    # 8B, no NVMe: parameter offload with in-flight staging keeps 14 bytes per parameter
    # in RAM (12 of state, the 2-byte home) plus two ring buffers of the largest bucket (the
    # embedding, 128256 x 4096 bf16: 1 GiB each), within 128 GiB less the reserve; only
    # where no step clips (its conditions ride on the row).
    chosen = eight.chosen
    assert chosen is not None and chosen.fits and chosen.library == "yes"
    assert chosen.name == "param offload + in-flight staging + checkpointing"
    assert "no gradient clipping" in chosen.conditions
    ring = 2 * 128256 * 4096 * 2
    assert chosen.host == pytest.approx(14 * p8 + ring, rel=0.005)
    assert chosen.host <= parse_bytes("128GiB") - host_reserve(parse_bytes("128GiB"))
    # With clipping no row fits: those the library runs without conditions keep 16 bytes
    # per parameter in RAM (2 more of gradient staging), more than 128 GiB less the
    # reserve; the NVMe rows need a disk.
    assert not any(row.fits for row in eight.estimate.rows if not row.conditions)
    running = eight.running
    assert running is not None and not running.fits and running.library == "yes"
    assert list(exceeded(running, eight.estimate)) == ["host"]  # its device total fits
    assert running.host >= 16 * p8
    # With a little NVMe, a row the library runs fits: the same machine plus that disk.
    short = eight.short_of_disk
    assert short is not None and short.library == "yes" and short.disk > 0
    assert list(exceeded(short, eight.estimate)) == ["disk"]
    with_disk = estimate(
        eight.star.model,
        seq_len=eight.star.seq_len,
        device_memory=eight.star.device_memory,
        host_memory=eight.star.host_memory,
        disk_memory=short.disk,
    )
    assert {row.name: row for row in with_disk.rows}[short.name].fits
    # 70B: its 12 bytes per parameter of state (788 GiB) cannot be in 256 GiB of RAM, nor
    # can the homes and gradient staging that parameter offload with NVMe state keeps there
    # (4 bytes per parameter). In-flight staging keeps 2 (the homes) and the ring: it fits,
    # with the state beyond the host budget on NVMe, where no step clips. With clipping the
    # homes go to NVMe beyond what fits beside the gradient staging (Note [homes on NVMe]),
    # which the library runs too.
    chosen = seventy.chosen
    assert chosen is not None and chosen.disk > 500 * 2**30 and chosen.library == "yes"
    assert chosen.name == "param offload + NVMe state + in-flight staging + ckpt"
    assert chosen.conditions
    assert chosen.largest_fitting_params >= seventy.estimate.params  # type: ignore[operator]
    assert chosen.host >= 2 * p70
    assert seventy.short_of_disk is None
    rows = {row.name: row for row in seventy.estimate.rows}
    # With host_budget="auto" (room left for the bounce ring) the library places it with the
    # homes movable: every home still fits, a little less state in RAM; the same conditions.
    auto = rows["params and state on NVMe + in-flight staging + ckpt"]
    assert auto.fits and auto.library == "yes" and auto.conditions == chosen.conditions
    assert 2 * p70 < auto.host < chosen.host and chosen.disk < auto.disk
    # Less NVMe than with clipping, whose whole-model gradient staging in RAM pushes more
    # homes and state to disk.
    assert auto.disk < rows["params and state on NVMe + checkpointing"].disk
    assert auto.host + auto.disk >= 14 * p70
    homes_in_ram = rows["param offload + NVMe state + checkpointing"]
    assert not homes_in_ram.fits and list(exceeded(homes_in_ram, seventy.estimate)) == ["host"]
    assert homes_in_ram.host >= 4 * p70
    best = seventy.running
    assert best is not None and best.name == "params and state on NVMe + checkpointing"
    assert best.fits and best.library == "yes" and not best.conditions
    assert best.largest_fitting_params >= seventy.estimate.params  # type: ignore[operator]
    # It keeps the gradient staging (2 bytes per parameter) in RAM and only part of the
    # homes: the rest of the 14 bytes per parameter is on disk.
    assert 2 * p70 < best.host < 4 * p70 < 12 * p70 < best.disk


def test_the_text_says_what_fits_and_what_runs(answers: list[Answer]) -> None:
    text = north_star_text(answers)
    eight, seventy = text.split("\n\n")[0].split("Llama-3-70B")
    for part in (eight, seventy):  # the conditions, plainly, and what runs with clipping
        assert "chosen: param offload + " in part and "in-flight staging" in part
        assert "only where each step announced and run during backward" in part
        assert "no gradient clipping" in part and "usually clips gradients" in part
        assert "best the library runs today with clipping: " in part
    assert "does not fit (host " in eight and "of NVMe or more" in eight
    assert "with clipping: params and state on NVMe" in seventy
    assert "the library does not run it yet" not in seventy


def test_the_cli_and_the_docs_reproduce_both(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", "--north-star"]) == 0
    out = capsys.readouterr().out
    docs = DOCS.read_text()
    for star in NORTH_STARS:
        command = f"zero-offload estimate {star.command()}"
        assert command in out and command in docs
    assert "zero-offload estimate --north-star" in docs
    assert main(["estimate", *NORTH_STARS[1].command().split()]) == 0
    out = capsys.readouterr().out
    assert "params and state on NVMe" in out and "in-flight staging" in out
    assert "*: only where each step announced" in out
