"""OffloadAdafactor (issue 37): a rule that reads whole parameters (Note [rules that read a
whole parameter] in zero_offload/optim/rule/base.py).

1. Parity over 20 steps in fp32 against ``torch.optim.Adafactor``'s for-loop (the
   TinyTransformer has 2-D and 1-D parameters, so both the factored and the full second
   moment), with clipping (``OffloadConfig(max_grad_norm=...)`` and ``opt.clip_grad_norm_``
   against ``torch.nn.utils.clip_grad_norm_``) and with 4 micro-batches of accumulation;
   the yardstick is torch's own for-loop vs foreach spread on the same run.
2. The factors in ``opt.state`` and ``state_dict()`` have torch's names and shapes; a
   resumed run is bitwise equal to an uninterrupted one; torch's own state dict loads.
3. A step announced during backward is bitwise the plain step.
4. bf16 weights: the model holds the master rounded, and the loss falls.
5. Host state bytes per parameter from the pools' report, against the estimator.
6. Every unsupported combination is refused at construction, naming the rule and
   the feature; bad hyper-parameters by name. Streaming checkpoints work:
   tests/test_whole_rules_streaming.py.
7. The kernel against torch on odd shapes (3-D, 1-wide, 0-D).
8. The kernel's factored U (Note [the update from the factors]) against torch's, elementwise:
   NaN, inf, 0 and clamped values where torch has them, the rest within a few ulp.
9. The kernel's fast paths give the plain path's bits: pass 1's four rows at a time (its
   fp32 runs of rows) and its uncopied fp32 gradient, on any number of threads.
10. Pass 1's reused partials (Note [pass 1's partials are reused]): the same bits from a
   fresh buffer, one left by a larger matrix, one full of NaN, and from two threads at once.
"""

from __future__ import annotations

import math
from typing import Any

import numba
import numpy as np
import pytest
import torch

from zero_offload import OffloadAdafactor, OffloadConfig
from zero_offload.estimate.pools import rule_state, rule_state_bytes
from zero_offload.kernels import adafactor, adafactor_stats, adafactor_step
from zero_offload.optim.rule import ADAFACTOR

from .helpers.models import batches, host_accelerator, lm_loss, make_pair, max_diff

STEPS = 20
#: 2 ulp of 1.0: the floor of the parity bound, where torch's two paths happen to agree
#: more closely than that on a run.
FLOOR = 2 * torch.finfo(torch.float32).eps
VARIANTS = {
    "defaults": {},
    "weight_decay": {"weight_decay": 0.1},
    "all": {"lr": 3e-2, "beta2_decay": -0.5, "eps": (1e-6, 1e-2), "d": 2.0,
            "weight_decay": 0.05},
    "maximize": {"maximize": True, "weight_decay": 0.1},
}  # fmt: skip


def _config(**config: Any) -> OffloadConfig:
    return OffloadConfig(bucket_bytes=8192, tile_elements=1024, **config)


def _build(
    model: torch.nn.Module, variant: str = "weight_decay", **config: Any
) -> OffloadAdafactor:
    return OffloadAdafactor(model.parameters(), **VARIANTS[variant], config=_config(**config),
                            accelerator=host_accelerator())  # fmt: skip


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, *, micro: int, clip: str | None,
           ours: bool) -> None:  # fmt: skip
    data = batches(STEPS * micro)
    for i in range(0, len(data), micro):
        for tokens, targets in data[i : i + micro]:
            lm_loss(model, tokens, targets).backward()
        if clip == "call" and ours:
            opt.clip_grad_norm_(0.5)  # type: ignore[attr-defined]
        elif clip is not None and not ours:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()


def _steps(model: torch.nn.Module, opt: torch.optim.Optimizer, part: list) -> None:
    for tokens, targets in part:
        lm_loss(model, tokens, targets).backward()
        opt.step()
        opt.zero_grad()


CASES = [
    *[(v, 1, None) for v in VARIANTS],
    ("weight_decay", 1, "config"),
    ("weight_decay", 1, "call"),
    ("weight_decay", 4, None),
    ("all", 4, "config"),
]


@pytest.mark.cuda_form
@pytest.mark.parametrize(("variant", "micro", "clip"), CASES,
                         ids=[f"{v}-micro{m}-clip{c}" for v, m, c in CASES])  # fmt: skip
