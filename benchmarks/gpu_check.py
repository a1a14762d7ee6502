"""The CUDA check: one script, a few minutes on one GPU, one table at the end.

    python benchmarks/gpu_check.py [--skip-tests] [--skip-benchmarks]

1. the default device budget (free memory at construction less the headroom, Note [the
   default device budget] in ``accelerator/cuda.py``) next to ``mem_get_info``;
2. pinned memory: the registration rate of ``CudaAccelerator.allocate_host`` (page-aligned
   mmap, pre-faulted, ``cudaHostRegister``) against torch's pinned allocator
   (``pin_memory=True``, which rounds sizes up), and the locked-memory limit;
3. pinned host-to-device and device-to-host bandwidth (exact-size pinned buffers from
   ``CudaAccelerator.allocate_host``, timed with CUDA events);
4. a GPT-style model (~100M parameters, bf16) that fits both ways: step time and peak device
   memory (``torch.cuda.max_memory_allocated``) with ``OffloadAdamW`` against the same loop
   with torch's fused AdamW keeping fp32 master weights and moments on the GPU;
5. a 1B-parameter GPT (bf16) at a batch that keeps the GPU busy (``--gpt-1b-tokens`` tokens a
   step, in ``--gpt-1b-micro`` micro-batches): the offloaded step (plain; announced with
   ``backward(step=True)``; ``overlap_step``) against the no-offload step (fp32 master and
   moments on the GPU, fused AdamW); issue 15's target is offloaded <= 1.1x;
6. the test suite's CUDA cases (``pytest -m cuda``), then again under PyTorch's CUDA
   sanitizer (``TORCH_CUDA_SANITIZER=1``), which raises on unsynchronised stream accesses;
7. the kernel and step benchmarks (``--quick``), which run on this machine's CPU and GPU.

Each result row is printed as soon as it is measured (so a run cut short still reports what
it got), and the whole table again at the end.

Without a GPU it says so in one line and exits 0. It runs unchanged on any CUDA machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


class _Rows(list):
    """The result rows; each is printed as it is added (a run cut short still reports)."""

    def append(self, row: tuple[str, str]) -> None:
        print(f"gpu_check: {row[0]}: {row[1]}", flush=True)
        super().append(row)

    def __iadd__(self, rows):
        for row in rows:
            self.append(row)
        return self


def _bandwidth(nbytes: int = 256 * 2**20, rounds: int = 5) -> dict[str, float]:
    from zero_offload import CudaAccelerator

    acc = CudaAccelerator()
    host = acc.allocate_host(nbytes, pinned=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=acc.device)
    out = {}
    for name, (dst, src) in {"h2d": (dev, host), "d2h": (host, dev)}.items():
        times = []
        for _ in range(rounds + 1):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        out[name] = nbytes / statistics.median(times[1:]) / 1e9
    return out


def _budget() -> list[tuple[str, str]]:
    from zero_offload import CudaAccelerator
    from zero_offload.config import format_bytes

    acc = CudaAccelerator()
    free, total = torch.cuda.mem_get_info(acc.device)
    return [
        ("device memory free / total", f"{format_bytes(free)} / {format_bytes(total)}"),
        (
            "default device budget",
            f"{format_bytes(acc.ledger.budget)} ({acc.ledger.budget_source})",
        ),
    ]


def _pinned(nbytes: int = 1 << 30) -> list[tuple[str, str]]:
    """Registration rate (GB/s) of our pinned buffers and of torch's pinned allocator."""
    from zero_offload import CudaAccelerator
    from zero_offload.accelerator.pinned import memlock_limit
    from zero_offload.config import format_bytes

    acc = CudaAccelerator()
    rows = []
    for size in (nbytes, nbytes + 4096):  # an exact power of two, and just above one
        start = time.perf_counter()
        ours = acc.allocate_host(size, pinned=True)
        mmap_s = time.perf_counter() - start
        held = torch.cuda.memory.host_memory_stats().get("allocated_bytes.current", 0)
        start = time.perf_counter()
        theirs = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        torch_s = time.perf_counter() - start
        # The allocator's bytes for this request: its size rounded up to a power of two.
        rounded = torch.cuda.memory.host_memory_stats().get("allocated_bytes.current", 0) - held
        rows.append(
            (
                f"pinning {format_bytes(size)}: mmap+register / torch GB/s",
                f"{size / mmap_s / 1e9:.2f} / {size / torch_s / 1e9:.2f} "
                f"(torch pinned {format_bytes(rounded)} for it)",
            )
        )
        del ours, theirs
        torch.cuda.synchronize()
    limit = memlock_limit()
    rows.append(
        ("locked-memory limit (ulimit -l)", "unlimited" if limit is None else format_bytes(limit))
    )
    return rows


