"""OffloadAdamW at world size 1 and 2 (gloo ranks on the host accelerator), same global batch.

    python benchmarks/bench_offload_step_dist.py [--quick] [--steps N]

A GPT-style model with bf16 weights trains on random tokens; at world size 2 each rank
(a spawned process joined over gloo on 127.0.0.1) trains on half of every global batch.
Per world size, from rank 0: the median training step (forward, backward, step), the
collective bytes per step (reduce-scatter and all-gather of every bucket in bf16; the
ZeRO target is 2x the model's bytes, what one data-parallel all-reduce moves), the
device-to-host gradient bytes per step (target: 1/N of world size 1), and the host pool
holding the fp32 master weights, moments, gradient accumulator and staging (target: 1/N
of world size 1, plus padding). Both world sizes share this machine's cores, so the step
time at world size 2 measures overhead, not speed-up.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import join_gloo, machine, spawn_ranks, write_json

from zero_offload import AcceleratorConfig, HostAccelerator, OffloadAdamW, OffloadConfig
from zero_offload.demo.model import GPTConfig, TinyGPT

SIZES = {
    "8M": GPTConfig(vocab_size=4096, seq_len=32, layers=4, hidden=256, heads=4),
    "2M": GPTConfig(vocab_size=2048, seq_len=32, layers=2, hidden=128, heads=4),
}
GLOBAL_BATCH = 8


def _rank_main(rank: int, world: int, port: int, size: str, steps: int, out: str) -> None:
    if world > 1:
        join_gloo(rank, world, port, timeout_s=120)
    else:
        torch.set_num_threads(os.cpu_count() or 1)
    torch.manual_seed(0)
    shape = SIZES[size]
    model = TinyGPT(shape).to(torch.bfloat16)
    acc = HostAccelerator(AcceleratorConfig(device_budget="2GiB"))
    opt = OffloadAdamW(
        model.parameters(), lr=1e-4, accelerator=acc, config=OffloadConfig(bucket_bytes="2MiB")
    )
    gen = torch.Generator().manual_seed(1)
    share = GLOBAL_BATCH // world
    times: list[float] = []
    marks: dict[str, int] = {}
    for step in range(steps + 1):  # step 0 warms up (numba, pools) and is not timed
        tokens = torch.randint(0, shape.vocab_size, (GLOBAL_BATCH, shape.seq_len), generator=gen)
        tokens = tokens[rank * share : (rank + 1) * share]
        if step == 1:
            marks = _bytes(opt)
        began = time.perf_counter()
        loss = model(tokens, tokens)
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        if step:
            times.append(time.perf_counter() - began)
    after = _bytes(opt)
    host_pool = sum(pool.capacity for pool in opt.manager.pools if pool.name.endswith(".host"))
    result = {
        "world_size": world,
        "params": sum(p.numel() for p in model.parameters()),
        "step_ms": 1e3 * statistics.median(times),
        "per_step": {key: (after[key] - marks[key]) / steps for key in after},
        "host_state_bytes": host_pool,
        "buckets": len(opt.buckets),
    }
    opt.close()
    if world > 1:
        dist.destroy_process_group()
    if rank == 0:
        torch.save(result, Path(out) / f"world{world}.pt")


def _bytes(opt: OffloadAdamW) -> dict[str, int]:
    from zero_offload.memory.traffic import Category, Direction

    counters = opt.manager.counters
    comm = opt.comm.counters if opt.comm is not None else None
    return {
        "reduce_scatter": comm.bytes("reduce_scatter") if comm else 0,
        "all_gather": comm.bytes("all_gather") if comm else 0,
        "d2h_gradients": counters.bytes(Direction.D2H, Category.GRADIENTS),
        "h2d_weights": counters.bytes(Direction.H2D, Category.WEIGHTS),
    }


def _spawn(world: int, size: str, steps: int, out: str) -> None:
    """Run ``world`` ranks of this script as processes and wait for them."""
    spawn_ranks(
        world,
        lambda rank, port: [
            *(os.path.abspath(__file__), "--steps", str(steps)),
            *("--rank", str(rank), str(world), str(port), size, out),
        ],
        what="bench_offload_step_dist",
    )


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.2f}"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2M parameters, 5 steps")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 10)")
    parser.add_argument("--rank", nargs=5, help=argparse.SUPPRESS)  # a spawned rank's args
    args = parser.parse_args(argv)
    size = "2M" if args.quick else "8M"
    steps = args.steps or (5 if args.quick else 10)
    if args.rank:
        rank, world, port, out = int(args.rank[0]), int(args.rank[1]), args.rank[2], args.rank[4]
        _rank_main(rank, world, int(port), args.rank[3], steps, out)
        return {}
    rows = []
    with tempfile.TemporaryDirectory() as out:
        for world in (1, 2):
            _spawn(world, size, steps, out)
            rows.append(torch.load(Path(out) / f"world{world}.pt", weights_only=False))
    base = rows[0]
    print(f"\nOffloadAdamW, {size} GPT (bf16), global batch {GLOBAL_BATCH}, gloo on this host\n")
    print(
        "| world size | step ms | reduce-scatter MiB/step | all-gather MiB/step "
        "| D2H grads MiB/step | host optimizer state MiB/rank | vs world 1 |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        per = row["per_step"]
        print(
            f"| {row['world_size']} | {row['step_ms']:.1f} | {_mib(per['reduce_scatter'])} "
            f"| {_mib(per['all_gather'])} | {_mib(per['d2h_gradients'])} "
            f"| {_mib(row['host_state_bytes'])} "
            f"| {row['host_state_bytes'] / base['host_state_bytes']:.3f} |"
        )
    model_bytes = 2 * base["params"]
    print(
        f"\nmodel bf16 bytes {_mib(model_bytes)} MiB; collectives per step at world size 2: "
        f"{_mib(rows[1]['per_step']['reduce_scatter'] + rows[1]['per_step']['all_gather'])} "
        f"MiB = {(rows[1]['per_step']['reduce_scatter'] + rows[1]['per_step']['all_gather']) / model_bytes:.3f} "
        "x the model (ZeRO: 2x, padding included)"
    )
    result = {"machine": machine(), "size": size, "steps": steps, "rows": rows}
    path = write_json("bench_offload_step_dist", result)
    print(f"JSON: {path}")
    return result


if __name__ == "__main__":
    main()