def test_matches_torch_within_its_own_foreach_spread(
    variant: str, micro: int, clip: str | None
) -> None:
    """Ours against torch's for-loop, within max(2 x its spread from torch's foreach, 2 ulp
    of 1; measured: within 1.0 x, at most 4.8e-7): the norms (weights, update, clipping's)
    are summed in another order, so the step sizes differ in their last bits, as between
    torch's two paths, and a matrix's U is the factored form, a few ulp of U from torch's
    (Note [the update from the factors] in kernels/adafactor.py)."""
    model, ref = make_pair()
    _, ref_foreach = make_pair()
    opt = _build(model, variant, max_grad_norm=0.5 if clip == "config" else None)
    hyper = VARIANTS[variant]
    loop = torch.optim.Adafactor(ref.parameters(), **hyper, foreach=False)
    foreach = torch.optim.Adafactor(ref_foreach.parameters(), **hyper, foreach=True)
    _train(model, opt, micro=micro, clip=clip, ours=True)
    _train(ref, loop, micro=micro, clip=clip, ours=False)
    _train(ref_foreach, foreach, micro=micro, clip=clip, ours=False)
    spread = max_diff(ref_foreach, ref)
    diff = max_diff(model, ref)
    assert diff <= max(2 * spread, FLOOR), (diff, spread)
    for p, rp in zip(model.parameters(), ref.parameters(), strict=True):
        ours, theirs = opt.state[p], loop.state[rp]
        names = {"row_var", "col_var"} if p.dim() >= 2 else {"variance"}
        assert set(ours) == {"master", "step", *names}
        assert int(ours["step"]) == int(theirs["step"]) == STEPS
        for name in names:
            assert ours[name].shape == theirs[name].shape, name
            assert torch.allclose(ours[name], theirs[name], rtol=1e-5, atol=1e-12), name
    opt.close()


@pytest.mark.cuda_form
def test_a_resumed_run_is_bitwise_equal_and_torch_state_loads() -> None:
    """``state_dict()`` holds torch's per-parameter keys (``row_var``/``col_var`` or
    ``variance``, ``step``) and our ``master``; a second optimizer loaded from it continues
    bitwise as the first. A ``torch.optim.Adafactor`` state dict loads too (the master from
    the weights) and continues as torch does."""
    data = batches(8)
    model, twin = make_pair()
    opt = _build(model)
    _steps(model, opt, data[:4])
    twin.load_state_dict(model.state_dict())
    opt2 = _build(twin)
    saved = opt.state_dict()
    keys = {frozenset(entry) for entry in saved["state"].values()}
    assert keys == {frozenset({"master", "row_var", "col_var", "step"}),
                    frozenset({"master", "variance", "step"})}  # fmt: skip
    opt2.load_state_dict(saved)
    _steps(model, opt, data[4:])
    _steps(twin, opt2, data[4:])
    assert max_diff(model, twin) == 0.0
    opt.close()
    opt2.close()

    ours, ref = make_pair()
    torch_opt = torch.optim.Adafactor(ref.parameters(), **VARIANTS["weight_decay"])
    _steps(ref, torch_opt, data[:4])
    ours.load_state_dict(ref.state_dict())
    opt3 = _build(ours)
    opt3.load_state_dict(torch_opt.state_dict())
    _steps(ours, opt3, data[4:])
    _steps(ref, torch_opt, data[4:])
    assert max_diff(ours, ref) < 1e-6
    opt3.close()


def test_a_state_dict_without_state_restarts_the_factors_from_zero() -> None:
    data = batches(4)
    model, ref = make_pair()
    opt = _build(model)
    _steps(model, opt, data[:2])
    opt.load_state_dict({**opt.state_dict(), "state": {}})
    ref.load_state_dict(model.state_dict())
    ropt = torch.optim.Adafactor(ref.parameters(), **VARIANTS["weight_decay"])
    _steps(model, opt, data[2:])
    _steps(ref, ropt, data[2:])
    assert max_diff(model, ref) < 1e-6
    opt.close()


