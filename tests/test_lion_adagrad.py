"""OffloadLion and OffloadAdagrad (issue 37): two elementwise rules, each one rule, one kernel
and a thin facade.

1. Parity over 20 steps in fp32: Adagrad against ``torch.optim.Adagrad`` (lr_decay,
   weight_decay, initial_accumulator_value, maximize), Lion against the paper's update
   written below (``LionReference``); state offloaded to the host (``offload_fraction`` 1.0)
   and half resident on the device (0.5, the rule's device step), with clipping
   (``OffloadConfig(max_grad_norm=...)`` against ``clip_grad_norm_`` on the reference) and
   with 4 micro-batches of accumulation; on 2 gloo ranks with clipping; on NVMe too (Adagrad's ``sum`` starts from
   ``initial_accumulator_value``, written tile by tile into the records). A state dict
   without state restarts ``sum`` from that value.
2. A resumed run is bitwise equal to an uninterrupted one, by the rules' field names.
3. Host state bytes per parameter, measured from ``opt.placement``: Lion 8 (AdamW's 12 less
   one moment), Adagrad 8.
4. A bad hyper-parameter is refused with a ValueError naming it.
5. Properties (hypothesis): random parameter sizes, two param groups with their own
   hyper-parameters, bucket sizes and ``offload_fraction``.
6. The kernels: their tile loops vectorise and fuse no multiply-add; the host kernel (bf16
   gradient and out, two tiles) and the rule's device step give the same bits; a bad
   argument is named before anything is written.

Tolerance: fp32. Lion's reference does the kernel's operations in the kernel's order (Note
[Lion's operation order] in kernels/lion.py), so without clipping it agrees bitwise; with
clipping the two sides' norms (hence coefficients) differ in the last bits, which moves a
weight only if it flips a sign (an lr-sized step, caught by the bound). Adagrad's kernel
follows torch's single-tensor order; torch's vectorised addcmul/addcdiv may round a few ulp
differently, which stays below 1e-5 over 20 steps on O(1) weights.

CUDA form (``cuda_form``, docs/gpu.md): the optimizer tests build their model, data and
accelerator through tests/helpers, so under ``--accelerator=cuda`` they run on ``cuda:0`` with
the same tolerances. Lion stays bitwise there: its reference and its device step are separate
fp32 torch ops (one kernel each, nothing to fuse), the host kernel fuses nothing, and sign
makes ``add_(..., alpha=-lr)`` exact. Torch's Adagrad takes its foreach path on CUDA, a few ulp
from the single-tensor order, inside FP32_ATOL. State read back (``opt.state``, a state dict)
lives on the host and is moved to the parameter's device before it is compared. Host only:
the gloo ranks (tests/helpers/dist.py spawns them on the host accelerator), and the kernels'
own tests (numba on the CPU).
"""

from __future__ import annotations

import copy
import pathlib
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from numba import njit, types

from zero_offload import OffloadAdagrad, OffloadAdamW, OffloadConfig, OffloadLion
from zero_offload.estimate.pools import rule_state
from zero_offload.estimate.rows import Context
from zero_offload.kernels import adagrad, adagrad_step, convert, lion, lion_step
from zero_offload.optim.rule import ADAGRAD, LION

from .helpers.device import on_device, run_accelerator
from .helpers.dist import data as dist_data
from .helpers.dist import run_ranks
from .helpers.models import batches, lm_loss, make_pair, max_diff
from .helpers.properties import scaled

FP32_ATOL = 1e-5
STEPS = 20
LION_HYPER = {"lr": 1e-3, "betas": (0.9, 0.99), "weight_decay": 0.1}