def _offload_vs_resident(rounds: int = 5) -> dict[str, float]:
    from bench_offload_step import SIZES, _TorchMixed

    from zero_offload import OffloadAdamW
    from zero_offload.demo.model import TinyGPT

    config = SIZES["100M"]
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (4, config.seq_len), generator=gen).cuda()
    result = {}
    for name in ("offload", "resident"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        torch.manual_seed(0)
        model = TinyGPT(config).cuda().bfloat16()
        opt = OffloadAdamW(model.parameters(), lr=1e-4) if name == "offload" else _TorchMixed(model)
        times = []
        for _ in range(rounds + 1):
            torch.cuda.synchronize()
            start = time.perf_counter()
            model(ids, ids).backward()
            opt.step()
            opt.zero_grad()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        result[f"{name}_step_s"] = statistics.median(times[1:])
        result[f"{name}_peak_bytes"] = torch.cuda.max_memory_allocated()
        if name == "offload":
            opt.close()
        del model, opt
    result["step_ratio"] = result["offload_step_s"] / result["resident_step_s"]
    result["memory_ratio"] = result["resident_peak_bytes"] / result["offload_peak_bytes"]
    return result


#: 1.15B parameters: 20 blocks of 12 * 2048^2 (50.3M each), a 32768 x 2048 embedding and
#: head, 2048 positions.
GPT_1B = {"vocab_size": 32768, "seq_len": 2048, "layers": 20, "hidden": 2048, "heads": 16}


def offloaded_vs_resident_step(
    config, *, micro: int, batch: int, rounds: int, device: torch.device
) -> dict[str, float]:
    """Median step seconds of the no-offload loop and of three offloaded loops on ``config``
    (a ``GPTConfig``), ``micro`` micro-batches of ``batch`` sequences a step, and the ratios.
    Runs on any accelerator (the tests run it on the CPU with a tiny config)."""
    from bench_offload_step import _TorchMixed

    from zero_offload import OffloadAdamW, OffloadConfig
    from zero_offload.demo.model import TinyGPT

    gen = torch.Generator().manual_seed(0)
    data = [
        torch.randint(0, config.vocab_size, (batch, config.seq_len), generator=gen).to(device)
        for _ in range(micro)
    ]
    cuda = device.type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    out: dict[str, float] = {}
    for name in ("resident", "offload", "offload_announced", "offload_overlap_step"):
        if cuda:
            torch.cuda.empty_cache()
        torch.manual_seed(0)
        model = TinyGPT(config).to(device=device, dtype=torch.bfloat16)
        if name == "resident":
            opt = _TorchMixed(model)
        else:
            config_ = OffloadConfig(overlap_step=name == "offload_overlap_step")
            opt = OffloadAdamW(model.parameters(), lr=1e-4, config=config_)
        announce = name == "offload_announced"
        times = []
        for _ in range(rounds + 1):
            sync()
            start = time.perf_counter()
            for i, ids in enumerate(data):
                loss = model(ids, ids)
                if name == "resident":
                    loss.backward()
                else:
                    opt.backward(loss, step=announce and i == micro - 1)
            opt.step()
            opt.zero_grad()
            sync()
            times.append(time.perf_counter() - start)
        out[f"{name}_step_s"] = statistics.median(times[1:])
        if name != "resident":
            opt.close()
        del model, opt, loss  # the loss's graph holds every parameter
    for name in ("offload", "offload_announced", "offload_overlap_step"):
        out[f"{name}_ratio"] = out[f"{name}_step_s"] / out["resident_step_s"]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument("--skip-benchmarks", action="store_true")
    parser.add_argument("--skip-gpt-1b", action="store_true")
    parser.add_argument("--gpt-1b-tokens", type=int, default=65536, help="tokens per step")
    parser.add_argument("--gpt-1b-micro", type=int, default=4, help="micro-batches per step")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print(f"gpu_check: no CUDA GPU visible to torch {torch.__version__}; nothing to check")
        return 0
    rows = _Rows([("GPU", torch.cuda.get_device_name())])
    status = 0
    rows += _budget()
    rows += _pinned()
    bw = _bandwidth()
    rows += [("pinned H2D GB/s", f"{bw['h2d']:.1f}"), ("pinned D2H GB/s", f"{bw['d2h']:.1f}")]
    both = _offload_vs_resident()
    rows += [
        ("step time offload / resident (100M, bf16)", f"{both['step_ratio']:.2f}"),
        ("peak device memory resident / offload", f"{both['memory_ratio']:.2f}x"),
        (
            "offload step ms / resident step ms",
            f"{both['offload_step_s'] * 1e3:.0f} / {both['resident_step_s'] * 1e3:.0f}",
        ),
    ]
    if not args.skip_gpt_1b:
        from zero_offload.demo.model import GPTConfig

        config = GPTConfig(**GPT_1B)
        micro = args.gpt_1b_micro
        batch = max(1, args.gpt_1b_tokens // (micro * config.seq_len))
        what = f"1B GPT, bf16, {micro} x {batch} x {config.seq_len} tokens"
        try:
            big = offloaded_vs_resident_step(
                config, micro=micro, batch=batch, rounds=3, device=torch.device("cuda")
            )
        except Exception as exc:  # the rest of the check still runs; the row says why
            rows.append((f"step comparison ({what})", f"FAILED: {type(exc).__name__}: {exc}"))
            status = 1
            torch.cuda.empty_cache()
        else:
            rows.append((f"no-offload step ms ({what})", f"{big['resident_step_s'] * 1e3:.0f}"))
            for name in ("offload", "offload_announced", "offload_overlap_step"):
                rows.append(
                    (
                        f"{name} step ms, / no-offload (target <= 1.1)",
                        f"{big[f'{name}_step_s'] * 1e3:.0f}, {big[f'{name}_ratio']:.2f}",
                    )
                )
    # The tests after the measurements: a run cut short keeps the numbers.
    if not args.skip_tests:
        tests = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-m", "cuda", os.path.join(HERE, "..", "tests")],
            check=False,
        )
        rows.append(
            ("CUDA tests (pytest -m cuda)", "passed" if tests.returncode == 0 else "FAILED")
        )
        sanitized = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-m", "cuda", os.path.join(HERE, "..", "tests")],
            check=False,
            env={**os.environ, "TORCH_CUDA_SANITIZER": "1"},
        )
        rows.append(
            (
                "CUDA tests under TORCH_CUDA_SANITIZER=1",
                "passed" if sanitized.returncode == 0 else "FAILED",
            )
        )
        status = status or tests.returncode or sanitized.returncode
    if not args.skip_benchmarks:
        import bench_cpu_adam
        import bench_offload_step

        adam = bench_cpu_adam.main(["--quick"])
        step = bench_offload_step.main(["--quick"])
        rows.append(("CPU Adam benchmark", f"{len(adam)} result groups (tables above)"))
        rows.append(("step / bare kernel (20M, CUDA)", f"{step['step_over_kernel']:.2f}"))
        rows.append(("device cut vs mixed (20M, CUDA)", f"{step['device_cut_vs_mixed']:.1f}x"))
    width = max(len(name) for name, _ in rows)
    print("\n| check | result |\n|---|---|")
    for name, value in rows:
        print(f"| {name.ljust(width)} | {value} |")
    return status


if __name__ == "__main__":
    sys.exit(main())
