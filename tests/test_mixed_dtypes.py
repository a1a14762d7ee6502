"""Mixed training dtypes in one optimizer: bf16 or fp16 layers with fp32 norms, and fp32
adapters on a frozen bf16 base.

The reference is torch's mixed-precision recipe (``MasterAdamW``): fp32 master copies of the
low-precision parameters (fp32 ones are their own master), torch's fused AdamW on the
masters with the gradients cast up (and unscaled, for fp16), the weights cast back down
after each step. Both sides run the same fp32 arithmetic in a different order, so the
masters differ by fp32 rounding after each step (measured after one step: every bf16 weight
equal, masters within 5e-7 relative); from then on a master within that distance of a
rounding boundary gives weights one ulp apart, and those flips feed the next forward.
Measured over 10 steps at lr 1e-3: losses within 4e-4 (bf16) and 2e-5 (fp16),
low-precision weights within one ulp of their magnitude (``finfo.eps * |x|`` at most), fp32
norms within 1.9e-5 (bf16 model) and 6e-7 (fp16 model); with two micro-batches a step
(the fp32 accumulator on our side, fp32 master gradients on torch's) losses within 1.2e-5. We allow 1e-3 on the losses, two
ulps (plus 1e-5 for weights near zero, whose ulp is tiny) on low-precision weights and 5e-5
on fp32 ones. torch's own fused and for-loop AdamW agree bitwise here, so the spread is
ours: the kernel's fp32 evaluation order.

CUDA form (``cuda_form``, docs/gpu.md): the models (``_model``), batches and accelerator are
the running test's (tests/helpers/device.py), so under ``--accelerator=cuda`` both sides run
their forward and backward on ``cuda:0`` with the same kernels and the tolerances above stand:
what separates them is still the optimizers' fp32 order (torch's fused AdamW on the GPU
against our CPU kernel). Host only: the two gloo ranks and the bucket planner alone.
"""

from __future__ import annotations

import copy
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from zero_offload import LossScalerConfig, OffloadAdamW, OffloadConfig
from zero_offload.optim.state.placement import GRAD_BUFFERS, POOL_ALIGNMENT, plan_dtype_buckets
from zero_offload.optim.update.loss_scaler import DynamicLossScaler, NoLossScaler
from zero_offload.views import Family

from .helpers.device import run_accelerator, run_device
from .helpers.dist import free_port
from .helpers.models import (
    batches,
    max_diff,
    mlp,
    mlp_batches,
    mlp_loss,
    mlp_opt,
    mlp_torch_adamw,
)

HYPER: dict[str, Any] = {"lr": 1e-3, "betas": (0.9, 0.95), "weight_decay": 0.1}
SCALE = 2.0**10  # the fp16 runs' loss scale (both sides), small enough never to overflow


