"""Property-based parity of the rules beside AdamW (issue 37): OffloadLion, OffloadAdagrad,
OffloadAdafactor and OffloadMuon through their public API.

Hypothesis draws parameter shapes (0-d, 1-element, prime-sized vectors, tall, wide and
1-wide matrices, a 3-D tensor), 1 to 3 param groups each with its own hyper-parameters,
``bucket_bytes`` and ``tile_elements`` (parameters straddle buckets and tiles), clipping
(none, ``OffloadConfig(max_grad_norm=...)``, ``opt.clip_grad_norm_``; binding or not), 1 to
3 micro-batches and 1 to 3 steps, and checks:

- Lion against the paper's update (``LionReference``, tests/test_lion_adagrad.py), bitwise;
- Adagrad against ``torch.optim.Adagrad``, within torch's own for-loop/foreach spread;
- Adafactor against ``torch.optim.Adafactor``, within torch's own for-loop/foreach spread;
- Muon: its matrices bitwise ``torch.optim.Muon``, its other parameters within torch's own
  for-loop/fused AdamW spread;
- every rule against itself under another bucket and tile layout and another split of the
  same hyper-parameters into groups, bitwise, with every statistic the host's (the anchor at
  the end shows why: a norm taken on the device may move ``last_grad_norm`` by an ulp).

Note [one clip, two checks]: clipping is checked in two parts so that each can be exact.
The norm our step reports (``last_grad_norm``, summed in fp64) is held to torch's
``get_total_norm`` (fp32 per-tensor norms, then their norm) at ``NORM_RTOL``; the reference
then scales its gradients by the coefficient our norm implies, ``min(1, max_norm / (norm +
1e-6))``, as ``clip_grad_norm_`` computes it. Fed torch's own (last-bits different)
coefficient, Lion would flip the sign of a near-zero ``c`` now and then (an lr-sized step)
and Muon's bf16 Newton-Schulz would round differently: the bitwise claims would become
chance.

The loss is separable, ``sum_i sum(sin(p_i * s_i * k) * s_i)`` (``k`` changes with step and
micro-batch), so a parameter's gradient depends on its own weights only: a few-ulp
difference in one parameter (Adagrad's, Adafactor's, Muon's AdamW part) cannot reach
another's gradient and turn into drift, and each comparison measures its rule's arithmetic.

Host only: Muon's reference would orthogonalize on the GPU (cuBLAS bf16) while ours does on
the CPU; the other properties have not been run under ``--accelerator=cuda``.
Examples are sized with ``scaled`` (tests/helpers/properties.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zero_offload import OffloadAdafactor, OffloadAdagrad, OffloadConfig, OffloadLion, OffloadMuon

from .helpers.device import run_accelerator
from .helpers.properties import scaled
from .test_lion_adagrad import LionReference

#: Parameter shapes: 0-d, 1-element, prime and tile-sized vectors; tall, wide, 1-wide and
#: square-ish matrices (Muon's), one over a tile; a 3-D tensor (Adafactor factors it, Muon
#: sends it to AdamW).
SHAPES = [(), (1,), (7,), (97,), (1031,), (1, 9), (9, 1), (5, 40), (40, 5), (17, 31), (33, 37),
          (2, 3, 5)]  # fmt: skip
BUCKET_BYTES = st.sampled_from([1024, 4096, 16384, 1 << 20])  # 1 KiB: the smallest allowed
TILES = st.sampled_from([1024, 1031, 2048, 1 << 21])  # 1024: the smallest allowed
#: Gradients here have norms of about 0.1 to 300: 0.5 binds on most runs, 1e6 never.
MAX_NORMS = st.sampled_from([0.5, 1e6])

#: Our fp64-summed norm against torch's fp32 one (Note [one clip, two checks]): an fp32
#: reduction over n <= 1e4 squares errs by about log2(n) ulp at most (14 x 6e-8 ~ 1e-6);
#: 1e-5 leaves a factor of 10.
NORM_RTOL = 1e-5


@dataclass(frozen=True)
class Run:
    """One drawn run: parameters, their groups' hyper-parameters, layout and loop."""

    shapes: tuple[tuple[int, ...], ...]
    groups: tuple[dict[str, Any], ...]  # group i holds parameters j with j % len(groups) == i
    bucket_bytes: int
    tile_elements: int
    clip: str  # "none", "config" (max_grad_norm) or "call" (opt.clip_grad_norm_)
    max_norm: float
    micro: int
    steps: int
    seed: int
    fraction: float = 1.0  # offload_fraction
    accumulation: str = "auto"  # grad_accumulation: "auto" (sums on the device) or "host"
    kwargs: dict[str, Any] = field(default_factory=dict)  # the constructor's, both sides

    def grouped(self, params: list[torch.Tensor]) -> list[dict[str, Any]]:
        n = len(self.groups)
        return [{"params": params[i::n], **hyper} for i, hyper in enumerate(self.groups)]