class LionReference(torch.optim.Optimizer):
    """Lion from the paper (Chen et al. 2023, Algorithm 2; lucidrains' lion-pytorch):
    ``c = b1*m + (1-b1)*g; p = p*(1-lr*wd) - lr*sign(c); m = b2*m + (1-b2)*g``, each
    product and sum a separate fp32 torch op."""

    def __init__(self, params: Any, lr: float, betas: tuple[float, float], weight_decay: float,
                 maximize: bool = False) -> None:  # fmt: skip
        defaults = {"lr": lr, "betas": betas, "weight_decay": weight_decay, "maximize": maximize}
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One step; ``closure`` (forward and backward, as Lightning passes) runs first."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, (b1, b2), wd = group["lr"], group["betas"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = -p.grad if group["maximize"] else p.grad
                m = self.state[p].setdefault("exp_avg", torch.zeros_like(p))
                c = m * b1 + g * (1 - b1)
                p.mul_(1 - lr * wd)
                p.add_(torch.sign(c), alpha=-lr)
                m.mul_(b2).add_(g * (1 - b2))
        return loss


def _steps(model: torch.nn.Module, opt: torch.optim.Optimizer, part: list) -> None:
    """One step per (tokens, targets) pair."""
    for tokens, targets in part:
        lm_loss(model, tokens, targets).backward()
        opt.step()
        opt.zero_grad()


def _config(**config: Any) -> OffloadConfig:
    return OffloadConfig(bucket_bytes=8192, tile_elements=1024, **config)


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, *, micro: int, clip: float | None,
           ours: bool) -> None:  # fmt: skip
    data = batches(STEPS * micro)
    for i in range(0, len(data), micro):
        for tokens, targets in data[i : i + micro]:
            lm_loss(model, tokens, targets).backward()
        if clip is not None and not ours:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()


ADAGRAD_VARIANTS = {
    "defaults": {},
    "lr_decay": {"lr_decay": 0.05},
    "weight_decay": {"weight_decay": 0.1},
    "initial_accumulator_value": {"initial_accumulator_value": 0.1},
    "all": {"lr_decay": 0.05, "weight_decay": 0.1, "initial_accumulator_value": 0.1,
            "maximize": False},
    "maximize": {"maximize": True, "weight_decay": 0.1},
}  # fmt: skip

CASES = [
    # (rule, Adagrad variant or Lion's maximize, where, micro-batches, clip)
    *[("adagrad", v, "host", 1, None) for v in ADAGRAD_VARIANTS],
    ("adagrad", "all", "half-resident", 1, None),
    ("adagrad", "all", "host", 1, 0.5),
    ("adagrad", "all", "half-resident", 1, 0.5),
    ("adagrad", "all", "host", 4, None),
    ("adagrad", "all", "half-resident", 4, None),
    ("adagrad", "all", "nvme", 1, None),
    ("lion", "plain", "host", 1, None),
    ("lion", "maximize", "host", 1, None),
    ("lion", "plain", "half-resident", 1, None),
    ("lion", "maximize", "half-resident", 1, None),
    ("lion", "plain", "host", 1, 0.5),
    ("lion", "plain", "half-resident", 1, 0.5),
    ("lion", "plain", "host", 4, None),
    ("lion", "plain", "half-resident", 4, None),
    ("lion", "plain", "nvme", 1, None),
]


#: Where the buckets' state lives in each case.
PLACES = {"host": {"host"}, "half-resident": {"host", "device"}, "nvme": {"nvme"}}


def _where(where: str, tmp_path: pathlib.Path) -> dict[str, Any]:
    if where == "half-resident":
        return {"offload_fraction": 0.5}
    if where == "nvme":
        return {"nvme_dir": str(tmp_path), "host_budget": 1}
    return {}


def _build(rule: str, variant: str, model: torch.nn.Module, **config: Any) -> torch.optim.Optimizer:
    if rule == "lion":
        return OffloadLion(model.parameters(), **LION_HYPER, maximize=variant == "maximize",
                           config=_config(**config), accelerator=run_accelerator())  # fmt: skip
    return OffloadAdagrad(model.parameters(), lr=1e-2, **ADAGRAD_VARIANTS[variant],
                          config=_config(**config), accelerator=run_accelerator())  # fmt: skip