def _aligned(nbytes: int) -> int:
    return -(-nbytes // POOL_ALIGNMENT) * POOL_ALIGNMENT


class Fp32Norm(nn.LayerNorm):
    """A LayerNorm kept in fp32 inside a low-precision model (transformers'
    ``_keep_in_fp32_modules``): it computes in fp32 and hands its caller's dtype back."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.float()).to(x.dtype)


class KeepFp32Model(nn.Module):
    """Embedding, pre-norm MLP blocks and a head in ``dtype``; every norm in fp32."""

    def __init__(self, dtype: torch.dtype, vocab: int = 64, dim: int = 32, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim, dtype=dtype)
        self.norms = nn.ModuleList(Fp32Norm(dim) for _ in range(layers))
        self.up = nn.ModuleList(nn.Linear(dim, 2 * dim, dtype=dtype) for _ in range(layers))
        self.down = nn.ModuleList(nn.Linear(2 * dim, dim, dtype=dtype) for _ in range(layers))
        self.norm = Fp32Norm(dim)
        self.head = nn.Linear(dim, vocab, dtype=dtype)
        with torch.no_grad():  # norms that are not the identity, so their updates matter
            for norm in [*self.norms, self.norm]:
                norm.weight.uniform_(0.5, 1.5)
                norm.bias.uniform_(-0.1, 0.1)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for norm, up, down in zip(self.norms, self.up, self.down, strict=True):
            x = x + down(nn.functional.gelu(up(norm(x))))
        return self.head(self.norm(x))


def _model(dtype: torch.dtype) -> KeepFp32Model:
    """``KeepFp32Model(dtype)`` on the running test's device (its norms stay fp32)."""
    return KeepFp32Model(dtype).to(run_device())


class MasterAdamW(torch.optim.AdamW):
    """The reference (module docstring): fused AdamW on fp32 masters; ``grad_scale``
    divides the gradients (the fp16 loss scale). ``collect()`` after each micro-batch adds
    the low-precision gradients into the masters' fp32 ones (fp32 parameters accumulate in
    their own ``.grad``), as mixed-precision recipes accumulate."""

    def __init__(self, params: list[nn.Parameter], *, grad_scale: float = 1.0) -> None:
        self.pairs = [
            (p, p if p.dtype == torch.float32 else p.detach().float().requires_grad_())
            for p in params
        ]
        self.unscale = grad_scale  # not "grad_scale": fused AdamW reads that attribute
        super().__init__([m for _, m in self.pairs], fused=True, **HYPER)

    @torch.no_grad()
    def collect(self) -> None:
        for param, master in self.pairs:
            if master is not param and param.grad is not None:
                grad = param.grad.float()
                master.grad = grad if master.grad is None else master.grad + grad
                param.grad = None

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        self.collect()
        for _, master in self.pairs:
            if master.grad is not None:
                master.grad /= self.unscale
        super().step()
        for param, master in self.pairs:
            if master is not param:
                param.copy_(master)


def _loss(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(tokens).float().flatten(0, 1), targets.flatten())


def _run(
    model: nn.Module, opt: torch.optim.Optimizer, data: list, backward: Any, micro: int = 1
) -> list[float]:
    """``micro`` micro-batches per step; the reference collects after each."""
    losses = []
    for i in range(0, len(data), micro):
        for tokens, targets in data[i : i + micro]:
            loss = _loss(model, tokens, targets)
            backward(loss)
            losses.append(loss.item())
            if isinstance(opt, MasterAdamW):
                opt.collect()
        opt.step()
        opt.zero_grad()
    return losses


def _assert_close_per_dtype(ours: nn.Module, ref: nn.Module) -> None:
    for (name, a), b in zip(ours.named_parameters(), ref.parameters(), strict=True):
        assert a.dtype == b.dtype, name
        if a.dtype == torch.float32:
            torch.testing.assert_close(a, b, rtol=0, atol=5e-5, msg=lambda m, n=name: f"{n}: {m}")
        else:
            ulp = torch.finfo(a.dtype).eps  # one ulp is at most eps * |x|
            torch.testing.assert_close(
                a.float(), b.float(), rtol=2 * ulp, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}"
            )


def _opt(model: nn.Module, **config: Any) -> OffloadAdamW:
    config.setdefault("bucket_bytes", 4096)
    config.setdefault("tile_elements", 1024)
    return OffloadAdamW(
        model.parameters(),
        **HYPER,
        config=OffloadConfig(**config),
        accelerator=run_accelerator(),
    )


@pytest.mark.cuda_form
@pytest.mark.parametrize("offload_fraction", [1.0, 0.5])
@pytest.mark.parametrize("micro", [1, 2])
def test_bf16_model_with_fp32_norms_matches_the_master_weight_reference(
    offload_fraction: float, micro: int
) -> None:
    torch.manual_seed(0)
    model = _model(torch.bfloat16)
    ref = copy.deepcopy(model)
    opt = _opt(model, offload_fraction=offload_fraction)
    assert {b.dtype for b in opt.buckets} == {torch.bfloat16, torch.float32}
    for bucket in opt.buckets:  # one training dtype per bucket
        assert {p.dtype for p in bucket.params} == {bucket.dtype}
    if offload_fraction != 1.0:
        assert {b.resident for b in opt.buckets} == {True, False}
    assert isinstance(opt.scaler, NoLossScaler)  # no fp16 parameter: nothing to scale
    data = batches(10 * micro)
    ours = _run(model, opt, data, lambda loss: loss.backward(), micro)
    reference = MasterAdamW(list(ref.parameters()))
    theirs = _run(ref, reference, data, lambda loss: loss.backward(), micro)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-3)
    assert ours[-1] < ours[0]
    _assert_close_per_dtype(model, ref)
    opt.close()


@pytest.mark.cuda_form
def test_fp16_model_with_fp32_norms_shares_one_loss_scale() -> None:
    torch.manual_seed(0)
    model = _model(torch.float16)
    ref = copy.deepcopy(model)
    opt = _opt(model, loss_scaler=LossScalerConfig(initial_scale=SCALE))
    assert {b.dtype for b in opt.buckets} == {torch.float16, torch.float32}
    assert isinstance(opt.scaler, DynamicLossScaler) and opt.loss_scale == SCALE
    data = batches(10)
    # opt.backward scales the whole loss: the fp32 norms' gradients are scaled as well, and
    # the step unscales every bucket by the one scale, as the reference does.
    ours = _run(model, opt, data, opt.backward)
    theirs = _run(
        ref,
        MasterAdamW(list(ref.parameters()), grad_scale=SCALE),
        data,
        lambda loss: (loss * SCALE).backward(),
    )
    assert opt.skipped_steps == 0 and opt.loss_scale == SCALE
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-3)
    _assert_close_per_dtype(model, ref)
    opt.close()


