"""Issue 39's north star: the workload of the H200 tables (shared/gpu-runs/2026-12-04-h200).

    python benchmarks/north_star.py [--budget-s 360] [--sizes 1.15B,2.69B] [--rounds 2]
    python benchmarks/north_star.py --cpu-smoke   # the same code path, tiny, host accelerator
    python benchmarks/gpu_check.py --north-star   # the same, as a gpu_check phase

The demo TinyGPT in bf16, every block under ``torch.utils.checkpoint`` (non-reentrant),
micro-batches of 8 x 2048 tokens, lr 1e-4, no clipping; 4 micro-batches a step, then 1. One
model and optimizer per (size, variant), timed at both micro-batch counts:

- ``no_offload``: bf16 model, fp32 master weights and fused AdamW on the device, whole GPU;
- ``offload``, ``offload_announced`` (``opt.backward(loss, step=True)`` on the last
  micro-batch), ``offload_overlap_step`` (``OffloadConfig(overlap_step=True)``) and, last
  (the first the budget cuts), ``offload_overlap_first_use`` (the same without weight shadows,
  each bucket waited for where the forward first reads it: ``overlap_shadow="off",
  overlap_landing="at_first_use"``): OffloadAdamW under a 24 GiB device cap
  (``set_per_process_memory_fraction`` and ``device_budget``);
- ``deepspeed``: ZeRO-2 with the optimizer offloaded to the CPU (DeepSpeedCPUAdam), the
  shared README's config, when ``deepspeed`` imports; a row saying why not otherwise.

A row per variant: the median step (one warm-up, then ``--rounds`` steps), its ratio to no
offload and to DeepSpeed, peak device memory (torch's, reset after the warm-up step),
achieved model TFLOPS (6 x parameters x tokens / step: recomputation not counted) and, for
ours, where the cap left room: how many buckets summed their micro-batches on the device and
kept a weight shadow for ``overlap_step`` (the optimizer's step notes). Over
``--budget-s`` the remaining variants are skipped, each with a row. ``--cpu-smoke`` runs on
the host accelerator at tiny sizes in seconds; its figures are NOT GPU figures, and its
output says so on every table. Prints markdown and writes ``north_star.json`` (to ``$OUT``
when set, else benchmarks/results/).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # this checkout's package, not an installed one
sys.path.insert(0, str(HERE))

from _common import write_json  # noqa: E402
from _runs import Target  # noqa: E402

GiB = 1 << 30
SIZES: dict[str, dict[str, int]] = {
    "1.15B": {"vocab_size": 32768, "seq_len": 2048, "layers": 20, "hidden": 2048, "heads": 16},
    "2.69B": {"vocab_size": 32768, "seq_len": 2048, "layers": 32, "hidden": 2560, "heads": 20},
}
SMOKE_SIZES: dict[str, dict[str, int]] = {
    "tiny-a": {"vocab_size": 256, "seq_len": 16, "layers": 2, "hidden": 64, "heads": 4},
    "tiny-b": {"vocab_size": 256, "seq_len": 16, "layers": 3, "hidden": 96, "heads": 4},
}
VARIANTS = (
    "no_offload",
    "offload",
    "offload_announced",
    "offload_overlap_step",
    "deepspeed",
    "offload_overlap_first_use",
)
MICRO = (4, 1)
LR = 1e-4
SMOKE_BANNER = (
    "HOST ACCELERATOR SMOKE RUN: tiny models on the CPU. These figures are NOT GPU figures "
    "and predict nothing about one; they show only that the north-star code path runs."
)


def build_model(shape: dict[str, int], target: Target) -> torch.nn.Module:
    """The demo TinyGPT in bf16, built on the device, every block checkpointed."""
    from torch.utils.checkpoint import checkpoint

    from zero_offload.demo.model import GPTConfig, TinyGPT

    torch.manual_seed(0)
    with target.device:  # built where it trains: never whole on the CPU first
        model = TinyGPT(GPTConfig(**shape)).to(torch.bfloat16)
    model.runner = lambda block, x: checkpoint(block, x, use_reentrant=False)
    return model


class _NoOffload:
    """bf16 model, fp32 master weights and fused AdamW on the device (the tables' baseline)."""

    def __init__(self, model: torch.nn.Module) -> None:
        from bench_offload_step import TorchMixed

        self.inner = TorchMixed(model)
        self.inner.opt.param_groups[0]["lr"] = LR

    def micro_batch(self, loss: torch.Tensor, last: bool) -> None:
        loss.backward()

    def step(self) -> None:
        self.inner.step()

    def close(self) -> None:
        """Nothing held beyond the model's own tensors."""


def _config(name: str) -> Any:
    """The ``OffloadConfig`` of offloaded variant ``name``."""
    from zero_offload import OffloadConfig

    if name == "offload_overlap_first_use":
        return OffloadConfig(
            overlap_step=True, overlap_shadow="off", overlap_landing="at_first_use"
        )
    return OffloadConfig(overlap_step=name == "offload_overlap_step")


class _Offload:
    """OffloadAdamW, plain, announced or with ``overlap_step`` (shadows, or landed at first
    use)."""

    def __init__(self, model: torch.nn.Module, target: Target, name: str, cap: int | None) -> None:
        from zero_offload import OffloadAdamW

        self.announce = name == "offload_announced"
        accelerator = target.accelerator(device_budget=cap) if cap else target.accelerator()
        self.opt = OffloadAdamW(
            model.parameters(),
            lr=LR,
            config=_config(name),
            accelerator=accelerator,
        )

    def micro_batch(self, loss: torch.Tensor, last: bool) -> None:
        self.opt.backward(loss, step=self.announce and last)

    def step(self) -> None:
        self.opt.step()
        self.opt.zero_grad()

    def placement(self) -> str:
        """Where the micro-batches added up and the delayed update's weights waited, from
        the step notes: whether the 24 GiB cap left room for them (issue 39)."""
        notes: dict[str, int] = {}
        for key, value in self.opt.manager.step_notes.items():
            name = key.rsplit(".", 1)[-1]
            notes[name] = notes.get(name, 0) + int(value)
        parts = []
        summed = (
            notes.get("device_accumulating_buckets", 0),
            notes.get("host_accumulating_buckets", 0),
        )
        if any(summed):
            parts.append(f"sums on device {summed[0]}/{sum(summed)}")
        shadows = (notes.get("shadowed_buckets", 0), notes.get("unshadowed_buckets", 0))
        if any(shadows):
            parts.append(f"shadows {shadows[0]}/{sum(shadows)}")
        return ", ".join(parts)

    def close(self) -> None:
        self.opt.close()


class _DeepSpeed:
    """DeepSpeed ZeRO-2, optimizer offloaded to the CPU: the shared README's config."""

    def __init__(self, model: torch.nn.Module, micro: int, batch: int) -> None:
        import deepspeed

        for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}.items():
            os.environ.setdefault(key, value)
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        config = {
            "train_micro_batch_size_per_gpu": batch,
            "gradient_accumulation_steps": micro,
            "bf16": {"enabled": True},
            "optimizer": {
                "type": "AdamW",
                "params": {"lr": LR, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0},
            },
            "zero_optimization": {
                "stage": 2,
                "offload_optimizer": {"device": "cpu", "pin_memory": True},
                "contiguous_gradients": True,
                "overlap_comm": True,
                "reduce_bucket_size": 2e8,
                "allgather_bucket_size": 2e8,
            },
            "gradient_clipping": 0,
        }
        self.engine, *_ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=config
        )

    def micro_batch(self, loss: torch.Tensor, last: bool) -> None:
        self.engine.backward(loss)
        self.engine.step()  # DeepSpeed steps per micro-batch; it updates at the boundary

    def step(self) -> None:
        """Done in ``micro_batch`` at the accumulation boundary."""

    def close(self) -> None:
        self.engine.destroy()