@pytest.mark.cuda_form
@pytest.mark.parametrize(
    ("rule", "variant", "where", "micro", "clip"),
    CASES,
    ids=[f"{r}-{v}-{w}-micro{m}-clip{c}" for r, v, w, m, c in CASES],
)
def test_matches_the_reference_over_20_steps(
    rule: str, variant: str, where: str, micro: int, clip: float | None, tmp_path: pathlib.Path
) -> None:
    model, ref = make_pair()
    config = _where(where, tmp_path)
    if clip is not None:
        config["max_grad_norm"] = clip
    opt = _build(rule, variant, model, **config)
    if rule == "lion":
        ropt: torch.optim.Optimizer = LionReference(
            ref.parameters(), **LION_HYPER, maximize=variant == "maximize"
        )
    else:
        ropt = torch.optim.Adagrad(ref.parameters(), lr=1e-2, **ADAGRAD_VARIANTS[variant])
    _train(model, opt, micro=micro, clip=clip, ours=True)
    _train(ref, ropt, micro=micro, clip=clip, ours=False)
    diff = max_diff(model, ref)
    if rule == "lion" and clip is None:
        assert diff == 0.0  # the same operations in the same order
    else:
        assert diff < FP32_ATOL
    places = {b.store.location for b in opt.buckets}
    assert places == PLACES[where]
    if where != "nvme":  # opt.state cannot hand out NVMe state as tensors
        field = "exp_avg" if rule == "lion" else "sum"
        for p, rp in zip(model.parameters(), ref.parameters(), strict=True):
            ours = opt.state[p][field].reshape(rp.shape).to(rp.device)  # host state: moved
            assert torch.allclose(ours, ropt.state[rp][field], atol=FP32_ATOL, rtol=0)
    opt.close()


@pytest.mark.parametrize("rule", ["lion", "adagrad"])
def test_two_gloo_ranks_with_clipping_match_one_process_and_the_reference(
    rule: str, tmp_path: pathlib.Path
) -> None:
    """Each rank steps its flat-range shard of every bucket (elementwise rules shard
    bitwise); the reduce-scatter sums in another order than one process, so each gradient
    differs by a few ulp: within FP32_ATOL of one process and of the reference."""
    hyper = LION_HYPER if rule == "lion" else {"lr": 1e-2, **ADAGRAD_VARIANTS["all"]}
    results = run_ranks(2, "rule_train", tmp_path, rule=rule, hyper=hyper, steps=STEPS, clip=0.5)
    model, ref = make_pair()
    facade = OffloadLion if rule == "lion" else OffloadAdagrad
    opt = facade(model.parameters(), **hyper, config=_config(max_grad_norm=0.5),
                 accelerator=run_accelerator())  # fmt: skip
    reference = LionReference if rule == "lion" else torch.optim.Adagrad
    ropt = reference(ref.parameters(), **hyper)
    for m, o, ours in ((model, opt, True), (ref, ropt, False)):
        for tokens, targets in dist_data(STEPS):
            lm_loss(m, tokens, targets).backward()
            if not ours:
                torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
            o.step()
            o.zero_grad()
    opt.close()
    for rank, result in enumerate(results):
        for theirs in (model, ref):
            diff = max(
                (w - p.detach()).abs().max().item()
                for w, p in zip(result["weights"], theirs.parameters(), strict=True)
            )
            assert diff < FP32_ATOL, (rank, diff)
        assert result["norms"] == results[0]["norms"]
    assert max(results[0]["norms"]) > 0.5  # clipping was active


