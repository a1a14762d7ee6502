"""Activation offload: a device pool whose free bytes are split during backward, and what
the offloader gives back without a backward (Note [a reload can find the free bytes split]
in activations/pools.py)."""

from __future__ import annotations

import gc
import re

import pytest
import torch
from torch import nn

from tests.conftest import make_accelerator
from zero_offload.activations import (
    ActivationOffloadConfig,
    ActivationOffloader,
    checkpoint,
    offload_activations,
)
from zero_offload.errors import PoolExhausted

VOCAB, DIM, LAYERS, BATCH, SEQ = 64, 64, 4, 4, 32


class _Block(nn.Module):
    """A transformer block: its saved tensors have many sizes and die out of order."""

    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(DIM)
        self.attn = nn.MultiheadAttention(DIM, 4, batch_first=True)
        self.ln2 = nn.LayerNorm(DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln(x)
        mask = torch.triu(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool), 1)
        a, _ = self.attn(h, h, h, attn_mask=mask, need_weights=False)
        x = x + a
        return x + self.mlp(self.ln2(x))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Embedding(VOCAB, DIM), *(_Block() for _ in range(LAYERS)), nn.Linear(DIM, VOCAB)
    )


def _step(device_pool_bytes: int) -> str | None:
    """One forward and backward under ``offload_activations(min_bytes=0)``; the device
    pool's ``PoolExhausted`` message, or None when the step passed."""
    model = _model()
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(0))
    offloader = ActivationOffloader(
        accelerator=make_accelerator("host"),
        config=ActivationOffloadConfig(
            min_bytes=0, host_pool_bytes="20MB", device_pool_bytes=device_pool_bytes
        ),
    )
    refused = None
    try:
        with offload_activations(offloader=offloader, min_bytes=0):
            out = model(tokens[:, :-1])
            loss = nn.functional.cross_entropy(out.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        loss.backward()
    except PoolExhausted as exc:
        refused = str(exc)
    loss = out = None  # the partial graph holds reloaded blocks
    gc.collect()
    offloader.close()
    return refused


# Found by sweeping device_pool_bytes: at this size the pool holds 102,400 bytes of live
# reloads and 57,344 free, split so that the largest free range (28,672) cannot hold the
# next demand reload (32,768). Which reloads are alive depends on when their events complete:
# strict mode completes compute events late (docs/accelerators.md), and at this size the pool
# is full there instead; the test then looks for a split size nearby.
SPLIT_POOL_BYTES = 160_112
NEARBY = range(120_000, 176_000, 4096)


def _split_refusal() -> str | None:
    """A refusal that says the free bytes are split: at SPLIT_POOL_BYTES, else the first of
    NEARBY that gives one."""
    for size in (SPLIT_POOL_BYTES, *NEARBY):
        refused = _step(size)
        if refused is not None and "enough, but split" in refused:
            return refused
    return None


def test_a_split_pool_says_so_and_names_a_size_that_works() -> None:
    refused = _split_refusal()
    if refused is None:
        pytest.skip("this build placed the reloads without splitting the free bytes")
    assert "enough, but split" in refused, refused
    assert "largest" in refused and "ActivationOffloadConfig.device_pool_bytes" in refused
    assert "layers' saved" not in refused  # each saved tensor is its own group here
    works = int(re.search(r"device_pool_bytes \(now \d+\) to (\d+) bytes", refused)[1])
    assert _step(works) is None


def test_a_full_pool_names_a_size_that_works() -> None:
    # Full, or (strict mode completing compute events late, in some runs) enough free bytes
    # split between live reloads: either refusal names a size that works.
    refused = _step(70_000)
    assert refused is not None, "70,000 bytes were not refused"
    assert "is full" in refused or "enough, but split" in refused, refused
    works = int(re.search(r"device_pool_bytes \(now \d+\) to (\d+) bytes", refused)[1])
    assert _step(works) is None


def test_stats_returns_a_dropped_graphs_device_memory() -> None:
    """An eval forward with grad enabled builds a graph nobody runs backward on: once its
    copies out ended, ``stats()`` (and ``synchronize()``) let go of the device tensors."""
    model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64))
    offloader = ActivationOffloader(
        accelerator=make_accelerator("host"),
        config=ActivationOffloadConfig(
            min_bytes=0, host_pool_bytes="4MiB", device_pool_bytes="1MiB"
        ),
    )
    with offload_activations(offloader=offloader, min_bytes=0):
        model(torch.randn(8, 64)).sum().item()  # graph built, then dropped
    gc.collect()
    offloader.manager.d2h.synchronize()  # the copies out ended; nothing polled them yet
    stats = offloader.stats()
    assert (stats["device_bytes"], stats["pending_offloads"]) == (0, 0), stats
    assert stats["host_pool_bytes_in_use"] == 0
    offloader.close()


def test_checkpoint_graph_dropped_is_returned_by_stats() -> None:
    layers = [nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(3)]
    offloader = ActivationOffloader(
        accelerator=make_accelerator("host"),
        config=ActivationOffloadConfig(
            min_bytes=0, host_pool_bytes="4MiB", device_pool_bytes="1MiB"
        ),
    )
    x = torch.randn(8, 64) * 2
    for layer in layers:
        x = checkpoint(layer, x, offloader=offloader)
    x = None
    gc.collect()
    offloader.manager.d2h.synchronize()
    assert offloader.stats()["device_bytes"] == 0
    offloader.close()
