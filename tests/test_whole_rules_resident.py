"""Adafactor and Muon with state resident on the device (issue 37): ``offload_fraction`` 0.0,
0.5 and ``"auto"`` (a device budget that splits the buckets), each resident parameter stepped
whole on the device (Note [whole parameters stepped on the device] in
zero_offload/optim/state/whole_resident.py).

1. Parity over 20 steps, with clipping and with 4 micro-batches, in fp32, against torch's own
   optimizer, with the bounds tests/test_adafactor.py and tests/test_muon.py use: Adafactor
   within max(2 x torch's for-loop vs foreach spread, 2 ulp of 1); Muon (the
   TinyTransformer's matrices, with AdamW for its norms and bias) within 4 x torch's own
   drift (Note [the yardstick is torch's own drift] in tests/test_muon.py). The mixed run
   against the all-host run within the same bound.
2. Without clipping, Muon on the device is bitwise torch's Muon beside torch's fused AdamW
   (the same torch operations on the same device), and Adafactor's factors are torch's.
3. bf16 weights: the mixed run against the all-host run within torch's own spread at bf16,
   and the model holds the master rounded.
4. A resumed run is bitwise the uninterrupted one with a resident bucket: ``state_dict`` and
   ``save_streaming``/``load_streaming``; either, saved from a mixed run, loads into an
   all-host and an all-resident optimizer with the same state.
5. The device pool holds the shaped state (the report's device bytes against the formula),
   and each step reserves the rule's temporaries for its largest parameter in the ledger;
   placement keeps room for them beside the pool ("auto" keeps fewer buckets, a fraction
   without room is refused), and so do the device accumulators of micro-batches.
6. What stays refused: resident state with ``overlap_step``, and on several ranks.

CUDA forms: the resume tests (ours against ours), and Adafactor's parity in fp32 and bf16
(torch's reference runs on the same GPU). Muon's parity stays host only, as in
tests/test_muon.py: on CUDA its host buckets and torch's reference do not run the same
arithmetic in the same places.
"""

from __future__ import annotations

import functools
import pathlib
from typing import Any

import pytest
import torch
from torch import nn

from zero_offload import OffloadAdafactor, OffloadConfig, OffloadMuon
from zero_offload.errors import DeviceBudgetExceeded
from zero_offload.optim import constructor_checks
from zero_offload.optim.offload_optimizer import OffloadOptimizer
from zero_offload.optim.state.placement import plan_dtype_buckets, plan_placement
from zero_offload.views import Family

from .helpers.device import run_kind
from .helpers.models import batches, host_accelerator, lm_loss, make_pair, max_diff, train
from .test_muon import DRIFT_FACTOR, _TorchPair, torch_drift

STEPS = 20
FLOOR = 2 * torch.finfo(torch.float32).eps
RULES = {
    "adafactor": (OffloadAdafactor, {"lr": 1e-2, "weight_decay": 0.1}),
    "muon": (OffloadMuon, {"lr": 0.02, "adamw_lr": 3e-3}),
}
#: offload_fraction, and the device budget that makes "auto" keep some buckets on each side
#: (the TinyTransformer's pools need about 150 KiB with every bucket offloaded; at 225 KiB
#: "auto" keeps 2 to 4 buckets of 7 or 13 resident, by rule and dtype).
FRACTIONS = {"0.0": (0.0, "256MiB"), "0.5": (0.5, "256MiB"), "auto": ("auto", "225KiB")}
CASES = {"clip": (1, 0.5), "micro4": (4, None)}


def _build(
    rule: str, model: nn.Module, fraction: str = "1.0", *, clip: float | None = None
) -> OffloadOptimizer:
    cls, hyper = RULES[rule]
    value, budget = FRACTIONS.get(fraction, (1.0, "256MiB"))
    config = OffloadConfig(bucket_bytes=8192, tile_elements=1024, offload_fraction=value,
                           max_grad_norm=clip)  # fmt: skip
    return cls(model.parameters(), **hyper, config=config,
               accelerator=host_accelerator(device_budget=budget))  # fmt: skip