@pytest.mark.cuda_form
def test_a_step_announced_during_backward_is_bitwise_the_plain_step() -> None:
    data = batches(4)
    model, twin = make_pair()
    opt, opt2 = _build(model), _build(twin)
    for tokens, targets in data:
        opt.backward(lm_loss(model, tokens, targets), step=True)
        opt.step()
        opt.zero_grad()
    _steps(twin, opt2, data)
    assert max_diff(model, twin) == 0.0
    opt.close()
    opt2.close()


@pytest.mark.cuda_form
def test_bf16_training() -> None:
    """bf16 weights, the fp32 master and fp32 factors: the model holds the master rounded
    (the kernel's ``out``), and the loss falls."""
    model, _ = make_pair(torch.bfloat16)
    opt = _build(model, "defaults")
    losses = []
    for tokens, targets in batches(12):
        loss = lm_loss(model, tokens, targets)
        loss.backward()
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    assert sum(losses[-3:]) < sum(losses[:3])
    state = opt.state_dict()["state"]
    for index, p in enumerate(model.parameters()):
        assert torch.equal(p.detach(), state[index]["master"].reshape(p.shape).bfloat16())
        assert all(t.dtype == torch.float32 for t in state[index].values())
    opt.close()


def test_host_state_bytes_per_parameter() -> None:
    """From the pools' report: the fp32 master (4 per element) and the shaped state, which
    is sublinear for the matrices; the same as the estimator's ``rule_state_bytes``."""
    model, _ = make_pair()
    shapes = [tuple(p.shape) for p in model.parameters()]
    opt = _build(model)
    report = opt.placement
    numel = sum(math.prod(s) for s in shapes)
    assert report.parameters == numel
    factors = sum(
        (math.prod(s[:-1]) + math.prod(s[:-2]) * s[-1]) if len(s) >= 2 else math.prod(s)
        for s in shapes
    )
    assert report.host == 4 * numel + 4 * factors == rule_state_bytes("adafactor", shapes)
    assert rule_state("adafactor").bytes_per_element == 4
    per_param = report.host / report.parameters
    assert 4 < per_param < 5  # against AdamW's 12
    # The pools hold it: the host pool was sized with the shaped state.
    assert report.pinned + report.pageable >= report.host
    opt.close()


# -- refusals ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("config", "message"),
    [({"partition_parameters": True}, r"partition_parameters=True \(ZeRO-3 shards")],
)
def test_unsupported_features_are_refused_at_construction(config: dict, message: str) -> None:
    model, _ = make_pair()
    with pytest.raises(ValueError, match=r"OffloadAdafactor: the adafactor rule reads whole "
                       r"parameters .* does not support " + message):  # fmt: skip
        _build(model, **config)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"lr": -1.0}, ValueError, r"lr must be >= 0.0, got -1.0"),
        ({"beta2_decay": 0.5}, ValueError, r"beta2_decay must be <= 0, got 0.5"),
        ({"eps": (1e-30,)}, ValueError, r"eps must be a pair"),
        ({"eps": (-1.0, 1e-3)}, ValueError, r"eps\[0\] must be >= 0.0, got -1.0"),
        ({"d": 0.5}, ValueError, r"d must be >= 1.0, got 0.5"),
        ({"weight_decay": -0.1}, ValueError, r"weight_decay must be >= 0.0, got -0.1"),
        ({"maximize": 1}, TypeError, r"maximize must be a bool"),
        ({"foreach": True}, ValueError, r"OffloadAdafactor ignores torch's foreach="),
    ],
)
def test_a_bad_hyper_parameter_is_refused_by_name(kwargs: dict, error: type, message: str) -> None:
    model, _ = make_pair()
    with pytest.raises(error, match=message):
        OffloadAdafactor(model.parameters(), **kwargs)


# -- the kernel ----------------------------------------------------------------------------