@pytest.mark.cuda_form
def test_an_fp16_overflow_skips_every_bucket_and_the_norm_is_global() -> None:
    torch.manual_seed(0)
    model = _model(torch.float16)
    opt = _opt(model, loss_scaler=LossScalerConfig(initial_scale=SCALE, hysteresis=1))
    before = [p.detach().clone() for p in model.parameters()]
    tokens, targets = batches(1)[0]
    opt.backward(_loss(model, tokens, targets))
    norm = opt.clip_grad_norm_(1e9)
    ref = copy.deepcopy(model)
    ref.zero_grad()
    (_loss(ref, tokens, targets) * SCALE).backward()
    # The global norm covers both dtypes' buckets, unscaled (fp32 sums on both sides).
    expected = torch.linalg.vector_norm(
        torch.stack([torch.linalg.vector_norm(p.grad.float()) for p in ref.parameters()])
    )
    torch.testing.assert_close(norm, (expected / SCALE).cpu(), rtol=1e-4, atol=0)  # ours: a CPU 0-d
    opt.zero_grad()
    overflow = model.head.weight.register_hook(lambda g: torch.full_like(g, float("inf")))
    opt.backward(_loss(model, tokens, targets))  # inf in the fp16 head only
    overflow.remove()
    opt.step()
    assert opt.skipped_steps == 1 and opt.loss_scale == SCALE / 2
    for param, old in zip(model.parameters(), before, strict=True):
        assert torch.equal(param, old)  # fp32 norms skipped too
    opt.close()


@pytest.mark.cuda_form
def test_device_and_host_pools_follow_the_placement_formula_per_dtype() -> None:
    torch.manual_seed(0)
    model = _model(torch.bfloat16)
    opt = _opt(model)
    acc = opt.accelerator
    acc.ledger.reset_peak()
    _run(model, opt, batches(3), lambda loss: loss.backward())
    # Per bucket of n = padded_numel elements and s = its own dtype's bytes (every bucket
    # offloaded, one rank): Note in optim/state/placement.py.
    weights = sum(_aligned(b.layout.padded_numel * b.dtype.itemsize) for b in opt.buckets)
    # Two gradient buffers, each of the largest bucket in bytes of either dtype.
    grad_buffers = GRAD_BUFFERS * max(
        _aligned(b.layout.padded_numel * b.dtype.itemsize) for b in opt.buckets
    )
    host = 0
    for b in opt.buckets:
        n, s = b.layout.padded_numel, b.dtype.itemsize
        host += _aligned(4 * n)  # fp32 master (no accumulator: one micro-batch per step)
        host += 2 * _aligned(4 * n)  # exp_avg, exp_avg_sq (fp32 moments)
        host += _aligned(s * n)  # gradient staging, in the bucket's dtype
        host += _aligned(s * n) if s != 4 else 0  # weight staging; fp32 copies the master
    (device_pool,) = [p for p in opt.manager.pools if p.name.endswith(".device")]
    (host_pool,) = [p for p in opt.manager.pools if p.name.endswith(".host")]
    assert device_pool.capacity == weights + grad_buffers
    assert host_pool.capacity == host
    assert acc.memory_stats()["peak"] <= weights + grad_buffers
    # The fp32 norm buckets sit among the bf16 ones in backward order, not after them.
    highest = [b.layout.slots[0].index for b in opt.buckets]
    assert highest == sorted(highest, reverse=True)
    dtypes = [b.dtype for b in opt.buckets]
    assert dtypes != sorted(dtypes, key=str)
    opt.close()


class LoraLinear(nn.Module):
    """A frozen bf16 base layer plus trainable fp32 low-rank adapters (PEFT's layout)."""

    def __init__(self, dim: int, rank: int = 4) -> None:
        super().__init__()
        self.base = nn.Linear(dim, dim, dtype=torch.bfloat16).requires_grad_(False)
        self.lora_a = nn.Parameter(torch.randn(rank, dim) * 0.1)  # host: moved with the model
        self.lora_b = nn.Parameter(torch.randn(dim, rank) * 0.1)  # host: as above

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        delta = x.float() @ self.lora_a.T @ self.lora_b.T
        return self.base(x) + delta.to(x.dtype)