#: Each rule's hyper-parameters: a param group draws one value of each.
HYPER: dict[str, dict[str, list[Any]]] = {
    "lion": {
        "lr": [1e-4, 1e-3],
        "betas": [(0.0, 0.9), (0.5, 0.99), (0.9, 0.99), (0.9, 0.9)],
        "weight_decay": [0.0, 0.1],
        "maximize": [False, True],
    },
    "adagrad": {
        "lr": [1e-3, 1e-2],
        "lr_decay": [0.0, 0.1],
        "weight_decay": [0.0, 0.1],
        "eps": [1e-10, 1e-6],
        "maximize": [False, True],
    },
    "adafactor": {
        "lr": [1e-2, 3e-2],
        "beta2_decay": [-0.8, -0.5],
        "eps": [(None, 1e-3), (1e-6, 1e-2)],
        "d": [1.0, 2.0],
        "weight_decay": [0.0, 0.1],
        "maximize": [False, True],
    },
    "muon": {
        "lr": [0.01, 0.02],
        "weight_decay": [0.0, 0.1],
        "momentum": [0.9, 0.95],
        "nesterov": [False, True],
        "ns_coefficients": [(3.4445, -4.7750, 2.0315), (3.0, -3.2, 1.2)],
        "eps": [1e-7],
        "ns_steps": [4, 5],
        "adjust_lr_fn": [None, "original", "match_rms_adamw"],
        "adamw_lr": [1e-3, 3e-3],
        "adamw_betas": [(0.9, 0.999), (0.8, 0.99)],
        "adamw_eps": [1e-8],
        "adamw_weight_decay": [0.0, 0.01],
    },
}
FACADES = {"lion": OffloadLion, "adagrad": OffloadAdagrad, "adafactor": OffloadAdafactor,
           "muon": OffloadMuon}  # fmt: skip


@st.composite
def runs(draw: st.DrawFn, rule: str) -> Run:
    shapes = tuple(draw(st.lists(st.sampled_from(SHAPES), min_size=1, max_size=6)))
    choices = HYPER[rule].items()
    groups = [
        {key: draw(st.sampled_from(values)) for key, values in choices}
        for _ in range(draw(st.integers(1, 3)))
    ]
    # Adagrad's start is a constructor argument on both sides: torch fills ``sum`` from the
    # constructor's value and ignores a group's, which OffloadAdagrad would honour.
    start = draw(st.sampled_from([0.0, 0.1])) if rule == "adagrad" else None
    return Run(
        shapes=shapes,
        groups=tuple(groups[: len(shapes)]),  # no empty group
        bucket_bytes=draw(BUCKET_BYTES),
        tile_elements=draw(TILES),
        clip=draw(st.sampled_from(["none", "config", "call"])),
        max_norm=draw(MAX_NORMS),
        micro=draw(st.integers(1, 3)),
        steps=draw(st.integers(1, 3)),
        seed=draw(st.integers(0, 2**16)),
        # Resident buckets step on the device: Lion and Adagrad by tiles, Adafactor and Muon
        # one whole parameter at a time (Note [whole parameters stepped on the device]).
        fraction=draw(st.sampled_from([1.0, 0.5])),
        accumulation=draw(st.sampled_from(["auto", "host"])),
        kwargs={} if start is None else {"initial_accumulator_value": start},
    )


# -- the loop ------------------------------------------------------------------------------


