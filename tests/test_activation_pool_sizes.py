"""``ActivationOffloadConfig.for_checkpoints``: pools exactly large enough for a model's
checkpointed layers (Note [pools sized for checkpointed layers] in activation_sizes.py).

A stack of checkpointed layers trains with 2 micro-batches a step at exactly those sizes,
without a dropped prefetch; one block fewer on the host is refused, and one block fewer on
the device drops prefetches. The estimator prints the same sizes and counts them in its
activation-offload rows.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.conftest import make_accelerator
from zero_offload import OffloadAdamW, estimate
from zero_offload.activation_sizes import checkpoint_pool_bytes
from zero_offload.activations import ActivationOffloadConfig, ActivationOffloader, checkpoint
from zero_offload.errors import PoolExhausted
from zero_offload.estimate import ModelShape

LAYERS, BATCH, SEQ, HIDDEN = 5, 2, 33, 40
SAVED = BATCH * SEQ * HIDDEN * 4  # one layer's fp32 input: 10,560 bytes, not a multiple of 512
BLOCK = 10_752  # 10,560 + up to 63 for the pointer's alignment, rounded up to 512


def _train(config: ActivationOffloadConfig, steps: int = 2) -> tuple[dict, str | None]:
    """``steps`` steps of 2 micro-batches through ``LAYERS`` checkpointed layers: the
    offloader's stats and, where a pool ran out, its ``PoolExhausted`` message. The first
    layer's input is a product (as an embedding's output is), so every layer's input is
    offloaded."""
    torch.manual_seed(0)
    embed = nn.Linear(HIDDEN, HIDDEN)
    layers = nn.ModuleList(
        nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.GELU()) for _ in range(LAYERS)
    )
    opt = OffloadAdamW(
        [*embed.parameters(), *layers.parameters()], lr=1e-3, accelerator=make_accelerator("host")
    )
    offloader = ActivationOffloader(manager=opt.manager, config=config)
    refused = None
    try:
        for _ in range(steps):
            for _ in range(2):
                x = embed(torch.randn(BATCH, SEQ, HIDDEN))
                for layer in layers:
                    x = checkpoint(layer, x, offloader=offloader)
                opt.backward(x.square().mean())
            opt.step()
            opt.zero_grad()
    except PoolExhausted as exc:
        refused = str(exc)  # the exception's frames go with it, and the graph below
    x = None  # the partial graph holds the saved inputs' blocks
    try:
        return offloader.stats(), refused
    finally:
        offloader.close()
        opt.close()


def test_the_sizes_are_one_block_per_layer_and_per_reload_in_flight() -> None:
    assert checkpoint_pool_bytes(SAVED, LAYERS) == (LAYERS * BLOCK, 2 * BLOCK)
    assert checkpoint_pool_bytes(SAVED, LAYERS, prefetch_depth=3) == (LAYERS * BLOCK, 4 * BLOCK)
    assert checkpoint_pool_bytes(SAVED, 2, prefetch_depth=3) == (2 * BLOCK, 2 * BLOCK)
    assert checkpoint_pool_bytes(512 - 63, 1) == (512, 512)  # the slack fits the block
    assert checkpoint_pool_bytes(512 - 62, 1) == (1024, 1024)


@pytest.mark.parametrize("depth", [0, 1, 2])
def test_a_model_trains_at_exactly_those_sizes(depth: int) -> None:
    config = ActivationOffloadConfig.for_checkpoints(
        SAVED, LAYERS, prefetch_depth=depth, min_bytes=0
    )
    assert (config.host_pool_bytes, config.device_pool_bytes) == (
        LAYERS * BLOCK,
        (depth + 1) * BLOCK,
    )
    stats, refused = _train(config)
    assert refused is None
    assert stats["prefetch_skipped"] == 0
    assert stats["prefetch_hits"] > 0 or depth == 0
    assert stats["host_pool_peak_bytes"] <= config.host_pool_bytes


def test_one_block_fewer_on_the_host_is_refused_naming_the_setting() -> None:
    config = ActivationOffloadConfig.for_checkpoints(SAVED, LAYERS, min_bytes=0)
    short = ActivationOffloadConfig(
        min_bytes=0,
        host_pool_bytes=config.host_pool_bytes - BLOCK,
        device_pool_bytes=config.device_pool_bytes,
    )
    _, refused = _train(short, steps=1)
    assert refused is not None and "Raise ActivationOffloadConfig.host_pool_bytes" in refused


def test_one_block_fewer_on_the_device_drops_prefetches() -> None:
    config = ActivationOffloadConfig.for_checkpoints(SAVED, LAYERS, min_bytes=0)
    short = ActivationOffloadConfig(
        min_bytes=0,
        host_pool_bytes=config.host_pool_bytes,
        device_pool_bytes=config.device_pool_bytes - BLOCK,
    )
    stats, refused = _train(short, steps=1)
    assert refused is None and stats["prefetch_skipped"] > 0


def test_for_checkpoints_refuses_sizes_given_by_hand_and_bad_counts() -> None:
    with pytest.raises(TypeError, match="sizes host_pool_bytes itself"):
        ActivationOffloadConfig.for_checkpoints(SAVED, LAYERS, host_pool_bytes="1GiB")
    with pytest.raises(ValueError, match="layers must be an int >= 1, got 0"):
        ActivationOffloadConfig.for_checkpoints(SAVED, 0)
    with pytest.raises(ValueError, match="prefetch_depth must be an int in"):
        ActivationOffloadConfig.for_checkpoints(SAVED, LAYERS, prefetch_depth=-1)


def test_the_estimator_prints_and_counts_the_same_pools() -> None:
    shape = ModelShape(layers=4, hidden=64, heads=4, ffn=256, vocab=128, seq_len=32, micro_batch=2)
    est = estimate(shape, device_memory="8GiB", host_memory="64GiB", dtype="bfloat16")
    host, device = checkpoint_pool_bytes(shape.checkpoint_bytes(2), shape.layers)
    rows = [row for row in est.rows if "activation offload" in row.name]
    assert rows
    layer, logits = shape.layer_activation_bytes(2), shape.logits_bytes(2)
    for row in rows:
        assert row.device_activations == device + layer + logits
    assert est.activation_pools == (host, device)
    text = est.table()
    assert f"ActivationOffloadConfig(host_pool_bytes={host}, device_pool_bytes={device})" in text