@pytest.mark.cuda_form
@pytest.mark.parametrize("where", ["host", "half-resident"])  # NVMe: no state_dict()
def test_a_state_dict_without_state_restarts_adagrad_from_its_initial_value(
    where: str, tmp_path: pathlib.Path
) -> None:
    """Loading a state dict that holds no state for the parameters resets each store's
    ``sum`` to ``initial_accumulator_value`` (not to 0) and the step count to 0: the run
    then matches a fresh ``torch.optim.Adagrad`` from the same weights."""
    hyper = {"lr": 1e-2, "lr_decay": 0.05, "initial_accumulator_value": 0.25}
    data = batches(4)
    model, ref = make_pair()
    opt = OffloadAdagrad(model.parameters(), **hyper, config=_config(**_where(where, tmp_path)),
                         accelerator=run_accelerator())  # fmt: skip

    _steps(model, opt, data[:2])
    opt.load_state_dict({**opt.state_dict(), "state": {}})
    ref.load_state_dict(model.state_dict())
    ropt = torch.optim.Adagrad(ref.parameters(), **hyper)
    _steps(model, opt, data[2:])
    _steps(ref, ropt, data[2:])
    assert max_diff(model, ref) < FP32_ATOL
    opt.close()


@pytest.mark.cuda_form
@pytest.mark.parametrize("rule", ["lion", "adagrad"])
@pytest.mark.parametrize("where", ["host", "half-resident", "nvme"])
def test_a_resumed_run_is_bitwise_equal(rule: str, where: str, tmp_path: pathlib.Path) -> None:
    """From ``state_dict()`` (whose per-parameter keys are torch's: the rule's field, the
    step, and our master), or on NVMe from ``save_streaming``/``load_streaming``."""
    variant = "plain" if rule == "lion" else "all"
    field = "exp_avg" if rule == "lion" else "sum"
    data = batches(8)
    model, twin = make_pair()
    opt = _build(rule, variant, model, **_where(where, tmp_path / "a"))
    _steps(model, opt, data[:4])
    twin.load_state_dict(model.state_dict())
    opt2 = _build(rule, variant, twin, **_where(where, tmp_path / "b"))
    if where == "nvme":
        opt.save_streaming(tmp_path / "ckpt")
        opt2.load_streaming(tmp_path / "ckpt")
    else:
        saved = opt.state_dict()
        assert set(next(iter(saved["state"].values()))) == {"master", field, "step"}
        opt2.load_state_dict(saved)
    _steps(model, opt, data[4:])
    _steps(twin, opt2, data[4:])
    assert max_diff(model, twin) == 0.0
    opt.close()
    opt2.close()


@pytest.mark.cuda_form
@pytest.mark.parametrize("rule", ["lion", "adagrad"])
@pytest.mark.parametrize("where", ["host", "half-resident"])
def test_bf16_training_with_bf16_state(rule: str, where: str, tmp_path: pathlib.Path) -> None:
    """Mixed precision: bf16 weights, the fp32 master, the offloaded buckets' state in bf16
    (``moments_dtype``; resident buckets keep fp32). The weights the model holds are the master rounded (the kernel's
    ``out``, or the device step's copy), and the loss falls."""
    model, _ = make_pair(torch.bfloat16)
    config = {"moments_dtype": "bfloat16", **_where(where, tmp_path)}
    opt = _build(rule, "plain" if rule == "lion" else "defaults", model, **config)
    losses = []
    for tokens, targets in batches(12):
        loss = lm_loss(model, tokens, targets)
        loss.backward()
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    assert sum(losses[-3:]) < sum(losses[:3])
    state = opt.state_dict()["state"]
    field = "exp_avg" if rule == "lion" else "sum"
    dtypes = {entry[field].dtype for entry in state.values()}
    assert dtypes == ({torch.bfloat16} if where == "host" else {torch.bfloat16, torch.float32})
    for index, p in enumerate(model.parameters()):
        master = state[index]["master"].reshape(p.shape).to(p.device)  # a state dict: host
        assert torch.equal(p.detach(), master.bfloat16())
    opt.close()


