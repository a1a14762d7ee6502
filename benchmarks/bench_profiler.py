"""Traffic profiler overhead: the same training steps with and without ``zero_offload.profile``.

Claims measured (one run, one machine): profiling changes the step time by less than 3%, and
one ``manager.copy`` costs under 20 µs of Python with the profiler on, within 10% of its cost
with the profiler off (issue 39). The copy rows issue small copies through one
``TieredMemoryManager`` in interleaved rounds, with and without a recording profiler (timing
only the copies and their synchronisation, not the profiler's start and stop); the ratio is
of median per-copy times (wall, and the process's CPU time, steadier on a shared machine),
and each variant's cyclic-GC collections and pauses per 1000 copies
(``GcPauses``, Note [GC pauses per step]) are summed over its rounds. The step rows: both variants train the demo's TinyGPT with OffloadAdamW (and activation offload) on the
host accelerator, in interleaved rounds that alternate which goes first (so drift in the
machine hits both alike); the profiled variant runs its steps inside one ``profile()`` with
``prof.step()`` each step and writes nothing. The ratio is of median step times from the same run;
GC pauses per step are counted over each variant's rounds (issue 39 asks for them).

Usage: ``python benchmarks/bench_profiler.py [--quick]``; prints a markdown table and writes
``benchmarks/results/bench_profiler.json``.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from typing import Any

import torch
from _common import machine, write_json

from zero_offload.accelerator import HostAccelerator
from zero_offload.activations import ActivationOffloadConfig, ActivationOffloader, checkpoint
from zero_offload.config import AcceleratorConfig, OffloadConfig
from zero_offload.demo.corpus import CharCorpus
from zero_offload.demo.model import GPTConfig, TinyGPT
from zero_offload.memory.manager import TieredMemoryManager
from zero_offload.memory.traffic import Category, Direction
from zero_offload.optim import OffloadAdamW
from zero_offload.profiling import profile
from zero_offload.profiling.gc_pauses import GcPauses, GcWindow


class _Trainer:
    """One model, optimizer and offloader; ``steps(n, prof)`` runs ``n`` training steps."""

    def __init__(self, *, layers: int, hidden: int, batch: int, seq_len: int) -> None:
        torch.manual_seed(0)
        self.corpus = CharCorpus.build(sentences=1000)
        shape = GPTConfig(
            vocab_size=self.corpus.vocab_size, seq_len=seq_len, layers=layers, hidden=hidden
        )
        acc = HostAccelerator(AcceleratorConfig(device_budget="256MiB"))
        self.model = TinyGPT(shape)
        self.opt = OffloadAdamW(
            self.model.parameters(),
            lr=1e-3,
            accelerator=acc,
            config=OffloadConfig(bucket_bytes="256KiB"),
        )
        self.offloader = ActivationOffloader(
            manager=self.opt.manager,
            config=ActivationOffloadConfig(
                min_bytes=0, host_pool_bytes="64MiB", device_pool_bytes="16MiB"
            ),
        )
        offloader = self.offloader
        self.model.runner = lambda block, x: checkpoint(block, x, offloader=offloader)
        self.batch, self.seq_len = batch, seq_len
        self.generator = torch.Generator().manual_seed(0)

    def steps(self, count: int, prof: Any = None) -> None:
        for _ in range(count):
            inputs, targets = self.corpus.batch(
                self.generator, batch=self.batch, seq_len=self.seq_len
            )
            self.model(inputs, targets).backward()
            self.opt.step()
            self.opt.zero_grad()
            if prof is not None:
                prof.step()

    def profiled(self, count: int) -> Any:
        with profile(self.opt, self.offloader) as prof:
            self.steps(count, prof)
        return prof

    def close(self) -> None:
        self.offloader.close()
        self.opt.close()


def _gc_row(window: GcWindow, per: float) -> dict[str, float]:
    """Collections, full collections and milliseconds paused in ``window``, divided by
    ``per``."""
    return {
        "collections": window.collections / per,
        "full_collections": window.gen2 / per,
        "ms": window.seconds * 1e3 / per,
    }


def copy_seconds(
    *, copies: int, rounds: int
) -> tuple[dict[str, list[float]], dict[str, list[float]], dict[str, dict[str, float]]]:
    """Seconds per ``manager.copy`` (issue, then one synchronisation per round, amortised),
    off and on a recording profiler (and on with the cyclic GC paused, to tell the
    profiler's Python from the collector's passes over its records), in interleaved rounds
    whose order rotates: wall time, and the process's CPU time (all its threads: the
    stream workers' too), which other jobs on a shared machine disturb less; and each
    variant's GC pauses per 1000 copies."""
    manager = TieredMemoryManager(HostAccelerator(AcceleratorConfig(device_budget="64MiB")))
    src, dst = torch.ones(256), torch.empty(256)  # 1 KiB: the Python path, not the bytes

    def issue() -> None:
        for _ in range(copies):
            manager.copy(dst, src, direction=Direction.D2H, category=Category.GRADIENTS)
        manager.synchronize()

    def timed() -> tuple[float, float]:
        began, cpu = time.perf_counter(), time.process_time()
        issue()
        return time.perf_counter() - began, time.process_time() - cpu

    def off() -> tuple[float, float]:
        return timed()

    def on() -> tuple[float, float]:
        with profile(manager, link_bandwidth=1e9) as prof:  # given: no link probe
            began, cpu = time.perf_counter(), time.process_time()
            issue()
            prof.data.copies.settle()  # the records' last rows: the profiler's, so counted
            return time.perf_counter() - began, time.process_time() - cpu

    def on_gc_paused() -> tuple[float, float]:
        # The profiler's own Python, apart from the collector: its records (each with two
        # events) survive the round and make the cyclic GC run over them.
        gc.disable()
        try:
            return on()
        finally:
            gc.enable()

    samples: dict[str, list[float]] = {"off": [], "on": [], "on_gc_paused": []}
    cpu: dict[str, list[float]] = {name: [] for name in samples}
    pauses = {name: GcWindow(0, 0, 0, 0.0, 0.0, 0) for name in samples}
    variants = [("off", off), ("on", on), ("on_gc_paused", on_gc_paused)]
    off(), on()  # warm-up
    with GcPauses() as gc_pauses:
        for round_index in range(rounds):
            shift = round_index % len(variants)
            for name, run in variants[shift:] + variants[:shift]:
                gc_pauses.take()
                wall, process = run()
                samples[name].append(wall / copies)
                cpu[name].append(process / copies)
                pauses[name] += gc_pauses.take()
    manager.close()
    gc_rows = {name: _gc_row(window, rounds * copies / 1000) for name, window in pauses.items()}
    return samples, cpu, gc_rows