def _train(model: nn.Module, opt: torch.optim.Optimizer, *, micro: int, clip: float | None,
           ours: bool, steps: int = STEPS) -> None:  # fmt: skip
    """``steps`` steps of ``micro`` micro-batches; torch's clipping for the reference (ours
    clips by its ``max_grad_norm``)."""
    train(model, opt, batches(steps * micro), micro_steps=micro, clip=None if ours else clip)


def _torch_optimizers(rule: str, model: nn.Module) -> tuple[Any, Any]:
    """torch's reference on ``model`` and the one whose distance from it is the bound:
    Adafactor's for-loop and foreach, Muon beside for-loop AdamW and beside fused AdamW."""
    if rule == "adafactor":
        hyper = RULES[rule][1]
        return (lambda: torch.optim.Adafactor(model.parameters(), **hyper, foreach=False),
                lambda m: torch.optim.Adafactor(m.parameters(), **hyper, foreach=True))  # fmt: skip
    return lambda: _TorchPair(model, "recipe"), lambda m: _TorchPair(m, "recipe", fused=True)


def _references(rule: str, case: str, dtype: torch.dtype) -> tuple[list, list, float]:
    """torch's reference weights after the run, the all-host run's, and the bound: torch's
    own spread (Adafactor: 2 x for-loop vs foreach) or drift (Muon: DRIFT_FACTOR x); once
    per accelerator kind."""
    return _references_on(rule, case, dtype, run_kind())


@functools.cache
def _references_on(rule: str, case: str, dtype: torch.dtype, kind: str) -> tuple[list, list, float]:
    micro, clip = CASES[case]
    ref, other = make_pair(dtype)
    reference, make_other = _torch_optimizers(rule, ref)
    _train(ref, reference(), micro=micro, clip=clip, ours=False)
    if rule == "adafactor":
        _train(other, make_other(other), micro=micro, clip=clip, ours=False)
        bound = max(2 * max_diff(other, ref), FLOOR)
    else:  # Muon: the larger of torch's two drifts (Note [the yardstick is torch's own drift])
        drift = torch_drift(
            lambda: make_pair(dtype)[1],
            lambda model, switch: _train(
                model, _TorchPair(model, "recipe", **switch), micro=micro, clip=clip, ours=False
            ),
            ref,
        )
        bound = max(DRIFT_FACTOR * drift, FLOOR)
    host, _ = make_pair(dtype)
    opt = _build(rule, host, clip=clip)
    _train(host, opt, micro=micro, clip=clip, ours=True)
    opt.close()
    return _weights(ref), _weights(host), bound


def _weights(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().float().cpu().clone() for p in model.parameters()]


def _diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b, strict=True))


def _resident(opt: OffloadOptimizer) -> tuple[int, int]:
    return sum(b.resident for b in opt.buckets), len(opt.buckets)


def _check_split(fraction: str, opt: OffloadOptimizer) -> None:
    resident, total = _resident(opt)
    if fraction == "0.0":
        assert resident == total
    else:  # 0.5, and "auto" under its budget: some buckets on each side
        assert 0 < resident < total, (fraction, resident, total)


# -- 1. parity ---------------------------------------------------------------------------------


def _parity(rule: str, fraction: str, case: str) -> None:
    micro, clip = CASES[case]
    want, host, bound = _references(rule, case, torch.float32)
    model, _ = make_pair()
    opt = _build(rule, model, fraction, clip=clip)
    _check_split(fraction, opt)
    _train(model, opt, micro=micro, clip=clip, ours=True)
    got = _weights(model)
    opt.close()
    assert _diff(got, want) <= bound, (_diff(got, want), bound)
    assert _diff(got, host) <= bound, (_diff(got, host), bound)


@pytest.mark.cuda_form
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("fraction", list(FRACTIONS))
def test_adafactor_matches_torch_within_its_own_spread(fraction: str, case: str) -> None:
    _parity("adafactor", fraction, case)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("fraction", list(FRACTIONS))