@pytest.mark.cuda_form
def test_host_state_bytes_per_parameter() -> None:
    """Measured from the pools' report: every real parameter's state on the host is its
    fields' bytes: AdamW 12 (master, two moments), Lion 8 (master, one moment: 4 less),
    Adagrad 8 (master, sum); the estimator sizes the same from the rule."""
    builds = {
        "adamw": lambda m: OffloadAdamW(m.parameters(), config=_config(),
                                        accelerator=run_accelerator()),
        "lion": lambda m: OffloadLion(m.parameters(), config=_config(),
                                      accelerator=run_accelerator()),
        "adagrad": lambda m: OffloadAdagrad(m.parameters(), config=_config(),
                                            accelerator=run_accelerator()),
    }  # fmt: skip
    per_param = {}
    for name, build in builds.items():
        model, _ = make_pair()
        opt = build(model)
        report = opt.placement
        assert report.host % report.parameters == 0, name
        per_param[name] = report.host // report.parameters
        assert per_param[name] == rule_state(name).bytes_per_element, name
        opt.close()
    assert per_param == {"adamw": 12, "lion": 8, "adagrad": 8}
    assert per_param["adamw"] - per_param["lion"] == 4
    for name, measured in per_param.items():  # the estimator's rows, bf16 training
        ctx = Context(itemsize=2, world_size=1, ranks_per_node=1, bucket_bytes=1, rule=name)
        assert ctx.state_bytes == measured, name


@pytest.mark.cuda_form
@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda p: OffloadLion(p, lr=-1.0), r"OffloadLion\b.*lr must be >= 0.0, got -1.0"),
        (
            lambda p: OffloadLion(p, betas=(1.5, 0.99)),
            r"betas\[0\] must be in \[0.0, 1.0\), got 1.5",
        ),
        (lambda p: OffloadLion(p, betas=(0.9,)), r"betas must be a pair"),
        (lambda p: OffloadLion(p, weight_decay=-0.1), r"weight_decay must be >= 0.0, got -0.1"),
        (lambda p: OffloadLion(p, foreach=True), r"OffloadLion ignores torch's foreach="),
        (lambda p: OffloadAdagrad(p, lr_decay=-0.1), r"lr_decay must be >= 0.0, got -0.1"),
        (lambda p: OffloadAdagrad(p, eps=-1e-10), r"eps must be >= 0.0, got -1e-10"),
        (
            lambda p: OffloadAdagrad(p, initial_accumulator_value=-1.0),
            r"initial_accumulator_value must be >= 0.0, got -1.0",
        ),
        (lambda p: OffloadAdagrad(p, fused=True), r"OffloadAdagrad ignores torch's fused="),
        (
            lambda p: OffloadAdagrad(
                [{"params": p[:2]}, {"params": p[2:], "initial_accumulator_value": 0.5}]
            ),
            r"param group 1: initial_accumulator_value=0.5 differs from the constructor's "
            r"\(0.0\); torch.optim.Adagrad starts every parameter's sum from",
        ),
    ],
)
def test_a_bad_hyper_parameter_is_refused_by_name(build: Any, message: str) -> None:
    model, _ = make_pair()
    params = list(model.parameters())
    with pytest.raises(ValueError, match=message):
        build(params)


# -- the kernels ---------------------------------------------------------------------------

F32 = types.Array(types.float32, 1, "C")
U16 = types.Array(types.uint16, 1, "C")  # bf16 bits
NONE = types.Array(types.uint8, 1, "C")  # an absent out, or convert.KEEP_MASTER
TAKE = types.Array(types.int8, 1, "C")  # convert.TAKE_WRITTEN
VECTOR_LOAD = re.compile(r"= load <\d+ x (?:float|i16)>")
FUSED = re.compile(r"llvm\.(?:fma|fmuladd)\.")
TILES = {
    # the tile loop, and its scalars after the arrays (all fp32)
    "lion": (lion._lion_tile, 7),
    "adagrad": (adagrad._adagrad_tile, 4),
}


