"""The traffic profiler: byte counts against an independent count, trace, report, plot."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from zero_offload.accelerator import HostAccelerator
from zero_offload.config import AcceleratorConfig, OffloadConfig
from zero_offload.optim import OffloadAdamW
from zero_offload.profiling import ProfilerState, profile

STEPS = 3


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64), nn.Linear(64, 8))


@pytest.fixture
def setup() -> Iterator[tuple[nn.Module, OffloadAdamW, HostAccelerator]]:
    acc = HostAccelerator(AcceleratorConfig(device_budget="64MiB", link_bandwidth=2e9))
    model = _model()
    opt = OffloadAdamW(
        model.parameters(), lr=1e-2, accelerator=acc, config=OffloadConfig(bucket_bytes="16KiB")
    )
    yield model, opt, acc
    opt.close()


def _train(model: nn.Module, opt: OffloadAdamW, steps: int, prof: object = None) -> None:
    for _ in range(steps):
        x = torch.randn(16, 64)
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        if prof is not None:
            prof.step()  # type: ignore[attr-defined]


def test_byte_counts_equal_an_independent_count(
    setup: tuple[nn.Module, OffloadAdamW, HostAccelerator], monkeypatch: pytest.MonkeyPatch
) -> None:
    model, opt, acc = setup
    _train(model, opt, 1)  # warm-up outside the profile
    seen = {"d2h": [0, 0], "h2d": [0, 0]}
    real_copy = acc.copy_

    def spy(dst: torch.Tensor, src: torch.Tensor, *, stream: object, **kwargs: object) -> None:
        entry = seen[stream.name]  # type: ignore[attr-defined]
        entry[0] += 1
        entry[1] += src.numel() * src.element_size()
        real_copy(dst, src, stream=stream, **kwargs)  # type: ignore[arg-type]

    with profile(opt) as prof:  # the link probe runs here, before the spy is installed
        monkeypatch.setattr(acc, "copy_", spy)
        _train(model, opt, STEPS, prof)
    summary = prof.to_dict()
    rows = {row["name"]: row for row in summary["transfers"]}
    grads, weights = rows["gradients D2H"], rows["weights H2D"]
    assert [grads["count"], grads["bytes"]] == seen["d2h"]
    assert [weights["count"], weights["bytes"]] == seen["h2d"]
    # Every parameter's gradient leaves once and its weights come back once per step: the
    # buckets' element counts, in fp32, bound the bytes from below (padding adds the rest).
    numel = sum(p.numel() for p in model.parameters())
    assert grads["bytes"] >= STEPS * numel * 4 and weights["bytes"] >= STEPS * numel * 4
    assert summary["totals"]["copies"] == seen["d2h"][0] + seen["h2d"][0]
    assert summary["steps"] == STEPS and summary["step_source"] == "prof.step() calls"
    assert grads["pending"] == 0 and grads["seconds"] > 0
    assert summary["link"]["source"] == "measured" and summary["link"]["h2d_bytes_per_s"] > 0


def test_chrome_trace_is_valid_json_with_the_stream_tracks(
    setup: tuple[nn.Module, OffloadAdamW, HostAccelerator], tmp_path: Path
) -> None:
    model, opt, _ = setup
    with profile(opt, link_bandwidth=1e9) as prof:
        _train(model, opt, STEPS, prof)
    path = prof.export_chrome_trace(tmp_path / "nested" / "trace.json")
    trace = json.loads(path.read_text())
    events = trace["traceEvents"]
    tracks = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert {"compute", "d2h", "h2d", "host_worker", "cpu_optimizer", "comm"} <= set(tracks.values())
    spans = [e for e in events if e["ph"] == "X"]
    assert spans and all(e["name"].startswith("zero_offload::") for e in spans)
    assert all(e["dur"] >= 0 and e["ts"] >= -1e3 for e in spans)
    on_track = {(tracks[e["tid"]], e["name"]) for e in spans}
    assert ("d2h", "zero_offload::gradients_d2h") in on_track
    assert ("h2d", "zero_offload::weights_h2d") in on_track
    assert ("cpu_optimizer", "zero_offload::cpu_adam") in on_track
    steps = [e for e in events if e["name"] == "zero_offload::step"]
    assert len(steps) == STEPS


def test_report_dict_and_json_agree(setup: tuple[nn.Module, OffloadAdamW, HostAccelerator]) -> None:
    model, opt, _ = setup
    with profile(opt, opt.manager, link_bandwidth=1e9) as prof:  # one manager, listened to once
        assert prof.state is ProfilerState.RECORDING
        _train(model, opt, STEPS)
    assert prof.state is ProfilerState.STOPPED
    summary = prof.to_dict()
    assert summary["steps"] == STEPS  # counted from the optimizer's cpu_adam phases
    assert json.loads(prof.to_json()) == json.loads(json.dumps(summary))
    text = prof.report()
    assert text == str(prof)
    for label in ("gradients D2H", "weights H2D", "activations in", "reduce-scatter"):
        assert label in text
    for label in ("defragmentation", "exposed", "zero_offload::cpu_adam", "per step"):
        assert label in text
    memory = summary["memory"]
    assert memory["device_peak_bytes"] == opt.accelerator.memory_stats()["in_use"]
    assert memory["host_reserved_bytes"] == sum(
        p.capacity for p in opt.manager.pools if p.kind != "device"
    )


def test_waited_time_is_the_managers_waits(
    setup: tuple[nn.Module, OffloadAdamW, HostAccelerator],
) -> None:
    """The rows' waited time adds up, by category, to the managers' stalls; exposed time is
    the part of it while the row's copies ran (Note [exposed versus hidden time])."""
    model, opt, _ = setup
    before = dict(opt.manager.exposed_seconds)
    with profile(opt, link_bandwidth=1e9) as prof:
        _train(model, opt, STEPS)
    waited = {c.value: s - before.get(c, 0.0) for c, s in opt.manager.exposed_seconds.items()}
    summary = prof.to_dict()
    by_category: dict[str, float] = {}
    for row in summary["transfers"]:
        by_category[row["category"]] = by_category.get(row["category"], 0.0) + row["waited_seconds"]
        assert 0.0 <= row["exposed_seconds"] <= row["waited_seconds"] + 1e-12
        assert row["exposed_seconds"] <= row["seconds"] + 1e-12
        assert row["hidden_seconds"] == pytest.approx(
            max(0.0, row["seconds"] - row["exposed_seconds"])
        )
    assert waited["weights"] > 0.0
    for category, seconds in waited.items():
        assert by_category.get(category, 0.0) == pytest.approx(seconds)
    assert summary["totals"]["waited_seconds"] == pytest.approx(sum(waited.values()))


