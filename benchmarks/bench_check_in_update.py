"""Parameter offload's write check: by fingerprints, or in the update's own pass.

    python benchmarks/bench_check_in_update.py [--tiny] [--rounds N] [--dtype bf16|fp16|fp32]

Under parameter offload the pinned home is the weights between uses, and CPU Adam writes
it. The write check (Note [weights written outside the optimizer] in views/param_views.py)
was a cold xxh3 of every weight at the step's start, on the caller's thread before CPU Adam
could start, plus another streamed over the tiles as they were published. Now the update
makes the check itself, element by element (Note [the write check in the update] in
optim/update/reconcile.py). This script trains ``bench_offload_step``'s GPT (20M
parameters; ``--tiny``: a small one) with ``offload_parameters=True`` both ways in one run,
in interleaved rounds after a warm-up: ``fingerprints`` (each bucket's store made to say it
cannot check in its update: the library before this change) and ``in the update`` (as it
ships); each with nothing written between steps (the usual case) and with one weight matrix
written through ``param.data`` before every step (the check finds it and reconciles). It
reports the medians of ``step()``'s wall time and of its calling thread's CPU time, the
optimizer's fingerprint passes (a unit's own check of its slot, Note [a write to a resident
unit reaches its home], is not the write check and is not counted), and each ratio to ``fingerprints``. Host-accelerator figures on this
machine's cores; on a GPU host the hash ran on one core against a whole team's Adam.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

if __name__ == "__main__":
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as bench_offload_step.py

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import machine, write_json
from bench_offload_step import FULL, LR, TINY, _batches, _make_model

from zero_offload import OffloadAdamW, OffloadConfig
from zero_offload.accelerator import AcceleratorConfig, HostAccelerator
from zero_offload.views import param_views

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
VARIANTS = ("fingerprints", "in the update")
WRITES = ("nothing written", "one matrix written")


class _Run:
    """One variant's model, optimizer and samples."""

    def __init__(self, check: str, write: str, scale, dtype: torch.dtype) -> None:
        self.check, self.write = check, write
        self.model = _make_model("gpt", dtype, torch.device("cpu"), scale)
        acc = HostAccelerator(AcceleratorConfig(device_budget="8GiB"))
        self.opt = OffloadAdamW(
            self.model.parameters(),
            lr=LR,
            accelerator=acc,
            model=self.model,
            config=OffloadConfig(offload_parameters=True),
        )
        if check == "fingerprints":
            for bucket in self.opt.buckets:
                bucket.store.reconciles_in_update = lambda: False  # type: ignore[method-assign]
        self.batch = _batches("gpt", 1, torch.device("cpu"), scale)[0]
        self.target = self.model.blocks[0].mlp[0].weight  # written before each step
        self.wall: list[float] = []
        self.cpu: list[float] = []

    def step_once(self) -> tuple[float, float]:
        self.opt.backward(self.model(*self.batch).float())  # the loss scale, for fp16
        if self.write == "one matrix written":
            self.target.data.mul_(0.5)  # no version counter moves: only a value check sees it
        wall, cpu = time.perf_counter(), time.thread_time()
        self.opt.step()
        wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
        self.opt.zero_grad()
        return wall, cpu

    def measure(self) -> None:
        wall, cpu = self.step_once()
        self.wall.append(wall)
        self.cpu.append(cpu)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="a small model: checks it runs")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    args = parser.parse_args(argv)
    scale = TINY if args.tiny else FULL
    runs = {
        (check, write): _Run(check, write, scale, DTYPES[args.dtype])
        for write in WRITES
        for check in VARIANTS
    }
    for run in runs.values():  # warm-up: compiled kernels, pools, the first fingerprints
        run.step_once()
        run.step_once()
    hashes = [0]
    fingerprint = param_views.ParamViews._fingerprint

    def counted(self, *args, **kwargs):
        caller = sys._getframe(1)
        names = {caller.f_code.co_name, caller.f_back.f_code.co_name if caller.f_back else ""}
        if "slot_fingerprint" not in names:  # not a unit's own check (a subclass's, too)
            hashes[0] += 1
        return fingerprint(self, *args, **kwargs)

    taken: dict[tuple[str, str], int] = dict.fromkeys(runs, 0)
    param_views.ParamViews._fingerprint = counted  # type: ignore[method-assign]
    try:
        for _ in range(args.rounds):  # interleaved rounds
            for key, run in runs.items():
                before = hashes[0]
                run.measure()
                taken[key] += hashes[0] - before
    finally:
        param_views.ParamViews._fingerprint = fingerprint  # type: ignore[method-assign]
    first = next(iter(runs.values()))
    numel = sum(p.numel() for p in first.model.parameters())
    buckets = len(first.opt.buckets)
    rows = {}
    for (check, write), run in runs.items():
        rows[f"{check}, {write}"] = {
            "step_s": statistics.median(run.wall),
            "step_cpu_s": statistics.median(run.cpu),
            "fingerprint_passes_per_step": taken[(check, write)] / args.rounds,
        }
        run.opt.close()
    lines = [
        f"{numel / 1e6:.1f}M {args.dtype} parameters in {buckets} buckets, parameter offload, "
        f"median of {args.rounds} interleaved rounds",
        "",
        "| write check | step() ms | step() CPU ms (calling thread) | fingerprint passes "
        "per step | / fingerprints: wall, CPU |",
        "|---|---:|---:|---:|---:|",
    ]
    ratio = {}
    for write in WRITES:
        base = rows[f"fingerprints, {write}"]
        for check in VARIANTS:
            name = f"{check}, {write}"
            r = rows[name]
            ratio[name] = {
                "step_s": r["step_s"] / base["step_s"],
                "step_cpu_s": r["step_cpu_s"] / base["step_cpu_s"],
            }
            lines.append(
                f"| {name} | {r['step_s'] * 1e3:.1f} | {r['step_cpu_s'] * 1e3:.1f} | "
                f"{r['fingerprint_passes_per_step']:.0f} | {ratio[name]['step_s']:.2f}, "
                f"{ratio[name]['step_cpu_s']:.2f} |"
            )
    print("\n".join(lines))
    result = {"machine": machine(), "dtype": args.dtype, "rows": rows, "ratio": ratio}
    name = "bench_check_in_update_tiny" if args.tiny else "bench_check_in_update"
    path = write_json(name, result)
    print(f"\nwrote {path}")
    return result


if __name__ == "__main__":
    main()
