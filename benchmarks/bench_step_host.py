"""The host side of ``step()`` on the host accelerator: CPU Adam's rate in the step against
the bare kernel, and where the rest of the step goes (issue 39, "Measured on this machine").

    python benchmarks/bench_step_host.py [--quick] [--rounds N]

Run it as users are told to launch (docs/threads.md): the script sets
``OMP_WAIT_POLICY=PASSIVE`` before importing torch unless the environment names a policy.

Three workloads, each trained with ``OffloadAdamW`` in bf16, everything offloaded:

- ``gpt21M x1``: the demo TinyGPT (21M parameters), 1 micro-batch of 32 tokens per step;
- ``gpt21M x4``: the same, 4 micro-batches per step;
- ``400 small``: 200 ``Linear(8, 8)`` layers, 400 parameters in one bucket.

Each round is one training step (``step()`` timed alone, ``zero_grad()`` outside), then,
for the GPT rows, the references over the same elements, in the same dtypes and at the
same thread count the step's kernel launches ran with (read inside the launch:
``numba.get_num_threads()``):

- ``bare``: ONE ``adam_step`` call over all of the step's elements;
- ``+ copies``: the kernel per launch of the step, each launch's bf16 weights copied by a
  second thread as soon as it is written (the host accelerator's "DMA" is a CPU memcpy,
  with torch's threads, on the cores the kernel uses);
- ``floor``: the same, each launch's weights also fingerprinted with xxh3 on the calling
  thread (Note [one cold hash per step]), as the step must on this simulator. On CUDA
  neither the memcpy nor the hash runs on the host: ``bare / floor`` is the part of the
  gap that belongs to the simulator, ``floor / cpu_adam`` the part that is the step's.

What is reported, median over the rounds after a warm-up:

- ``cpu_adam``: the step's ``cpu_adam`` phase (wall); ``kernel``: the wall time inside the
  compiled kernel of the step's launches; the in-step rate against ``bare`` as ``bare /
  cpu_adam`` (1.0 means the step updates at the bare kernel's rate) and ``bare / kernel``
  (the launches alone); ``floor / cpu_adam``; and ``CPU: bare / cpu_adam``, the same ratio
  in CPU time of the calling thread (one of the kernel's team), which the machine's load
  moves much less than wall time.
- Python per launch: the time in ``adam_step`` outside its compiled kernel (checks,
  scalars, the thread count), and the rest of the phase per launch (tile loop, waits).
- ``step() - cpu_adam``: absolute and as a share of ``cpu_adam``, with the CPU time of the
  calling thread (``time.thread_time``) beside the wall time: wall time on a loaded 2-core
  machine is noisy, the thread's CPU time much less.
- the breakdown of ``step() - cpu_adam`` by phase: the write check's ``changed()`` (one
  cold hash of every weight) and ``remember()``, the master's reconcile, copies issued on
  the calling thread, statistics (``grad_stats``, ``wait_grads``), the wait for the weights
  (``wait_weights``), and the rest.
- inside ``cpu_adam``: the streamed hash and the copies' issue.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

if __name__ == "__main__":
    # Before torch loads its OpenMP runtime: Note [no spinning team beside another].
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numba
import torch
import xxhash
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import machine, write_json

import zero_offload.kernels.adam as adam_module
import zero_offload.optim.rule.adamw as rule_module
import zero_offload.optim.update.modes as modes_module
import zero_offload.optim.update.policy as policy_module
import zero_offload.optim.update.reconcile as reconcile_module
from zero_offload import OffloadAdamW
from zero_offload.demo.model import GPTConfig, TinyGPT
from zero_offload.kernels import adam_step
from zero_offload.memory.manager import TieredMemoryManager
from zero_offload.optim.state.store import StateStore
from zero_offload.views.param_views import ParamViews

LR = 1e-4
GPT = GPTConfig(vocab_size=8192, seq_len=32, layers=8, hidden=384, heads=6)
GPT_QUICK = GPTConfig(vocab_size=2048, seq_len=32, layers=4, hidden=256, heads=4)
#: Phases reported by name (Note [named phases] in tracing.py).
PHASES = ("cpu_adam", "grad_stats", "wait_grads", "wait_weights")


class Probe:
    """Wall and thread-CPU seconds of the step's parts on the calling thread, per step.

    Installs wrappers around the write check, the reconcile, the copies' issue, the
    streamed hash, ``adam_step`` and its compiled kernel, and a phase listener; ``close()``
    puts everything back. Only calls on ``thread`` (the training thread) count."""

    def __init__(self) -> None:
        self.thread = threading.get_ident()
        self.wall: dict[str, float] = defaultdict(float)
        self.cpu: dict[str, float] = defaultdict(float)
        self.count: dict[str, int] = defaultdict(int)
        self.launches: list[tuple[int, str, str, str]] = []  # (elements, dtypes) per launch
        self.threads: list[int] = []  # numba's threads inside each launch
        self._saved: list[tuple[Any, str, Any]] = []
        self._wrap(reconcile_module, "changed_params_of", "changed")
        self._wrap(ParamViews, "remember", "remember")
        self._wrap(ParamViews, "published_tile", "hash_streamed")
        self._wrap(StateStore, "reconcile_master", "reconcile")
        self._wrap(TieredMemoryManager, "copy", "copy_issue")
        self._wrap(rule_module, "adam_step", "adam_launch", self._note_launch)
        self._wrap(adam_module, "_adam_kernel", "kernel", self._note_threads)
        for module in (modes_module, policy_module):  # where step() opens its phases
            self._saved.append((module, "phase", module.phase))
            module.phase = self._phase(module.phase)

    def _note_launch(self, args: tuple, kwargs: dict) -> None:
        p, g, m = args[0], args[1], args[2]
        out = kwargs.get("out")
        self.launches.append(
            (p.numel(), str(g.dtype), str(m.dtype), "none" if out is None else str(out.dtype))
        )

    def _note_threads(self, args: tuple, kwargs: dict) -> None:
        self.threads.append(numba.get_num_threads())

    def _wrap(
        self,
        owner: Any,
        name: str,
        key: str,
        note: Callable[[tuple, dict], None] | None = None,
    ) -> None:
        fn = getattr(owner, name)
        self._saved.append((owner, name, fn))
        probe = self

        def timed(*args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() != probe.thread:
                return fn(*args, **kwargs)
            if note is not None:
                note(args, kwargs)
            w0, c0 = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                probe.wall[key] += time.perf_counter() - w0
                probe.cpu[key] += time.thread_time() - c0
                probe.count[key] += 1

        setattr(owner, name, timed)

    def _phase(self, phase: Callable[..., Any]) -> Callable[..., Any]:
        """``tracing.phase``, timed (wall and thread CPU) on the training thread."""
        probe = self

        @contextlib.contextmanager
        def timed(name: str, **kwargs: Any) -> Iterator[None]:
            if threading.get_ident() != probe.thread or name not in PHASES:
                with phase(name, **kwargs):
                    yield
                return
            w0, c0 = time.perf_counter(), time.thread_time()
            try:
                with phase(name, **kwargs):
                    yield
            finally:
                probe.wall[name] += time.perf_counter() - w0
                probe.cpu[name] += time.thread_time() - c0
                probe.count[name] += 1

        return timed

    def reset(self) -> None:
        self.wall.clear()
        self.cpu.clear()
        self.count.clear()
        self.launches.clear()
        self.threads.clear()

    def close(self) -> None:
        for owner, name, fn in reversed(self._saved):
            setattr(owner, name, fn)


def _small_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(8, 8) for _ in range(200)]).to(torch.bfloat16)


class Workload:
    """One model, its optimizer and its batches; ``train()`` runs the forward and backward
    of one step, ``step()`` the optimizer step."""

    def __init__(self, name: str, *, micro: int, quick: bool) -> None:
        self.name = name
        self.micro = micro
        torch.manual_seed(0)
        if name == "400 small":
            self.model = _small_model()
            x = torch.randn(4, 8, dtype=torch.bfloat16)
            self.batches: list[Any] = [(x,)] * micro
            self.loss = lambda x: self.model(x).float().sum()
        else:
            config = GPT_QUICK if quick else GPT
            self.model = TinyGPT(config).to(torch.bfloat16)
            gen = torch.Generator().manual_seed(1)
            self.batches = [
                (
                    torch.randint(0, config.vocab_size, (1, config.seq_len), generator=gen),
                    torch.randint(0, config.vocab_size, (1, config.seq_len), generator=gen),
                )
                for _ in range(micro)
            ]
            self.loss = lambda ids, targets: self.model(ids, targets)
        self.numel = sum(p.numel() for p in self.model.parameters())
        self.opt = OffloadAdamW(self.model.parameters(), lr=LR)
        self.steps = 0

    def train(self) -> None:
        for batch in self.batches:
            self.loss(*batch).backward()

    def step(self) -> None:
        self.opt.step()
        self.steps += 1

    def zero_grad(self) -> None:
        self.opt.zero_grad()

    def close(self) -> None:
        self.opt.close()


class Reference:
    """The bare kernel over the step's elements in the step's dtypes (``bare``), and the
    simulator's floor for the step's launches (``floor``); see the module docstring."""

    def __init__(self, launches: list[tuple[int, str, str, str]]) -> None:
        dtype = {str(d): d for d in (torch.float32, torch.bfloat16, torch.float16)}
        n = sum(k for k, *_ in launches)
        _, grad, moments, out = launches[0]
        if any(launch[1:] != launches[0][1:] for launch in launches):
            raise RuntimeError(f"the step's launches mix dtypes: {sorted(set(launches))}")
        self.sizes = [k for k, *_ in launches]
        gen = torch.Generator().manual_seed(2)
        self.p = torch.randn(n, generator=gen)
        self.g = torch.randn(n, generator=gen).to(dtype[grad]).mul_(1e-3)
        self.m = torch.zeros(n, dtype=dtype[moments])
        self.v = torch.zeros(n, dtype=dtype[moments])
        self.out = None if out == "none" else torch.empty(n, dtype=dtype[out])
        self.dst = None if self.out is None else torch.empty_like(self.out)
        self.step = 0

    def _adam(self, lo: int, hi: int, threads: int) -> None:
        out = None if self.out is None else self.out[lo:hi]
        adam_step(self.p[lo:hi], self.g[lo:hi], self.m[lo:hi], self.v[lo:hi],
                  step=self.step, lr=LR, beta1=0.9, beta2=0.999, eps=1e-8,
                  weight_decay=0.01, out=out, num_threads=threads)  # fmt: skip

    def bare(self, threads: int) -> None:
        self.step += 1
        self._adam(0, self.p.numel(), threads)

    def floor(self, threads: int, *, hashed: bool = True) -> None:
        """Each launch of the step, its weights memcpy'd by a second thread and (with
        ``hashed``) fingerprinted on this one."""
        self.step += 1
        copies: list[threading.Thread] = []
        lo = 0
        for k in self.sizes:
            self._adam(lo, lo + k, threads)
            if self.out is not None and self.dst is not None:
                src, dst = self.out[lo : lo + k], self.dst[lo : lo + k]
                copy = threading.Thread(target=dst.copy_, args=(src,))
                copy.start()
                copies.append(copy)
                if hashed:
                    xxhash.xxh3_64_intdigest(src.view(torch.uint8).numpy())
            lo += k
        for copy in copies:
            copy.join()


def _timed(fn: Callable[[], None]) -> tuple[float, float, float]:
    """Wall, calling-thread CPU and process CPU seconds of ``fn()``."""
    w0, c0, p0 = time.perf_counter(), time.thread_time(), time.process_time()
    fn()
    return time.perf_counter() - w0, time.thread_time() - c0, time.process_time() - p0


def measure(name: str, *, micro: int, rounds: int, quick: bool) -> dict[str, Any]:
    """Median of ``rounds`` interleaved rounds (step, bare, floor) after two warm-up steps."""
    work = Workload(name, micro=micro, quick=quick)
    probe = Probe()
    samples: dict[str, list[float]] = defaultdict(list)
    reference: Reference | None = None
    threads = 0
    probe_dtypes: tuple[str, ...] = ()
    try:
        for r in range(rounds + 2):
            work.train()
            probe.reset()
            wall, cpu, proc = _timed(work.step)  # step() alone
            work.zero_grad()
            if reference is None and probe.launches and name != "400 small":
                reference = Reference(list(probe.launches))
                threads = probe.threads[0]
                probe_dtypes = probe.launches[0][1:]
            if r < 2:  # warm-up: compilation, first allocations
                if reference is not None:
                    reference.bare(threads)
                    reference.floor(threads)
                    reference.floor(threads, hashed=False)
                continue
            adam = probe.wall["cpu_adam"]
            samples["step"].append(wall)
            samples["step_cpu"].append(cpu)
            samples["step_process_cpu"].append(proc)
            samples["cpu_adam"].append(adam)
            samples["outside"].append(wall - adam)
            samples["cpu_adam_cpu"].append(probe.cpu["cpu_adam"])
            samples["outside_cpu"].append(cpu - probe.cpu["cpu_adam"])
            for key in ("kernel", "adam_launch", "hash_streamed", "copy_issue", "changed",
                        "remember", "reconcile", "grad_stats", "wait_grads",
                        "wait_weights"):  # fmt: skip
                samples[key].append(probe.wall[key])
                samples[f"{key}_cpu"].append(probe.cpu[key])
            samples["launches"].append(probe.count["adam_launch"])
            samples["threads"].append(min(probe.threads) if probe.threads else 0)
            if reference is not None:
                bare = _timed(lambda: reference.bare(threads))  # noqa: B023
                floor = _timed(lambda: reference.floor(threads))  # noqa: B023
                copies = _timed(lambda: reference.floor(threads, hashed=False))  # noqa: B023
                samples["copies"].append(copies[0])
                samples["bare"].append(bare[0])
                samples["bare_process_cpu"].append(bare[2])
                samples["bare_cpu"].append(bare[1])
                samples["floor"].append(floor[0])
    finally:
        probe.close()
        work.close()
    med: dict[str, Any] = {key: statistics.median(v) for key, v in samples.items()}
    # Split of step() - cpu_adam: the parts timed outside the phase. remember() runs after
    # cpu_adam (in the landing); the copies issued inside it are CPU Adam's, the others
    # (the reconcile's D2H) are counted in "reconcile".
    named = ("changed", "remember", "reconcile", "grad_stats", "wait_grads", "wait_weights")
    med["others"] = med["outside"] - sum(med[key] for key in named)
    med["others_cpu"] = med["outside_cpu"] - sum(med[f"{key}_cpu"] for key in named)
    med["python_per_launch"] = (med["adam_launch"] - med["kernel"]) / max(1, med["launches"])
    med["rest_per_launch"] = (
        med["cpu_adam"] - med["adam_launch"] - med["hash_streamed"] - med["copy_issue"]
    ) / max(1, med["launches"])
    med["numel"] = work.numel
    if reference is not None:  # master fp32; the gradient, moments and weights as read
        med["dtypes"] = "grad {}, moments {}, out {}".format(*probe_dtypes)
    med["micro"] = micro
    med["steps"] = rounds
    return med


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small models, few rounds")
    parser.add_argument("--rounds", type=int, default=None, help="rounds after warm-up")
    args = parser.parse_args(argv)
    rounds = args.rounds or (3 if args.quick else 11)
    size = "gpt(quick)" if args.quick else "gpt21M"
    rows = {
        f"{size} x1": measure("gpt", micro=1, rounds=rounds, quick=args.quick),
        f"{size} x4": measure("gpt", micro=4, rounds=rounds, quick=args.quick),
        "400 small": measure("400 small", micro=1, rounds=rounds, quick=args.quick),
    }
    rate = [
        "| workload | elements | threads | launches | cpu_adam ms | kernel ms | bare ms "
        "| + copies ms | + hash (floor) ms | **bare / cpu_adam** | bare / kernel "
        "| bare / floor | floor / cpu_adam | CPU: bare / cpu_adam "
        "| µs Python per launch | µs rest per launch |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    outside = [
        "| workload | step ms | cpu_adam ms | **step - cpu_adam ms** | / cpu_adam "
        "| step CPU ms (thread) | changed() | remember() | reconcile | grad_stats "
        "| wait_grads | wait_weights | others | in cpu_adam: hash, copies issued |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for label, m in rows.items():
        if "bare" in m:
            rate.append(
                f"| {label} | {m['numel'] / 1e6:.1f}M | {m['threads']:.0f} "
                f"| {m['launches']:.0f} | {_ms(m['cpu_adam'])} | {_ms(m['kernel'])} "
                f"| {_ms(m['bare'])} | {_ms(m['copies'])} | {_ms(m['floor'])} "
                f"| **{m['bare'] / m['cpu_adam']:.2f}** | {m['bare'] / m['kernel']:.2f} "
                f"| {m['bare'] / m['floor']:.2f} | {m['floor'] / m['cpu_adam']:.2f} "
                f"| {m['bare_cpu'] / m['cpu_adam_cpu']:.2f} "
                f"| {m['python_per_launch'] * 1e6:.0f} | {m['rest_per_launch'] * 1e6:.0f} |"
            )
        outside.append(
            f"| {label} | {_ms(m['step'])} | {_ms(m['cpu_adam'])} | **{_ms(m['outside'])}** "
            f"| {m['outside'] / m['cpu_adam']:.2f} | {_ms(m['step_cpu'])} "
            f"| {_ms(m['changed'])} | {_ms(m['remember'])} | {_ms(m['reconcile'])} "
            f"| {_ms(m['grad_stats'])} | {_ms(m['wait_grads'])} | {_ms(m['wait_weights'])} "
            f"| {_ms(m['others'])} | {_ms(m['hash_streamed'])}, {_ms(m['copy_issue'])} |"
        )
    outside_cpu = [
        "| workload | step CPU ms | cpu_adam CPU ms | **step - cpu_adam CPU ms** "
        "| changed() | remember() | grad_stats | wait_grads | wait_weights | others "
        "| step, all threads CPU ms |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for label, m in rows.items():
        outside_cpu.append(
            f"| {label} | {_ms(m['step_cpu'])} | {_ms(m['cpu_adam_cpu'])} "
            f"| **{_ms(m['outside_cpu'])}** | {_ms(m['changed_cpu'])} "
            f"| {_ms(m['remember_cpu'])} | {_ms(m['grad_stats_cpu'])} "
            f"| {_ms(m['wait_grads_cpu'])} | {_ms(m['wait_weights_cpu'])} "
            f"| {_ms(m['others_cpu'])} | {_ms(m['step_process_cpu'])} |"
        )
    print("\nCPU Adam in the step against the bare kernel (same elements, dtypes, threads):")
    print("\n".join(rate))
    print("\nstep() outside CPU Adam, by phase (ms, wall, calling thread):")
    print("\n".join(outside))
    print("\nThe same in CPU time of the calling thread (ms; the last column all threads):")
    print("\n".join(outside_cpu))
    result = {
        "machine": machine(),
        "rounds": rounds,
        "rows": rows,
        "tables": [rate, outside, outside_cpu],
    }
    path = write_json("bench_step_host_quick" if args.quick else "bench_step_host", result)
    print(f"\nwrote {path}")
    return result


if __name__ == "__main__":
    main()
