"""BlockPool: allocation latency, fragmentation, and defragmentation throughput.

Claims measured (one run, one machine):
  1. alloc+free with 10k live blocks of mixed sizes takes <= 10 us (median), next to
     ``torch.empty`` of the same sizes on the host;
  2. fragmentation after a long random workload, with and without defragmentation;
  3. defragmentation moves bytes at >= 0.5x a plain ``copy_`` of the same bytes.

Usage: ``python benchmarks/bench_pool.py [--quick]``; prints a markdown table and writes
``benchmarks/results/bench_pool.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from zero_offload.accelerator import HostAccelerator
from zero_offload.errors import PoolExhausted
from zero_offload.memory.pool import Block, BlockPool

KiB, MiB = 1024, 1024 * 1024
RESULTS = Path(__file__).resolve().parent / "results"


def log_uniform(rng: random.Random, low: int, high: int) -> int:
    """A size between ``low`` and ``high`` bytes, uniform in log space (many small, few big)."""
    return int(math.exp(rng.uniform(math.log(low), math.log(high))))


def cpu_model() -> str:
    """The CPU's model name as lscpu shows it."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def bench_latency(acc: HostAccelerator, *, live: int, pairs: int, seed: int) -> dict[str, float]:
    """Median ns of one free + one alloc, with ``live`` blocks held, pool and torch.empty."""
    rng = random.Random(seed)
    sizes = [log_uniform(rng, 256, 64 * KiB) for _ in range(live + pairs)]
    victims = [rng.randrange(live) for _ in range(pairs)]
    pool = BlockPool.host(acc, 2 * sum(sizes[:live]) + 64 * MiB, name="latency")
    blocks = [pool.alloc(n) for n in sizes[:live]]
    tensors = [torch.empty(n, dtype=torch.uint8) for n in sizes[:live]]
    clock = time.perf_counter_ns
    pool_ns, torch_ns = [], []
    for i in range(pairs):
        size, victim = sizes[live + i], victims[i]
        start = clock()
        blocks[victim].free()
        blocks[victim] = pool.alloc(size)
        pool_ns.append(clock() - start)
        start = clock()
        tensors[victim] = torch.empty(size, dtype=torch.uint8)  # frees the old one
        torch_ns.append(clock() - start)
    return {
        "live_blocks": live,
        "pairs": pairs,
        "pool_alloc_free_us": statistics.median(pool_ns) / 1e3,
        "torch_empty_us": statistics.median(torch_ns) / 1e3,
        "pool_fragmentation_after": pool.stats()["fragmentation"],
    }


def run_workload(pool: BlockPool, *, ops: int, seed: int) -> dict[str, float]:
    """Random allocs and frees holding the pool about 85% full; counts failures."""
    rng = random.Random(seed)
    live: list[Block] = []
    failed = 0
    samples = []
    for step in range(ops):
        stats = pool.stats() if step % 100 == 0 else None
        if stats is not None:
            samples.append(stats["fragmentation"])
        in_use = pool._blocks.counters.bytes_in_use  # cheap read for the driver, not a measurement
        if live and (in_use > 0.85 * pool.usable or rng.random() < 0.45):
            live.pop(rng.randrange(len(live))).free()
            continue
        try:
            live.append(pool.alloc(log_uniform(rng, 4 * KiB, 4 * MiB)))
        except PoolExhausted:
            failed += 1
    stats = pool.stats()
    return {
        "fragmentation_end": stats["fragmentation"],
        "fragmentation_mean": statistics.fmean(samples),
        "failed_allocs": failed,
        "defragmentations": stats["defragmentations"],
        "bytes_moved": stats["bytes_moved"],
    }


def bench_fragmentation(acc: HostAccelerator, *, ops: int, seed: int) -> dict[str, Any]:
    """The same random workload with automatic defragmentation off, then on."""
    results = {}
    for label, auto in (("without", False), ("with", True)):
        pool = BlockPool.host(acc, 64 * MiB, name=f"frag-{label}", auto_defragment=auto)
        results[label] = run_workload(pool, ops=ops, seed=seed)
        if auto:
            pool.defragment()
            results[label]["fragmentation_after_defragment"] = pool.stats()["fragmentation"]
    return results


