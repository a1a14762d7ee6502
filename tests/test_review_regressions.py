"""Regressions from a review of the optimizer rewrite: each test failed before its fix.

Tolerance 1e-5 against torch.optim.AdamW (fp32), as in the parity tests.
"""

import copy
import itertools
import warnings

import pytest
import torch
from torch import nn

import zero_offload.optim.grads.to_host as off
import zero_offload.optim.update.tiles as tiles
from zero_offload import AcceleratorConfig, HostAccelerator, OffloadAdamW, OffloadConfig

warnings.simplefilter("ignore")


def mlp(seed=0, dims=(16, 32, 32, 8), dtype=torch.float32):
    torch.manual_seed(seed)
    layers = []
    for a, b in itertools.pairwise(dims):
        layers += [nn.Linear(a, b), nn.Tanh()]
    return nn.Sequential(*layers[:-1]).to(dtype)


def data(n, seed=1, d_in=16, d_out=8):
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(4, d_in, generator=g), torch.randn(4, d_out, generator=g)) for _ in range(n)
    ]


def loss_fn(m, x, y):
    return ((m(x.to(next(m.parameters()).dtype)).float() - y) ** 2).mean()


def mk(model, cls=OffloadAdamW, lr=1e-2, wd=0.1, acc=None, budget="256MiB", **cfg):
    cfg.setdefault("bucket_bytes", 2048)
    cfg.setdefault("tile_elements", 1024)
    acc = acc or HostAccelerator(AcceleratorConfig(device_budget=budget))
    return cls(
        model.parameters(),
        lr=lr,
        betas=(0.9, 0.95),
        weight_decay=wd,
        config=OffloadConfig(**cfg),
        accelerator=acc,
    )


def mdiff(a, b):
    return max(
        (x.detach().float() - y.detach().float()).abs().max().item()
        for x, y in zip(a.parameters(), b.parameters(), strict=True)
    )


def train_both(model, opt, ref, ropt, batches):
    """One step per batch on ours and on the torch reference."""
    for x, y in batches:
        for m, o in ((model, opt), (ref, ropt)):
            loss_fn(m, x, y).backward()
            o.step()
            o.zero_grad()


def ref_opt(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)


def fwd(model, x, boom=False):
    h = model[0](x)
    if boom:

        def hk(g):
            raise RuntimeError("boom")

        h.register_hook(hk)
    for layer in list(model)[1:]:
        h = layer(h)
    return h


# 1 ---------------------------------------------------------------------------------------
def test_announced_backward_that_raises_then_zero_grad_recovers():
    # An exact announced step keeps no backup: the buckets it stepped before the backward
    # raised stay stepped (counted, with a warning naming them), the others are not, and
    # the optimizer trains on normally afterwards.
    m = mlp()
    o = mk(m)
    D = data(3)
    x, y = D[0]
    with pytest.raises(RuntimeError, match="boom"):
        o.backward(((fwd(m, x, True) - y) ** 2).mean(), step=True)
    with pytest.warns(UserWarning, match=r"buckets \[.*\] were stepped"):
        o.zero_grad()
    counts = {int(o.state[p]["step"]) for p in m.parameters()}
    assert counts == {0, 1}
    for x, y in D[1:]:
        o.backward(((fwd(m, x) - y) ** 2).mean(), step=True)
        o.step()
        o.zero_grad()
    assert {int(o.state[p]["step"]) for p in m.parameters()} == {2, 3}


# 2 ---------------------------------------------------------------------------------------
class Two(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 16, bias=False)
        self.b = nn.Linear(16, 16, bias=False)

    def forward(self, x, use_b):
        return self.a(x) + (self.b(x) if use_b else 0)


def test_bucket_without_gradient_in_new_backward_is_not_restepped():
    torch.manual_seed(0)
    m = Two()
    r = copy.deepcopy(m)
    o = mk(m, bucket_bytes=1024)
    ro = ref_opt(r)
    for k, (x, y) in enumerate(data(3, d_out=16)):
        for mod, opt in ((m, o), (r, ro)):
            ((mod(x, k == 0) - y) ** 2).mean().backward()
            opt.step()
            mod.zero_grad()
    assert int(o.state[m.b.weight]["step"]) == 1
    assert mdiff(m, r) < 1e-5


# 3 ---------------------------------------------------------------------------------------
def test_second_backward_after_announced_one_is_refused_or_counted():
    m = mlp()
    r = copy.deepcopy(m)
    o = mk(m)
    ro = ref_opt(r)
    D = data(2)
    o.backward(loss_fn(m, *D[0]), step=True)
    try:
        loss_fn(m, *D[1]).backward()
    except RuntimeError:
        return  # refused, as Note [stepping during backward] promises
    o.step()
    for x, y in D:
        loss_fn(r, x, y).backward()
    ro.step()
    assert mdiff(m, r) < 1e-5, "the second backward's gradients were silently dropped"


