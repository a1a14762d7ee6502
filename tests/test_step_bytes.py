"""The step at the speed of its bytes (Note [no accumulator for one backward]): Adam reads a
lone flush's gradient from staging, the accumulator exists only once a window accumulates.

Each fast path is compared bitwise (``torch.equal``) with the fp32-accumulator path, forced
with ``require_accumulator()``; accumulation is compared with torch (1e-5, as elsewhere).
"""

from __future__ import annotations

import pytest
import torch

from ._models import batches, lm_loss, make_pair, max_diff, offload_opt, torch_adamw


def _train(model, opt, data, *, micro: int = 1, clip: float | None = None) -> None:
    for i in range(0, len(data), micro):
        for tokens, targets in data[i : i + micro]:
            opt.backward(lm_loss(model, tokens, targets))
        if clip is not None:
            opt.clip_grad_norm_(clip)
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("clip", [None, 0.05])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_adam_from_staging_is_bitwise_the_accumulator_path(
    dtype: torch.dtype, clip: float | None
) -> None:
    fast_model, plain_model = make_pair(dtype)
    fast = offload_opt(fast_model)
    plain = offload_opt(plain_model)
    for bucket in plain.buckets:
        bucket.backend.require_accumulator()
    data = batches(4)
    _train(fast_model, fast, data, clip=clip)
    _train(plain_model, plain, data, clip=clip)
    assert max_diff(fast_model, plain_model) == 0.0
    assert fast.last_grad_norm == plain.last_grad_norm
    # One backward per step: no accumulator was ever allocated.
    assert all(b.backend.grad_acc is None for b in fast.buckets)
    assert all(b.backend.accumulators.pool is None for b in fast.buckets)


def test_accumulation_allocates_the_accumulator_and_matches_torch() -> None:
    model, ref = make_pair()
    opt = offload_opt(model)
    ropt = torch_adamw(ref)
    data = batches(8)
    _train(model, opt, data[:2])  # one micro-batch per step first: no accumulator
    assert all(b.backend.grad_acc is None for b in opt.buckets)
    _train(model, opt, data[2:], micro=3)
    assert all(b.backend.grad_acc is not None for b in opt.buckets)
    for tokens, targets in data[:2]:
        lm_loss(ref, tokens, targets).backward()
        ropt.step()
        ropt.zero_grad()
    for i in range(2, 8, 3):
        for tokens, targets in data[i : i + 3]:
            lm_loss(ref, tokens, targets).backward()
        ropt.step()
        ropt.zero_grad()
    assert max_diff(model, ref) < 1e-5
