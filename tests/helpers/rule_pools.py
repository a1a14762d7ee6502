"""The pools an optimizer of each rule builds over the estimator test's model, on one rank
or on each of several spawned gloo ranks (``dist.run_ranks(world, "rule_pools", ...)``):
what tests/test_estimate_rules.py holds the estimator's rows to."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from zero_offload import (
    OffloadAdafactor,
    OffloadAdagrad,
    OffloadAdam,
    OffloadAdamW,
    OffloadConfig,
    OffloadLion,
    OffloadMuon,
)
from zero_offload.demo.model import GPTConfig, TinyGPT
from zero_offload.estimate import ModelShape

from .models import host_accelerator

#: Small buckets: several per block, several parameters per bucket, so the owners of Note
#: [a whole parameter has one owner] differ within a bucket and carry over between them.
BUCKET_BYTES = 8192
#: Each rule's facade and hyper-parameters (defaults where the facade has them).
FACADES: dict[str, tuple[Any, dict[str, Any]]] = {
    "adamw": (OffloadAdamW, {"lr": 1e-3}),
    "adam": (OffloadAdam, {"lr": 1e-3}),
    "lion": (OffloadLion, {"lr": 1e-4}),
    "adagrad": (OffloadAdagrad, {"lr": 1e-2}),
    "adafactor": (OffloadAdafactor, {"lr": 1e-2}),
    "muon": (OffloadMuon, {"lr": 0.02, "adamw_lr": 3e-3}),
}
_CONFIG = GPTConfig(vocab_size=50, seq_len=16, layers=4, hidden=32, heads=4)
#: The model's shape: the same parameters, in the same order, as ``model()``.
SHAPE = ModelShape(layers=4, hidden=32, heads=4, vocab=50, seq_len=16)


def model(dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    """The TinyGPT of ``SHAPE``."""
    torch.manual_seed(0)
    return TinyGPT(_CONFIG).to(dtype)


def built_pools(rule: str, dtype: torch.dtype = torch.bfloat16) -> dict[str, int]:
    """Bytes of the pools ``rule``'s optimizer builds over ``model(dtype)``: on the device
    (weights and gradient buffers, everything offloaded), in host RAM (the state, the
    staging), and the state alone (``opt.placement.host``)."""
    facade, hyper = FACADES[rule]
    net = model(dtype)
    opt = facade(
        net.parameters(),
        **hyper,
        config=OffloadConfig(bucket_bytes=BUCKET_BYTES),
        accelerator=host_accelerator(),
    )
    try:
        pools = opt.manager.pools
        return {
            "device": sum(p.capacity for p in pools if p.kind == "device"),
            "host": sum(p.capacity for p in pools if p.kind != "device"),
            "state": opt.placement.host,
        }
    finally:
        opt.close()


def scenario_rule_pools(rank: int, world: int, out: Path, *, rule: str) -> dict:
    return built_pools(rule)


SCENARIOS = {"rule_pools": scenario_rule_pools}