# 4 ---------------------------------------------------------------------------------------
def _failing(self, nbytes, *, owner):
    raise MemoryError("simulated: cannot pin the accumulator")


@pytest.mark.parametrize("where", ["fold_in_open_grad", "flush_overlap_step"])
def test_accumulator_allocation_failure_leaves_nothing_behind(monkeypatch, where):
    m = mlp()
    o = mk(m, overlap_step=(where == "flush_overlap_step"))
    acc = o.accelerator
    D = data(3)
    if where == "fold_in_open_grad":
        loss_fn(m, *D[0]).backward()
    monkeypatch.setattr(off.AccumulatorPool, "alloc", _failing)
    with pytest.raises(MemoryError):
        loss_fn(m, *D[1]).backward()
    monkeypatch.undo()
    o.zero_grad()  # flush case: raises "(bug)" today
    assert all(b.gradients._grad_block is None for b in o.buckets), "leaked device grad block"
    loss_fn(m, *D[2]).backward()
    o.step()
    o.zero_grad()
    o.close()
    assert acc.memory_stats()["in_use"] == 0


# 5 ---------------------------------------------------------------------------------------
def test_amsgrad_true_after_load_is_honoured_or_refused():
    m = mlp()
    r = copy.deepcopy(m)
    D = data(6)
    ro = torch.optim.AdamW(
        r.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, amsgrad=True
    )
    for x, y in D[:3]:
        loss_fn(r, x, y).backward()
        ro.step()
        ro.zero_grad()
    m.load_state_dict(r.state_dict())
    o = mk(m)
    try:
        o.load_state_dict(copy.deepcopy(ro.state_dict()))
    except (ValueError, TypeError):
        return  # refused: fine
    train_both(m, o, r, ro, D[3:])
    assert mdiff(m, r) < 1e-5


# 6 ---------------------------------------------------------------------------------------
def test_state_dict_between_announced_backward_and_step_does_not_double_step():
    m = mlp()
    r = copy.deepcopy(m)
    o = mk(m)
    ro = ref_opt(r)
    x, y = data(1)[0]
    o.backward(loss_fn(m, x, y), step=True)
    o.state_dict()
    o.step()
    loss_fn(r, x, y).backward()
    ro.step()
    assert int(o.state[next(m.parameters())]["step"]) == 1
    assert mdiff(m, r) < 1e-5


# 7 ---------------------------------------------------------------------------------------
def test_clip_grad_norm_does_not_leak_past_zero_grad():
    m = mlp()
    r = copy.deepcopy(m)
    o = mk(m)
    ro = ref_opt(r)
    D = data(2)
    loss_fn(m, *D[0]).backward()
    o.clip_grad_norm_(1e-3)
    o.zero_grad()
    for mod, opt in ((m, o), (r, ro)):
        loss_fn(mod, *D[1]).backward()
        opt.step()
    assert mdiff(m, r) < 1e-5


# 8 ---------------------------------------------------------------------------------------
def test_load_state_dict_between_announced_backward_and_step():
    m = mlp()
    r = copy.deepcopy(m)
    o = mk(m)
    ro = ref_opt(r)
    D = data(4)
    for x, y in D[:2]:
        for mod, opt in ((m, o), (r, ro)):
            loss_fn(mod, x, y).backward()
            opt.step()
            opt.zero_grad()
    sd, rsd, msd = (
        copy.deepcopy(o.state_dict()),
        copy.deepcopy(ro.state_dict()),
        copy.deepcopy(m.state_dict()),
    )
    for mod, opt in ((m, o), (r, ro)):
        loss_fn(mod, *D[2]).backward()
        opt.step()
        opt.zero_grad()
    o.backward(loss_fn(m, *D[3]), step=True)
    loss_fn(r, *D[3]).backward()
    m.load_state_dict(msd)
    o.load_state_dict(sd)
    r.load_state_dict(msd)
    ro.load_state_dict(rsd)
    try:
        o.step()
    except RuntimeError:
        return  # a clear refusal would be acceptable
    ro.step()
    assert int(o.state[next(m.parameters())]["step"]) == 3
    assert mdiff(m, r) < 1e-5


# 9 ---------------------------------------------------------------------------------------
def test_add_param_group_after_announce():
    from ._models import host_accelerator

    m = mlp()
    ps = list(m.parameters())
    for p in ps[2:]:
        p.requires_grad_(False)
    o = OffloadAdamW(
        ps[:2], lr=1e-2, config=OffloadConfig(bucket_bytes=2048), accelerator=host_accelerator()
    )
    x, y = data(1)[0]
    assert o.announce_step()
    for p in ps[2:]:
        p.requires_grad_(True)
    try:
        o.add_param_group({"params": ps[2:]})
    except RuntimeError:
        return  # a clear refusal is fine
    loss_fn(m, x, y).backward()
    o.step()  # KeyError(1) today, forever after