def test_muon_matches_torch_within_its_own_drift(fraction: str, case: str) -> None:
    _parity("muon", fraction, case)


def test_muon_on_the_device_is_bitwise_torch_beside_fused_adamw() -> None:
    """Every bucket resident, no clipping: the matrices step with torch's Muon operations
    and the rest with torch's fused AdamW, on the same (CPU) tensors as torch: bitwise."""
    model, ref = make_pair()
    opt = _build("muon", model, "0.0")
    torch_opt = _TorchPair(ref, "recipe", fused=True)
    _train(model, opt, micro=1, clip=None, ours=True, steps=8)
    _train(ref, torch_opt, micro=1, clip=None, ours=False, steps=8)
    assert max_diff(model, ref) == 0.0
    for p, rp in zip(model.parameters(), ref.parameters(), strict=True):
        theirs = torch_opt.muon.state[rp] if p.dim() == 2 else torch_opt.adamw.state[rp]
        for name in ("momentum_buffer",) if p.dim() == 2 else ("exp_avg", "exp_avg_sq"):
            assert torch.equal(opt.state[p][name], theirs[name]), name
    opt.close()


def test_adafactor_on_the_device_keeps_torchs_factors() -> None:
    """One step from the same weights and gradient: the factors are torch's bits (Note
    [Adafactor on the device, without a host sync]); the weights within an ulp of their
    size (a matrix's U is the factored form, a few ulp of U from torch's: Note [the update
    from the factors] in kernels/adafactor.py; that can flip a weight's last bit)."""
    model, ref = make_pair()
    opt = _build("adafactor", model, "0.0")
    torch_opt = torch.optim.Adafactor(ref.parameters(), **RULES["adafactor"][1], foreach=False)
    _train(model, opt, micro=1, clip=None, ours=True, steps=1)
    _train(ref, torch_opt, micro=1, clip=None, ours=False, steps=1)
    size = max(p.detach().abs().max().item() for p in ref.parameters())
    assert max_diff(model, ref) <= torch.finfo(torch.float32).eps * max(1.0, size)
    for p, rp in zip(model.parameters(), ref.parameters(), strict=True):
        for name in ("row_var", "col_var") if p.dim() >= 2 else ("variance",):
            assert torch.equal(opt.state[p][name], torch_opt.state[rp][name]), name
    opt.close()


@pytest.mark.parametrize("maximize", [False, True])
@pytest.mark.parametrize("shape", [(37,), (), (3, 5, 7), (1, 9), (9, 1), (30, 20)])
def test_adafactor_device_step_follows_torch_on_odd_shapes(
    shape: tuple[int, ...], maximize: bool
) -> None:
    """20 steps of one parameter, the rule's device step on CPU tensors against torch's
    for-loop given the same gradients: the factors bitwise, the weights within an ulp of
    their size per step (the last add: Note [Adafactor on the device, without a host
    sync])."""
    gen = torch.Generator().manual_seed(len(shape))
    p0 = torch.randn(shape, generator=gen)
    ref = nn.Parameter(p0.clone())
    hyper = {"lr": 1e-2, "weight_decay": 0.1, "maximize": maximize}
    opt = torch.optim.Adafactor([ref], **hyper, foreach=False)
    rule = OffloadAdafactor.rule
    group = {"beta2_decay": -0.8, "eps": (None, 1e-3), "d": 1.0, **hyper}
    master = p0.clone().reshape(-1)
    state = {f.name: torch.zeros(f.shape) for f in rule.param_state(shape)}
    for step in range(1, STEPS + 1):
        grad = torch.randn(shape, generator=gen)
        ref.grad = grad.clone()
        opt.step()
        rule.device_parameter_step({"master": master}, state, grad.reshape(-1), shape=shape,
                                   step=step, hyper=rule.hyper(group), grad_scale=1.0,
                                   step_tensor=torch.zeros(()))  # fmt: skip
    ulp = torch.finfo(torch.float32).eps * max(1.0, p0.abs().max().item())
    assert (master - ref.detach().reshape(-1)).abs().max().item() <= STEPS * ulp
    for name, value in state.items():
        assert torch.equal(value, opt.state[ref][name]), name