class LoraModel(nn.Module):
    def __init__(self, vocab: int = 64, dim: int = 32, layers: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim, dtype=torch.bfloat16).requires_grad_(False)
        self.layers = nn.ModuleList(LoraLinear(dim) for _ in range(layers))
        self.head = nn.Linear(dim, vocab, dtype=torch.bfloat16).requires_grad_(False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = x + nn.functional.gelu(layer(x))
        return self.head(x)


@pytest.mark.cuda_form
def test_frozen_bf16_base_with_fp32_adapters_has_host_state_for_the_adapters_alone() -> None:
    torch.manual_seed(0)
    model = LoraModel().to(run_device())
    ref = copy.deepcopy(model)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    opt = _opt(model)
    trained = {id(p) for b in opt.buckets for p in b.params}
    assert trained == {id(p) for p in model.parameters() if p.requires_grad}
    assert {b.dtype for b in opt.buckets} == {torch.float32}
    # Host state, fp32 adapters only (Note in optim/state/placement.py): master, exp_avg,
    # exp_avg_sq and gradient staging, 4 bytes each (the accumulator comes only with
    # accumulation); no weight staging (an fp32 bucket copies its master out); nothing for
    # the frozen bf16 base.
    (host_pool,) = [p for p in opt.manager.pools if p.name.endswith(".host")]
    assert host_pool.capacity == sum(4 * _aligned(4 * b.layout.padded_numel) for b in opt.buckets)
    frozen_numel = sum(p.numel() for p in frozen.values())
    assert host_pool.capacity < 4 * frozen_numel  # a master of the base alone would not fit
    data = batches(8)
    ours = _run(model, opt, data, lambda loss: loss.backward())
    ropt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], **HYPER)
    theirs = _run(ref, ropt, data, lambda loss: loss.backward())
    # All trained parameters are fp32: torch's AdamW is the exact reference, to rounding.
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)
    for (name, a), b in zip(model.named_parameters(), ref.parameters(), strict=True):
        if a.requires_grad:
            torch.testing.assert_close(a, b, rtol=0, atol=1e-5, msg=name)
        else:
            assert torch.equal(a, frozen[name]), name  # bitwise unchanged
    opt.close()


@pytest.mark.cuda_form
def test_add_param_group_with_the_first_fp16_parameters_brings_the_loss_scaler() -> None:
    torch.manual_seed(0)
    model = _model(torch.float16)
    norms = [p for n, p in model.named_parameters() if "norm" in n]
    rest = [p for n, p in model.named_parameters() if "norm" not in n]
    opt = OffloadAdamW(
        norms,
        **HYPER,
        config=OffloadConfig(loss_scaler=LossScalerConfig(initial_scale=SCALE)),
        accelerator=run_accelerator(),
    )
    assert isinstance(opt.scaler, NoLossScaler)
    opt.add_param_group({"params": rest})
    assert isinstance(opt.scaler, DynamicLossScaler) and opt.loss_scale == SCALE
    assert {b.dtype for b in opt.buckets} == {torch.float16, torch.float32}
    opt.close()


@pytest.mark.cuda_form
def test_first_fp16_group_added_mid_window_does_not_unscale_fp32_window():
    m = mlp()
    r = copy.deepcopy(m)
    o = mlp_opt(m)
    ro = mlp_torch_adamw(r)
    x, y = mlp_batches(1)[0]
    mlp_loss(m, x, y).backward()
    mlp_loss(r, x, y).backward()
    try:
        o.add_param_group({"params": list(nn.Linear(4, 4).half().to(run_device()).parameters())})
    except (RuntimeError, ValueError):
        return  # a clear refusal is fine
    o.step()
    ro.step()
    assert max_diff(m, r) < 1e-5


@pytest.mark.cuda_form
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_mixed_dtype_checkpoint_resumes_bitwise(dtype: torch.dtype) -> None:
    """State dict of buckets of two dtypes (fp32 masters of both, the fp16 loss scale):
    save after 4 steps, resume into a model with other weights, continue to 8."""
    data = batches(8)
    scaler = LossScalerConfig(initial_scale=SCALE, growth_interval=3)  # it grows meanwhile

    def build(seed: int) -> tuple[nn.Module, OffloadAdamW]:
        torch.manual_seed(seed)
        model = _model(dtype)
        return model, _opt(model, loss_scaler=scaler)

    whole, opt = build(0)
    _run(whole, opt, data, opt.backward)
    first, opt1 = build(0)
    _run(first, opt1, data[:4], opt1.backward)
    model_state = copy.deepcopy(first.state_dict())
    opt_state = copy.deepcopy(opt1.state_dict())
    resumed, opt2 = build(7)
    resumed.load_state_dict(model_state)
    opt2.load_state_dict(opt_state)
    assert opt2.loss_scale == opt1.loss_scale
    _run(resumed, opt2, data[4:], opt2.backward)
    assert opt2.loss_scale == opt.loss_scale
    assert opt.loss_scale == (4 * SCALE if dtype == torch.float16 else 1.0)
    for a, b in zip(whole.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)
    for o in (opt, opt1, opt2):
        o.close()