def _gc_text(row: dict[str, float]) -> str:
    return f"{row['collections']:.1f} ({row['full_collections']:.2f} full), {row['ms']:.2f} ms"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the measurement; print the table, write the JSON, return the results."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds, under a minute")
    args = parser.parse_args(argv)
    config = {
        "layers": 2,
        "hidden": 128,
        "batch": 8,
        "seq_len": 64,
        "steps_per_round": 6 if args.quick else 10,
        "rounds": 6 if args.quick else 20,
        "copies_per_round": 2000,
        "copy_rounds": 9 if args.quick else 21,
    }
    copy_samples, copy_cpu, copy_gc = copy_seconds(
        copies=config["copies_per_round"], rounds=config["copy_rounds"]
    )
    copy_off, copy_on, copy_on_nogc = (
        statistics.median(copy_samples[k]) for k in ("off", "on", "on_gc_paused")
    )
    cpu_median = {name: statistics.median(values) for name, values in copy_cpu.items()}
    trainer = _Trainer(
        layers=config["layers"],
        hidden=config["hidden"],
        batch=config["batch"],
        seq_len=config["seq_len"],
    )
    count = config["steps_per_round"]
    samples: dict[str, list[float]] = {"off": [], "on": []}
    step_pauses = {name: GcWindow(0, 0, 0, 0.0, 0.0, 0) for name in samples}
    try:
        trainer.steps(3)
        prof = trainer.profiled(1)  # warm-up: kernels compiled, the link probed once
        variants = [("off", trainer.steps), ("on", trainer.profiled)]
        with GcPauses() as gc_pauses:
            for round_index in range(config["rounds"]):
                # Alternate which variant goes first, so neither always follows the other.
                for name, run in variants[:: 1 if round_index % 2 == 0 else -1]:
                    gc_pauses.take()
                    began = time.perf_counter()
                    prof = run(count) or prof
                    samples[name].append((time.perf_counter() - began) / count)
                    step_pauses[name] += gc_pauses.take()
        summary = prof.to_dict()  # the last profiled round's, outside the timing
    finally:
        trainer.close()
    copies_per_step = summary["totals"]["copies"] / max(1, summary["steps"])
    off, on = statistics.median(samples["off"]), statistics.median(samples["on"])
    results = {
        "machine": dict(machine(), torch=torch.__version__, threads=torch.get_num_threads()),
        "config": config,
        "step_seconds_off": off,
        "step_seconds_on": on,
        "ratio": on / off,
        "copies_per_step": copies_per_step,
        "samples": samples,
        "copy_seconds_off": copy_off,
        "copy_seconds_on": copy_on,
        "copy_ratio": copy_on / copy_off,
        "copy_seconds_on_gc_paused": copy_on_nogc,
        "copy_samples": copy_samples,
        "copy_cpu_seconds": cpu_median,
        "copy_cpu_ratio": cpu_median["on"] / cpu_median["off"],
        "copy_cpu_samples": copy_cpu,
        "copy_gc_per_1000": copy_gc,
        "step_gc": {
            name: _gc_row(window, config["rounds"] * count) for name, window in step_pauses.items()
        },
    }
    print(
        "| manager.copy | median µs per copy | ratio on/off | CPU µs per copy | CPU ratio "
        "| GC per 1000 copies |"
    )
    print("|---|---|---|---|---|---|")
    for label, key, seconds in (
        ("profiler off", "off", copy_off),
        ("profiler on", "on", copy_on),
        ("profiler on, GC paused", "on_gc_paused", copy_on_nogc),
    ):
        ratio = "" if key == "off" else f"{seconds / copy_off:.3f}"
        cpu_ratio = "" if key == "off" else f"{cpu_median[key] / cpu_median['off']:.3f}"
        print(
            f"| {label} | {seconds * 1e6:.1f} | {ratio} | {cpu_median[key] * 1e6:.1f} | "
            f"{cpu_ratio} | {_gc_text(copy_gc[key])} |"
        )
    copy_verdict = "within" if copy_on / copy_off < 1.10 and copy_on < 20e-6 else "NOT within"
    print(
        f"\nper-copy profiler overhead {copy_on / copy_off - 1:+.1%} ({copy_verdict} the "
        "10% and 20 µs claims)\n"
    )
    print("| profiling | median step | copies/step | ratio on/off | GC pauses per step |")
    print("|---|---|---|---|---|")
    step_gc = results["step_gc"]
    print(f"| off | {off * 1e3:.1f} ms | {copies_per_step:.0f} | | {_gc_text(step_gc['off'])} |")
    print(
        f"| on | {on * 1e3:.1f} ms | {copies_per_step:.0f} | {on / off:.3f} | "
        f"{_gc_text(step_gc['on'])} |"
    )
    change = on / off - 1
    if abs(change) < 0.03:
        verdict = "within the 3% claim"
    elif change < 0:
        verdict = "profiled ran faster: machine noise exceeds the overhead; rerun without --quick"
    else:
        verdict = "NOT within the 3% claim"
    print(f"\nprofiling overhead {change:+.1%} ({verdict})")
    write_json("bench_profiler", results)
    return results


if __name__ == "__main__":
    main()