@pytest.mark.parametrize("eps1", [None, 0.5, 0.0], ids=["eps", "clamping", "zero"])
@pytest.mark.parametrize("shape", [(3, 5, 7), (30, 20), (9, 1), (1, 9)], ids=str)
def test_adafactor_device_step_rounds_the_update_as_the_host_kernel(
    shape: tuple[int, ...], eps1: float | None
) -> None:
    """A matrix's U on the device is the host kernel's factored form with its operations
    (Note [Adafactor on the device, without a host sync]): from zero state, with small
    integer gradients (every row and column sum exact, so both sides hold the same factors)
    and a zero row and column (with eps1 0 their U is 0 * inf: NaN, which must stay in its
    elements: a NaN norm clips nothing), the step size fixed by eps2 and no clipping (d
    large), so only U could tell them apart: one step gives the same bits."""
    gen = torch.Generator().manual_seed(sum(shape))
    p0 = torch.randn(shape, generator=gen)
    grad = torch.randint(-3, 4, shape, generator=gen).float()
    if shape[-2] > 1 and shape[-1] > 1:  # a zero row and a zero column (NaN U for eps1 0)
        grad[..., 0, :] = 0.0
        grad[..., :, -1] = 0.0
    rule = OffloadAdafactor.rule
    group = {"lr": 1e-2, "beta2_decay": -0.8, "eps": (eps1, 10.0), "d": 1e30,
             "weight_decay": 0.1, "maximize": False}  # fmt: skip
    hyper = rule.hyper(group)
    device = p0.clone().reshape(-1)
    device_state = {f.name: torch.zeros(f.shape) for f in rule.param_state(shape)}
    rule.device_parameter_step({"master": device}, device_state, grad.reshape(-1), shape=shape,
                               step=1, hyper=hyper, grad_scale=1.0,
                               step_tensor=torch.zeros(()))  # fmt: skip
    host = p0.clone().reshape(-1)
    host_state = {f.name: torch.zeros(f.shape) for f in rule.param_state(shape)}
    rule.parameter_step({"master": host}, host_state, grad.reshape(-1), shape=shape, step=1,
                        hyper=hyper, grad_scale=1.0, out=None)  # fmt: skip
    for name, value in device_state.items():
        assert torch.equal(value, host_state[name]), name
    assert not torch.equal(host, p0.reshape(-1) * (1 - 1e-2 * 0.1))  # U moved it
    assert torch.equal(device.view(torch.int32), host.view(torch.int32))


# -- 3. bf16 -----------------------------------------------------------------------------------


def _bf16(rule: str, fraction: str) -> None:
    """bf16 weights with clipping: the mixed run against the all-host run, within torch's
    own spread (or drift) on the same bf16 run; the model holds the master rounded."""
    micro, clip = CASES["clip"]
    _, host, bound = _references(rule, "clip", torch.bfloat16)
    model, _ = make_pair(torch.bfloat16)
    opt = _build(rule, model, fraction, clip=clip)
    _check_split(fraction, opt)
    _train(model, opt, micro=micro, clip=clip, ours=True)
    assert _diff(_weights(model), host) <= bound, (_diff(_weights(model), host), bound)
    state = opt.state_dict()["state"]
    for index, p in enumerate(model.parameters()):
        master = state[index]["master"].reshape(p.shape).to(p.device)
        assert torch.equal(p.detach(), master.bfloat16())
    opt.close()


@pytest.mark.cuda_form
@pytest.mark.parametrize("fraction", list(FRACTIONS))
def test_bf16_adafactor_mixed_run_is_the_host_run_within_torchs_spread(fraction: str) -> None:
    _bf16("adafactor", fraction)


@pytest.mark.parametrize("fraction", list(FRACTIONS))
def test_bf16_muon_mixed_run_is_the_host_run_within_torchs_drift(fraction: str) -> None:
    _bf16("muon", fraction)


