"""Parameter offload: step time and device peak with and without it, on a simulated link.

    python benchmarks/bench_param_offload.py [--quick] [--link BYTES_PER_S]

Everything runs on the host accelerator with a simulated device-host link of ``--link``
bytes per second (default 2e8, 200 MB/s: a PCIe link scaled down about as far as this
machine's two CPU cores are from a GPU, so copies and compute take comparable time), a bf16 ``TinyGPT`` (``zero_offload.demo.model``), AdamW on the host:

- ``small``: a model that fits both ways, trained with its weights resident (the optimizer
  publishes the updated weights over the link after each step) and with
  ``offload_parameters=True`` (each unit crosses the link for its forward and again for its
  backward, prefetched ``prefetch_layers`` units ahead);
- ``large``: a model whose weights alone exceed the device budget: resident is refused
  (``DeviceBudgetExceeded``), parameter offload trains.

Per configuration: seconds per training step (forward, backward, step; median of the
measured steps after one warm-up), the ledger's device peak, the H2D weight bytes per
step, and the seconds per step compute stood waiting for them (exposed). Prints a table and
writes ``benchmarks/results/bench_param_offload.json``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import machine, write_json

from zero_offload import OffloadAdamW, OffloadConfig
from zero_offload.accelerator.host import HostAccelerator
from zero_offload.config import AcceleratorConfig, format_bytes
from zero_offload.demo.model import GPTConfig, TinyGPT
from zero_offload.errors import DeviceBudgetExceeded
from zero_offload.memory.traffic import Category, Direction

VOCAB, SEQ, BATCH = 512, 64, 8


def _model(layers: int, hidden: int) -> TinyGPT:
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=VOCAB, seq_len=SEQ, layers=layers, hidden=hidden, heads=8)
    return TinyGPT(config).to(torch.bfloat16)


def _run(
    layers: int, hidden: int, *, budget: int, link: float, offload: bool, steps: int
) -> dict[str, object]:
    model = _model(layers, hidden)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    row: dict[str, object] = {
        "layers": layers,
        "hidden": hidden,
        "params": sum(p.numel() for p in model.parameters()),
        "weight_bytes": weights,
        "budget": budget,
        "parameter_offload": offload,
    }
    accelerator = HostAccelerator(AcceleratorConfig(device_budget=budget, link_bandwidth=link))
    try:
        opt = OffloadAdamW(
            model.parameters(),
            lr=1e-4,
            config=OffloadConfig(
                bucket_bytes="1MiB", offload_parameters=offload, prefetch_layers=1
            ),
            accelerator=accelerator,
            **({"model": model} if offload else {}),
        )
    except DeviceBudgetExceeded as error:
        row.update(fits=False, error=str(error).split(":")[0])
        return row
    gen = torch.Generator().manual_seed(1)
    manager = opt.manager
    times, exposed, copied = [], [], []
    for i in range(steps + 1):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
        wait0 = manager.exposed_seconds.get(Category.WEIGHTS, 0.0)
        bytes0 = manager.counters.bytes(Direction.H2D, Category.WEIGHTS)
        t0 = time.perf_counter()
        model(ids, ids).backward()
        opt.step()
        opt.zero_grad()
        manager.synchronize()  # the step's weight copies are part of its time
        if i:  # the first step is the warm-up (the forward order is learned there)
            times.append(time.perf_counter() - t0)
            exposed.append(manager.exposed_seconds.get(Category.WEIGHTS, 0.0) - wait0)
            copied.append(manager.counters.bytes(Direction.H2D, Category.WEIGHTS) - bytes0)
    row.update(
        fits=True,
        step_s=statistics.median(times),
        device_peak=accelerator.memory_stats()["peak"],
        h2d_weight_bytes_per_step=statistics.median(copied),
        h2d_copy_s_per_step=statistics.median(copied) / link,
        exposed_s_per_step=statistics.median(exposed),
    )
    opt.close()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps, smaller models")
    parser.add_argument("--link", type=float, default=2e8, help="simulated link, bytes/s")
    args = parser.parse_args()
    steps = 2 if args.quick else 4
    hidden = 128 if args.quick else 256
    small, large = (4, 16) if args.quick else (8, 32)
    torch.set_num_threads(os.cpu_count() or 1)
    # One budget: twice the small model's weights (it fits resident); the large model's
    # weights alone are about twice the budget.
    budget = 2 * sum(p.numel() * 2 for p in _model(small, hidden).parameters())
    rows = [
        {
            "case": "small, resident",
            **_run(small, hidden, budget=budget, link=args.link, offload=False, steps=steps),
        },
        {
            "case": "small, parameter offload",
            **_run(small, hidden, budget=budget, link=args.link, offload=True, steps=steps),
        },
        {
            "case": "large, resident",
            **_run(large, hidden, budget=budget, link=args.link, offload=False, steps=steps),
        },
        {
            "case": "large, parameter offload",
            **_run(large, hidden, budget=budget, link=args.link, offload=True, steps=steps),
        },
    ]
    header = (
        f"{'case':<26} {'params':>8} {'weights':>10} {'budget':>10} {'fits':>4} "
        f"{'step s':>7} {'device peak':>11} {'H2D/step':>10} {'copy s':>7} {'exposed s':>9}"
    )
    print(
        f"simulated link {args.link / 1e9:g} GB/s, bf16 TinyGPT hidden {hidden}, batch {BATCH}x{SEQ}"
    )
    print(header)
    for row in rows:
        line = (
            f"{row['case']:<26} {row['params'] / 1e6:>7.2f}M {format_bytes(row['weight_bytes']):>10} "
            f"{format_bytes(row['budget']):>10} {'yes' if row['fits'] else 'no':>4} "
        )
        if row["fits"]:
            line += (
                f"{row['step_s']:>7.3f} {format_bytes(row['device_peak']):>11} "
                f"{format_bytes(int(row['h2d_weight_bytes_per_step'])):>10} "
                f"{row['h2d_copy_s_per_step']:>7.3f} {row['exposed_s_per_step']:>9.3f}"
            )
        else:
            line += row["error"]
        print(line)
    path = write_json(
        "bench_param_offload",
        {"machine": machine(), "link_bytes_per_s": args.link, "rows": rows},
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
