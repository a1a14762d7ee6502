"""The gradient lifecycle as users' loops exercise it (Note [a bucket's gradient lifecycle]).

Every parity check compares against ``torch.optim.AdamW`` on an identical model with the
same batches. Tolerance: 1e-5 on the weights after a few steps (fp32), the spread between
torch's own for-loop and fused AdamW on this model; "bitwise" means ``torch.equal``.

CUDA form: every test builds through tests/helpers (``_TwoLayers`` is moved to the test's
device), so under ``--accelerator=cuda`` it runs on ``cuda:0`` with the same tolerances (TF32
off, Note [no TF32 in the CUDA forms] in conftest.py).
"""

from __future__ import annotations

import copy
import gc
import time

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from zero_offload import OffloadAdamW, OffloadConfig, StepFailed
from zero_offload.memory.traffic import Category, Direction
from zero_offload.optim.grads.buffers import LazyHostPool
from zero_offload.optim.grads.lifecycle import GradState

from .helpers.device import on_device, run_accelerator, run_device
from .helpers.models import (
    batches,
    host_accelerator,
    lm_loss,
    make_pair,
    max_diff,
    mlp,
    mlp_batches,
    mlp_loss,
    mlp_opt,
    mlp_torch_adamw,
    mlp_train_both,
    offload_opt,
    torch_adamw,
    train,
)

pytestmark = pytest.mark.cuda_form

TOL = 1e-5


def _clear(style: str, model: nn.Module, opt: torch.optim.Optimizer) -> None:
    if style in ("model", "both"):
        model.zero_grad()
    if style in ("opt_keep", "both"):
        opt.zero_grad(set_to_none=False)


@pytest.mark.parametrize("micro", [1, 4])
@pytest.mark.parametrize("style", ["model", "opt_keep", "both", "neither"])
def test_every_way_of_clearing_gradients_trains_like_torch(style: str, micro: int) -> None:
    model, ref = make_pair()
    opt = offload_opt(model)
    ropt = torch_adamw(ref)
    data = batches(3 * micro)
    for i in range(0, len(data), micro):
        for tokens, targets in data[i : i + micro]:
            lm_loss(model, tokens, targets).backward()
            lm_loss(ref, tokens, targets).backward()
        opt.step()
        _clear(style, model, opt)  # "neither": step() alone consumes the window
        ropt.step()
        ropt.zero_grad()
    assert max_diff(model, ref) < TOL


def test_clip_grad_norm_does_not_leak_past_zero_grad():
    m = mlp()
    r = copy.deepcopy(m)
    o = mlp_opt(m)
    ro = mlp_torch_adamw(r)
    D = mlp_batches(2)
    mlp_loss(m, *D[0]).backward()
    o.clip_grad_norm_(1e-3)
    o.zero_grad()
    for mod, opt in ((m, o), (r, ro)):
        mlp_loss(mod, *D[1]).backward()
        opt.step()
    assert max_diff(m, r) < 1e-5


class _TwoLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 16, bias=False)
        self.b = nn.Linear(16, 16, bias=False)

    def forward(self, x, use_b):
        return self.a(x) + (self.b(x) if use_b else 0)


def test_bucket_without_gradient_in_new_backward_is_not_restepped():
    torch.manual_seed(0)
    m = _TwoLayers().to(run_device())
    r = copy.deepcopy(m)
    o = mlp_opt(m, bucket_bytes=1024)
    ro = mlp_torch_adamw(r)
    for k, (x, y) in enumerate(mlp_batches(3, d_out=16)):
        for mod, opt in ((m, o), (r, ro)):
            ((mod(x, k == 0) - y) ** 2).mean().backward()
            opt.step()
            mod.zero_grad()
    assert int(o.state[m.b.weight]["step"]) == 1
    assert max_diff(m, r) < 1e-5