def test_plot_writes_a_png(
    setup: tuple[nn.Module, OffloadAdamW, HostAccelerator], tmp_path: Path
) -> None:
    pytest.importorskip("matplotlib")
    model, opt, _ = setup
    with profile(opt, link_bandwidth=1e9) as prof:
        _train(model, opt, 2, prof)
    path = prof.plot(tmp_path / "traffic.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_says_what_to_install(
    setup: tuple[nn.Module, OffloadAdamW, HostAccelerator],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model, opt, _ = setup
    with profile(opt, link_bandwidth=1e9) as prof:
        _train(model, opt, 1)
    monkeypatch.setitem(sys.modules, "matplotlib.backends.backend_agg", None)
    with pytest.raises(ImportError, match=r"pip install zero-offload\[plot\]"):
        prof.plot(tmp_path / "traffic.png")


def test_activation_offloader_shares_the_report(
    setup: tuple[nn.Module, OffloadAdamW, HostAccelerator],
) -> None:
    activations = pytest.importorskip("zero_offload.activations")
    model, opt, _ = setup
    offloader = activations.ActivationOffloader(
        manager=opt.manager,
        config=activations.ActivationOffloadConfig(
            min_bytes=0, host_pool_bytes="256KiB", device_pool_bytes="128KiB"
        ),
    )
    try:
        with profile(opt, offloader, link_bandwidth=1e9) as prof:
            x = torch.randn(16, 64)
            y = activations.checkpoint(model, x, offloader=offloader)
            y.square().mean().backward()
            opt.step()
            opt.zero_grad()
        rows = {row["name"]: row for row in prof.to_dict()["transfers"]}
        assert rows["activations out"]["count"] >= 1
        assert rows["activations in"]["count"] == rows["activations out"]["count"]
    finally:
        offloader.close()


@pytest.mark.parametrize(
    ("target", "error"), [(object(), TypeError), (None, ValueError)], ids=["object", "nothing"]
)
def test_bad_targets_are_refused(target: object, error: type[Exception]) -> None:
    with pytest.raises(error, match="profile"):
        profile(*(() if target is None else (target,)))


def test_bad_link_bandwidth_is_refused(
    setup: tuple[nn.Module, OffloadAdamW, HostAccelerator],
) -> None:
    with pytest.raises(ValueError, match="link_bandwidth"):
        profile(setup[1], link_bandwidth=-1.0)


def test_an_error_in_the_body_propagates_and_stops_the_profiler(
    setup: tuple[nn.Module, OffloadAdamW, HostAccelerator],
) -> None:
    model, opt, _ = setup
    with pytest.raises(KeyError, match="from the body"), profile(opt, link_bandwidth=1e9) as prof:
        _train(model, opt, 1)
        raise KeyError("from the body")
    assert prof.state is ProfilerState.STOPPED
    prof.stop()  # idempotent
    assert prof.to_dict()["steps"] == 1
    with pytest.raises(RuntimeError, match="recording"):
        prof.step()