@pytest.mark.parametrize("growth", [1.0, 1.3], ids=["steady", "clipped"])
@pytest.mark.parametrize("shape", [(37,), (), (3, 5, 7), (1, 9), (9, 1), (300, 200)])
def test_the_kernel_follows_torch_on_odd_shapes(shape: tuple[int, ...], growth: float) -> None:
    """20 steps of one parameter against torch's for-loop, bf16 gradients: within a few ulp,
    and the factors as torch keeps them. With gradients growing 1.3x a step, each step's U
    is larger than the second moment's average: its RMS is above d = 1 and the update
    clipping binds, so its norm (from the factors where nothing is clamped: Note [the
    update's norm from the factors]) sets every step's size."""
    gen = torch.Generator().manual_seed(len(shape))
    p0 = torch.randn(shape, generator=gen)
    ref = torch.nn.Parameter(p0.clone())
    opt = torch.optim.Adafactor([ref], lr=1e-2, weight_decay=0.1)
    unclipped = torch.nn.Parameter(p0.clone())  # d so large that nothing is clipped
    opt_unclipped = torch.optim.Adafactor([unclipped], lr=1e-2, weight_decay=0.1, d=1e30)
    master = p0.clone().reshape(-1)
    state = {f.name: torch.zeros(f.shape) for f in ADAFACTOR.param_state(shape)}
    for step in range(1, STEPS + 1):
        grad = (torch.randn(shape, generator=gen) * growth**step).bfloat16()
        ref.grad = grad.float()
        unclipped.grad = grad.float()
        opt.step()
        opt_unclipped.step()
        adafactor_step(master, grad.reshape(-1), shape=shape, step=step, lr=1e-2,
                       beta2_decay=-0.8, eps1=torch.finfo(torch.float32).eps, eps2=1e-3, d=1.0,
                       weight_decay=0.1, **{k: v.view(-1) for k, v in state.items()})  # fmt: skip
    assert torch.allclose(master, ref.detach().reshape(-1), rtol=0, atol=1e-6)
    for name, value in state.items():
        assert torch.allclose(value, opt.state[ref][name], rtol=1e-5, atol=0), name
    if growth > 1:  # the clipping bound: torch's unclipped run went elsewhere
        assert not torch.allclose(ref, unclipped, rtol=0, atol=1e-4)


def test_the_kernel_names_a_bad_argument_before_writing() -> None:
    master = torch.randn(12)
    before = master.clone()
    grad = torch.randn(12)
    common = {"step": 1, "lr": 1e-2, "beta2_decay": -0.8, "eps1": 1e-7, "eps2": 1e-3, "d": 1.0,
              "weight_decay": 0.0}  # fmt: skip
    with pytest.raises(ValueError, match=r"col_var has 3 elements but needs 4"):
        adafactor_step(master, grad, shape=(3, 4), row_var=torch.zeros(3), col_var=torch.zeros(3),
                       **common)  # fmt: skip
    with pytest.raises(ValueError, match=r"param has 12 elements but shape \(13,\) has 13"):
        adafactor_step(master, grad, shape=(13,), variance=torch.zeros(13), **common)
    with pytest.raises(ValueError, match=r"beta2_decay=0.5 is out of range"):
        adafactor_step(master, grad, shape=(12,), variance=torch.zeros(12),
                       **{**common, "beta2_decay": 0.5})  # fmt: skip
    assert torch.equal(master, before)


def _ordered(x: np.ndarray) -> np.ndarray:
    """fp32 bits as integers in the floats' order: the difference of two is ulps apart."""
    i = x.astype(np.float32).view(np.int32).astype(np.int64)
    return np.where(i < 0, -(i & 0x7FFFFFFF), i)


#: How far the factored U may be from torch's, in ulp of U (Note [the update from the
#: factors]): ours within 2 ulp of the exact value (a_i, b_j, their product, the multiply
#: by G: half an ulp each), torch's within 2.5 (V's product and division, halved by the
#: square root, then the square root, the reciprocal and the multiply), and torch's fp32
#: row mean may differ from our once-rounded float64 mean by an ulp (half an ulp of U).
#: Measured: at most 4, a few elements in ten thousand.
U_ULPS = 5


