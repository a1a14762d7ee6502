"""The host worker's gradient passes against torch and the memory: statistics, accumulation.

    python benchmarks/bench_grad_passes.py [--quick] [--rounds N]

Per gradient dtype (fp32, bf16) at 16M elements, timed in interleaved rounds (median after
a warm-up), in one process:

- ``grad_stats`` (sum of squares in float64 and the overflow flag, one pass) against
  torch's ``torch.linalg.vector_norm(g, dtype=torch.float64)`` (what a norm in float64 costs
  torch; its fp32 norm is ``vector_norm(g)``, also timed);
- ``accumulate_grad`` (``acc += g`` in fp32 with the statistics of the result, one pass)
  against torch's ``acc.add_(g)`` (no statistics) and ``acc.add_(g)`` followed by
  ``vector_norm(acc)`` (the same result in two passes);
- each against ``copy_`` of the same bytes in the same run ("x copy_ speed": the pass's bytes
  at copy_'s bandwidth over its time; a pass that mostly reads can beat 1).

Each pass runs on one thread (``num_threads=1``) as the optimizer runs it (Note [the Adam
pass gets the cores] in ``zero_offload/optim/grads/buffers.py``) and on every thread; torch's
ops run on ``torch.get_num_threads()`` threads.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import machine, time_rounds, write_json

from zero_offload.kernels import accumulate_grad, grad_stats


def bench(dtype: torch.dtype, n: int, rounds: int) -> dict[str, float]:
    gen = torch.Generator().manual_seed(0)
    g = torch.randn(n, generator=gen).to(dtype)  # (n,) the gradient, training dtype
    acc = torch.zeros(n)  # (n,) fp32 accumulator
    src, dst = torch.zeros(n * 8, dtype=torch.uint8), torch.zeros(n * 8, dtype=torch.uint8)
    fns = {
        "ours stats, 1 thread": lambda: grad_stats(g, num_threads=1),
        "ours stats, all threads": lambda: grad_stats(g),
        "torch vector_norm float64": lambda: torch.linalg.vector_norm(g, dtype=torch.float64),
        "torch vector_norm": lambda: torch.linalg.vector_norm(g),
        "ours accumulate, 1 thread": lambda: accumulate_grad(
            acc, g, overwrite=False, num_threads=1
        ),
        "ours accumulate, all threads": lambda: accumulate_grad(acc, g, overwrite=False),
        "torch add_": lambda: acc.add_(g),
        "torch add_ + vector_norm": lambda: torch.linalg.vector_norm(acc.add_(g)),
        "copy_ (bandwidth)": lambda: dst.copy_(src),
    }
    med = time_rounds(fns, rounds=rounds)
    bandwidth = 2 * src.numel() / med["copy_ (bandwidth)"]  # bytes read + written per second
    size = g.element_size()
    return {
        **med,
        "bandwidth": bandwidth,
        # stats read the gradient; accumulation reads it and the accumulator, writes that
        "roofline stats": n * size / bandwidth,
        "roofline accumulate": n * (size + 8) / bandwidth,
    }


def _table(dtype: torch.dtype, n: int, r: dict[str, float]) -> list[str]:
    name = str(dtype).removeprefix("torch.")
    lines = [
        f"| {n >> 20}M, {name} gradient | ms | x copy_ speed | ours 1 thread / this |",
        "|---|---:|---:|---:|",
    ]
    for key, roof, ours in [
        ("ours stats, 1 thread", "roofline stats", "ours stats, 1 thread"),
        ("ours stats, all threads", "roofline stats", "ours stats, 1 thread"),
        ("torch vector_norm float64", "roofline stats", "ours stats, 1 thread"),
        ("torch vector_norm", "roofline stats", "ours stats, 1 thread"),
        ("ours accumulate, 1 thread", "roofline accumulate", "ours accumulate, 1 thread"),
        ("ours accumulate, all threads", "roofline accumulate", "ours accumulate, 1 thread"),
        ("torch add_", "roofline accumulate", "ours accumulate, 1 thread"),
        ("torch add_ + vector_norm", "roofline accumulate", "ours accumulate, 1 thread"),
    ]:
        lines.append(
            f"| {key} | {r[key] * 1e3:.2f} | {r[roof] / r[key]:.2f} | {r[ours] / r[key]:.2f} |"
        )
    lines.append(f"\nbandwidth (copy_, same run): {r['bandwidth'] / 1e9:.1f} GB/s")
    return lines


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="5 rounds")
    ap.add_argument("--rounds", type=int, default=None, help="timed rounds (default 5/11)")
    args = ap.parse_args(argv)
    rounds = args.rounds or (5 if args.quick else 11)
    n = 16 << 20
    print(f"machine: {machine()}; torch threads {torch.get_num_threads()}")
    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        r = bench(dtype, n, rounds)
        print("\n".join(_table(dtype, n, r)) + "\n", flush=True)
        results[str(dtype)] = r
    payload = {"machine": machine(), "rounds": rounds, "elements": n, "results": results}
    print(f"wrote {write_json('bench_grad_passes', payload)}")
    return payload


if __name__ == "__main__":
    main()