def _data(run: Run) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The initial weights and the loss's scales (0.5 <= |s| <= 1.5), from ``run.seed``."""
    gen = torch.Generator().manual_seed(run.seed)
    init = [torch.randn(shape, generator=gen) for shape in run.shapes]
    scales = [(torch.rand(shape, generator=gen) * 2 - 1) for shape in run.shapes]
    return init, [s.sign() * 0.5 + s for s in scales]


def _k(step: int, micro: int) -> float:
    """The loss's frequency: 1 to 1.8, so its curvature stays at most |s|^3 k^2 < 11."""
    return 1 + 0.3 * step + 0.1 * micro


def _backward(params: list[torch.Tensor], scales: list[torch.Tensor], k: float) -> None:
    loss = sum((torch.sin(p * s * k) * s).sum() for p, s in zip(params, scales, strict=True))
    loss.backward()  # type: ignore[union-attr]


def train_ours(run: Run, rule: str, params: list[torch.Tensor], scales: list[torch.Tensor], *,
               groups: list[dict[str, Any]] | None = None) -> list[float | None]:  # fmt: skip
    """Train with the rule's facade (``groups``: other param groups than ``run``'s);
    returns ``last_grad_norm`` after each step."""
    layout = {"bucket_bytes": run.bucket_bytes, "tile_elements": run.tile_elements,
              "offload_fraction": run.fraction, "grad_accumulation": run.accumulation}  # fmt: skip
    if run.clip == "config":
        layout["max_grad_norm"] = run.max_norm
    opt = FACADES[rule](groups or run.grouped(params), **run.kwargs,
                        config=OffloadConfig(**layout), accelerator=run_accelerator())  # fmt: skip
    norms = []
    for step in range(run.steps):
        for micro in range(run.micro):
            _backward(params, scales, _k(step, micro))
        if run.clip == "call":
            opt.clip_grad_norm_(run.max_norm)
        opt.step()
        norms.append(opt.last_grad_norm)
        opt.zero_grad()
    opt.close()
    return norms


def train_reference(run: Run, opts: list[torch.optim.Optimizer], params: list[torch.Tensor],
                    scales: list[torch.Tensor], norms: list[float | None]) -> None:  # fmt: skip
    """The same loop on torch's side; with clipping, checks our norm against torch's and
    applies our coefficient (Note [one clip, two checks])."""
    for step in range(run.steps):
        for micro in range(run.micro):
            _backward(params, scales, _k(step, micro))
        if run.clip != "none":
            grads = [p.grad for p in params]
            theirs = torch.nn.utils.get_total_norm(grads).item()
            assert math.isclose(norms[step], theirs, rel_tol=NORM_RTOL), (norms[step], theirs)
            coefficient = min(1.0, run.max_norm / (norms[step] + 1e-6))  # clip_grad_norm_'s
            if coefficient < 1.0:
                for grad in grads:
                    grad.mul_(coefficient)  # in fp32, as our kernels scale
        for opt in opts:
            opt.step()
            opt.zero_grad()


def _leaves(init: list[torch.Tensor]) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(t.clone()) for t in init]


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x.detach() - y.detach()).abs().max().item() for x, y in zip(a, b, strict=True))


def _spread(run: Run, init: list[torch.Tensor], scales: list[torch.Tensor], norms: list,
            build: Any, switches: tuple[dict, dict]) -> tuple[list, float]:  # fmt: skip
    """Torch's own yardstick: the reference trained with each of two implementations
    (``switches``); returns the first run's parameters and how far the two parted."""
    trained = []
    for switch in switches:
        params = _leaves(init)
        train_reference(run, build(params, switch), params, scales, norms)
        trained.append(params)
    return trained[0], _max_diff(*trained)


# -- the properties ------------------------------------------------------------------------


@settings(max_examples=scaled(50), deadline=None)
@given(run=runs("lion"))
def test_lion_is_bitwise_the_papers_update(run: Run) -> None:
    """Bitwise, clipping and accumulation included: the reference does the kernel's
    operations in its order (Note [Lion's operation order] in kernels/lion.py), the host
    kernel and the device step agree bitwise (tests/test_lion_adagrad.py), accumulation is
    the same fp32 sums in the same order, and the clip coefficient is shared."""
    init, scales = _data(run)
    ours, theirs = _leaves(init), _leaves(init)
    norms = train_ours(run, "lion", ours, scales)
    reference = LionReference(run.grouped(theirs), **run.groups[0])  # each group sets its own
    train_reference(run, [reference], theirs, scales, norms)
    assert _max_diff(ours, theirs) == 0.0


