"""``zero-offload demo`` at a tiny size: it trains, the loss falls, the files appear."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from zero_offload.cli import main
from zero_offload.demo.corpus import CharCorpus, generate_text
from zero_offload.demo.train import DemoConfig, run_demo

TINY = ["--layers", "1", "--hidden", "32", "--heads", "2", "--batch", "8", "--seq-len", "32"]


def test_demo_command_trains_and_reports(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "demo"
    assert main(["demo", "--steps", "25", "--lr", "1e-2", *TINY, "--out", str(out)]) == 0
    text = capsys.readouterr().out
    losses = [
        float(line.split("loss")[1].split()[0])
        for line in text.splitlines()
        if line.startswith("step ")
    ]
    assert len(losses) == 25
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.3  # falling, not noise
    for needle in ("device budget", "activation offload: on", "gradients D2H", "Chrome trace"):
        assert needle in text
    assert json.loads((out / "trace.json").read_text())["traceEvents"]
    summary = json.loads((out / "profile.json").read_text())
    rows = {row["name"]: row for row in summary["transfers"]}
    assert rows["activations out"]["count"] == 25  # one block input per step
    assert rows["gradients D2H"]["count"] > 0 and summary["steps"] == 25


def test_default_budget_needs_offload_and_no_activation_offload_runs(tmp_path: Path) -> None:
    lines: list[str] = []
    config = DemoConfig(
        steps=2, layers=2, hidden=128, batch=2, seq_len=16, activation_offload=False, out=tmp_path
    )
    result = run_demo(config, echo=lines.append)
    assert len(result.losses) == 2 and "off" in result.activation_offload
    assert "does not fit: offload needed" in "\n".join(lines)
    assert result.profile["transfers"][2]["name"] == "activations out"
    assert result.profile["transfers"][2]["count"] == 0


def test_corpus_is_deterministic_and_shifted_by_one() -> None:
    import torch

    assert generate_text(sentences=20, seed=3) == generate_text(sentences=20, seed=3)
    assert generate_text(sentences=20, seed=3) != generate_text(sentences=20, seed=4)
    corpus = CharCorpus.build(sentences=200, seed=1)
    inputs, targets = corpus.batch(torch.Generator().manual_seed(0), batch=4, seq_len=16)
    assert inputs.shape == targets.shape == (4, 16)
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    assert corpus.decode(corpus.ids[:30]) == corpus.text[:30]
