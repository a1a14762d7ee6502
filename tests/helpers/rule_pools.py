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


def built_pools(
    rule: str, dtype: torch.dtype = torch.bfloat16, moments_dtype: str = "float32"
) -> dict[str, int]:
    """Bytes of the pools ``rule``'s optimizer builds over ``model(dtype)`` with
    ``OffloadConfig(moments_dtype=moments_dtype)``: on the device (weights and gradient
    buffers, everything offloaded), in host RAM (the state, the staging), and the state
    alone (``opt.placement.host``)."""
    facade, hyper = FACADES[rule]
    net = model(dtype)
    opt = facade(
        net.parameters(),
        **hyper,
        config=OffloadConfig(bucket_bytes=BUCKET_BYTES, moments_dtype=moments_dtype),
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


def built_param_pools(rule: str, moments_dtype: str = "float32") -> dict[str, int]:
    """The pools ``rule``'s optimizer builds over ``model()`` with parameter offload (one
    rank), its moments in ``moments_dtype``: the window's slots, the optimizer's device
    pool (the gradient buffers), and the units' host pools (Note [homes are pinned unit by
    unit]) together."""
    facade, hyper = FACADES[rule]
    net = model()
    config = OffloadConfig(
        bucket_bytes=BUCKET_BYTES, offload_parameters=True, moments_dtype=moments_dtype
    )
    opt = facade(
        net.parameters(),
        **hyper,
        config=config,
        accelerator=host_accelerator(),
        model=net,
    )
    try:
        pools = opt.manager.pool_stats()
        return {
            kind: sum(s["capacity_bytes"] for name, s in pools.items() if name.endswith(suffix))
            for kind, suffix in (("window", ".window"), ("device", ".device"), ("host", ".host"))
        }
    finally:
        opt.close()


def built_extras(rule: str) -> dict[str, int]:
    """The pools beyond the state that ``rule``'s optimizer builds over ``model()`` as it
    trains: with ``overlap_step``, each bucket's weight shadow on the device; with two
    micro-batches a step (``grad_accumulation="auto"``: the first window on the host, the
    second on the device), the device and host accumulators; summed on the host, the spare
    staging."""
    facade, hyper = FACADES[rule]
    tokens = torch.randint(0, _CONFIG.vocab_size, (2, _CONFIG.seq_len), generator=_gen())
    sizes: dict[str, int] = {}
    runs = (  # (config, micro-batches a step, the pools it is measured by)
        (OffloadConfig(bucket_bytes=BUCKET_BYTES, overlap_step=True), 1, (".weight_shadow",)),
        (OffloadConfig(bucket_bytes=BUCKET_BYTES), 2, (".grad_acc_dev", ".grad_acc")),
        # The spare stays only where the windows are summed on the host (Note [the spare
        # goes when the device sums] in optim/grads/staging.py).
        (OffloadConfig(bucket_bytes=BUCKET_BYTES, grad_accumulation="host"), 2, (".grad_staging_spare",)),
    )  # fmt: skip
    for config, micro, suffixes in runs:
        net = model()
        opt = facade(net.parameters(), **hyper, config=config, accelerator=host_accelerator())
        try:
            for _ in range(2):
                for _ in range(micro):
                    opt.backward(net(tokens).float().square().mean())
                opt.step()
                opt.zero_grad()
            if config.overlap_step:
                opt.flush_pending_update()
            for suffix in suffixes:
                sizes[suffix] = sum(
                    p.capacity for p in opt.manager.pools if p.name.endswith(suffix)
                )
        finally:
            opt.close()
    return sizes


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(1)


def scenario_rule_pools(
    rank: int, world: int, out: Path, *, rule: str, moments_dtype: str = "float32"
) -> dict:
    return built_pools(rule, moments_dtype=moments_dtype)


def scenario_rule_extras(rank: int, world: int, out: Path, *, rule: str) -> dict:
    return built_extras(rule)


SCENARIOS = {"rule_pools": scenario_rule_pools, "rule_extras": scenario_rule_extras}