# 10 --------------------------------------------------------------------------------------
def test_refused_eager_step_leaves_state_unchanged():
    m = mlp()
    r = copy.deepcopy(m)
    o = mk(m)
    ro = ref_opt(r)
    x, y = data(1)[0]
    o.backward(loss_fn(m, x, y), step=True)
    p = next(m.parameters())
    p.grad = torch.zeros_like(p)
    with pytest.raises(RuntimeError, match="set by hand"):
        o.step()
    p.grad = None
    o.step()
    loss_fn(r, x, y).backward()
    ro.step()
    assert mdiff(m, r) < 1e-5, "the announced update was applied twice"


# 11 --------------------------------------------------------------------------------------
def test_overlap_step_write_to_one_param_keeps_others_pending_update():
    res = []
    for write in (False, True):
        m = mlp()
        o = mk(m, overlap_step=True, bucket_bytes=1 << 20)
        for x, y in data(3):
            loss_fn(m, x, y).backward()
            o.step()
            o.zero_grad()
        if write:
            with torch.no_grad():
                m[0].bias.mul_(1.0)
        o.flush_pending_update()
        res.append([p.detach().clone() for n, p in m.named_parameters() if n != "0.bias"])
    assert all(torch.equal(a, b) for a, b in zip(*res, strict=True))


# 12 --------------------------------------------------------------------------------------
def test_first_fp16_group_added_mid_window_does_not_unscale_fp32_window():
    m = mlp()
    r = copy.deepcopy(m)
    o = mk(m)
    ro = ref_opt(r)
    x, y = data(1)[0]
    loss_fn(m, x, y).backward()
    loss_fn(r, x, y).backward()
    try:
        o.add_param_group({"params": list(nn.Linear(4, 4).half().parameters())})
    except (RuntimeError, ValueError):
        return  # a clear refusal is fine
    o.step()
    ro.step()
    assert mdiff(m, r) < 1e-5


def test_a_delayed_update_behind_the_next_backward_does_not_wait_for_it(monkeypatch):
    # overlap_step queues the update on the host worker; here it is slow, so the next
    # backward's flushes (and their host-worker events) are queued behind it. The update
    # must not wait for those events (Note [Adam follows the gradient in]): it would wait
    # for work queued after itself, forever. Run in a thread, so a regression fails, not
    # hangs.
    import threading
    import time

    kernel = tiles.adam_step

    def slow(*args, **kwargs):
        time.sleep(0.02)
        return kernel(*args, **kwargs)

    monkeypatch.setattr(tiles, "adam_step", slow)
    model = mlp()
    opt = mk(model, overlap_step=True)
    batches = data(4)
    done = threading.Event()

    def train():
        for x, y in batches:
            loss_fn(model, x, y).backward()
            opt.step()
            opt.zero_grad()
        opt.flush_pending_update()
        done.set()

    worker = threading.Thread(target=train, daemon=True)
    worker.start()
    worker.join(timeout=60)
    assert done.is_set(), "the delayed update waited for work queued behind it"
    opt.close()


def test_a_host_worker_failure_after_a_fast_step_says_the_step_was_applied(monkeypatch):
    # Note [a step that needs no statistics]: the update runs before the host worker's
    # statistics are read, so their failure comes after the step changed every bucket.
    # It must say so (StepFailed), not look like a step that changed nothing.
    import time

    from zero_offload.errors import StreamError
    from zero_offload.optim.update.modes import StepFailed

    model = mlp()
    opt = mk(model)
    assert not opt._policy.needs_statistics()
    (x, y), (x2, y2) = data(2)
    loss_fn(model, x, y).backward()
    opt.step()
    opt.zero_grad()
    last = opt.buckets[0].layout.index  # backward reaches the first layer's bucket last
    real = off.HostGradients._sum_partials

    def failing(self, partials):
        if self.layout.index == last:
            time.sleep(0.05)  # the caller is past its last submit when this fails
            raise MemoryError("injected")
        return real(self, partials)

    monkeypatch.setattr(off.HostGradients, "_sum_partials", failing)
    before = [p.detach().clone() for p in model.parameters()]
    loss_fn(model, x2, y2).backward()
    with pytest.raises(StepFailed, match=r"step\(\) was applied to buckets .*rebuild"):
        opt.step()
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    with pytest.raises(StreamError, match="injected"):  # the worker's error is sticky
        opt.close()


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
    opt = mk(model, bucket_bytes=64 * 64 * 4 if lone else 2048)
    ropt = ref_opt(ref)
    batches = data(3, d_in=dims[0])
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
        loss_fn(model, *batches[0]).backward()
    monkeypatch.setattr(TieredMemoryManager, "copy", real)
    opt.zero_grad()
    train_both(model, opt, ref, ropt, batches[1:])
    assert mdiff(model, ref) < 1e-5
    opt.close()