@pytest.mark.parametrize("name", list(TILES))
@pytest.mark.parametrize(
    ("grad", "out", "take"),
    [(F32, NONE, NONE), (U16, U16, NONE), (U16, U16, TAKE)],
    ids=["fp32", "bf16", "bf16-taking-written"],
)
def test_the_tile_loop_vectorises_and_fuses_nothing(
    name: str, grad: Any, out: Any, take: Any
) -> None:
    """As tests/test_kernels_vectorised.py checks Adam's loop: whole-vector loads, no
    gather, no fused multiply-add (Note [every specialisation rounds alike]), also where
    the master takes written weights (Note [the update takes the written weights])."""
    tile, scalars = TILES[name]
    signature = (F32, grad, types.int64, F32, out, take, *[types.float32] * scalars)
    dispatcher = njit(fastmath=convert.FASTMATH_ELEMENTWISE, error_model="numpy")(tile.py_func)
    dispatcher.compile(signature)
    ir = dispatcher.inspect_llvm(signature)
    assert VECTOR_LOAD.search(ir) is not None and "masked.gather" not in ir
    assert FUSED.search(ir) is None


def _kernel_case(seed: int = 0, n: int = 5000) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    master = torch.randn(n, generator=gen)
    grad = torch.randn(n, generator=gen).to(torch.bfloat16).float()  # exact in bf16
    state = torch.rand(n, generator=gen)
    return master, grad, state


@pytest.mark.parametrize("rule", [LION, ADAGRAD], ids=["lion", "adagrad"])
@pytest.mark.parametrize("maximize", [False, True])
def test_host_kernel_and_device_step_agree_bitwise(rule: Any, maximize: bool) -> None:
    """One tile through the CPU kernel (``tile_step``: bf16 gradient, bf16 out, in two tiles)
    and through the device step (``device_tile_step``: torch ops, fp32 gradient): the same
    bits, so a bucket's result does not depend on where its state lives. Adagrad's device
    step is torch's own operations (its vectorised addcmul fuses), so it is held to a few
    ulp."""
    group = {"lr": 1e-2, "betas": (0.9, 0.99), "weight_decay": 0.1, "maximize": maximize,
             "lr_decay": 0.05, "eps": 1e-10, "initial_accumulator_value": 0.0}  # fmt: skip
    hyper = rule.hyper(group)
    name = rule.state_fields(torch.float32, [group]).names[1]
    master, grad, state = _kernel_case()
    host = {"master": master.clone(), name: state.clone()}
    dev = {"master": master.clone(), name: state.clone()}
    out = torch.empty(master.numel(), dtype=torch.bfloat16)
    half = master.numel() // 2
    for lo, hi in ((0, half), (half, master.numel())):
        rule.tile_step({k: v[lo:hi] for k, v in host.items()}, grad.bfloat16()[lo:hi], step=3,
                       hyper=hyper, grad_scale=0.5, out=out[lo:hi])  # fmt: skip
    rule.device_tile_step(dev, grad, step=3, hyper=hyper, grad_scale=0.5,
                          step_tensor=torch.zeros(()))  # fmt: skip
    assert torch.equal(out, host["master"].bfloat16())
    for key in host:
        if rule is LION:
            assert torch.equal(host[key], dev[key]), key
        else:
            assert torch.allclose(host[key], dev[key], rtol=1e-6, atol=0), key


