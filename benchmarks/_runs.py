"""The training runs ``gpu_check.py`` measures: ``OffloadAdamW`` against torch, on a GPU at
real sizes or on the host accelerator at tiny ones (``Target``, ``Sizes``).

- ``parity_run``: OffloadAdamW in one mode against ``torch.optim.AdamW`` on the same fp32
  GPT and batches: the largest weight difference, the step times, the peak device bytes.
- ``torch_spread``: torch's for-loop AdamW against its fused one: float rounding's own
  spread, the yardstick of the parity rows.
- ``step_comparison``: a bf16 GPT's step, offloaded (plain, announced, ``overlap_step``)
  against resident (fp32 master and moments on the device, fused AdamW).

Every timed run makes one warm-up step first (kernel compiles, allocator and pool growth),
then resets the device's peak-memory counter, then times each step between device syncs
(``_common.time_rounds``).
"""

from __future__ import annotations

import copy
import gc
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from _common import time_rounds

#: The parity runs' AdamW, on both sides.
LR, BETAS, WEIGHT_DECAY = 1e-3, (0.9, 0.95), 0.1
#: fp32 parity floor: a few ulp per step from the kernel's evaluation order
#: (tests/test_offload_adamw_parity.py); the bar is this or twice torch's own spread.
FP32_ATOL = 1e-5
MODES = ("plain", "announced", "overlap_step", "param_offload", "activation_offload", "nvme")
STEP_VARIANTS = ("resident", "offload", "offload_announced", "offload_overlap_step")
MiB = 1 << 20


@dataclass(frozen=True)
class Sizes:
    """How big each phase's work is: real on a GPU, tiny for the CPU smoke run."""

    parity_model: dict[str, int]  # GPTConfig fields
    parity_batch: int  # sequences a step
    parity_steps: int  # the first is a warm-up, the rest are timed
    bucket_bytes: int
    tile_elements: int
    step_model: dict[str, int]  # the step-100m comparison
    step_batch: int
    step_rounds: int
    pinned_bytes: int
    bandwidth_bytes: int


CUDA_SIZES = Sizes(
    parity_model={"vocab_size": 8192, "seq_len": 256, "layers": 6, "hidden": 512, "heads": 8},
    parity_batch=8,
    parity_steps=10,
    bucket_bytes=4 * MiB,
    tile_elements=1 << 18,
    step_model={"vocab_size": 8192, "seq_len": 32, "layers": 12, "hidden": 768, "heads": 12},
    step_batch=4,
    step_rounds=5,
    pinned_bytes=1 << 30,
    bandwidth_bytes=256 * MiB,
)
TINY_SIZES = Sizes(
    parity_model={"vocab_size": 64, "seq_len": 16, "layers": 2, "hidden": 32, "heads": 4},
    parity_batch=2,
    parity_steps=4,
    bucket_bytes=8192,
    tile_elements=1024,
    step_model={"vocab_size": 256, "seq_len": 16, "layers": 2, "hidden": 64, "heads": 4},
    step_batch=2,
    step_rounds=2,
    pinned_bytes=MiB,
    bandwidth_bytes=MiB,
)