def deepspeed_missing(target: Target) -> str | None:
    """Why the DeepSpeed variant cannot run here, or None."""
    if not target.cuda:
        return "DeepSpeed's CPU-offload optimizer needs CUDA; not run on the host accelerator"
    try:
        import deepspeed  # noqa: F401
    except Exception as exc:  # an ImportError, or a broken install's own error
        return f"deepspeed does not import ({type(exc).__name__}: {exc})"
    return None


def _time_steps(
    model: torch.nn.Module, runner: Any, data: list[list[torch.Tensor]], target: Target
) -> tuple[float, int | None]:
    """One warm-up step, the peak reset, then each remaining step timed between syncs."""
    seconds: list[float] = []
    for index, micro_batches in enumerate(data):
        target.sync()
        began = time.perf_counter()
        for i, ids in enumerate(micro_batches):
            runner.micro_batch(model(ids, ids), last=i == len(micro_batches) - 1)
        runner.step()
        target.sync()
        if index == 0:
            target.reset_peak()
        else:
            seconds.append(time.perf_counter() - began)
    return statistics.median(seconds), target.peak_bytes()


def run_variant(
    name: str, shape: dict[str, int], *, target: Target, batch: int, rounds: int, cap: int | None
) -> dict[int, dict[str, Any]]:
    """Median step and peak of one variant at each micro-batch count (one build for both)."""
    target.release()
    capped = cap is not None and target.cuda and name.startswith("offload")
    if capped:
        total = torch.cuda.get_device_properties(target.device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), target.device)
    model = build_model(shape, target)
    gen = torch.Generator().manual_seed(1)
    out: dict[int, dict[str, Any]] = {}
    runner: Any = None
    try:
        for micro in MICRO:
            if runner is None or name == "deepspeed":
                if runner is not None:  # DeepSpeed fixes its accumulation: a fresh engine
                    runner.close()
                    runner = None
                    model = build_model(shape, target)
                if name == "no_offload":
                    runner = _NoOffload(model)
                elif name == "deepspeed":
                    runner = _DeepSpeed(model, micro, batch)
                else:
                    runner = _Offload(model, target, name, cap if capped else None)
            data = [
                [
                    torch.randint(
                        0, shape["vocab_size"], (batch, shape["seq_len"]), generator=gen
                    ).to(target.device)
                    for _ in range(micro)
                ]
                for _ in range(rounds + 1)
            ]
            step_s, peak = _time_steps(model, runner, data, target)
            out[micro] = {"step_s": step_s, "peak_bytes": peak}
            if isinstance(runner, _Offload):
                out[micro]["placement"] = runner.placement()
    finally:
        if runner is not None:
            runner.close()
        del model, runner
        if capped:
            torch.cuda.set_per_process_memory_fraction(1.0, target.device)
        gc.collect()
        target.release()
    return out