# -- 4. resume -----------------------------------------------------------------------------------


def _steps(model: nn.Module, opt: OffloadOptimizer, part: list) -> None:
    for tokens, targets in part:
        lm_loss(model, tokens, targets).backward()
        opt.step()
        opt.zero_grad()


def _same_state(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for index, entry in want.items():
        assert set(got[index]) == set(entry), index
        for name, value in entry.items():
            assert torch.equal(got[index][name], value), (index, name)


@pytest.mark.cuda_form
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rule", list(RULES))
def test_a_state_dict_resume_is_bitwise_with_resident_buckets(
    rule: str, dtype: torch.dtype
) -> None:
    data = batches(8)
    model, twin = make_pair(dtype)
    opt = _build(rule, model, "0.5")
    _steps(model, opt, data[:4])
    saved = opt.state_dict()
    twin.load_state_dict(model.state_dict())
    opt2 = _build(rule, twin, "0.5")
    opt2.load_state_dict(saved)
    _same_state(opt2.state_dict()["state"], saved["state"])
    _steps(model, opt, data[4:])
    _steps(twin, opt2, data[4:])
    assert max_diff(model, twin) == 0.0
    _same_state(opt2.state_dict()["state"], opt.state_dict()["state"])
    # The same state loads into an all-host optimizer, and into every bucket resident.
    for fraction in ("1.0", "0.0"):
        other, _ = make_pair(dtype, seed=1)
        other.load_state_dict(model.state_dict())
        opt3 = _build(rule, other, fraction)
        opt3.load_state_dict(opt.state_dict())
        _same_state(opt3.state_dict()["state"], opt.state_dict()["state"])
        opt3.close()
    opt.close()
    opt2.close()


@pytest.mark.cuda_form
@pytest.mark.parametrize("rule", list(RULES))
def test_a_streamed_resume_is_bitwise_with_resident_buckets(
    rule: str, tmp_path: pathlib.Path
) -> None:
    data = batches(8)
    uninterrupted, _ = make_pair()
    opt = _build(rule, uninterrupted, "0.5")
    _steps(uninterrupted, opt, data)
    want_state = opt.state_dict()["state"]
    opt.close()

    model, _ = make_pair()
    opt = _build(rule, model, "0.5")
    _steps(model, opt, data[:4])
    opt.save_streaming(tmp_path / "ckpt")
    saved = opt.state_dict()["state"]
    model_state = {name: value.clone() for name, value in model.state_dict().items()}
    opt.close()
    resumed, _ = make_pair(seed=1)  # everything comes from the checkpoint
    ropt = _build(rule, resumed, "0.5")
    resumed.load_state_dict(model_state)
    ropt.load_streaming(tmp_path / "ckpt")
    _same_state(ropt.state_dict()["state"], saved)
    _steps(resumed, ropt, data[4:])
    _same_state(ropt.state_dict()["state"], want_state)
    assert max_diff(resumed, uninterrupted) == 0.0
    ropt.close()
    # The checkpoint loads into another placement too: all on the host, all resident.
    for fraction in ("1.0", "0.0"):
        other, _ = make_pair(seed=1)
        other.load_state_dict(model_state)
        opt3 = _build(rule, other, fraction)
        opt3.load_streaming(tmp_path / "ckpt")
        _same_state(opt3.state_dict()["state"], saved)
        opt3.close()


# -- 5. the device pool and the temporaries --------------------------------------------------------


@pytest.mark.parametrize("rule", list(RULES))
def test_the_device_pool_holds_the_shaped_state(rule: str) -> None:
    """Every bucket resident: the report's device state is the fp32 master (4 per element)
    plus each parameter's shaped state (its ``param_state``, fp32), and nothing is on the
    host; the pool was sized for it (construction allocates every block from it)."""
    model, _ = make_pair()
    opt = _build(rule, model, "0.0")
    numel = sum(p.numel() for p in model.parameters())
    shaped = sum(f.numel for p in model.parameters()
                 for f in opt.rule.param_state(tuple(p.shape)))  # fmt: skip
    report = opt.placement
    assert report.device == 4 * numel + 4 * shaped
    assert report.host == 0
    opt.close()


@pytest.mark.parametrize("rule", list(RULES))
def test_each_step_reserves_its_largest_parameters_temporaries(
    rule: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Note [resident temporaries are counted]: per resident bucket and step, the ledger
    holds the rule's temporaries for the bucket's largest parameter while it steps."""
    model, _ = make_pair()
    opt = _build(rule, model, "0.0", clip=0.5)
    ledger = opt.accelerator.ledger
    reserved: list[tuple[int, str]] = []
    reserve = ledger.reserve
    monkeypatch.setattr(ledger, "reserve", lambda n, what: (reserved.append((n, what)),
                                                              reserve(n, what=what))[1])  # fmt: skip
    _steps(model, opt, batches(1))
    hyper = opt.rule.hyper(opt.param_groups[0])
    for bucket in opt.buckets:
        want = max(opt.rule.device_parameter_temporary_bytes(slot.shape, hyper, 0.5)
                   for slot in bucket.layout.slots)  # fmt: skip
        got = [n for n, what in reserved if what == f"bucket{bucket.layout.index} step temporaries"]
        assert len(got) == 1 and want > 0
        # The clipping coefficient is not 0.5, but scaled either way: the same bytes.
        assert got[0] == want, (bucket.layout.index, got, want)
    opt.close()


# -- 6. what stays refused ---------------------------------------------------------------------


@pytest.mark.parametrize("rule", list(RULES))
def test_resident_state_with_overlap_step_is_still_refused(rule: str) -> None:
    """The delayed update needs all state on the host, for every rule."""
    cls, hyper = RULES[rule]
    model, _ = make_pair()
    config = OffloadConfig(offload_fraction=0.5, overlap_step=True)
    with pytest.raises(ValueError, match=r"overlap_step .* needs all state on the host "
                       r"\(offload_fraction=1.0\), got 0.5"):  # fmt: skip
        cls(model.parameters(), **hyper, config=config, accelerator=host_accelerator())


class _TwoRanks:
    """What construction reads of a process group of 2 before it refuses (no collective
    runs): its size and where it is."""

    world_size = 2

    def where(self) -> str:
        return "rank 0/2"


def _refused_alike(name: str, *, refused: Exception | None = None, **_: object) -> None:
    """The constructor's comparison where both ranks refused alike: each raises its own
    refusal (Note [a rank that fails alone]), here without a collective."""
    if refused is not None:
        raise refused


@pytest.mark.parametrize("fraction", [0.5, "auto"])
@pytest.mark.parametrize("rule", list(RULES))
def test_resident_state_on_several_ranks_is_still_refused(
    rule: str, fraction: float | str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Device-resident state is not partitioned, for any rule (docs/multi-rank.md): several
    ranks need ``offload_fraction=1.0``, and the whole-parameter check lets that refusal
    speak (it has nothing against several ranks without parameter offload)."""
    monkeypatch.setattr(constructor_checks, "optimizer_comm", lambda group, timeout: _TwoRanks())
    monkeypatch.setattr(constructor_checks, "agree_on_arguments", _refused_alike)
    cls, hyper = RULES[rule]
    model, _ = make_pair()
    config = OffloadConfig(offload_fraction=fraction)
    with pytest.raises(ValueError, match=r"rank 0/2: OffloadConfig.offload_fraction must be "
                       r"1.0 with several ranks"):  # fmt: skip
        cls(model.parameters(), **hyper, config=config, accelerator=host_accelerator(),
            process_group="given")  # fmt: skip


@pytest.mark.parametrize("rule", list(RULES))
def test_device_accumulators_leave_the_resident_step_its_room(rule: str) -> None:
    """``"auto"`` under budgets from tight to loose, 4 micro-batches: the device
    accumulators, taken at the first window that accumulates, keep the largest resident
    step's temporaries free beside their reserve, so every step fits (before, Muon's step
    failed at 224 to 240 KiB, its accumulators having taken that room)."""
    stepped = 0
    for kib in range(200, 320, 8):
        model, _ = make_pair()
        cls, hyper = RULES[rule]
        config = OffloadConfig(bucket_bytes=8192, tile_elements=1024, offload_fraction="auto",
                               max_grad_norm=0.5)  # fmt: skip
        opt = cls(model.parameters(), **hyper, config=config,
                  accelerator=host_accelerator(device_budget=f"{kib}KiB"))  # fmt: skip
        if any(bucket.resident for bucket in opt.buckets):
            train(model, opt, batches(8), micro_steps=4)
            stepped += 1
        opt.close()
    assert stepped >= 5


def _placement(fraction: float | str, device_free: int, temporaries: int) -> Any:
    """Four buckets of 1024 fp32 elements, one (32, 32) matrix each, under Adafactor's
    resident state; each bucket's step needs ``temporaries`` device bytes beyond the pool."""
    layouts = plan_dtype_buckets(
        [Family(group=0, dtype=torch.float32, members=[(i, (32, 32)) for i in range(4)])],
        bucket_bytes=4096,
        world_size=1,
        align_numel=256,
    )
    state = OffloadAdafactor.rule.state_fields(torch.float32, [])
    return plan_placement(
        layouts,
        itemsize=4,
        state=state,
        resident_state=state,
        offload_fraction=fraction,
        device_free=device_free,
        auto_headroom=0.0,
        alignment=512,
        step_temporaries={layout.index: temporaries for layout in layouts},
    )


def test_placement_leaves_room_for_the_largest_step() -> None:
    """A resident bucket costs the master and the accumulator (4 + 4 bytes per element) and
    its shaped state (a (32, 32) matrix's factors: 64 fp32); beside the pool, the largest
    resident step's temporaries must fit: "auto" keeps one bucket fewer for them, and a
    float fraction that leaves no room for them is refused, naming them."""
    per_bucket = 4096 + 4096 + 512  # master, accumulator, factors (aligned to 512)
    weights = 4 * 4096  # every bucket's fp32 weights
    buffers = 2 * 4096  # two gradient buffers of the largest offloaded bucket
    free = weights + buffers + 3 * per_bucket
    without = _placement("auto", free, 0)
    placement = _placement("auto", free, 8192)
    assert len(without.resident) == 3
    assert len(placement.resident) == 2
    assert placement.device_resident_state == 2 * per_bucket
    with pytest.raises(DeviceBudgetExceeded, match=r"and 8.00 KiB of step temporaries beside"):
        _placement(0.0, 4 * per_bucket + weights, 8192)


@pytest.mark.cuda_form
@pytest.mark.parametrize("rule", list(RULES))
def test_resident_buckets_beside_nvme_state_are_bitwise_beside_host_ram(
    rule: str, tmp_path: pathlib.Path
) -> None:
    # offload_fraction=0.5 with nvme_dir: the offloaded half's master on NVMe (Note [NVMe
    # tiles follow whole parameters]), the rest stepped on the device; the same bits as
    # the offloaded half in host RAM.
    cls, hyper = RULES[rule]

    def run(nvme: pathlib.Path | None) -> list[torch.Tensor]:
        extra = {} if nvme is None else {"nvme_dir": nvme, "host_budget": 1}
        config = OffloadConfig(bucket_bytes=8192, tile_elements=1024, offload_fraction=0.5,
                               **extra)  # fmt: skip
        model, _ = make_pair()
        opt = cls(model.parameters(), **hyper, config=config, accelerator=host_accelerator())
        placement = opt.placement
        train(model, opt, batches(4))
        opt.close()
        assert placement.device > 0 and (placement.nvme > 0) == (nvme is not None)
        return [p.detach().clone() for p in model.parameters()]

    assert all(map(torch.equal, run(tmp_path / "nvme"), run(None)))
