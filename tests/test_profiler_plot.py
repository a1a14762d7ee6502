"""The profiler's picture: the per-step breakdown it draws, the step it zooms into, and the
PNG itself from a short run."""

from __future__ import annotations

import pytest

from zero_offload.memory.traffic import Category, StallRecord
from zero_offload.profiling.data import PhaseSpan, ProfileData
from zero_offload.profiling.link import LinkBandwidth
from zero_offload.profiling.plot import representative_step, step_times


class _At:
    """An event that completed at ``at``."""

    def __init__(self, at: float) -> None:
        self.at = at

    def completed_at(self) -> float:
        return self.at


def _stall(began: float, ended: float) -> StallRecord:
    return StallRecord(0, Category.WEIGHTS, "compute", began, _At(began), _At(ended), 1)  # type: ignore[arg-type]


def _data() -> ProfileData:
    data = ProfileData(managers=[], link=LinkBandwidth(None, None, 0, "test"), started_at=0.0)
    data.step_marks = [1.0, 1.5, 2.2, 2.7]  # walls: 1.0 (warm-up), 0.5, 0.7, 0.5
    data.stalls.append(0, _stall(1.1, 1.2))
    data.stalls.append(0, _stall(1.45, 1.6))  # spans a mark
    data.phases = [
        PhaseSpan("cpu_adam", "cpu_optimizer", 1.3, 1.4),
        PhaseSpan("wait_weights", "compute", 1.1, 1.2),  # not the optimizer
        PhaseSpan("cpu_adam", "cpu_optimizer", 2.5, 2.6),
    ]
    return data


def test_each_step_splits_into_compute_exposed_and_optimizer():
    steps = step_times(_data())
    assert [round(s.wall, 6) for s in steps] == [1.0, 0.5, 0.7, 0.5]
    second = steps[1]
    assert second.exposed == pytest.approx(0.1 + 0.05)  # the stall is clipped at the mark
    assert second.optimizer == pytest.approx(0.1)
    assert second.compute == pytest.approx(0.5 - 0.15 - 0.1)
    assert steps[2].exposed == pytest.approx(0.1) and steps[2].optimizer == 0.0
    assert steps[3].optimizer == pytest.approx(0.1)


def test_a_phase_nested_in_another_on_the_optimizer_track_counts_once():
    # A wait for gradients inside CPU Adam (Note [Adam follows the gradient in]).
    data = _data()
    data.phases.append(PhaseSpan("wait_grads", "cpu_optimizer", 1.32, 1.38))
    data.phases.append(PhaseSpan("wait_grads", "cpu_optimizer", 1.39, 1.42))  # runs past it
    second = step_times(data)[1]
    assert second.optimizer == pytest.approx(0.12)  # 1.3 to 1.42
    assert second.compute == pytest.approx(0.5 - 0.15 - 0.12)


def test_the_zoomed_step_is_the_median_after_warm_up():
    steps = step_times(_data())
    assert representative_step(steps).index == 1  # median of 0.5, 0.7, 0.5; not step 0
    assert representative_step([]) is None


def test_the_png_from_a_short_run(tmp_path):
    pytest.importorskip("matplotlib")
    from zero_offload import profile

    from .helpers.models import batches, lm_loss, make_pair, offload_opt

    model, _ = make_pair()
    opt = offload_opt(model)
    with profile(opt) as prof:
        for tokens, targets in batches(4):
            lm_loss(model, tokens, targets).backward()
            opt.step()
            opt.zero_grad()
            prof.step()
    assert prof.data.stalls  # the weights' waits were heard
    path = prof.plot(tmp_path / "traffic.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 20_000
    opt.close()