def north_star(
    *,
    target: Target,
    sizes: dict[str, dict[str, int]],
    batch: int,
    rounds: int,
    budget_s: float,
    cap: int | None,
    emit: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Every (size, variant) within ``budget_s``; returns the rows (and prints tables)."""
    began = time.monotonic()
    rows: list[dict[str, Any]] = []
    for size, shape in sizes.items():
        params = None
        for name in VARIANTS:
            row_base = {"size": size, "variant": name}
            why = deepspeed_missing(target) if name == "deepspeed" else None
            elapsed = time.monotonic() - began
            if why is None and elapsed > budget_s:
                why = f"skipped: {elapsed:.0f} s spent of the {budget_s:.0f} s budget"
            if why is not None:
                rows += [dict(row_base, micro=m, skipped=why) for m in MICRO]
                continue
            try:
                results = run_variant(
                    name, shape, target=target, batch=batch, rounds=rounds, cap=cap
                )
            except Exception as exc:  # one variant's failure is a row, not the end of the run
                rows += [
                    dict(row_base, micro=m, skipped=f"failed: {type(exc).__name__}: {exc}")
                    for m in MICRO
                ]
                continue
            if params is None:
                params = _parameters(shape)
            for micro, result in results.items():
                tokens = micro * batch * shape["seq_len"]
                rows.append(
                    dict(
                        row_base,
                        micro=micro,
                        parameters=params,
                        tokens=tokens,
                        tflops=6 * params * tokens / result["step_s"] / 1e12,
                        **result,
                    )
                )
    _add_ratios(rows)
    emit(format_table(rows, smoke=not target.cuda))
    return {"rows": rows, "seconds": time.monotonic() - began}


def _parameters(shape: dict[str, int]) -> int:
    """TinyGPT's parameter count, from a model on the meta device (no memory)."""
    from zero_offload.demo.model import GPTConfig, TinyGPT

    with torch.device("meta"):
        return sum(p.numel() for p in TinyGPT(GPTConfig(**shape)).parameters())


def _add_ratios(rows: list[dict[str, Any]]) -> None:
    base = {(r["size"], r["micro"], r["variant"]): r.get("step_s") for r in rows}
    for row in rows:
        if "step_s" not in row:
            continue
        for key, variant in (("vs_no_offload", "no_offload"), ("vs_deepspeed", "deepspeed")):
            other = base.get((row["size"], row["micro"], variant))
            row[key] = row["step_s"] / other if other else None


def format_table(rows: list[dict[str, Any]], *, smoke: bool) -> str:
    """The markdown table; on the host accelerator, under a banner saying it is no GPU's."""
    lines = [f"**{SMOKE_BANNER}**", ""] if smoke else []
    lines += [
        "| size | micro | variant | step s | / no offload | / DeepSpeed | peak device GiB | TFLOPS "
        "| where |",
        "|---|---:|---|---:|---:|---:|---:|---:|---|",
    ]

    def ratio(value: float | None) -> str:
        return f"{value:.2f}" if value is not None else "-"

    for row in rows:
        head = f"| {row['size']} | {row['micro']} | {row['variant']}"
        if "step_s" not in row:
            lines.append(f"{head} | {row['skipped']} | | | | | |")
            continue
        peak = row["peak_bytes"]
        lines.append(
            f"{head} | {row['step_s']:.3f} | {ratio(row['vs_no_offload'])} | "
            f"{ratio(row['vs_deepspeed'])} | {'-' if peak is None else f'{peak / GiB:.2f}'} | "
            f"{row['tflops']:.3g} | {row.get('placement', '')} |"
        )
    if smoke:
        lines += ["", f"**{SMOKE_BANNER}**"]
    return "\n".join(lines)


def run_for(target: Target, *, budget_s: float, emit: Callable[[str], None]) -> dict[str, Any]:
    """The whole north star on ``target``: real sizes on CUDA, tiny ones on the host
    accelerator (what ``gpu_check.py --north-star`` runs)."""
    cuda = target.cuda
    return north_star(
        target=target,
        sizes=SIZES if cuda else SMOKE_SIZES,
        batch=8 if cuda else 2,
        rounds=2,
        budget_s=budget_s,
        cap=24 * GiB if cuda else None,
        emit=emit,
    )


def report_rows(rows: list[dict[str, Any]], *, smoke: bool) -> list[tuple[str, str]]:
    """``(name, value)`` per row, for gpu_check's report; host figures say they are not a
    GPU's in their name."""
    where = " [host accelerator: NOT a GPU figure]" if smoke else ""
    out = []
    for row in rows:
        name = f"{row['size']} x{row['micro']} micro-batches, {row['variant']}{where}"
        if "step_s" not in row:
            out.append((name, row["skipped"]))
            continue
        ratios = ", ".join(
            f"{row[key]:.2f}x {label}"
            for key, label in (("vs_no_offload", "no offload"), ("vs_deepspeed", "DeepSpeed"))
            if row.get(key) is not None
        )
        peak = row["peak_bytes"]
        peak_text = f", peak {peak / GiB:.2f} GiB" if peak is not None else ""
        where_text = f"; {row['placement']}" if row.get("placement") else ""
        out.append(
            (
                name,
                f"{row['step_s']:.3f} s ({ratios}){peak_text}, {row['tflops']:.3g} TFLOPS"
                f"{where_text}",
            )
        )
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-smoke", action="store_true", help="host accelerator, tiny sizes")
    parser.add_argument("--budget-s", type=float, default=360.0, help="skip variants after this")
    parser.add_argument("--rounds", type=int, default=2, help="timed steps after one warm-up")
    parser.add_argument("--sizes", default=None, help="comma-separated, of " + ",".join(SIZES))
    parser.add_argument("--cap-gib", type=float, default=24.0, help="offloaded runs' device cap")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1 (timed steps after the warm-up), got {args.rounds}")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.cpu_smoke:
        target, sizes, batch = Target("host"), SMOKE_SIZES, 2
    elif torch.cuda.is_available():
        target, sizes, batch = Target("cuda"), SIZES, 8
    else:
        print("no GPU here: run with --cpu-smoke for the host accelerator's smoke run")
        return {"rows": [], "skipped": "no GPU"}
    if args.sizes:
        unknown = set(args.sizes.split(",")) - set(sizes)
        if unknown:
            raise SystemExit(f"--sizes: unknown {sorted(unknown)}; known: {sorted(sizes)}")
        sizes = {k: v for k, v in sizes.items() if k in args.sizes.split(",")}
    result = north_star(
        target=target,
        sizes=sizes,
        batch=batch,
        rounds=args.rounds,
        budget_s=args.budget_s,
        cap=int(args.cap_gib * GiB) if target.cuda else None,
    )
    result.update(accelerator=target.kind, gpu_figures=target.cuda)
    if not target.cuda:
        result["note"] = SMOKE_BANNER
    out = os.environ.get("OUT")
    if out:
        Path(out, "north_star.json").write_text(json.dumps(result, indent=2, default=str))
    else:
        write_json("north_star_smoke" if args.cpu_smoke else "north_star", result)
    return result


if __name__ == "__main__":
    main()