def _rank_training(rank: int, world: int, port: int, dtype: torch.dtype, out: str) -> None:
    """One rank's share (of 6) of each global batch (``world`` 1: all of it, no process
    group); rank 0 saves the trained weights."""
    torch.set_num_threads(1)  # the ranks share two cores
    if world > 1:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=60),
        )
    torch.manual_seed(0)
    model = KeepFp32Model(dtype)
    opt = _opt(model, loss_scaler=LossScalerConfig(initial_scale=SCALE))
    per = 6 // world
    share = slice(rank * per, (rank + 1) * per)
    for tokens, targets in batches(6, batch=6):
        opt.backward(_loss(model, tokens[share], targets[share]))
        opt.step()
        opt.zero_grad()
    if rank == 0:
        torch.save([p.detach().clone() for p in model.parameters()], out)
    opt.close()
    if world > 1:
        dist.destroy_process_group()


def test_two_ranks_with_fp16_and_fp32_buckets_match_one_process(tmp_path: Path) -> None:
    """Buckets of both dtypes reduce-scattered in one order on both ranks, one loss scale
    (the overflow flag all-reduced). The ranks average each fp16 gradient in fp16, one
    rounding more than one process's backward over the whole batch; measured: fp16 weights
    within one ulp, fp32 norms within 2.2e-6, inside the tolerances above. (bf16, with 3
    fewer mantissa bits, moves the elements whose two half-batch gradients nearly cancel by
    up to a few Adam steps: a comparison with one process says nothing there.)"""
    one, two = tmp_path / "one.pt", tmp_path / "two.pt"
    threads = torch.get_num_threads()
    try:  # one thread here too, as in the ranks; then torch's count as it was for later tests
        _rank_training(0, 1, 0, torch.float16, str(one))
    finally:
        torch.set_num_threads(threads)
    mp.spawn(_rank_training, args=(2, free_port(), torch.float16, str(two)), nprocs=2)
    ref, ours = KeepFp32Model(torch.float16), KeepFp32Model(torch.float16)
    with torch.no_grad():
        for module, path in ((ref, one), (ours, two)):
            for param, saved in zip(module.parameters(), torch.load(path), strict=True):
                param.copy_(saved)
    _assert_close_per_dtype(ours, ref)


def test_plan_dtype_buckets_alone() -> None:
    """The pure planner: one dtype per bucket, each dtype's own elements per bucket, real
    group indices, numbering from ``first_index``, backward order across the dtypes."""
    bf16 = [(0, (40,)), (2, (8,)), (4, (8,))]  # group 0: 0, 2 | group 1: 4
    fp32 = [(1, (4,)), (3, (4,)), (5, (4,))]  # group 0: 1, 3 | group 1: 5
    families = [
        Family(0, torch.bfloat16, [m for m in bf16 if m[0] < 4]),
        Family(0, torch.float32, [m for m in fp32 if m[0] < 4]),
        Family(1, torch.bfloat16, [m for m in bf16 if m[0] >= 4]),
        Family(1, torch.float32, [m for m in fp32 if m[0] >= 4]),
    ]
    layouts = plan_dtype_buckets(
        families, bucket_bytes=128, world_size=1, align_numel=1, first_index=3
    )
    bf16_indices = {i for i, _ in bf16}
    contents = [[slot.index for slot in layout.slots] for layout in layouts]
    # 128 bytes: 64 bf16 elements, so parameters 2 and 0 share a bucket (56 elements with
    # the slot alignment gap, Note [slots are aligned]); 32 fp32 ones hold 3 and 1 (20).
    assert contents == [[5], [4], [3, 1], [2, 0]]
    assert max(layout.numel for layout in layouts if layout.slots[0].index == 2) > 32
    assert [layout.index for layout in layouts] == [3, 4, 5, 6]
    assert [layout.group for layout in layouts] == [1, 1, 0, 0]
    for indices in contents:
        assert len({i in bf16_indices for i in indices}) == 1  # one dtype per bucket
