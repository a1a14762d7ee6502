"""The ``overlap_step`` row against the pools the optimizer builds (Note [overlap_step's
device extras follow the budget] in ``estimate/delayed.py``): every bucket's spare gradient
staging on the host (no fp32 accumulator on either side), and the weight shadows the device
budget gives, for every rule and both training dtypes, with room for all of them, and under
budgets whose reserve refuses some shadows. One micro-batch a step, a bf16 or fp32 TinyGPT
of 4 blocks in 8 KiB buckets."""

from __future__ import annotations

import pytest
import torch

from zero_offload import OffloadConfig
from zero_offload.accelerator import HostAccelerator
from zero_offload.config import AcceleratorConfig
from zero_offload.estimate.delayed import Shadowed
from zero_offload.estimate.nvme import total_bytes
from zero_offload.estimate.rows import ActivationMode, Context, Limits, RowBytes
from zero_offload.estimate.subjects import ModuleSubject, ShapeSubject

from .helpers.rule_pools import BUCKET_BYTES, FACADES, SHAPE, model

_ROW = Shadowed("overlap", ActivationMode.CHECKPOINTED)


def _built(rule: str, dtype: torch.dtype, budget: int) -> dict[str, int]:
    """The pools ``rule``'s optimizer holds after two ``overlap_step`` steps of one
    micro-batch under a device budget of ``budget`` bytes: on the device, on the host."""
    facade, hyper = FACADES[rule]
    net = model(dtype)
    acc = HostAccelerator(AcceleratorConfig(device_budget=budget))
    config = OffloadConfig(bucket_bytes=BUCKET_BYTES, overlap_step=True)
    opt = facade(net.parameters(), **hyper, config=config, accelerator=acc)
    tokens = torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(1))
    try:
        for _ in range(2):
            opt.backward(net(tokens).float().square().mean())
            opt.step()
            opt.zero_grad()
        opt.flush_pending_update()
        pools = opt.manager.pools
        return {
            "device": sum(p.capacity for p in pools if p.kind == "device"),
            "host": sum(p.capacity for p in pools if p.kind != "device"),
            "shadows": sum(1 for p in pools if p.name.endswith(".weight_shadow")),
        }
    finally:
        opt.close()


def _row(rule: str, itemsize: int, budget: int | None, *, shape: bool = False) -> RowBytes:
    ctx = Context(itemsize=itemsize, world_size=1, ranks_per_node=1, bucket_bytes=BUCKET_BYTES)
    ctx = Context(**{**ctx.__dict__, "rule": rule})
    subject = ShapeSubject(SHAPE, ctx) if shape else ModuleSubject(SHAPE.parameter_shapes(), ctx)
    row = _ROW.bytes(subject, Limits(device=budget, host=None, host_reserve=0))
    assert row is not None
    return row


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("rule", ["adamw", "lion", "adagrad", "adafactor", "muon"])
def test_the_row_is_the_built_pools_at_every_budget(rule: str, dtype: torch.dtype) -> None:
    itemsize = dtype.itemsize
    full = _row(rule, itemsize, None)
    ctx = Context(itemsize=itemsize, world_size=1, ranks_per_node=1, bucket_bytes=BUCKET_BYTES)
    ctx = Context(**{**ctx.__dict__, "rule": rule})
    subject = ModuleSubject(SHAPE.parameter_shapes(), ctx)
    weights, grad_buffers, host = subject.offload_pools()
    # One micro-batch: every bucket's spare gradient staging, a(ks) (k B/param), and no
    # fp32 accumulator, host or device (Note [the delayed update reads one buffer, the next
    # backward fills the other] in optim/grads/staging.py).
    spares = total_bytes(subject.bucket_groups(), ctx, "grad")
    assert full.host == host + spares
    shadows = total_bytes(subject.bucket_groups(), ctx, "home")  # a(ks) each, device
    whole = weights + grad_buffers + shadows
    assert full.model_states + full.buffers == whole  # room for all of it
    roomy = 2**30
    for budget in (roomy, int(whole * 1.01), int(whole * 0.97)):
        built = _built(rule, dtype, budget)
        row = _row(rule, itemsize, budget)
        assert row.model_states + row.buffers == built["device"], budget
        assert row.host == built["host"], budget
        by_shape = _row(rule, itemsize, budget, shape=True)  # the shape plans the same
        assert (by_shape.model_states, by_shape.buffers, by_shape.host) == (
            row.model_states,
            row.buffers,
            row.host,
        )
    # Under the row's own bytes the reserve beside the shadows refuses some of them.
    tight = _built(rule, dtype, int(whole * 1.01))
    assert tight["shadows"] < _built(rule, dtype, roomy)["shadows"]