def bench_defragment(
    acc: HostAccelerator, *, capacity: int, reps: int, seed: int
) -> dict[str, float]:
    """GB/s of ``defragment()`` on a 90%-full pool with 40% of blocks freed, vs ``copy_``."""
    rng = random.Random(seed)
    pool = BlockPool.host(acc, capacity, name="defrag")
    src = torch.ones(capacity, dtype=torch.uint8)  # both written once: pages faulted in
    dst = torch.zeros(capacity, dtype=torch.uint8)
    moved_bytes, defrag_gbps, copy_gbps = [], [], []
    for _ in range(reps):
        blocks: list[Block] = []
        while pool.stats()["bytes_in_use"] < 0.9 * capacity - 4 * MiB:
            blocks.append(pool.alloc(log_uniform(rng, 64 * KiB, 4 * MiB)))
        for block in rng.sample(blocks, k=int(0.4 * len(blocks))):
            block.free()
            blocks.remove(block)
        start = time.perf_counter()
        moved = pool.defragment()
        defrag_gbps.append(moved / (time.perf_counter() - start) / 1e9)
        # The baseline right after, on the same bytes, so both see the same machine load.
        start = time.perf_counter()
        dst[:moved].copy_(src[:moved])
        copy_gbps.append(moved / (time.perf_counter() - start) / 1e9)
        moved_bytes.append(moved)
        for block in blocks:
            block.free()
    ratios = [d / c for d, c in zip(defrag_gbps, copy_gbps, strict=True)]
    return {
        "capacity_bytes": capacity,
        "bytes_moved_median": statistics.median(moved_bytes),
        "defragment_gb_per_s": statistics.median(defrag_gbps),
        "copy_gb_per_s": statistics.median(copy_gbps),
        "ratio": statistics.median(ratios),
    }


def table(results: dict[str, Any]) -> str:
    """The markdown table of one run."""
    lat, frag, dfr = results["latency"], results["fragmentation"], results["defragment"]
    rows = [
        ("metric", "BlockPool", "baseline", "target", "met"),
        ("---", "---", "---", "---", "---"),
        (
            f"alloc+free, {lat['live_blocks']} live blocks (median)",
            f"{lat['pool_alloc_free_us']:.2f} us",
            f"torch.empty {lat['torch_empty_us']:.2f} us",
            "<= 10 us",
            "yes" if lat["pool_alloc_free_us"] <= 10 else "no",
        ),
        (
            f"fragmentation after {results['config']['workload_ops']} random ops (end / mean)",
            f"auto-defrag: {frag['with']['fragmentation_end']:.3f} / "
            f"{frag['with']['fragmentation_mean']:.3f}",
            f"no defrag: {frag['without']['fragmentation_end']:.3f} / "
            f"{frag['without']['fragmentation_mean']:.3f}",
            "-",
            "-",
        ),
        (
            "failed allocations in that workload",
            f"{frag['with']['failed_allocs']} ({frag['with']['defragmentations']} defrags)",
            f"no defrag: {frag['without']['failed_allocs']}",
            "-",
            "-",
        ),
        (
            f"defragment throughput ({dfr['bytes_moved_median'] / MiB:.0f} MiB moved)",
            f"{dfr['defragment_gb_per_s']:.2f} GB/s",
            f"copy_ {dfr['copy_gb_per_s']:.2f} GB/s",
            ">= 0.5x copy_",
            f"{'yes' if dfr['ratio'] >= 0.5 else 'no'} ({dfr['ratio']:.2f}x)",
        ),
    ]
    return "\n".join("| " + " | ".join(row) + " |" for row in rows)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run every measurement; print the table, write the JSON, return the results."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes, under a minute")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    config = {
        "quick": args.quick,
        "seed": args.seed,
        "live_blocks": 10_000,
        "pairs": 5_000 if args.quick else 50_000,
        "workload_ops": 10_000 if args.quick else 100_000,
        "defrag_capacity_bytes": (128 if args.quick else 512) * MiB,
        "reps": 3 if args.quick else 5,
    }
    acc = HostAccelerator()
    results: dict[str, Any] = {
        "machine": {
            "cpu": cpu_model(),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
        },
        "config": config,
        "latency": bench_latency(
            acc, live=config["live_blocks"], pairs=config["pairs"], seed=args.seed
        ),
        "fragmentation": bench_fragmentation(acc, ops=config["workload_ops"], seed=args.seed),
        "defragment": bench_defragment(
            acc, capacity=config["defrag_capacity_bytes"], reps=config["reps"], seed=args.seed
        ),
    }
    print(f"BlockPool on {results['machine']['cpu']} (torch {torch.__version__})\n")
    print(table(results))
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / "bench_pool.json"
    path.write_text(json.dumps(results, indent=2) + "\n")
    print(f"\nwrote {path}")
    return results


if __name__ == "__main__":
    main()