def test_the_kernels_name_a_bad_argument_before_writing() -> None:
    master, grad, state = _kernel_case()
    before = master.clone()
    with pytest.raises(ValueError, match=r"exp_avg has 4999 elements but param has 5000"):
        lion_step(master, grad, state[:-1], lr=1e-3, beta1=0.9, beta2=0.99, weight_decay=0.0)
    with pytest.raises(ValueError, match=r"beta2=1.5 is out of range"):
        lion_step(master, grad, state, lr=1e-3, beta1=0.9, beta2=1.5, weight_decay=0.0)
    with pytest.raises(ValueError, match=r"lr_decay=-1.0 is out of range"):
        adagrad_step(master, grad, state, step=1, lr=1e-2, lr_decay=-1.0, weight_decay=0.0,
                     eps=1e-10)  # fmt: skip
    with pytest.raises(TypeError, match=r"state_sum has dtype torch.float16"):
        adagrad_step(master, grad, state.half(), step=1, lr=1e-2, lr_decay=0.0,
                     weight_decay=0.0, eps=1e-10)  # fmt: skip
    with pytest.raises(ValueError, match=r"step=0 is invalid"):
        adagrad_step(master, grad, state, step=0, lr=1e-2, lr_decay=0.0, weight_decay=0.0,
                     eps=1e-10)  # fmt: skip
    assert torch.equal(master, before)


# -- properties ----------------------------------------------------------------------------


@st.composite
def rule_runs(draw: st.DrawFn) -> dict[str, Any]:
    """A rule, its hyper-parameters for two param groups, parameter sizes (1-element and
    prime sizes among them, so parameters straddle buckets and tiles) and where the state
    lives."""
    rule = draw(st.sampled_from(["lion", "adagrad"]))
    if rule == "lion":
        b1 = draw(st.sampled_from([0.0, 0.5, 0.9]))
        b2 = draw(st.sampled_from([0.9, 0.99]))

        def group() -> dict[str, Any]:
            return {"lr": draw(st.sampled_from([1e-4, 1e-3])), "betas": (b1, b2),
                    "weight_decay": draw(st.sampled_from([0.0, 0.1])),
                    "maximize": draw(st.booleans())}  # fmt: skip
    else:
        start = draw(st.sampled_from([0.0, 0.1]))

        def group() -> dict[str, Any]:
            return {"lr": draw(st.sampled_from([1e-3, 1e-2])),
                    "lr_decay": draw(st.sampled_from([0.0, 0.1])),
                    "weight_decay": draw(st.sampled_from([0.0, 0.1])),
                    "initial_accumulator_value": start, "eps": 1e-10,
                    "maximize": draw(st.booleans())}  # fmt: skip

    return {
        "rule": rule,
        "groups": (group(), group()),
        "sizes": draw(st.lists(st.sampled_from([1, 7, 97, 257, 1031, 4099]), min_size=2, max_size=6)),
        "fraction": draw(st.sampled_from([1.0, 0.5])),
        "bucket_bytes": draw(st.sampled_from([1024, 4096, 16384])),
        "split": draw(st.integers(min_value=1, max_value=5)),
    }  # fmt: skip


