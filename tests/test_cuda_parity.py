"""OffloadAdamW against torch.optim.AdamW in every mode, on every accelerator kind here.

The other parity tests build their optimizer on the host accelerator; these take the kind
from the ``accel_kind`` fixture (tests/conftest.py): ``host`` always, ``cuda`` marked
``cuda`` and skipped without a GPU, so on a GPU (``benchmarks/gpu_check.py`` runs this file)
each mode trains through the CUDA path: plain, announced (``opt.backward(loss, step=True)``),
``overlap_step`` (against torch AdamW with the same one-step delay, written out by hand),
parameter offload, activation offload (each block's input checkpointed to the host) and the
NVMe tier. Each test also checks that its mode did what it says (an activation offloaded,
a parameter released, state on disk), so a mode that quietly fell back cannot pass.

Tolerance: fp32 everywhere, as tests/test_offload_adamw_parity.py: a few ulp per step from
the kernel's evaluation order, below 1e-5 absolute over these 6 steps.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from tests.conftest import make_accelerator
from zero_offload import (
    ActivationOffloadConfig,
    ActivationOffloader,
    OffloadAdamW,
    OffloadConfig,
    checkpoint,
)
from zero_offload.demo.model import GPTConfig, TinyGPT
from zero_offload.params import UnitState

from .helpers.models import batches, lm_loss, max_diff, torch_adamw, train

FP32_ATOL = 1e-5
STEPS = 6
SHAPE = GPTConfig(vocab_size=64, seq_len=16, layers=3, hidden=32, heads=4)
BATCH = 4
#: One checkpointed block input: (batch, seq, hidden) fp32.
LAYER_BYTES = BATCH * SHAPE.seq_len * SHAPE.hidden * 4


def _pair(device: torch.device) -> tuple[TinyGPT, TinyGPT]:
    """Two identical fp32 GPTs on ``device``: ours and torch's. Without the attention's qkv
    bias: the key bias's gradient is zero in exact arithmetic, so its float noise (which
    differs once the two runs' weights differ by an ulp, and on CUDA may differ run to run)
    would be amplified by Adam into updates near ``lr`` (tests/helpers/models.py, the same)."""
    torch.manual_seed(0)
    with device:
        model = TinyGPT(SHAPE)
    for block in model.blocks:
        block.attn.qkv.bias = None
    return model, copy.deepcopy(model)


def _data(device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [
        (tokens.to(device), targets.to(device))
        for tokens, targets in batches(
            STEPS, vocab=SHAPE.vocab_size, batch=BATCH, seq=SHAPE.seq_len
        )
    ]


def _offload_adamw(model: TinyGPT, accel_kind: str, **config: object) -> OffloadAdamW:
    """``tests/helpers/models.offload_opt``'s hyper-parameters and small buckets and tiles, on a
    fresh accelerator of ``accel_kind``; ``model=`` for parameter offload."""
    return OffloadAdamW(
        model.parameters(),
        lr=1e-3,
        betas=(0.9, 0.95),
        weight_decay=0.1,
        config=OffloadConfig(bucket_bytes=8192, tile_elements=1024, **config),  # type: ignore[arg-type]
        accelerator=make_accelerator(accel_kind, device_budget="1GiB"),
        model=model if config.get("offload_parameters") else None,
    )


def _assert_matches_torch(model: TinyGPT, ref: TinyGPT, data: list) -> None:
    train(ref, torch_adamw(ref), data)
    assert max_diff(model, ref) < FP32_ATOL


@pytest.mark.parametrize("announced", [False, True], ids=["plain", "announced"])
def test_plain_and_announced_steps_match_torch_adamw(accel_kind: str, announced: bool) -> None:
    model, ref = _pair(make_accelerator(accel_kind).device)
    data = _data(model.head.weight.device)
    opt = _offload_adamw(model, accel_kind)
    assert len(opt.buckets) > 3  # several buckets, several tiles each

    def backward(loss: torch.Tensor) -> None:
        opt.backward(loss, step=announced)

    losses = train(model, opt, data, backward=backward)
    opt.close()
    assert losses[-1] < losses[0]
    _assert_matches_torch(model, ref, data)


def test_overlap_step_matches_torch_adamw_one_update_behind(accel_kind: str) -> None:
    model, ref = _pair(make_accelerator(accel_kind).device)
    data = _data(model.head.weight.device)
    opt = _offload_adamw(model, accel_kind, overlap_step=True)
    # Note [delayed parameter update]: the forward of step k sees the weights of update
    # k - 2; the master (``master`` here) is current. ``ref`` is what the forward sees.
    master = copy.deepcopy(ref)
    ropt = torch_adamw(master)
    pending: list[torch.Tensor] = []
    for tokens, targets in data:
        lm_loss(model, tokens, targets).backward()
        opt.step()
        opt.zero_grad()
        lm_loss(ref, tokens, targets).backward()
        if pending:  # the previous update reaches the weights the forward sees
            with torch.no_grad():
                for p, q in zip(ref.parameters(), pending, strict=True):
                    p.copy_(q)
        for p, q in zip(master.parameters(), ref.parameters(), strict=True):
            p.grad, q.grad = q.grad, None
        ropt.step()
        ropt.zero_grad()
        pending = [p.detach().clone() for p in master.parameters()]
        assert max_diff(model, ref) < FP32_ATOL  # the weights the next forward sees
    opt.close()  # publishes the last update
    assert max_diff(model, master) < FP32_ATOL


def test_parameter_offload_matches_torch_adamw(accel_kind: str) -> None:
    model, ref = _pair(make_accelerator(accel_kind).device)
    data = _data(model.head.weight.device)
    opt = _offload_adamw(model, accel_kind, offload_parameters=True, prefetch_layers=1)
    train(model, opt, data)
    units = opt.param_offloader.units
    assert len(units) > SHAPE.layers  # the blocks, and the embeddings and head around them
    # Between steps every unit is released: its parameters are zero-byte device placeholders.
    assert all(unit.state is UnitState.ON_HOST for unit in units)
    opt.close()
    _assert_matches_torch(model, ref, data)


def test_activation_offload_matches_torch_adamw(accel_kind: str) -> None:
    model, ref = _pair(make_accelerator(accel_kind).device)
    data = _data(model.head.weight.device)
    opt = _offload_adamw(model, accel_kind)
    offloader = ActivationOffloader(
        manager=opt.manager,
        config=ActivationOffloadConfig(
            min_bytes=0,
            # Every block input of one forward, each rounded up to the pool's alignment.
            host_pool_bytes=SHAPE.layers * (LAYER_BYTES + 4096),
            # Prefetch depth 1: the one in use, the one coming, one on its way out.
            device_pool_bytes=3 * (LAYER_BYTES + 4096),
        ),
    )
    model.runner = lambda block, x: checkpoint(block, x, offloader=offloader)
    train(model, opt, data)
    stats = offloader.stats()
    opt.close()
    offloader.close()
    # One block input per layer per step left for the host and came back.
    assert stats["offloaded_tensors"] == stats["reloads"] == SHAPE.layers * STEPS
    _assert_matches_torch(model, ref, data)


def test_nvme_state_matches_torch_adamw(accel_kind: str, tmp_path: Path) -> None:
    model, ref = _pair(make_accelerator(accel_kind).device)
    data = _data(model.head.weight.device)
    opt = _offload_adamw(model, accel_kind, nvme_dir=tmp_path, host_budget=1)  # all on disk
    train(model, opt, data)
    on_disk = [path for path in tmp_path.rglob("*") if path.is_file() and path.stat().st_size]
    opt.close()
    assert on_disk, f"no optimizer state under {tmp_path}"
    _assert_matches_torch(model, ref, data)
