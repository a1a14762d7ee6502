"""Small helpers shared by the benchmark scripts: timing and result files."""

from __future__ import annotations

import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def cuda_sync_if_used() -> None:
    """``torch.cuda.synchronize()`` once this process has touched CUDA; a no-op otherwise.

    CUDA kernels run asynchronously: without a sync a timer around them measures their
    launches, not their work. A process that never initialised CUDA has nothing in flight.
    """
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def time_samples(
    fns: dict[str, Callable[[], object]],
    *,
    rounds: int,
    warmup: int = 1,
    sync: Callable[[], None] | None = None,
) -> dict[str, list[float]]:
    """Seconds of every call of each function, timed in interleaved rounds.

    Each round calls every function once, so slow drift in the machine (frequency, a
    neighbour's load) hits all of them alike instead of whichever ran last. ``sync`` runs
    before the clock starts and before it stops, so asynchronous device work is inside the
    interval it belongs to; default ``cuda_sync_if_used`` (pass ``lambda: None`` to time
    launches only).
    """
    if rounds < 1 or warmup < 0:
        raise ValueError(f"time_rounds needs rounds >= 1 and warmup >= 0, got {rounds}, {warmup}")
    sync = cuda_sync_if_used if sync is None else sync
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            sync()  # the previous call's device work is not this one's
            t0 = time.perf_counter()
            fn()
            sync()
            samples[name].append(time.perf_counter() - t0)
    return samples


def time_rounds(
    fns: dict[str, Callable[[], object]],
    *,
    rounds: int,
    warmup: int = 1,
    sync: Callable[[], None] | None = None,
) -> dict:
    """Median seconds per call of each function (``time_samples``'s rounds)."""
    samples = time_samples(fns, rounds=rounds, warmup=warmup, sync=sync)
    return {name: statistics.median(s) for name, s in samples.items()}


def spread(samples: list[float]) -> dict[str, float]:
    """p10, median and p90 of ``samples`` (seconds); with fewer than 2 samples all three
    are the one sample."""
    if len(samples) < 2:
        return dict.fromkeys(("p10", "median", "p90"), samples[0])
    deciles = statistics.quantiles(samples, n=10, method="inclusive")
    return {"p10": deciles[0], "median": statistics.median(samples), "p90": deciles[-1]}


def machine() -> dict[str, object]:
    """The CPU model and core count, for the record."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": model, "logical_cpus": os.cpu_count()}


def write_json(name: str, payload: dict) -> Path:
    """Write ``payload`` to benchmarks/results/<name>.json and return the path."""
    RESULTS_DIR.mkdir(exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2, sort_keys=True))
    return path


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, for a gloo group's rendezvous."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def join_gloo(rank: int, world: int, port: int, *, timeout_s: float = 300.0) -> None:
    """A spawned rank's start: its share of this machine's cores as torch threads, then the
    gloo group on 127.0.0.1:``port``."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=timeout_s),
    )


def spawn_ranks(
    world: int,
    argv: Callable[[int, int], list[str]],
    *,
    what: str,
    env: dict[str, str] | None = None,
) -> None:
    """Run ``world`` processes ``python *argv(rank, port)``, ``port`` one free port for
    their gloo group, and wait for them all; ``env`` is added to this environment.

    Processes of a script, not ``torch.multiprocessing.spawn``: ``zero-offload bench``
    imports a script under a private name, which a spawned function could not be found by.
    Raises ``RuntimeError`` naming ``what`` and the exit codes when a rank failed.
    """
    port = free_port()
    child_env = {**os.environ, **(env or {})}
    procs = [
        subprocess.Popen([sys.executable, *argv(rank, port)], env=child_env)
        for rank in range(world)
    ]
    codes = [proc.wait() for proc in procs]
    if any(codes):
        raise RuntimeError(f"{what}, world size {world}: ranks exited with codes {codes}")