def _ulps(params: list[torch.Tensor], n: int) -> float:
    """``n`` fp32 ulps of the largest weight."""
    top = max(p.detach().abs().max().item() for p in params)
    return n * math.ulp(max(top, 1.0)) * 2**29  # an fp32 ulp: fp64's times 2^(52 - 23)


@settings(max_examples=scaled(50), deadline=None)
@given(run=runs("adagrad"))
def test_adagrad_matches_torch_within_its_own_spread(run: Run) -> None:
    """Within 2 x torch's for-loop/foreach spread on the same run, with a floor of 2 ulps
    of the largest weight per step: our kernel does torch's single-tensor operations in
    their order, but torch's addcmul/addcdiv may round the update a last bit differently
    from the kernel's separate operations (tests/test_lion_adagrad.py), as its foreach
    kernels do; the update's last bit and the weight's rounding of it make two ulps."""
    init, scales = _data(run)
    ours = _leaves(init)
    norms = train_ours(run, "adagrad", ours, scales)

    def build(params: list, switch: dict) -> list:
        return [torch.optim.Adagrad(run.grouped(params), **run.kwargs, **switch)]

    theirs, spread = _spread(
        run, init, scales, norms, build, ({"foreach": False}, {"foreach": True})
    )
    diff = _max_diff(ours, theirs)
    assert diff <= max(2 * spread, _ulps(theirs, 2 * run.steps)), (diff, spread)


@settings(max_examples=scaled(40), deadline=None)
@given(run=runs("adafactor"))
def test_adafactor_matches_torch_within_its_own_spread(run: Run) -> None:
    """Within 2 x torch's for-loop/foreach spread on the same run (tests/test_adafactor.py's
    bound), with a floor of 2 ulps of the largest weight per step: the RMS norms of the
    weights and of the update are summed in another order than torch's, so the step size
    differs in its last bits, as between torch's two paths."""
    init, scales = _data(run)
    ours = _leaves(init)
    norms = train_ours(run, "adafactor", ours, scales)

    def build(params: list, switch: dict) -> list:
        return [torch.optim.Adafactor(run.grouped(params), **switch)]

    theirs, spread = _spread(
        run, init, scales, norms, build, ({"foreach": False}, {"foreach": True})
    )
    diff = _max_diff(ours, theirs)
    assert diff <= max(2 * spread, _ulps(theirs, 2 * run.steps)), (diff, spread)


ADAMW_KEYS = {"adamw_lr": "lr", "adamw_betas": "betas", "adamw_eps": "eps",
              "adamw_weight_decay": "weight_decay"}  # fmt: skip


def _torch_muon(run: Run, params: list, switch: dict) -> list[torch.optim.Optimizer]:
    """torch's recipe per group: Muon over its 2-D parameters, AdamW (``switch``: for-loop
    or fused) over the rest, each with the group's hyper-parameters."""
    muon, adamw = [], []
    for group in run.grouped(params):
        hyper = {k: v for k, v in group.items() if k != "params"}
        mats = [p for p in group["params"] if p.dim() == 2]
        rest = [p for p in group["params"] if p.dim() != 2]
        if mats:
            muon.append({"params": mats, **{k: v for k, v in hyper.items() if k not in ADAMW_KEYS}})
        if rest:
            adamw.append({"params": rest, **{ADAMW_KEYS[k]: hyper[k] for k in ADAMW_KEYS}})
    opts: list[torch.optim.Optimizer] = []
    if muon:
        opts.append(torch.optim.Muon(muon))
    if adamw:
        opts.append(torch.optim.AdamW(adamw, **switch))
    return opts