@pytest.mark.parametrize("eps1", [1.2e-7, 1e-3, 0.0], ids=["default", "large", "zero"])
def test_the_factored_update_is_torchs_to_a_few_ulp(eps1: float) -> None:
    """Note [the update from the factors]: U = min(a_i * b_j, cap) * G against torch's
    rsqrt(max((R @ C) / max(mean(R), eps1), eps1^2)) * G, over factors spread across 24
    decades (so many elements clamp) and rows and columns of 0, inf and NaN (one special
    row per batch: a batch with an inf or NaN row has an inf or NaN row mean): NaN, inf, 0
    and the clamped values exactly where torch has them, every other U within U_ULPS."""
    gen = np.random.default_rng(3)
    batches, m, n = 4, 37, 300
    row_var = 10.0 ** gen.uniform(-12, 12, (batches, m, 1))
    col_var = 10.0 ** gen.uniform(-12, 12, (batches, 1, n))
    for b, special in enumerate([1.0, 0.0, math.inf, math.nan]):
        row_var[b, 1] = special if b else row_var[b, 1]
        col_var[b, 0, :3] = (0.0, math.inf, math.nan)
    row_var, col_var = row_var.astype(np.float32), col_var.astype(np.float32)
    g = gen.standard_normal((batches, m, n), dtype=np.float32)
    g[:, 5, :4] = (0.0, math.inf, -math.inf, math.nan)

    r, c = torch.from_numpy(row_var), torch.from_numpy(col_var)
    v = (r @ c).div_(r.mean(dim=-2, keepdim=True).clamp_(min=eps1))
    clear = (v < 0.999 * eps1 * eps1).numpy()  # clamped, and not by a rounding
    want = (v.clamp_(min=eps1 * eps1).rsqrt_() * torch.from_numpy(g)).numpy()

    row_f = np.empty(batches * m, np.float32)
    col_f = np.empty(batches * n, np.float32)
    adafactor._rsqrt_factors(row_var.reshape(-1), col_var.reshape(-1), m, np.float32(eps1),
                             row_f, col_f, np.empty(batches))  # fmt: skip
    cap = np.float32(adafactor.adafactor_update_cap(eps1))
    got = np.empty_like(g)
    for b in range(batches):
        for i in range(m):
            adafactor._u_row(g[b, i], 0, np.float32(1.0), col_f[b * n : (b + 1) * n],
                             row_f[b * m + i], cap, got[b, i])  # fmt: skip
    assert np.array_equal(np.isnan(got), np.isnan(want))
    finite = np.isfinite(want) & (want != 0)
    assert np.array_equal(got[~finite & ~np.isnan(want)], want[~finite & ~np.isnan(want)])
    assert np.array_equal(got[clear & finite], want[clear & finite])
    ulps = np.abs(_ordered(got[finite]) - _ordered(want[finite]))
    assert ulps.max() <= U_ULPS, ulps.max()
    assert (clear & finite).any() == (eps1 > 0)
    assert (finite & ~clear).sum() > batches * m * n // 10  # not only clamped values


#: Shapes for the fast-path checks: batches whose rows are not a multiple of four, rows
#: wider than a reduction chunk, several row blocks, a single row.
FAST_PATH_SHAPES = [(2, 7, 2050), (513, 4097), (6, 33), (1, 300), (37, 1)]


@pytest.mark.parametrize("shape", FAST_PATH_SHAPES, ids=str)
def test_fast_paths_give_the_plain_bits(shape: tuple[int, ...]) -> None:
    """The same gradient values as fp32 (pass 1 sums it uncopied), as bf16 (copied, scaled),
    as negated fp32 under maximize (copied, scaled by -1), on one thread and on all: equal
    bits of the master, the factors and ``out`` after three steps."""
    gen = torch.Generator().manual_seed(sum(shape))
    numel = math.prod(shape)
    p0 = torch.randn(numel, generator=gen)
    grads = [torch.randn(numel, generator=gen).bfloat16() for _ in range(3)]

    def run(variant: str, threads: int) -> list[torch.Tensor]:
        master = p0.clone()
        state = {f.name: torch.zeros(f.shape).view(-1) for f in ADAFACTOR.param_state(shape)}
        out = torch.empty(numel, dtype=torch.bfloat16)
        for step, g in enumerate(grads, start=1):
            grad = {"fp32": g.float(), "bf16": g, "maximize": -g.float()}[variant]
            adafactor_step(master, grad, shape=shape, step=step, lr=1e-2, beta2_decay=-0.8,
                           eps1=1.2e-7, eps2=1e-3, d=1.0, weight_decay=0.1,
                           maximize=variant == "maximize", out=out, num_threads=threads,
                           **state)  # fmt: skip
        return [master, out, *state.values()]

    pool = numba.config.NUMBA_NUM_THREADS
    plain = run("fp32", 1)
    runs = [
        run(variant, threads) for variant in ("fp32", "bf16", "maximize") for threads in (1, pool)
    ]
    for other in runs:
        for a, b in zip(plain, other, strict=True):
            assert torch.equal(a.view(torch.int16 if a.element_size() == 2 else torch.int32),
                               b.view(torch.int16 if b.element_size() == 2 else torch.int32))  # fmt: skip


