"""What noticing weights written outside the optimizer costs per step.

    python benchmarks/bench_write_check.py [--rounds N]

Note [weights written outside the optimizer] (``zero_offload/views/param_views.py``): each
step compares every parameter's fingerprint with the one taken when the optimizer last
published it (``changed()``), and takes a new one after publishing (``remember()``). Timed
here on ``bench_offload_step.py``'s ``embed`` model (17M parameters), bf16 and fp32, host
accelerator, against one whole ``step()`` (which includes the check), median of interleaved
rounds. Prints a table and writes benchmarks/results/bench_write_check.json.
"""

from __future__ import annotations

import argparse

import torch
from _common import machine, time_rounds, write_json
from bench_offload_step import EmbedModel, _batches

from zero_offload import AcceleratorConfig, HostAccelerator, OffloadAdamW, OffloadConfig


def measure(dtype: torch.dtype, rounds: int) -> dict[str, float]:
    torch.manual_seed(0)
    model = EmbedModel().to(dtype=dtype)
    opt = OffloadAdamW(
        model.parameters(),
        lr=1e-3,
        config=OffloadConfig(),
        accelerator=HostAccelerator(AcceleratorConfig(device_budget="2GiB")),
    )
    ids, targets = _batches("embed", 1, torch.device("cpu"))[0]

    def step() -> None:
        opt.backward(model(ids, targets))
        opt.step()
        opt.zero_grad()

    def check() -> None:
        for bucket in opt.buckets:
            bucket.views.changed()
            bucket.views.remember()

    try:
        times = time_rounds({"train_step": step, "check": check}, rounds=rounds, sync=lambda: None)
    finally:
        opt.close()
    return {"params": sum(p.numel() for p in model.parameters()), **times}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    result: dict[str, object] = {"machine": machine()}
    print(f"{'dtype':<10}{'params':>10}{'train step ms':>15}{'check ms':>10}")
    for dtype in (torch.bfloat16, torch.float32):
        row = measure(dtype, args.rounds)
        result[str(dtype)] = row
        print(
            f"{dtype!s:<10}{row['params'] / 1e6:>9.1f}M"
            f"{row['train_step'] * 1e3:>15.1f}{row['check'] * 1e3:>10.1f}"
        )
    print(f"wrote {write_json('bench_write_check', result)}")


if __name__ == "__main__":
    main()