@settings(max_examples=scaled(50), deadline=None)
@given(run=runs("muon"))
def test_muon_matrices_are_torch_and_the_rest_adamw_within_its_spread(run: Run) -> None:
    """The matrices bitwise torch's Muon (the same torch operations on the same dtypes: Note
    [Muon as torch steps it] in kernels/muon.py; the loss is separable, so the AdamW part's
    last bits never reach them). The other parameters within 8 x torch's for-loop/fused
    AdamW spread plus 4e-7 per step (tests/test_properties.py's yardstick for AdamW)."""
    init, scales = _data(run)
    ours = _leaves(init)
    norms = train_ours(run, "muon", ours, scales)
    theirs, spread = _spread(
        run,
        init,
        scales,
        norms,
        lambda ps, sw: _torch_muon(run, ps, sw),
        ({"foreach": False}, {"fused": True}),
    )
    mats = [i for i, p in enumerate(ours) if p.dim() == 2]
    rest = [i for i, p in enumerate(ours) if p.dim() != 2]
    if mats:
        assert _max_diff([ours[i] for i in mats], [theirs[i] for i in mats]) == 0.0
    if rest:
        diff = _max_diff([ours[i] for i in rest], [theirs[i] for i in rest])
        assert diff <= 8 * spread + 4e-7 * run.steps, (diff, spread)


@settings(max_examples=scaled(40), deadline=None)
@given(rule=st.sampled_from(list(FACADES)), data=st.data(), layout=st.tuples(BUCKET_BYTES, TILES))
def test_every_rule_is_bitwise_itself_under_another_layout_and_grouping(
    rule: str, data: st.DataObject, layout: tuple[int, int]
) -> None:
    """Another bucket size and tile size, and every group split in two with the same
    hyper-parameters (its parameters alternately): the same bits and the same norms. An
    elementwise rule's tiles fuse nothing (Note [every specialisation rounds alike] in
    kernels/convert.py), a whole-parameter rule steps each parameter on its own, and the
    norm does not depend on the bucketing (Note [the norm does not depend on the bucketing]
    in optim/grads/stat_cells.py). That Note covers the host's statistics only, so all
    state stays offloaded and windows sum on the host: the layout decides which parameters
    are resident (``offload_fraction`` < 1) and which buckets sum a window on the device (a
    bucket flushed twice in one backward does), and such a bucket's norm, one float64 norm
    per parameter, equals the host's exactly added cells only to about 1e-16
    (docs/gradient-semantics.md; the anchor below). Adagrad's device step is besides
    torch's addcmul, a last bit from its host kernel."""
    run = replace(data.draw(runs(rule)), fraction=1.0, accumulation="host")
    init, scales = _data(run)
    first, second = _leaves(init), _leaves(init)
    norms = train_ours(run, rule, first, scales)
    halves = [
        {**group, "params": part}
        for group in run.grouped(second)
        for part in (group["params"][0::2], group["params"][1::2])
        if part
    ]
    other = replace(run, bucket_bytes=layout[0], tile_elements=layout[1])
    assert train_ours(other, rule, second, scales, groups=halves) == norms
    assert _max_diff(first, second) == 0.0


@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_a_resident_parameter_moves_the_norm_by_a_last_bit_at_most(fraction: float) -> None:
    """The anchor for docs/gradient-semantics.md: all offloaded, the norm is bitwise the
    same for both bucket sizes; with ``offload_fraction=0.5`` the bucket size decides which
    parameter is resident (one bucket, resident; or two, one each way), and a resident
    parameter's norm is its own float64 norm, not the host's exactly added cells:
    ``last_grad_norm`` agrees to a few float64 ulps (this seed moves it by one), the
    weights without a binding clip bitwise."""
    lion = {"lr": 1e-3, "betas": (0.9, 0.99), "weight_decay": 0.1, "maximize": False}
    run = Run(shapes=((300,), (300,)), groups=(lion,), bucket_bytes=1 << 20,
              tile_elements=1024, clip="config", max_norm=1e6, micro=1, steps=1, seed=5,
              fraction=fraction)  # fmt: skip
    init, scales = _data(run)
    a, b = _leaves(init), _leaves(init)
    (norm_a,) = train_ours(run, "lion", a, scales)
    (norm_b,) = train_ours(replace(run, bucket_bytes=1024), "lion", b, scales)
    if fraction == 1.0:
        assert norm_a == norm_b
    else:
        assert math.isclose(norm_a, norm_b, rel_tol=4 * 2**-52)
    assert _max_diff(a, b) == 0.0
