"""``overlap_step`` with and without the device weight shadow, over a simulated link.

    python benchmarks/bench_overlap_shadow.py [--tiny] [--rounds N] [--link-gbps G]
        [--bucket-mib B]

Note [the delayed update lands in a shadow] (optim/shadow.py): with a shadow, the delayed
update's weights cross the link while the next forward and backward run, and ``step()``
copies them on the device; without one, ``step()`` copies the whole model's weights across
the link before the next forward may start, or (``overlap_landing="at_first_use"``, Note
[weights landed at their first use] in views/in_flight.py) issues them and returns, the
forward waiting for each bucket where it first reads it. This script trains ``bench_offload_step``'s
bf16 GPT (20M parameters; ``--tiny``: a small one) with ``overlap_step`` the three ways, in
one run, in buckets of ``--bucket-mib`` MiB, on the host accelerator with a link of ``--link-gbps`` GB/s (the copy threads sleep
for each copy's bytes at that rate, so the link's time overlaps compute as a DMA's would).
It reports, per variant, the median over interleaved rounds after a warm-up of: the time
``step()`` blocks the caller, the whole step (forward, backward and ``step()``), and the
weight bytes ``step()`` itself issues across the link; and each variant's ratio to "no
shadow". Host-accelerator
figures on this machine's cores, not GPU figures: the GPU's are ``gpu_check.py
--north-star``'s ``offload_overlap_step`` rows.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time

if __name__ == "__main__":
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as bench_offload_step.py

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import machine, write_json
from bench_offload_step import FULL, LR, TINY, _batches, _make_model

import zero_offload.optim.shadow as shadow_mod
from zero_offload import OffloadAdamW, OffloadConfig
from zero_offload.accelerator import AcceleratorConfig, HostAccelerator
from zero_offload.memory.traffic import Category, Direction

VARIANTS = ("shadow", "no shadow", "no shadow, landed at first use")


class _Run:
    """One variant's model, optimizer and counters."""

    def __init__(self, name: str, scale, link: float, bucket_bytes: int) -> None:
        self.name = name
        self.model = _make_model("gpt", torch.bfloat16, torch.device("cpu"), scale)
        acc = HostAccelerator(AcceleratorConfig(link_bandwidth=link, device_budget="8GiB"))
        take = shadow_mod.WeightShadows.take
        if name.startswith("no shadow"):
            shadow_mod.WeightShadows.take = lambda self, **_: None  # type: ignore[method-assign]
        try:
            self.opt = OffloadAdamW(
                self.model.parameters(),
                lr=LR,
                accelerator=acc,
                config=OffloadConfig(
                    overlap_step=True,
                    bucket_bytes=bucket_bytes,
                    overlap_landing="at_first_use" if "first use" in name else "at_step",
                ),
            )
            self.batch = _batches("gpt", 1, torch.device("cpu"), scale)[0]
            self.step_once()  # the first update's shadows are taken here
        finally:
            shadow_mod.WeightShadows.take = take  # type: ignore[method-assign]
        self.in_step = False
        self.sent = 0  # H2D weight bytes the caller's thread queued inside step()
        main = threading.main_thread()

        def listen(record) -> None:
            direction = getattr(record, "direction", None)
            if (
                self.in_step
                and direction is Direction.H2D
                and record.category is Category.WEIGHTS
                and threading.current_thread() is main
            ):
                self.sent += record.nbytes

        self.opt.manager.subscribe(listen)
        self.blocked: list[float] = []
        self.whole: list[float] = []
        self.bytes: list[int] = []

    def step_once(self) -> tuple[float, float]:
        t0 = time.perf_counter()
        self.model(*self.batch).backward()
        self.in_step = True
        t1 = time.perf_counter()
        self.opt.step()
        t2 = time.perf_counter()
        self.in_step = False
        self.opt.zero_grad()
        return t2 - t1, t2 - t0

    def measure(self) -> None:
        self.sent = 0
        blocked, whole = self.step_once()
        self.blocked.append(blocked)
        self.whole.append(whole)
        self.bytes.append(self.sent)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="a small model: checks it runs")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--link-gbps", type=float, default=1.0, help="simulated link, GB/s")
    parser.add_argument("--bucket-mib", type=float, default=4.0, help="bucket size, MiB")
    args = parser.parse_args(argv)
    scale = TINY if args.tiny else FULL
    bucket_bytes = int(args.bucket_mib * 2**20)
    runs = {name: _Run(name, scale, args.link_gbps * 1e9, bucket_bytes) for name in VARIANTS}
    for run in runs.values():  # warm-up: the second update publishes the first
        run.step_once()
    for _ in range(args.rounds):  # interleaved rounds
        for run in runs.values():
            run.measure()
    numel = sum(p.numel() for p in runs["shadow"].model.parameters())
    buckets = len(runs["shadow"].opt.buckets)
    rows = {}
    for name, run in runs.items():
        rows[name] = {
            "step_blocks_s": statistics.median(run.blocked),
            "whole_step_s": statistics.median(run.whole),
            "h2d_bytes_in_step": statistics.median(run.bytes),
            "shadowed_buckets": sum(
                v
                for k, v in run.opt.manager.step_notes.items()
                if k.endswith(".delayed_update.shadowed_buckets")
            ),
        }
        run.opt.close()
    keys = ("step_blocks_s", "whole_step_s")
    ratio = {
        name: {key: rows[name][key] / rows["no shadow"][key] for key in keys}
        for name in VARIANTS
        if name != "no shadow"
    }
    lines = [
        f"{numel / 1e6:.1f}M bf16 parameters in {buckets} buckets of {args.bucket_mib:g} MiB, "
        f"link {args.link_gbps:g} GB/s (simulated), median of {args.rounds} interleaved rounds",
        "",
        "| overlap_step | step() blocks ms | forward + backward + step() ms | weight bytes "
        "step() issues | shadowed buckets |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, r in rows.items():
        lines.append(
            f"| {name} | {r['step_blocks_s'] * 1e3:.1f} | {r['whole_step_s'] * 1e3:.1f} | "
            f"{r['h2d_bytes_in_step'] / 1e6:.1f} MB | {r['shadowed_buckets']} |"
        )
    for name, r in ratio.items():
        lines.append(
            f"| **{name} / no shadow** | **{r['step_blocks_s']:.2f}** | "
            f"**{r['whole_step_s']:.2f}** | | |"
        )
    print("\n".join(lines))
    result = {
        "machine": machine(),
        "link_gbps": args.link_gbps,
        "bucket_mib": args.bucket_mib,
        "rows": rows,
        "ratio": ratio,
    }
    path = write_json("bench_overlap_shadow_tiny" if args.tiny else "bench_overlap_shadow", result)
    print(f"\nwrote {path}")
    return result


if __name__ == "__main__":
    main()
