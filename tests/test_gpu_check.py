"""benchmarks/gpu_check.py's measurements run unchanged on the host accelerator, so a GPU
session spends its minutes measuring, not debugging the script."""

from __future__ import annotations

import os
import sys

import torch

BENCHMARKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks")


def test_the_offloaded_vs_resident_step_comparison_runs_on_a_tiny_gpt() -> None:
    sys.path.insert(0, BENCHMARKS)
    try:
        import gpu_check

        from zero_offload.demo.model import GPTConfig, TinyGPT

        config = GPTConfig(vocab_size=256, seq_len=16, layers=2, hidden=64, heads=4)
        out = gpu_check.offloaded_vs_resident_step(
            config, micro=2, batch=2, rounds=1, device=torch.device("cpu")
        )
    finally:
        sys.path.remove(BENCHMARKS)
    for name in ("offload", "offload_announced", "offload_overlap_step"):
        assert out[f"{name}_step_s"] > 0
        assert out[f"{name}_ratio"] == out[f"{name}_step_s"] / out["resident_step_s"]
    # The 1B shape is what it says.
    with torch.device("meta"):
        big = TinyGPT(GPTConfig(**gpu_check.GPT_1B))
    assert 1.0e9 < sum(p.numel() for p in big.parameters()) < 1.2e9
