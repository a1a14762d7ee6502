"""A run says what it is doing: the construction log line (Note [construction says where the
state went]) and progress bars on long waits (Note [waits say what they wait for])."""

from __future__ import annotations

import importlib
import logging
import pathlib

import pytest
import torch
from torch import nn

from zero_offload import OffloadAdamW, OffloadConfig
from zero_offload.progress import progress, progress_enabled


def test_construction_logs_where_the_state_went(caplog: pytest.LogCaptureFixture) -> None:
    model = nn.Linear(64, 32)  # 64 * 32 + 32 = 2080 fp32 parameters
    with caplog.at_level(logging.INFO, logger="zero_offload"):
        opt = OffloadAdamW(model.parameters())
    try:
        lines = [r.getMessage() for r in caplog.records if r.name == "zero_offload"]
        assert len(lines) == 1, lines
        placement = opt.placement
        # fp32 master + exp_avg + exp_avg_sq: 12 bytes per parameter, all on the host.
        assert placement.parameters == 2080
        assert placement.host == 12 * 2080
        assert placement.device == placement.nvme == 0
        assert placement.pinned + placement.pageable > placement.host  # staging too
        assert placement.device_budget == opt.accelerator.memory_stats()["budget"]
        line = lines[0]
        for expected in ("2,080 parameters", "host 24.38 KiB", "NVMe 0 B", "budget"):
            assert expected in line, line
    finally:
        opt.close()


def test_the_log_line_counts_state_on_nvme(tmp_path: pathlib.Path) -> None:
    model = nn.Linear(512, 512)  # 262,656 parameters: 3 MiB of state, host_budget 1 MiB
    opt = OffloadAdamW(
        model.parameters(), config=OffloadConfig(nvme_dir=str(tmp_path), host_budget="1MiB")
    )
    try:
        placement = opt.placement
        assert placement.nvme > 0
        assert placement.nvme + placement.host + placement.device == 12 * 262_656
    finally:
        opt.close()


def test_progress_bars_follow_the_terminal_and_the_environment(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("ZERO_OFFLOAD_PROGRESS", "0")
    assert not progress_enabled()
    assert list(progress(range(3), desc="quiet", delay=0)) == [0, 1, 2]
    assert "quiet" not in capsys.readouterr().err
    monkeypatch.setenv("ZERO_OFFLOAD_PROGRESS", "1")
    assert progress_enabled()
    assert list(progress(range(3), desc="loud", total=3, delay=0)) == [0, 1, 2]
    assert "zero-offload: loud" in capsys.readouterr().err
    monkeypatch.delenv("ZERO_OFFLOAD_PROGRESS")
    assert progress_enabled() is False  # pytest's captured stderr is not a terminal


def test_streaming_checkpoints_and_kernel_warmup_show_bars(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import zero_offload.progress as bars
    from zero_offload.kernels import warmup

    monkeypatch.setenv("ZERO_OFFLOAD_PROGRESS", "1")
    real = bars.progress
    seen: list[str] = []

    def at_once(items, *, desc, **kwargs):  # no 2 s delay in a test
        seen.append(desc)
        kwargs["delay"] = 0
        if desc.startswith("compiling"):  # the bar, not a cold compile of all 24 kernels
            return real(iter(()), desc=desc, **kwargs)
        return real(items, desc=desc, **kwargs)

    warmup_module = importlib.import_module("zero_offload.kernels.warmup")  # not the function
    monkeypatch.setattr(warmup_module, "progress", at_once)
    monkeypatch.setattr("zero_offload.optim.checkpoint.streaming.progress", at_once)
    warmup()
    model = nn.Linear(16, 16)
    opt = OffloadAdamW(model.parameters())
    try:
        opt.backward(model(torch.randn(2, 16)).sum())
        opt.step()
        opt.save_streaming(tmp_path / "ckpt")
        opt.load_streaming(tmp_path / "ckpt")
    finally:
        opt.close()
    assert seen == [
        "compiling CPU Adam kernels",
        "save_streaming",
        "checking the checkpoint",
        "load_streaming",
    ]
    err = capsys.readouterr().err
    assert (
        "zero-offload: compiling CPU Adam kernels" in err and "zero-offload: save_streaming" in err
    )


def test_nvme_preallocation_goes_through_a_bar(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[str] = []

    def record(items, *, desc, **kwargs):
        seen.append(desc)
        return iter(items)

    monkeypatch.setattr("zero_offload.memory.storage_file.progress", record)
    model = nn.Linear(512, 512)
    opt = OffloadAdamW(
        model.parameters(), config=OffloadConfig(nvme_dir=str(tmp_path), host_budget="1MiB")
    )
    try:
        assert seen and all(desc.startswith("preallocating ") for desc in seen)
        opt.backward(model(torch.randn(2, 512)).sum())
        opt.step()  # the files were preallocated whole: the step writes and reads them
    finally:
        opt.close()


def test_step_metrics_neither_keep_the_optimizer_alive_nor_outlive_it() -> None:
    """The phase listeners are global: metrics hold the optimizer weakly and stop listening
    when it is collected (an OffloadTrainer rebuilding its optimizer per trial leaked each)."""
    import gc
    import weakref

    from zero_offload import tracing
    from zero_offload.profiling.metrics import StepMetrics

    before = len(tracing._listeners)
    model = nn.Linear(16, 16)
    opt = OffloadAdamW(model.parameters())
    metrics = StepMetrics(opt)
    opt.backward(model(torch.randn(2, 16)).sum())
    opt.step()
    assert metrics.collect(1)["offload/cpu_adam_ms"] > 0
    alive = weakref.ref(opt)
    del opt
    gc.collect()
    assert alive() is None
    assert len(tracing._listeners) == before
    assert metrics.collect(1) == {}


def test_step_metrics_count_their_own_optimizers_cpu_adam_only() -> None:
    """Two optimizers (a GAN, a model and its head): each one's cpu_adam_ms is its own
    steps' time, whether its update runs in step() or on the host worker (overlap_step)."""
    from zero_offload.profiling.metrics import StepMetrics

    first, second = nn.Linear(64, 64), nn.Linear(64, 64)
    opts = [
        OffloadAdamW(first.parameters()),
        OffloadAdamW(second.parameters(), config=OffloadConfig(overlap_step=True)),
    ]
    metrics = [StepMetrics(opt) for opt in opts]
    try:
        for stepping, (model, opt) in enumerate(zip((first, second), opts, strict=True)):
            for _ in range(3):
                opt.backward(model(torch.randn(2, 64)).sum())
                opt.step()
                opt.zero_grad()
            opt.flush_pending_update()  # the delayed update's CPU Adam has run
            figures = [m.collect(3)["offload/cpu_adam_ms"] for m in metrics]
            assert figures[stepping] > 0
            assert figures[1 - stepping] == 0.0, figures  # it did not step
    finally:
        for m, opt in zip(metrics, opts, strict=True):
            m.close()
            opt.close()
