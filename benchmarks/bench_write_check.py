"""The cost of the check for weights written outside the optimizer, alone, in CPU time.

    python benchmarks/bench_write_check.py [--tiny] [--steps N]

Note [weights written outside the optimizer] (views/param_views.py) fingerprints each
bucket's training-dtype weights: ``changed()`` at a step's start, ``remember()`` after its
weights landed. Note [one cold hash per step] has ``remember()`` take the fingerprints of
the tiles as they are published, while they are in cache. This script trains
``bench_offload_step``'s ``embed`` model (17M parameters) for a few steps both ways in one
run: ``streamed`` (the library as it is) and ``two cold hashes`` (streaming turned off, so
``remember()`` hashes the weights afresh, as before), and reports the CPU time of the
calling thread spent inside the check per step (``time.thread_time``: meaningful on a busy
machine, unlike wall time), and the weight bytes each way reads from memory cold per step.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

if __name__ == "__main__":
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as bench_offload_step.py

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import machine, write_json
from bench_offload_step import FULL, LR, TINY, _batches, _make_model

from zero_offload import OffloadAdamW
from zero_offload.views import fingerprints, param_views

#: The check's entry points, timed where they run.
TIMED = ("changed_params", "remember", "published_tile")


def _timed(totals: dict[str, float], name: str, fn: Callable) -> Callable:
    def wrapper(*args, **kwargs):
        t0 = time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[name] += time.thread_time() - t0

    return wrapper


def _measure(dtype: torch.dtype, steps: int, scale, *, streamed: bool) -> dict[str, float]:
    """CPU seconds per step inside each of the check's entry points, median over steps."""
    cls = param_views.ParamViews
    saved = {name: getattr(cls, name) for name in (*TIMED, "begin_published")}
    totals = dict.fromkeys(TIMED, 0.0)
    per_step: dict[str, list[float]] = {name: [] for name in TIMED}
    try:
        for name in TIMED:
            setattr(cls, name, _timed(totals, name, saved[name]))
        if not streamed:
            cls.begin_published = cls.drop_published  # remember() hashes afresh
        model = _make_model("embed", dtype, torch.device("cpu"), scale)
        opt = OffloadAdamW(model.parameters(), lr=LR)
        ids, targets = _batches("embed", 1, torch.device("cpu"), scale)[0]
        for step in range(steps + 1):
            for name in TIMED:
                totals[name] = 0.0
            model(ids, targets).backward()
            opt.step()
            opt.zero_grad()
            if step:  # the first step compiles and warms up
                for name in TIMED:
                    per_step[name].append(totals[name])
        numel = sum(p.numel() for p in model.parameters())
        opt.close()
    finally:
        for name, fn in saved.items():
            setattr(cls, name, fn)
    out = {name: statistics.median(v) for name, v in per_step.items()}
    out["total"] = statistics.median([sum(v) for v in zip(*per_step.values(), strict=True)])
    size = torch.empty((), dtype=dtype).element_size()
    # Cold weight bytes hashed per step: the start's check always; remember() too when not
    # streamed (the streamed tiles are read while in cache, just written by CPU Adam).
    out["cold_bytes"] = numel * size * (1 if streamed else 2)
    return out


def _slot_by_slot(flat: torch.Tensor, ranges: list[tuple[int, int]]) -> torch.Tensor:
    """The device fingerprints as they were taken before Note [one fingerprint pass per
    bucket]: each slot's chunks summed apart (the same numbers)."""
    ints = flat.view(fingerprints.SAME_SIZE_INT[flat.element_size()])
    sums = []
    for start, end in ranges:
        total = torch.zeros((), dtype=torch.int64, device=flat.device)
        for lo in range(start, end, fingerprints.DEVICE_CHUNK):
            hi = min(end, lo + fingerprints.DEVICE_CHUNK)
            total += fingerprints.mixed_terms(ints[lo:hi], lo).sum()
        sums.append(total)
    return torch.stack(sums)


def _device_path(rounds: int) -> list[str]:
    """The GPU path's fingerprint of one bucket of many small parameters (a GPT's norms and
    biases), run on the CPU: ms per bucket, one pass against slot by slot, median of
    interleaved rounds. On a GPU the cost is the kernels launched, about proportional to
    the ops dispatched, which the table gives too."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.ops += 1
            return func(*args, **(kwargs or {}))

    lines = ["| bucket | way | ops dispatched | ms per bucket | slot by slot / one pass |"]
    lines.append("|---|---|---:|---:|---:|")
    for count, size in ((400, 1024), (40, 65536)):
        flat = torch.randn(count * size).to(torch.bfloat16)
        ranges = [(i * size, i * size + size - 16) for i in range(count)]
        ways = {
            "slot by slot (before)": _slot_by_slot,
            "one pass (now)": fingerprints.device_fingerprints,
        }
        times: dict[str, list[float]] = {name: [] for name in ways}
        ops = {}
        for name, fn in ways.items():
            Count.ops = 0
            with Count():
                fn(flat, ranges)
            ops[name] = Count.ops
        for _ in range(rounds):  # interleaved, after the warm-up above
            for name, fn in ways.items():
                t0 = time.perf_counter()
                fn(flat, ranges)
                times[name].append(time.perf_counter() - t0)
        med = {name: statistics.median(v) for name, v in times.items()}
        ratio = med["slot by slot (before)"] / med["one pass (now)"]
        for name in ways:
            shown = f"**{ratio:.1f}**" if name.startswith("one") else ""
            lines.append(
                f"| {count} x {size} bf16 | {name} | {ops[name]} | {med[name] * 1e3:.2f} | "
                f"{shown} |"
            )
    return lines


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="a small model: checks it runs")
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args(argv)
    scale = TINY if args.tiny else FULL
    lines = [
        "| dtype | check | changed() ms | remember() ms | tiles streamed ms | total CPU ms "
        "| cold MB/step |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    result: dict = {"machine": machine(), "rows": []}
    for dtype in (torch.bfloat16, torch.float32):
        for streamed in (False, True):
            r = _measure(dtype, args.steps, scale, streamed=streamed)
            label = "streamed (now)" if streamed else "two cold hashes (before)"
            lines.append(
                f"| {str(dtype).removeprefix('torch.')} | {label} | "
                f"{r['changed_params'] * 1e3:.2f} | {r['remember'] * 1e3:.2f} | "
                f"{r['published_tile'] * 1e3:.2f} | **{r['total'] * 1e3:.2f}** | "
                f"{r['cold_bytes'] / 1e6:.0f} |"
            )
            print(lines[-1] if len(lines) > 3 else "\n".join(lines), flush=True)
            result["rows"].append({"dtype": str(dtype), "streamed": streamed, **r})
    device = _device_path(3 if args.tiny else 9)
    result["device_path"] = device
    print()
    print("\n".join(lines))
    print("\nThe GPU path's fingerprint, on the CPU (Note [one fingerprint pass per bucket]):")
    print("\n".join(device))
    path = write_json("bench_write_check_tiny" if args.tiny else "bench_write_check", result)
    print(f"\nwrote {path}")
    return result


if __name__ == "__main__":
    main()
