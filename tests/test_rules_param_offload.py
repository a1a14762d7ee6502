"""Lion, Adagrad, Adafactor and Muon with parameter offload and with streaming checkpoints
(issue 37: "every rule works with NVMe state, parameter offload,
checkpoints (consolidated and streaming, bitwise resume)"). NVMe state, consolidated
checkpoints, 2 gloo ranks and parity against torch are in tests/test_lion_adagrad.py,
tests/test_adafactor.py and tests/test_muon.py; here:

1. Weights three times the device budget, fetched unit by unit (``offload_parameters``),
   train bitwise like the same rule with its weights resident: the rule sees the same
   gradients and writes the same pinned weights, whatever fetches them. For Adafactor and
   Muon, which read whole parameters, each unit's host pool holds exactly its buckets'
   state, the shaped state (the factors, the momentum buffers) included (Note [rules that
   read a whole parameter] in optim/rule/base.py).
2. A run resumed from ``save_streaming``/``load_streaming`` with host state (and with
   parameter offload) is bitwise equal to the uninterrupted one, for every rule (Adafactor's
   and Muon's shaped state: Note [shaped state in a streamed checkpoint] in
   optim/checkpoint/bucket_file.py; without parameter offload, fp32 and bf16 and
   ``overlap_step``: tests/test_whole_rules_streaming.py).
3. ``partition_parameters`` is still refused for Adafactor and Muon, naming the feature.

CUDA form: the models, data and accelerators come from tests/helpers, so under
``--accelerator=cuda`` they run on ``cuda:0``, bitwise as on the host (both sides run the
same kernels).
"""

from __future__ import annotations

import functools
import pathlib
from typing import Any

import pytest
import torch

from zero_offload import OffloadAdafactor, OffloadAdagrad, OffloadConfig, OffloadLion, OffloadMuon
from zero_offload.errors import DeviceBudgetExceeded
from zero_offload.estimate.pools import rule_state_bytes
from zero_offload.params import UnitState

from .helpers.device import on_device, run_accelerator
from .test_param_offload import SEQ, VOCAB, assert_same, gpt, weight_bytes

pytestmark = pytest.mark.cuda_form

#: The float32 TinyGPT of tests/test_param_offload.py (12 blocks of 64).
_gpt = functools.partial(gpt, torch.float32)

RULES = {
    "lion": (OffloadLion, {"lr": 1e-3, "betas": (0.9, 0.99), "weight_decay": 0.1}),
    "adagrad": (OffloadAdagrad, {"lr": 1e-2, "lr_decay": 0.05, "weight_decay": 0.1,
                                 "initial_accumulator_value": 0.1}),
}  # fmt: skip
#: Rules that read whole parameters (Muon: the 2-D weights, embeddings included; the
#: norms' and biases' vectors go to its AdamW, Note [Muon routes by shape]).
WHOLE = {
    "adafactor": (OffloadAdafactor, {"lr": 1e-2, "weight_decay": 0.1}),
    "muon": (OffloadMuon, {"lr": 0.02, "adamw_lr": 3e-3}),
}


def _opt(rule: str, model: torch.nn.Module, budget: str | int, *, offload: bool, **config: Any):
    facade, hyper = {**RULES, **WHOLE}[rule]
    return facade(
        model.parameters(),
        **hyper,
        config=OffloadConfig(
            bucket_bytes=16384, tile_elements=1024, offload_parameters=offload, **config
        ),
        accelerator=run_accelerator(device_budget=budget),
        **({"model": model} if offload else {}),
    )


def _train(model: torch.nn.Module, opt: Any, steps: int, *, seed: int = 1) -> list[float]:
    gen = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        ids = on_device(torch.randint(0, VOCAB, (2, SEQ), generator=gen))
        loss = model(ids, ids)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("rule", [*RULES, *WHOLE])
def test_weights_three_times_the_budget_train_bitwise_like_resident(rule: str) -> None:
    budget = weight_bytes(_gpt()) // 3
    with pytest.raises(DeviceBudgetExceeded):  # without parameter offload it cannot fit
        _opt(rule, _gpt(), budget, offload=False)
    want = _gpt()
    opt = _opt(rule, want, "1GiB", offload=False)
    want_losses = _train(want, opt, 8)
    opt.close()
    model = _gpt()
    opt = _opt(rule, model, budget, offload=True)
    if rule in WHOLE:
        _assert_unit_pools_hold_the_shaped_state(rule, model, opt)
    losses = _train(model, opt, 8)
    peak = opt.accelerator.memory_stats()["peak"]
    assert all(unit.state is UnitState.ON_HOST for unit in opt.param_offloader.units)
    opt.close()
    assert losses == want_losses
    assert_same(model, want)
    assert peak <= budget


def _assert_unit_pools_hold_the_shaped_state(rule: str, model: torch.nn.Module, opt: Any) -> None:
    """Every unit's host pool is full (sized exactly: the shaped state counted, not more),
    and the host state is the estimator's ``rule_state_bytes``: the per-element fields
    (the fp32 master; Muon's AdamW moments) and the shaped state, alignment aside."""
    units = {
        n: s for n, s in opt.manager.pool_stats().items() if ".unit" in n and n.endswith(".host")
    }
    assert len(units) == len(opt.param_offloader.units)  # one pool per unit
    for name, stats in units.items():
        assert stats["bytes_in_use"] == stats["capacity_bytes"], name
    shapes = [tuple(p.shape) for p in model.parameters()]
    assert opt.placement.host == rule_state_bytes(rule, shapes)


@pytest.mark.parametrize("rule", list(WHOLE))
def test_partition_parameters_is_still_refused_for_whole_parameter_rules(rule: str) -> None:
    """ZeRO-3's flat-range shards would cut the parameters these rules read whole; the
    refusal names the rule, the feature and what works instead."""
    model = _gpt()
    with pytest.raises(ValueError, match=rf"the {rule} rule reads whole parameters .* "
                       r"partition_parameters=True \(ZeRO-3 shards .*\(offload_parameters=True"
                       r" on one rank"):  # fmt: skip
        _opt(rule, model, "1GiB", offload=False, partition_parameters=True)


@pytest.mark.parametrize("rule", [*RULES, *WHOLE])
@pytest.mark.parametrize("offload", [False, True], ids=["resident", "param-offload"])
def test_a_streaming_resume_with_host_state_is_bitwise(
    rule: str, offload: bool, tmp_path: pathlib.Path
) -> None:
    budget = weight_bytes(_gpt()) // 3 if offload else "1GiB"
    build = functools.partial(_opt, rule, budget=budget, offload=offload)
    model = _gpt()
    opt = build(model)
    _train(model, opt, 4, seed=1)
    opt.save_streaming(tmp_path / "ckpt")
    twin = _gpt()
    if not offload:  # the model's weights are the model's to save, as with torch
        twin.load_state_dict(model.state_dict())
    twin_opt = build(twin)
    # With parameter offload the weights' home is the optimizer's, saved with its state.
    twin_opt.load_streaming(tmp_path / "ckpt")
    _train(model, opt, 4, seed=2)
    _train(twin, twin_opt, 4, seed=2)
    opt.close()
    twin_opt.close()
    assert_same(model, twin)