@dataclass(frozen=True)
class Target:
    """Where the check runs: ``"cuda"`` (the GPU) or ``"host"`` (the host accelerator)."""

    kind: str

    @property
    def cuda(self) -> bool:
        return self.kind == "cuda"

    @property
    def device(self) -> torch.device:
        return (
            torch.device("cuda", torch.cuda.current_device()) if self.cuda else torch.device("cpu")
        )

    def accelerator(self, **config: Any) -> Any:
        """A fresh accelerator of this kind with the given ``AcceleratorConfig`` fields."""
        from zero_offload import AcceleratorConfig, CudaAccelerator, HostAccelerator

        cls = CudaAccelerator if self.cuda else HostAccelerator
        return cls(AcceleratorConfig(**config))

    def sync(self) -> None:
        """Wait for the device's queued work (CUDA kernels run asynchronously)."""
        if self.cuda:
            torch.cuda.synchronize()

    def reset_peak(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()

    def peak_bytes(self) -> int | None:
        """Peak device bytes torch allocated since ``reset_peak`` (None off CUDA: the host
        accelerator's "device" is ordinary memory that torch does not count)."""
        return torch.cuda.max_memory_allocated() if self.cuda else None

    def release(self) -> None:
        """Give the memory of the previous run back, so the next one's peak is its own (an
        optimizer's hooks make reference cycles: collected, not just unreferenced)."""
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()


@dataclass(frozen=True)
class ParityResult:
    """One mode's run against its torch reference, same model, same batches."""

    mode: str
    steps: int
    max_abs_diff: float  # largest |w_ours - w_torch| over every weight, after all steps
    ours_step_s: float  # median of the timed steps (all but the first)
    torch_step_s: float
    ours_peak_bytes: int | None  # peak device bytes in the timed steps (CUDA only)
    torch_peak_bytes: int | None

    @property
    def step_ratio(self) -> float:
        return self.ours_step_s / self.torch_step_s


def gpt(shape: dict[str, int], target: Target, dtype: torch.dtype = torch.float32) -> Any:
    from zero_offload.demo.model import GPTConfig, TinyGPT

    torch.manual_seed(0)
    with target.device:  # built where it trains: a large model never sits on the CPU first
        return TinyGPT(GPTConfig(**shape)).to(dtype)


def _parity_gpt(shape: dict[str, int], target: Target) -> Any:
    """``gpt`` without the attention's qkv bias. The key bias's gradient is zero in exact
    arithmetic (softmax ignores a shift shared by every key), so its float noise, which
    differs as soon as two runs' weights differ by an ulp, would be amplified by Adam into
    updates near ``lr`` that no two implementations share (tests/helpers/models.py says the same)."""
    model = gpt(shape, target)
    for block in model.blocks:
        block.attn.qkv.bias = None
    return model


def batches(shape: dict[str, int], batch: int, n: int, target: Target) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [
        torch.randint(0, shape["vocab_size"], (batch, shape["seq_len"]), generator=gen).to(
            target.device
        )
        for _ in range(n)
    ]


def timed(step: Callable[[], None], steps: int, target: Target) -> tuple[float, int | None]:
    """Run ``step`` ``steps`` times: one warm-up (kernel compiles, allocator and pool
    growth), the peak reset, then the rest timed with a device sync around each. Returns the
    median seconds and the peak device bytes of the timed steps."""
    step()
    target.reset_peak()
    seconds = time_rounds({"step": step}, rounds=steps - 1, warmup=0, sync=target.sync)["step"]
    return seconds, target.peak_bytes()


def _torch_run(
    sizes: Sizes, target: Target, data: list[torch.Tensor], *, delayed: bool = False, **impl: Any
) -> tuple[Any, float, int | None]:
    """torch.optim.AdamW over ``data``; returns the trained weights, step seconds, peak.

    ``delayed``: overlap_step's semantics by hand (Note [delayed parameter update]): each
    forward sees weights one update behind the fp32 master; the master is returned."""
    model = _parity_gpt(sizes.parity_model, target)
    master = copy.deepcopy(model) if delayed else model
    opt = torch.optim.AdamW(
        master.parameters(), lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY, **impl
    )
    feed = iter(data)
    pending: list[torch.Tensor] = []

    def step() -> None:
        ids = next(feed)
        model(ids, ids).backward()
        if pending:
            with torch.no_grad():
                for p, q in zip(model.parameters(), pending, strict=True):
                    p.copy_(q)  # the previous step's update reaches the forward's weights
        if delayed:
            for p, q in zip(master.parameters(), model.parameters(), strict=True):
                p.grad, q.grad = q.grad, None
        opt.step()
        opt.zero_grad()
        if delayed:
            pending[:] = [p.detach().clone() for p in master.parameters()]

    seconds, peak = timed(step, len(data), target)
    return master, seconds, peak


def _ours_run(
    mode: str, sizes: Sizes, target: Target, data: list[torch.Tensor], workdir: Path
) -> tuple[Any, float, int | None]:
    """OffloadAdamW in ``mode`` over ``data``; the weights after ``close()`` (which publishes
    a pending delayed update and leaves offloaded parameters in place), step seconds, peak."""
    from zero_offload import (
        ActivationOffloadConfig,
        ActivationOffloader,
        OffloadAdamW,
        OffloadConfig,
        checkpoint,
    )

    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    model = _parity_gpt(sizes.parity_model, target)
    config: dict[str, Any] = {
        "bucket_bytes": sizes.bucket_bytes,
        "tile_elements": sizes.tile_elements,
    }
    extra: dict[str, Any] = {}
    if mode == "overlap_step":
        config["overlap_step"] = True
    elif mode == "param_offload":
        config["offload_parameters"] = True
        extra["model"] = model
    elif mode == "nvme":
        config.update(nvme_dir=str(workdir), host_budget=1)  # every bucket's state on disk
    opt = OffloadAdamW(
        model.parameters(),
        lr=LR,
        betas=BETAS,
        weight_decay=WEIGHT_DECAY,
        config=OffloadConfig(**config),
        accelerator=target.accelerator(),
        **extra,
    )
    offloader = None
    try:
        if mode == "activation_offload":
            shape = sizes.parity_model
            # One checkpointed block input per layer, fp32 (Note [pools sized for
            # checkpointed layers] in activation_sizes.py).
            layer_bytes = sizes.parity_batch * shape["seq_len"] * shape["hidden"] * 4
            offloader = ActivationOffloader(
                manager=opt.manager,
                config=ActivationOffloadConfig.for_checkpoints(
                    layer_bytes, shape["layers"], min_bytes=0
                ),
            )
            model.runner = lambda block, x: checkpoint(block, x, offloader=offloader)
        announce = mode == "announced"
        feed = iter(data)

        def step() -> None:
            ids = next(feed)
            loss = model(ids, ids)
            if announce:
                opt.backward(loss, step=True)
            else:
                loss.backward()
            opt.step()
            opt.zero_grad()

        seconds, peak = timed(step, len(data), target)
        if offloader is not None:
            stats = offloader.stats()
            if stats["offloaded_tensors"] == 0:
                raise RuntimeError("activation_offload: no activation was offloaded (a bug)")
    finally:
        opt.close()
        if offloader is not None:
            offloader.close()
    return model, seconds, peak


def _host_weights(model: Any) -> list[torch.Tensor]:
    """fp32 copies of ``model``'s weights in host memory, so the device holds one model at a
    time (each run's peak is its own)."""
    return [p.detach().to("cpu", torch.float32, copy=True) for p in model.parameters()]


def _max_abs_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b, strict=True))