class _RaiseInBackward(torch.autograd.Function):
    """Identity forward; its backward raises (an OOM in the middle of backward)."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        raise torch.OutOfMemoryError("injected: out of memory in backward")


def _loss(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor, *, fail: bool):
    # TinyTransformer's forward, with the failure between the two blocks: backward has
    # produced the head's, the norm's and the last block's gradients when it raises.
    x = model.embed(tokens)
    x = model.blocks[0](x)
    if fail:
        x = _RaiseInBackward.apply(x)
    x = model.blocks[1](x)
    logits = model.head(model.norm(x))
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _failing_backward(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> None:
    with pytest.raises(torch.OutOfMemoryError, match="injected"):
        _loss(model, tokens, targets, fail=True).backward()


# Three buckets: at the failure the first has gone to the host and the second is half-filled.
FAIL_BUCKET_BYTES = 32768


def test_a_backward_that_raised_is_discarded_by_zero_grad() -> None:
    model, ref = make_pair()
    opt = offload_opt(model, bucket_bytes=FAIL_BUCKET_BYTES)
    ropt = torch_adamw(ref)
    data = batches(4)
    for step, (tokens, targets) in enumerate(data):
        if step == 1:  # an OOM-skipping loop: catch, zero_grad, next batch
            _failing_backward(model, tokens, targets)
            states = {b.grads.state for b in opt.buckets}
            # Some buckets went to the host, one is half-filled, the rest untouched.
            assert GradState.IN_FLIGHT in states or GradState.ACCUMULATED in states
            assert GradState.FILLING in states
            opt.zero_grad()
            assert all(b.grads.state is GradState.EMPTY for b in opt.buckets)
            continue
        _loss(model, tokens, targets, fail=False).backward()
        _loss(ref, tokens, targets, fail=False).backward()
        opt.step()
        opt.zero_grad()
        ropt.step()
        ropt.zero_grad()
    assert max_diff(model, ref) < TOL


def test_a_backward_that_raised_then_another_backward_counts_like_param_grad() -> None:
    # Without zero_grad, torch keeps the partial gradients in .grad and the next backward
    # adds to them; so do we, and nothing of the failed backward outlives the next step.
    model, ref = make_pair()
    opt = offload_opt(model, bucket_bytes=FAIL_BUCKET_BYTES)
    ropt = torch_adamw(ref)
    for step, (tokens, targets) in enumerate(batches(4)):
        if step == 1:
            _failing_backward(model, tokens, targets)
            _failing_backward(ref, tokens, targets)
        _loss(model, tokens, targets, fail=False).backward()
        _loss(ref, tokens, targets, fail=False).backward()
        opt.step()
        ropt.step()
        opt.zero_grad()
        ropt.zero_grad()
        assert not opt._router.open
        assert all(b.grads.state is GradState.EMPTY for b in opt.buckets)
    assert max_diff(model, ref) < TOL


@pytest.mark.parametrize("lone", [False, True], ids=["bucket", "lone-gradient"])
def test_a_gradient_copy_failing_mid_flush_is_discarded_by_zero_grad(monkeypatch, lone):
    # A flush queues its gradient tile by tile (Note [Adam follows the gradient in]); when
    # queuing one fails, the bucket keeps its device buffer (or its adopted gradient), so
    # the backward that raised is discarded by zero_grad like any other, and training goes
    # on as torch's would without that backward.
    from zero_offload.memory.manager import TieredMemoryManager
    from zero_offload.memory.traffic import Category

    dims = (64, 64, 8) if lone else (16, 32, 32, 8)
    model, ref = mlp(dims=dims), mlp(dims=dims)
    opt = mlp_opt(model, bucket_bytes=64 * 64 * 4 if lone else 2048)
    ropt = mlp_torch_adamw(ref)
    batches = mlp_batches(3, d_in=dims[0])
    real = TieredMemoryManager.copy
    calls = []

    def failing(self, dst, src, *, category, **kwargs):
        if category is Category.GRADIENTS:
            calls.append(1)
            if len(calls) == 2:
                raise RuntimeError("injected copy failure")
        return real(self, dst, src, category=category, **kwargs)

    monkeypatch.setattr(TieredMemoryManager, "copy", failing)
    with pytest.raises(RuntimeError, match="injected copy failure"):
        mlp_loss(model, *batches[0]).backward()
    monkeypatch.setattr(TieredMemoryManager, "copy", real)
    opt.zero_grad()
    mlp_train_both(model, opt, ref, ropt, batches[1:])
    assert max_diff(model, ref) < 1e-5
    opt.close()


def _failing_alloc(self, nbytes, *, owner):
    raise MemoryError("simulated: cannot pin the accumulator")


@pytest.mark.parametrize("where", ["fold_in_open_grad", "flush_overlap_step"])
def test_accumulator_allocation_failure_leaves_nothing_behind(monkeypatch, where):
    m = mlp()
    # A lazily pinned host buffer's allocation is what fails (grad_accumulation="host"):
    # the fp32 accumulator of a fold; with overlap_step, the spare staging that the second
    # window's flush lands in (Note [the delayed update reads one buffer, the next backward
    # fills the other] in optim/grads/staging.py).
    o = mlp_opt(m, overlap_step=(where == "flush_overlap_step"), grad_accumulation="host")
    acc = o.accelerator
    D = mlp_batches(3)
    mlp_loss(m, *D[0]).backward()
    if where == "flush_overlap_step":
        o.step()
        o.zero_grad()
    monkeypatch.setattr(LazyHostPool, "alloc", _failing_alloc)  # AccumulatorPool's too
    with pytest.raises(MemoryError):
        mlp_loss(m, *D[1]).backward()
    monkeypatch.undo()
    o.zero_grad()  # flush case: raises "(bug)" today
    assert all(b.gradients.open.block is None for b in o.buckets), "leaked device grad block"
    mlp_loss(m, *D[2]).backward()
    o.step()
    o.zero_grad()
    o.close()
    assert acc.memory_stats()["in_use"] == 0


class _Checkpointed(nn.Module):
    """TinyTransformer with each block under activation checkpointing."""

    def __init__(self, base: nn.Module, *, reentrant: bool) -> None:
        super().__init__()
        self.base = base
        self.reentrant = reentrant

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.base.embed(tokens)
        for block in self.base.blocks:
            x = checkpoint(block, x, use_reentrant=self.reentrant)
        return self.base.head(self.base.norm(x))


@pytest.mark.parametrize("reentrant", [True, False])
def test_checkpointing_flushes_each_bucket_once_per_backward(reentrant: bool) -> None:
    base, ref = make_pair()
    model = _Checkpointed(base, reentrant=reentrant)
    # Tiles larger than a bucket: a flush is then one copy (Note [Adam follows the gradient
    # in] copies a larger one tile by tile).
    opt = offload_opt(base, tile_elements=1 << 20)
    ropt = torch_adamw(ref)
    counters = opt.manager.counters
    key = f"{Direction.D2H.value}/{Category.GRADIENTS.value}"
    for tokens, targets in batches(3):
        before = counters.snapshot().get(key, {}).get("copies", 0)
        backwards = opt.backwards
        lm_loss(model, tokens, targets).backward()
        # Every bucket is complete before the end of backward, so each goes exactly once;
        # the nested graph tasks of reentrant checkpointing do not end the backward.
        assert counters.snapshot()[key]["copies"] - before == len(opt.buckets)
        assert opt.backwards == backwards + 1
        lm_loss(ref, tokens, targets).backward()
        opt.step()
        opt.zero_grad()
        ropt.step()
        ropt.zero_grad()
    assert max_diff(base, ref) < TOL


def test_retain_graph_backwards_are_two_backwards() -> None:
    model, ref = make_pair()
    opt = offload_opt(model)
    ropt = torch_adamw(ref)
    for tokens, targets in batches(2):
        loss = lm_loss(model, tokens, targets)
        loss.backward(retain_graph=True)
        loss.backward()
        rloss = lm_loss(ref, tokens, targets)
        rloss.backward(retain_graph=True)
        rloss.backward()
        opt.step()
        opt.zero_grad()
        ropt.step()
        ropt.zero_grad()
    assert opt.backwards == 4
    assert max_diff(model, ref) < TOL


def test_overlap_step_lets_weights_loaded_between_steps_win() -> None:
    model, other = make_pair(seed=0)
    _, fresh = make_pair(seed=1)
    opt = offload_opt(model, overlap_step=True)
    twin = offload_opt(other, overlap_step=True)  # the same run without the load
    for tokens, targets in batches(3):
        for m, o in ((model, opt), (other, twin)):
            lm_loss(m, tokens, targets).backward()
            o.step()
            o.zero_grad()
    loaded = copy.deepcopy(fresh.state_dict())
    model.load_state_dict(loaded)  # between steps, with update 3 still pending
    opt.step()  # no gradients: publishes nothing but must not overwrite the load
    opt.flush_pending_update()
    for name, value in model.state_dict().items():
        assert torch.equal(value, loaded[name]), name
    # The master follows the loaded weights; the moments keep update 3 (torch's semantics:
    # loading the model does not touch the optimizer).
    twin.step()
    twin.flush_pending_update()
    mine, theirs = opt.state_dict()["state"], twin.state_dict()["state"]
    for index, param in enumerate(model.parameters()):
        assert torch.equal(mine[index]["master"], param.detach())
        assert torch.equal(mine[index]["exp_avg"], theirs[index]["exp_avg"])


def test_overlap_step_write_to_one_param_keeps_others_pending_update():
    res = []
    for write in (False, True):
        m = mlp()
        o = mlp_opt(m, overlap_step=True, bucket_bytes=1 << 20)
        for x, y in mlp_batches(3):
            mlp_loss(m, x, y).backward()
            o.step()
            o.zero_grad()
        if write:
            with torch.no_grad():
                m[0].bias.mul_(1.0)
        o.flush_pending_update()
        res.append([p.detach().clone() for n, p in m.named_parameters() if n != "0.bias"])
    assert all(torch.equal(a, b) for a, b in zip(*res, strict=True))


def _params_snapshot(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _same_state(a: dict, b: dict) -> bool:
    return a["state"].keys() == b["state"].keys() and all(
        torch.equal(a["state"][i][k], b["state"][i][k]) for i in a["state"] for k in a["state"][i]
    )


def test_a_parameter_unfrozen_after_construction_is_refused_and_nothing_changes() -> None:
    model, _ = make_pair()
    model.head.bias.requires_grad_(False)
    opt = offload_opt(model)
    tokens, targets = batches(1)[0]
    lm_loss(model, tokens, targets).backward()
    opt.step()
    opt.zero_grad()
    model.head.bias.requires_grad_(True)
    weights, state = _params_snapshot(model), opt.state_dict()
    lm_loss(model, tokens, targets).backward()
    with pytest.raises(ValueError, match=r"frozen .* when OffloadAdamW#\d+ was built"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters(), strict=True))
    assert _same_state(state, opt.state_dict())


def test_replaced_param_data_is_refused_and_nothing_changes() -> None:
    model, _ = make_pair()
    opt = offload_opt(model)
    tokens, targets = batches(1)[0]
    lm_loss(model, tokens, targets).backward()
    opt.step()
    opt.zero_grad()
    model.head.weight.data = model.head.weight.data.clone()  # detached from its slot
    weights, state = _params_snapshot(model), opt.state_dict()
    lm_loss(model, tokens, targets).backward()
    with pytest.raises(ValueError, match=r"\.data was replaced after construction"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters(), strict=True))
    assert _same_state(state, opt.state_dict())


def test_optimizer_state_is_live_and_distributed_checkpoint_round_trips() -> None:
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    model, _ = make_pair()
    opt = offload_opt(model)
    # Empty before the first step, as torch's (Note [opt.state is torch's before the first
    # step] in optim/reports/live.py); the entries are at hand all the same.
    assert len(opt.state) == 0 and int(opt.state[model.head.weight]["step"]) == 0
    for tokens, targets in batches(2):
        lm_loss(model, tokens, targets).backward()
        opt.step()
        opt.zero_grad()
    assert len(opt.state) == sum(1 for p in model.parameters() if p.requires_grad)
    saved = opt.state_dict()
    entry = opt.state[model.head.weight]
    index = next(i for i, p in enumerate(model.parameters()) if p is model.head.weight)
    assert int(entry["step"]) == 2
    assert torch.equal(entry["exp_avg"], saved["state"][index]["exp_avg"])
    osd = get_optimizer_state_dict(model, opt)  # must not run torch's fake zero-grad step
    assert _same_state(saved, opt.state_dict())
    with torch.no_grad():
        entry["exp_avg"].zero_()  # the entries are views: this writes the optimizer state
    assert not _same_state(saved, opt.state_dict())
    set_optimizer_state_dict(model, opt, osd)
    assert _same_state(saved, opt.state_dict())


def test_a_failure_in_the_middle_of_step_says_what_was_stepped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model, _ = make_pair()
    opt = offload_opt(model)
    tokens, targets = batches(1)[0]
    # A bad hyper-parameter is refused before anything changes.
    lm_loss(model, tokens, targets).backward()
    weights, state = _params_snapshot(model), opt.state_dict()
    opt.param_groups[0]["lr"] = -1.0
    with pytest.raises(ValueError, match="lr must be >= 0"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters(), strict=True))
    assert _same_state(state, opt.state_dict())
    opt.param_groups[0]["lr"] = 1e-3
    # A failure after mutation started names what was stepped.
    victim = opt.buckets[2].store

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("injected kernel failure")

    monkeypatch.setattr(victim, "update", broken)
    with pytest.raises(StepFailed, match=r"bucket 2.*buckets \[0, 1\] were stepped.*reload"):
        opt.step()


def _threads() -> int:
    import threading

    return threading.active_count()


def test_optimizers_dropped_without_close_release_everything() -> None:
    psutil = pytest.importorskip("psutil")
    acc = host_accelerator()
    model, ref = make_pair()
    gc.collect()
    threads, in_use = _threads(), acc.memory_stats()["in_use"]
    rss = psutil.Process().memory_info().rss
    for _ in range(200):
        opt = offload_opt(model, accelerator=acc)
        lm_loss(model, *batches(1)[0]).backward()
        opt.step()
        del opt  # like a Trainer or a notebook cell: no close()
    gc.collect()
    # A dropped stream's finalizer only queues its worker's stop (close() joins; nothing
    # here calls it): on a loaded machine the last few may still be leaving. Wait for them.
    deadline = time.monotonic() + 30
    while _threads() > threads + 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _threads() <= threads + 1
    assert acc.memory_stats()["in_use"] == in_use
    assert psutil.Process().memory_info().rss - rss < 200 * 2**20
    # A new optimizer over the same model trains exactly like torch: the old hooks are gone.
    ref.load_state_dict(model.state_dict())
    opt = offload_opt(model, accelerator=acc)
    ropt = torch_adamw(ref)
    for tokens, targets in batches(3):
        lm_loss(model, tokens, targets).backward()
        lm_loss(ref, tokens, targets).backward()
        opt.step()
        opt.zero_grad()
        ropt.step()
        ropt.zero_grad()
    assert max_diff(model, ref) < TOL


@pytest.mark.parametrize("offload_parameters", [False, True])
def test_a_second_live_optimizer_over_the_same_parameters_is_refused(
    offload_parameters: bool,
) -> None:
    """A notebook cell run again. Under parameter offload the second constructor used to
    fetch the first one's released parameters by looking at their memory, and refused two
    untied parameters as sharing it (the shared slot's address), before this refusal."""
    model, _ = make_pair()

    def build() -> OffloadAdamW:
        extra = {"model": model} if offload_parameters else {}
        return OffloadAdamW(
            model.parameters(),
            lr=1e-3,
            config=OffloadConfig(offload_parameters=offload_parameters, bucket_bytes=8192),
            accelerator=run_accelerator(),
            **extra,
        )

    first = build()
    train(model, first, batches(1))
    with pytest.raises(ValueError, match=r"already trained by OffloadAdamW#\d+.*close\(\)"):
        build()
    first.close()
    build().close()  # once the first is gone, it works


def _run_overlap(data, *, save_every: int | None, between_micro: bool) -> nn.Module:
    model, _ = make_pair()
    opt = offload_opt(model, overlap_step=True)
    for step in range(0, len(data), 2):
        for micro, (tokens, targets) in enumerate(data[step : step + 2]):
            lm_loss(model, tokens, targets).backward()
            if between_micro and micro == 0:
                opt.state_dict()
        opt.step()
        opt.zero_grad()
        if save_every and (step // 2) % save_every == 0:
            opt.state_dict()
    opt.flush_pending_update()
    return model


def test_overlap_step_checkpointing_never_changes_training() -> None:
    data = batches(16)
    plain = _run_overlap(data, save_every=None, between_micro=False)
    for kwargs in (
        {"save_every": 2, "between_micro": False},
        {"save_every": None, "between_micro": True},
    ):
        other = _run_overlap(data, **kwargs)
        assert max_diff(plain, other) == 0.0, kwargs


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("order", ["model_first", "optimizer_first"])
def test_bf16_resume_is_bitwise_in_either_load_order(order: str, overlap: bool) -> None:
    data = batches(8)
    model, _ = make_pair(torch.bfloat16)
    start = copy.deepcopy(model.state_dict())
    opt = offload_opt(model, overlap_step=overlap)

    def run(m: nn.Module, o: torch.optim.Optimizer, part: list) -> None:
        for tokens, targets in part:
            lm_loss(m, tokens, targets).backward()
            o.step()
            o.zero_grad()

    run(model, opt, data[:4])
    model_ckpt = copy.deepcopy(model.state_dict())
    opt_ckpt = copy.deepcopy(opt.state_dict())
    run(model, opt, data[4:])
    if overlap:
        opt.flush_pending_update()
    resumed, _ = make_pair(torch.bfloat16)
    resumed.load_state_dict(start)
    ropt = offload_opt(resumed, overlap_step=overlap)
    if order == "model_first":
        resumed.load_state_dict(model_ckpt)
        ropt.load_state_dict(opt_ckpt)
    else:
        ropt.load_state_dict(opt_ckpt)
        resumed.load_state_dict(model_ckpt)
    run(resumed, ropt, data[4:])
    if overlap:
        ropt.flush_pending_update()
    assert max_diff(model, resumed) == 0.0


class _WithEmpty(nn.Module):
    """A linear layer beside a parameter of no elements (register tokens, count 0)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.registers = nn.Parameter(on_device(torch.zeros(0, 4)))
        self.lin = nn.Linear(4, 4).to(run_device())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = torch.cat([self.registers.expand(x.shape[0], 0, 4), x.unsqueeze(1)], dim=1)
        return self.lin(tokens).square().mean()


def test_an_empty_parameter_trains_as_torch_skips_it() -> None:
    """A parameter of no elements gets an (empty) gradient from autograd and has nothing to
    step: it is left out of the buckets, and its gradient must not be taken for a frozen
    parameter's (every step raised). The rest trains as torch's AdamW trains it."""
    from zero_offload import OffloadAdamW

    model, ref = _WithEmpty(), _WithEmpty()
    opt = OffloadAdamW(model.parameters(), lr=1e-2, accelerator=host_accelerator())
    torch_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    gen = torch.Generator().manual_seed(3)
    for _ in range(4):
        x = on_device(torch.randn(2, 4, generator=gen))
        for m, o in ((model, opt), (ref, torch_opt)):
            m(x).backward()
            o.step()
            o.zero_grad()
    torch.testing.assert_close(model.lin.weight, ref.lin.weight, rtol=0, atol=1e-6)
    assert model.registers.shape == (0, 4)
    opt.close()


def test_zero_grad_keeping_zeros_steps_alike_and_refuses_where_torch_would_not_skip() -> None:
    """Note [zero gradients are not kept]: with every parameter used, zero_grad(set_to_none=
    False) trains as zero_grad() does (bitwise). A parameter that had a gradient, was zeroed
    with set_to_none=False and got none in this window would step in torch (a zero gradient,
    weight decay and momentum): the step refuses, naming it, and changes nothing; after
    zero_grad() the loop goes on as torch's does with set_to_none=True."""
    from zero_offload import OffloadAdamW

    def build() -> tuple[nn.ModuleDict, OffloadAdamW]:
        torch.manual_seed(0)
        model = nn.ModuleDict({"a": nn.Linear(4, 4), "b": nn.Linear(4, 4)}).to(run_device())
        opt = OffloadAdamW(model.named_parameters(), lr=1e-2, accelerator=host_accelerator())
        return model, opt

    x = on_device(torch.randn(2, 4, generator=torch.Generator().manual_seed(1)))
    (kept, kept_opt), (plain, plain_opt) = build(), build()
    for _ in range(3):
        for model, opt, to_none in ((kept, kept_opt, False), (plain, plain_opt, True)):
            model["b"](model["a"](x)).square().sum().backward()
            opt.step()
            opt.zero_grad(set_to_none=to_none)
    assert all(
        torch.equal(p, q) for p, q in zip(kept.parameters(), plain.parameters(), strict=True)
    )
    kept["a"](x).square().sum().backward()  # b gets no gradient; torch would step it
    before = [p.detach().clone() for p in kept.parameters()]
    with pytest.raises(ValueError, match=r"'b\.(weight|bias)'.*got no gradient.*set_to_none=False"):
        kept_opt.step()
    assert all(torch.equal(p, q) for p, q in zip(before, kept.parameters(), strict=True))
    kept_opt.zero_grad()
    kept["a"](x).square().sum().backward()
    kept_opt.step()  # torch skips b too now: no refusal
    assert torch.equal(kept["b"].weight, before[2])
    with pytest.raises(TypeError, match="set_to_none"):
        kept_opt.zero_grad(set_to_none=None)  # type: ignore[arg-type]
    kept_opt.close()
    plain_opt.close()


def test_several_optimizers_over_one_model_clip_by_its_global_norm() -> None:
    """Note [clipping by a total norm]: a model two offload optimizers train (as OffloadMuon
    beside an OffloadAdamW) is clipped by the norm of all its gradients with
    zero_offload.clip_grad_norm_, as torch's clip_grad_norm_ over model.parameters() clips
    one optimizer's: the norm it returns and the weights after 4 steps match torch's, and
    clipping each by its own norm would not have."""
    import zero_offload
    from zero_offload import OffloadAdamW

    model, ref = make_pair()
    params = list(model.parameters())
    hyper = {"lr": 1e-3, "betas": (0.9, 0.95), "weight_decay": 0.1}
    halves = [
        OffloadAdamW(part, **hyper, accelerator=host_accelerator())
        for part in (params[::2], params[1::2])
    ]
    ropt = torch_adamw(ref)
    for tokens, targets in batches(4):
        lm_loss(model, tokens, targets).backward()
        lm_loss(ref, tokens, targets).backward()
        own = [float(o.grad_norm()) for o in halves]
        norm = zero_offload.clip_grad_norm_(halves, 0.2)
        want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.2)
        assert max(own) < float(want) and float(want) > 0.2  # clipping binds, globally
        torch.testing.assert_close(norm, want, rtol=1e-6, atol=0)
        for o in (*halves, ropt):
            o.step()
            o.zero_grad()
    assert max_diff(model, ref) < TOL
    with pytest.raises(TypeError, match="offload optimizers"):
        zero_offload.clip_grad_norm_([*halves, ropt], 0.2)
    with pytest.raises(ValueError, match=r"max_norm must be a number > 0 .*, got 0"):
        zero_offload.clip_grad_norm_(halves, 0)
    halves[1]._policy.scaler.scale = 2.0  # as after a back-off of its own fp16 scaler
    with pytest.raises(ValueError, match=r"loss scales differ \(\[1.0, 2.0\]\)"):
        zero_offload.clip_grad_norm_(halves, 0.2)
    halves[1]._policy.scaler.scale = 1.0
    with pytest.raises(ValueError, match=r"total_norm must be one number.*\(2,\)"):
        halves[0].clip_grads_with_norm_(0.2, torch.ones(2))  # host: a bad argument
    for o in halves:
        o.close()