@pytest.mark.parametrize("direct", [True, False], ids=["fp32-uncopied", "scaled-copy"])
@pytest.mark.parametrize("shape", [(2, 7, 2050), (9, 4100), (40, 2050)], ids=str)
def test_pass_1_adds_in_row_order(shape: tuple[int, ...], direct: bool) -> None:
    """Note [pass 1 four rows at a time]: a column's squares are added in fp32 row by row
    over runs of COLUMN_ROWS rows of one batch counted from the block's first row, each
    run's sum added in float64 in run order; the row sums and p's sum are the reduction
    loop over each row's chunks in order: bit for bit what a row-by-row walk gives."""
    from zero_offload.kernels.stats import SUM_CHUNK, _sumsq_f32

    gen = np.random.default_rng(len(shape))
    *batch, m, n = shape
    rows = math.prod(batch) * m
    grad = gen.standard_normal(rows * n, dtype=np.float32)
    param = gen.standard_normal(rows * n, dtype=np.float32)
    nblocks = 2  # blocks of 7 rows (one batch each), of 4 and 5 rows, of 20 rows (16 + 4)
    rowsq = np.empty(rows)
    # Left over from before: pass 1 zeroes its blocks' rows (Note [pass 1's partials are
    # reused]).
    colpart = np.full((nblocks, rows // m * n), np.nan)
    colw = np.full((nblocks, rows // m * n), np.inf)
    psq = np.empty(nblocks)
    row_var = gen.uniform(0.5, 2.0, rows).astype(np.float32)
    weight = np.float32(0.3)
    adafactor_stats._factored_stats(param, grad, 0, np.float32(1.0), m, n, nblocks, rowsq, colpart,
                              psq, direct, row_var, weight, colw)  # fmt: skip
    squares = grad.reshape(rows, n) * grad.reshape(rows, n)  # fp32, rounded as the kernel
    for blk in range(nblocks):
        r0, r1 = rows * blk // nblocks, rows * (blk + 1) // nblocks
        expect = np.zeros(rows // m * n)
        expect_w = np.zeros(rows // m * n)
        p_sum = 0.0
        run = np.zeros(n, dtype=np.float32)
        run_w = np.zeros(n, dtype=np.float32)
        for r in range(r0, r1):
            cb = r // m * n
            run += squares[r]  # fp32, in row order
            s = adafactor_stats._row_scale(rowsq[r], row_var[r], n, weight)
            scaled = grad[r * n : (r + 1) * n] * s  # fp32
            run_w += scaled * scaled
            if (r - r0 + 1) % adafactor_stats.COLUMN_ROWS == 0 or r + 1 == r1 or (r + 1) % m == 0:
                expect[cb : cb + n] += run.astype(np.float64)
                expect_w[cb : cb + n] += run_w.astype(np.float64)
                run[:] = 0.0
                run_w[:] = 0.0
            for lo in range(0, n, SUM_CHUNK):
                p_sum += _sumsq_f32(param[r * n + lo : r * n + min(lo + SUM_CHUNK, n)])
        assert np.array_equal(colpart[blk], expect)
        assert np.array_equal(colw[blk], expect_w)
        assert psq[blk] == p_sum
    for r in range(rows):
        chunks = [
            grad[r * n + lo : r * n + min(lo + SUM_CHUNK, n)] for lo in range(0, n, SUM_CHUNK)
        ]
        total = 0.0
        for chunk in chunks:
            total += _sumsq_f32(chunk)
        assert rowsq[r] == total


def _factored_norms(shape: tuple[int, ...], grad: np.ndarray, row_var: np.ndarray,
                    col_var: np.ndarray, eps1: float) -> tuple[float, float]:  # fmt: skip
    """||U||^2 of one step two ways: from pass 1's weighted column sums and the factors, and
    pass 2's sum over the U the update applies (Note [the update's norm from the factors])."""
    *batch, m, n = shape
    rows = math.prod(batch) * m
    nblocks = adafactor_stats._row_blocks(rows, n, rows // m * n)
    weight = np.float32(0.6)
    param = np.ones(rows * n, np.float32)
    rowsq, psq = np.empty(rows), np.empty(nblocks)
    colpart, colw = np.zeros((2, nblocks, rows // m * n))
    adafactor_stats._factored_stats(param, grad, 0, np.float32(1.0), m, n, nblocks, rowsq, colpart,
                              psq, True, row_var, weight, colw)  # fmt: skip
    adafactor_stats._update_factors(rowsq, colpart, row_var, col_var, m, n, weight)
    row_f, col_f = np.empty(rows, np.float32), np.empty(rows // m * n, np.float32)
    rmeans = np.empty(rows // m)
    adafactor._rsqrt_factors(row_var, col_var, m, np.float32(eps1), row_f, col_f, rmeans)
    cap = np.float32(adafactor.adafactor_update_cap(eps1))
    usq = np.empty(nblocks)
    adafactor._factored_usq(grad, 0, np.float32(1.0), m, n, row_f, col_f, cap, nblocks, usq)
    return adafactor_stats._usq_from_factors(colw, row_f, col_f, rmeans, cap), math.fsum(usq)


@pytest.mark.parametrize("shape", [(3, 50, 70), (300, 200), (1, 9), (9, 1), (40, 4100)], ids=str)
@pytest.mark.parametrize("spread", [0.0, 6.0], ids=["unit", "12-decades"])
def test_the_norm_from_the_factors_is_the_applied_updates(
    shape: tuple[int, ...], spread: float
) -> None:
    """Note [the update's norm from the factors]: where no element is clamped, ||U||^2 from
    pass 1's sums of (g_ij / sqrt(R_i))^2 by column, times r_b and b_j^2, is pass 2's sum
    of the applied U^2 within 1e-6 relative (both within a few ulp of exact per term, and
    the sums' own rounding), with gradients and state across 12 decades."""
    gen = np.random.default_rng(sum(shape))
    *batch, m, n = shape
    rows = math.prod(batch) * m
    scale_r = 10.0 ** gen.uniform(-spread, spread, (rows, 1))
    scale_c = 10.0 ** gen.uniform(-spread, spread, (1, n))
    grad = (gen.standard_normal((rows, n)) * scale_r * scale_c).astype(np.float32).reshape(-1)
    row_var = (10.0 ** gen.uniform(-spread, spread, rows)).astype(np.float32)
    col_var = (10.0 ** gen.uniform(-spread, spread, rows // m * n)).astype(np.float32)
    fast, slow = _factored_norms(shape, grad, row_var, col_var, eps1=0.0)
    assert fast >= 0.0
    assert abs(fast - slow) <= 1e-6 * slow, (fast, slow)


@pytest.mark.parametrize(
    "case",
    ["clamped", "zero row", "zero column", "nan", "inf"],
)
def test_the_norm_from_the_factors_declines_what_it_cannot_know(case: str) -> None:
    """Where an element may be clamped (a large eps1, a zero row or column: a factor of inf)
    or a factor or sum is not finite, the factors do not give ||U||: the kernel returns -1
    and the step sums the applied U in pass 2."""
    shape = (30, 20)
    gen = np.random.default_rng(7)
    grad = gen.standard_normal(600).astype(np.float32)
    eps1 = 0.0
    if case == "clamped":
        eps1 = 0.5  # cap 2: most a_i * b_j are near 1 / rms(g) ~ 1, some above 2
        grad[:20] *= 1e-3  # a row of small gradients: a_0 * b_j large
    elif case == "zero row":
        grad[20:40] = 0.0
    elif case == "zero column":
        grad[3::20] = 0.0
    else:
        grad[5] = math.nan if case == "nan" else math.inf
    fast, slow = _factored_norms(
        shape, grad, np.zeros(30, np.float32), np.zeros(20, np.float32), eps1
    )
    assert fast == -1.0, (fast, slow)


@pytest.mark.parametrize(("eps1", "passes"), [(1.2e-7, 0), (0.5, 1)], ids=["fits", "clamps"])
def test_pass_2_runs_only_where_an_element_may_be_clamped(
    monkeypatch: pytest.MonkeyPatch, eps1: float, passes: int
) -> None:
    """The step makes two passes over a matrix where no element is clamped (the norm from
    the factors), three where one may be (pass 2, the sum of the applied U); 1-D parameters
    always two (their U^2 is summed beside V's update)."""
    calls = []
    real = adafactor._factored_usq
    monkeypatch.setattr(adafactor, "_factored_usq", lambda *a: calls.append(1) or real(*a))
    gen = torch.Generator().manual_seed(5)
    shape = (64, 48)
    master = torch.randn(shape, generator=gen).reshape(-1)
    grad = torch.randn(shape, generator=gen).reshape(-1)
    grad[:48] *= 1e-4  # row 0: tiny gradients, a_0 large: clamped under eps1 = 0.5
    state = {f.name: torch.zeros(f.shape).view(-1) for f in ADAFACTOR.param_state(shape)}
    adafactor_step(master, grad, shape=shape, step=1, lr=1e-2, beta2_decay=-0.8, eps1=eps1,
                   eps2=1e-3, d=1.0, weight_decay=0.0, **state)  # fmt: skip
    assert len(calls) == passes


def _kernel_run(shape: tuple[int, ...], seed: int) -> tuple[bytes, ...]:
    """Three Adafactor steps of a ``shape`` parameter; its master and factors' bytes."""
    gen = torch.Generator().manual_seed(seed)
    *batch, m, n = shape
    numel = math.prod(shape)
    param = torch.randn(numel, generator=gen)
    row_var, col_var = torch.zeros(math.prod(batch) * m), torch.zeros(math.prod(batch) * n)
    for step in range(1, 4):
        grad = torch.randn(numel, generator=gen) * 10.0 ** (step - 2)
        adafactor_step(param, grad, shape=shape, row_var=row_var, col_var=col_var, step=step,
                       lr=1e-2, beta2_decay=-0.8, eps1=1e-30, eps2=1e-3, d=1.0,
                       weight_decay=0.0)  # fmt: skip
    return tuple(t.numpy().tobytes() for t in (param, row_var, col_var))


def test_pass_one_partials_reused_from_any_state_give_the_same_bits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every step here takes ||U|| from the factors (pass 2 is never made, counted), so a
    weighted partial left unzeroed could not hide behind pass 2's own sum."""
    pass_two: list[int] = []
    real_usq = adafactor._factored_usq
    monkeypatch.setattr(
        adafactor, "_factored_usq", lambda *args: (pass_two.append(1), real_usq(*args))[1]
    )
    shape = (2, 96, 300)
    nblocks = adafactor_stats._row_blocks(2 * 96, 300, 2 * 300)
    adafactor_stats.release_column_partials()
    fresh = _kernel_run(shape, 0)  # the thread's first buffer
    _kernel_run((512, 700), 1)  # grows it past this matrix's need
    assert _kernel_run(shape, 0) == fresh  # a prefix of the larger one, as it was left
    plain, weighted = adafactor_stats.column_partials(nblocks, 2 * 300)  # this shape's own
    plain[:] = np.nan
    weighted[:] = -np.inf
    assert _kernel_run(shape, 0) == fresh  # over NaN (plain) and -inf (weighted)
    assert pass_two == []
    adafactor_stats.release_column_partials()
    assert getattr(adafactor_stats._partials, "buffer", None) is None


def test_pass_one_partials_are_per_thread() -> None:
    """Two threads stepping different matrices at once each get their own buffer: their
    results are those of the same steps run one after the other."""
    import threading

    shapes = [((300, 257), 3), ((3, 64, 129), 4)]
    alone = [_kernel_run(shape, seed) for shape, seed in shapes]
    results: list[Any] = [None, None]
    buffers: list[Any] = [None, None]

    def run(i: int) -> None:
        for _ in range(3):
            results[i] = _kernel_run(*shapes[i])
        buffers[i] = adafactor_stats._partials.buffer

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == alone
    assert buffers[0] is not None and buffers[1] is not None
    assert not np.shares_memory(buffers[0], buffers[1])