def parity_run(mode: str, target: Target, sizes: Sizes, *, workdir: Path) -> ParityResult:
    """OffloadAdamW in ``mode`` against torch.optim.AdamW (default implementation) on the
    same fp32 GPT and batches; ``overlap_step`` against the same one-step delay by hand."""
    data = batches(sizes.parity_model, sizes.parity_batch, sizes.parity_steps, target)
    model, ours_s, ours_peak = _ours_run(mode, sizes, target, data, workdir)
    ours = _host_weights(model)
    del model
    target.release()
    model, torch_s, torch_peak = _torch_run(sizes, target, data, delayed=mode == "overlap_step")
    diff = _max_abs_diff(ours, _host_weights(model))
    del model
    target.release()
    return ParityResult(mode, len(data), diff, ours_s, torch_s, ours_peak, torch_peak)


def torch_spread(target: Target, sizes: Sizes) -> float:
    """Largest weight difference between torch's for-loop and fused AdamW on the parity
    run: float rounding's own spread, the yardstick of every parity row."""
    data = batches(sizes.parity_model, sizes.parity_batch, sizes.parity_steps, target)
    loop = _host_weights(_torch_run(sizes, target, data, foreach=False)[0])
    target.release()
    fused = _host_weights(_torch_run(sizes, target, data, fused=True)[0])
    target.release()
    return _max_abs_diff(loop, fused)


def step_comparison(
    config: Any,
    *,
    micro: int,
    batch: int,
    rounds: int,
    target: Target,
    variants: tuple[str, ...] = STEP_VARIANTS,
) -> dict[str, float]:
    """Median step seconds (and, on CUDA, peak device bytes) of each variant on a bf16
    ``TinyGPT(config)``, ``micro`` micro-batches of ``batch`` sequences a step: ``resident``
    is the no-offload loop (fp32 master weights and moments on the device, fused AdamW); the
    others are OffloadAdamW plain, announced and with ``overlap_step``. Peaks are reset
    after construction and one warm-up step. Ratios are against ``resident``."""
    from bench_offload_step import TorchMixed

    from zero_offload import OffloadAdamW, OffloadConfig

    unknown = set(variants) - set(STEP_VARIANTS)
    if "resident" not in variants or unknown:
        raise ValueError(
            f"variants must include 'resident' and come from {STEP_VARIANTS}, got {variants}"
        )
    shape = {k: getattr(config, k) for k in ("vocab_size", "seq_len", "layers", "hidden", "heads")}
    data = [batches(shape, batch, micro, target) for _ in range(rounds + 1)]
    out: dict[str, float] = {}
    for name in variants:
        target.release()
        model = gpt(shape, target, torch.bfloat16)
        if name == "resident":
            opt: Any = TorchMixed(model)
        else:
            opt = OffloadAdamW(
                model.parameters(),
                lr=1e-4,
                config=OffloadConfig(overlap_step=name == "offload_overlap_step"),
                accelerator=target.accelerator(),
            )
        out.setdefault("parameters", sum(p.numel() for p in model.parameters()))
        announce = name == "offload_announced"
        feed = iter(data)

        def step(
            model: Any = model,
            opt: Any = opt,
            name: str = name,
            announce: bool = announce,
            steps: Iterator[list[torch.Tensor]] = feed,
        ) -> None:
            for i, ids in enumerate(next(steps)):
                loss = model(ids, ids)
                if name == "resident":
                    loss.backward()
                else:
                    opt.backward(loss, step=announce and i == micro - 1)
            opt.step()
            opt.zero_grad()

        out[f"{name}_step_s"], peak = timed(step, rounds + 1, target)
        if peak is not None:
            out[f"{name}_peak_bytes"] = peak
        if name != "resident":
            opt.close()
        del model, opt, step
    for name in variants:
        if name != "resident":
            out[f"{name}_ratio"] = out[f"{name}_step_s"] / out["resident_step_s"]
    target.release()
    return out