@pytest.mark.cuda_form
@settings(max_examples=scaled(8), deadline=None)
@given(run=rule_runs())
def test_random_shapes_groups_and_hyper_parameters_match_the_reference(run: dict) -> None:
    """Random parameters in two param groups (their own hyper-parameters), a fixed smooth
    loss, 6 steps: Lion bitwise against the paper's update, Adagrad within FP32_ATOL of
    torch's."""
    gen = torch.Generator().manual_seed(len(run["sizes"]))
    init = [on_device(torch.randn(n, generator=gen)) for n in run["sizes"]]
    scale = [on_device(torch.randn(n, generator=gen)) for n in run["sizes"]]
    ours = [torch.nn.Parameter(t.clone()) for t in init]
    theirs = [torch.nn.Parameter(t.clone()) for t in init]
    split = min(run["split"], len(init) - 1)

    def groups(params: list[torch.nn.Parameter]) -> list[dict[str, Any]]:
        first, second = run["groups"]
        return [{"params": params[:split], **first}, {"params": params[split:], **second}]

    facade = OffloadLion if run["rule"] == "lion" else OffloadAdagrad
    config = OffloadConfig(bucket_bytes=run["bucket_bytes"], tile_elements=1024,
                           offload_fraction=run["fraction"])  # fmt: skip
    # torch's Adagrad starts every sum from the constructor's value, ours refuses a group
    # that names another: the constructor is given it, as the reference is
    start = {k: v for k, v in run["groups"][0].items() if k == "initial_accumulator_value"}
    opt = facade(groups(ours), **start, config=config, accelerator=run_accelerator())
    reference = LionReference if run["rule"] == "lion" else torch.optim.Adagrad
    ropt = reference(groups(theirs), **run["groups"][0])
    for step in range(6):
        for params, o in ((ours, opt), (theirs, ropt)):
            loss = sum(
                (torch.sin(p * s * (1 + step)) * s).sum()
                for p, s in zip(params, scale, strict=True)
            )
            loss.backward()
            o.step()
            o.zero_grad()
    opt.close()
    diff = max((a - b).abs().max().item() for a, b in zip(ours, theirs, strict=True))
    assert diff == 0.0 if run["rule"] == "lion" else diff < FP32_ATOL


def test_adagrad_loads_torchs_state_of_parameters_not_stepped_yet() -> None:
    """torch's Adagrad saves every parameter from its construction on (``step`` 0, ``sum`` at
    its start), and a parameter no backward has reached yet keeps that entry: such a state
    dict loads (step 0 is "not stepped yet"), and the run goes on as torch's."""
    model, ref = make_pair()
    hyper = {"lr": 1e-2, "lr_decay": 0.05, "initial_accumulator_value": 0.25}
    ropt = torch.optim.Adagrad(ref.parameters(), **hyper)
    fresh = copy.deepcopy(ropt.state_dict())  # step 0 everywhere
    assert all(float(entry["step"]) == 0 for entry in fresh["state"].values())
    opt = OffloadAdagrad(model.parameters(), **hyper, config=_config(),
                         accelerator=run_accelerator())  # fmt: skip
    opt.load_state_dict(fresh)
    data = batches(4)
    for tokens, targets in data:
        for m, o in ((model, opt), (ref, ropt)):
            lm_loss(m, tokens, targets).backward()
            o.step()
            o.zero_grad()
    assert max_diff(model, ref) <= FP32_ATOL
    for p, rp in zip(model.parameters(), ref.parameters(), strict=True):
        assert int(opt.state[p]["step"]) == int(ropt.state[rp]["step"]) == 4
    opt.close()


def test_a_state_dict_of_another_rule_is_refused_and_changes_nothing() -> None:
    """state_dict() records its rule (as the streaming checkpoints do): an OffloadAdamW's
    loaded into an OffloadLion (Adam's moments taken for Lion's momentum) is refused,
    naming both, and nothing is loaded; Adam and AdamW load each other's, as torch's do."""
    from zero_offload import OffloadAdam

    model, _ = make_pair()
    adamw = OffloadAdamW(model.parameters(), lr=1e-3, config=_config(),
                         accelerator=run_accelerator())  # fmt: skip
    _steps(model, adamw, batches(2))
    saved = adamw.state_dict()
    assert (saved["zero_offload"]["rule"], saved["zero_offload"]["family"]) == ("adamw", "adam")
    adamw.close()
    lion = OffloadLion(model.parameters(), **LION_HYPER, config=_config(),
                       accelerator=run_accelerator())  # fmt: skip
    before = lion.state_dict()
    with pytest.raises(ValueError, match=r"saved by an optimizer with the 'adamw' rule.*'lion'"):
        lion.load_state_dict(saved)
    after = lion.state_dict()
    assert after["param_groups"] == before["param_groups"] and after["state"] == {}
    lion.close()
    adam = OffloadAdam(model.parameters(), config=_config(), accelerator=run_accelerator())
    adam.load_state_dict(saved)
    adam.close()
