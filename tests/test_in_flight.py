"""``views/in_flight.py`` alone (Note [weights landed at their first use]): a bucket's
parameters in flight land once, before any value is read or written, on whichever thread
reads first; a read on another thread waits for that landing; a landing that fails fails
every later read; metadata never lands. The optimizer's use of it is
tests/test_overlap_landing.py."""

from __future__ import annotations

import sys
import threading
import time

import pytest
import torch

import zero_offload.views.in_flight as in_flight
from zero_offload.views.in_flight import InFlight, Landing, is_in_flight


def _params(n: int = 2) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.zeros(4)) for _ in range(n)]


def test_metadata_does_not_land_and_a_value_read_lands_once() -> None:
    params = _params()
    calls: list[int] = []
    landing = InFlight(params, lambda: calls.append(1), what="bucket 0")
    assert all(is_in_flight(p) for p in params)
    assert params[0].shape == (4,) and params[0].dtype == torch.float32
    assert params[0].requires_grad and params[0].grad is None and params[0].numel() == 4
    assert calls == [] and landing.state is Landing.IN_FLIGHT
    assert params[1].sum().item() == 0.0  # a value read of one parameter lands the bucket
    params[0].sum()
    assert calls == [1] and landing.state is Landing.LANDED
    assert not any(is_in_flight(p) for p in params)
    assert type(params[0]) is torch.nn.Parameter


def test_a_read_on_another_thread_waits_for_the_landing_in_progress() -> None:
    # Thread A starts landing (its copies take 0.2 s); the main thread reads another
    # parameter of the bucket meanwhile: it waits and sees the landed weights, not the old.
    params = _params()
    aliases = [p.detach() for p in params]  # taken before the class switch
    started = threading.Event()

    def land() -> None:
        started.set()
        time.sleep(0.2)
        for alias in aliases:
            alias.fill_(1.0)  # the copies end

    InFlight(params, land, what="bucket 0")
    seen: dict[str, float] = {}
    reader = threading.Thread(target=lambda: seen.update(a=params[0].sum().item()))
    reader.start()
    assert started.wait(5)
    seen["b"] = params[1].sum().item()
    reader.join()
    assert seen == {"a": 4.0, "b": 4.0}


def test_the_landing_reads_its_own_parameters_without_landing_again() -> None:
    params = _params()
    sums: list[float] = []
    InFlight(params, lambda: sums.append(params[0].sum().item()), what="bucket 0")
    assert params[1].mul(2).sum().item() == 0.0
    assert sums == [0.0]


def test_a_failed_landing_fails_every_read_until_abandoned() -> None:
    params = _params()

    def land() -> None:
        raise OSError("the copy stream failed")

    landing = InFlight(params, land, what="bucket 3")
    with pytest.raises(OSError, match="copy stream failed"):
        params[0].sum()
    for param in params:  # every later read raises, naming the bucket: the weights may be torn
        with pytest.raises(RuntimeError, match=r"bucket 3: its weights did not land") as info:
            param.sum()
        assert isinstance(info.value.__cause__, OSError)
    assert landing.state is Landing.FAILED
    landing.abandon()
    assert not any(is_in_flight(p) for p in params) and params[0].sum().item() == 0.0


def test_an_old_dynamo_without_class_guards_is_refused(monkeypatch) -> None:
    # torch < 2.5 did not guard a compiled graph on its parameters' classes: a graph
    # compiled before would run over parameters in flight without landing them.
    config = sys.modules.get("torch._dynamo.config")
    if config is not None:
        monkeypatch.delitem(sys.modules, "torch._dynamo.config")
    monkeypatch.setattr(torch, "__version__", "2.4.1")
    refusal = in_flight.compile_refusal()
    assert refusal is not None and "overlap_landing='at_step'" in refusal and "2.4.1" in refusal
    monkeypatch.setattr(torch, "__version__", "2.5.0")
    assert in_flight.compile_refusal() is None
    from zero_offload import OffloadAdamW, OffloadConfig
    from zero_offload.optim import constructor_checks

    # The optimizer asks before it builds anything.
    monkeypatch.setattr(constructor_checks, "compile_refusal", lambda: "refused: old dynamo")
    config_ = OffloadConfig(overlap_step=True, overlap_landing="at_first_use")
    with pytest.raises(ValueError, match="refused: old dynamo"):
        OffloadAdamW(_params(), config=config_)
