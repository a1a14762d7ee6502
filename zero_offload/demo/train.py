"""``zero-offload demo``: train TinyGPT on the generated corpus with OffloadAdamW, profiled.

The device budget is set below what the model needs without offload, so the run shows
offload doing its job: the budget, the need with and without offload, a progress line per
step (loss, tokens/s, exposed transfer time), then the loss drop, the traffic report, and
the files written (Chrome trace, JSON summary, and a plot when matplotlib is installed).

Under ``torchrun --nproc_per_node=N`` it joins the process group from torchrun's
environment (gloo on the host accelerator, NCCL on CUDA), gives each rank an equal share
of every global batch, partitions the optimizer state over the ranks (ZeRO stage 2 with
offload), and prints and writes files from rank 0 only.
"""

from __future__ import annotations

import math
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..accelerator import Accelerator, CudaAccelerator, HostAccelerator, choose_accelerator
from ..activation_sizes import checkpoint_pool_bytes
from ..config import AcceleratorConfig, OffloadConfig, format_bytes
from ..estimate import offload_adamw_bytes
from ..optim import OffloadAdamW
from ..profiling import profile
from .corpus import CharCorpus
from .model import GPTConfig, TinyGPT

__all__ = ["DemoConfig", "DemoResult", "run_demo"]

_KIB = 1024


@dataclass(frozen=True)
class DemoConfig:
    """Settings of the demo run (the command's flags).

    Attributes:
        steps: optimizer steps. >= 1. Default 100.
        layers, hidden, heads: model shape (``hidden`` a multiple of ``heads``).
        batch: sequences per step. seq_len: characters per sequence.
        lr: peak learning rate (linear warm-up over the first 10% of steps, cosine decay
            to a tenth of it). Default 3e-3.
        offload_fraction: share of parameters whose optimizer state lives on the host, in
            [0, 1]. Default 1.0.
        activation_offload: checkpoint each block and keep its input on the host.
        device_budget: bytes of device memory the library may use; ``None`` picks one below
            what training without offload would need.
        bucket_bytes: gradient bytes per bucket (small, so the model has several buckets).
        link_bandwidth: simulated link for the host accelerator, bytes/s (``None``: none).
        out: folder for the trace, plot and JSON. seed: model init and batch order.
    """

    steps: int = 100
    layers: int = 3
    hidden: int = 128
    heads: int = 4
    batch: int = 16
    seq_len: int = 64
    lr: float = 3e-3
    offload_fraction: float = 1.0
    activation_offload: bool = True
    device_budget: int | None = None
    bucket_bytes: int = 256 * _KIB
    link_bandwidth: float | None = None
    out: Path = Path("zero-offload-demo")
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("steps", "layers", "hidden", "heads", "batch", "seq_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be an int >= 1, got {value!r}")
        if self.hidden % self.heads:
            raise ValueError(
                f"--hidden {self.hidden} must be a multiple of the {self.heads} attention heads"
            )
        if not 0.0 <= self.offload_fraction <= 1.0:
            raise ValueError(f"--offload-fraction must be in [0, 1], got {self.offload_fraction}")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"--lr must be a finite number > 0, got {self.lr}")
        if self.device_budget is not None and self.device_budget <= 0:
            raise ValueError(f"--device-budget must be > 0 bytes, got {self.device_budget}")


@dataclass
class DemoResult:
    """What the run produced: per-step losses and the files written."""

    losses: list[float] = field(default_factory=list)
    seconds: float = 0.0
    files: dict[str, Path] = field(default_factory=dict)
    profile: dict[str, Any] = field(default_factory=dict)
    activation_offload: str = ""

    @property
    def loss_drop(self) -> tuple[float, float]:
        """Mean loss of the first and of the last few steps."""
        k = max(1, min(5, len(self.losses) // 4))
        return sum(self.losses[:k]) / k, sum(self.losses[-k:]) / k


#: torchrun's environment variables that a multi-rank demo needs.
_TORCHRUN_ENV = ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class _Ranks:
    """This process's place in the run: one rank unless launched by torchrun."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0


def _ranks_from_env(batch: int) -> _Ranks:
    """Read torchrun's environment; refuse an incomplete one or an unsplittable batch."""
    world = os.environ.get("WORLD_SIZE", "1").strip() or "1"
    if world == "1":
        return _Ranks()
    missing = [name for name in _TORCHRUN_ENV if not os.environ.get(name)]
    rank = os.environ.get("RANK", "?")
    if missing or not world.isdigit():
        raise ValueError(
            f"rank {rank}: WORLD_SIZE={world} but {', '.join(missing) or 'WORLD_SIZE'} is "
            "not set: launch the multi-rank demo with torchrun "
            "(torchrun --nproc_per_node=2 -m zero_offload demo ...)"
        )
    ranks = _Ranks(int(rank), int(world), int(os.environ["LOCAL_RANK"]))
    if batch % ranks.world_size:
        raise ValueError(
            f"rank {ranks.rank}: --batch {batch} must be a multiple of the {ranks.world_size} "
            "ranks (each rank trains on an equal share of every global batch)"
        )
    return ranks


def _join_process_group(ranks: _Ranks, accelerator_name: str) -> None:
    """gloo on the host accelerator, NCCL on CUDA; the group's timeout is the optimizer's
    collective deadline (Note [collective deadlines] in ``collectives.py``)."""
    backend = "nccl" if accelerator_name == "cuda" else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(ranks.local_rank)
    dist.init_process_group(backend, timeout=timedelta(seconds=OffloadConfig().collective_timeout))


def _accelerator(budget: int, link_bandwidth: float | None) -> Accelerator:
    name, _ = choose_accelerator()
    if name == "cuda":
        return CudaAccelerator(AcceleratorConfig(device_budget=budget))
    return HostAccelerator(AcceleratorConfig(device_budget=budget, link_bandwidth=link_bandwidth))


def _lr_at(step: int, config: DemoConfig) -> float:
    warmup = max(1, config.steps // 10)
    if step < warmup:
        return config.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, config.steps - warmup)
    return config.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


def _activation_pool_bytes(config: DemoConfig, itemsize: int) -> tuple[int, int]:
    """Host and device pool bytes for the block inputs that checkpointing keeps, as
    ``ActivationOffloadConfig.for_checkpoints`` sizes them (Note [pools sized for
    checkpointed layers] in activation_sizes.py; prefetch depth 1)."""
    per_layer = config.batch * config.seq_len * config.hidden * itemsize
    return checkpoint_pool_bytes(per_layer, config.layers)


def _model_state_bytes(model: nn.Module) -> int:
    """Bytes of weights, gradients and two Adam moments without offload (fp32: 16 per param)."""
    return sum(p.numel() * (2 * p.element_size() + 8) for p in model.parameters())


class _ActivationOffload:
    """Wires ``zero_offload.activations.checkpoint`` into the model, when that package exists."""

    def __init__(self, optimizer: OffloadAdamW, config: DemoConfig, itemsize: int) -> None:
        self.offloader: Any = None  # an ActivationOffloader when on
        self._checkpoint: Callable[..., Any] | None = None  # activations.checkpoint when on
        self.status = "off (--no-activation-offload)"
        self.device_pool_bytes = 0
        if not config.activation_offload:
            return
        try:
            from ..activations import ActivationOffloadConfig, ActivationOffloader, checkpoint
        except ImportError:
            self.status = "not available (zero_offload.activations is missing)"
            return
        host_bytes, device_bytes = _activation_pool_bytes(config, itemsize)
        self.offloader = ActivationOffloader(
            manager=optimizer.manager,
            config=ActivationOffloadConfig(
                min_bytes=0, host_pool_bytes=host_bytes, device_pool_bytes=device_bytes
            ),
        )
        self.device_pool_bytes = device_bytes
        self._checkpoint = checkpoint
        self.status = (
            f"on: each block's input checkpointed to host ({format_bytes(host_bytes)} host "
            f"pool, {format_bytes(device_bytes)} device pool for prefetch)"
        )

    def runner(self) -> Callable[[nn.Module, torch.Tensor], torch.Tensor] | None:
        offloader, checkpoint = self.offloader, self._checkpoint
        if offloader is None or checkpoint is None:
            return None
        return lambda block, x: checkpoint(block, x, offloader=offloader)

    def close(self) -> None:
        if self.offloader is not None:
            self.offloader.close()


def _default_budget(model: nn.Module, config: DemoConfig, itemsize: int) -> int:
    """OffloadAdamW's device pools (exact) and the activation pool, with 25% to spare."""
    shapes = [tuple(p.shape) for p in model.parameters()]
    weights, grad_buffers, _ = offload_adamw_bytes(
        shapes, itemsize=itemsize, bucket_bytes=config.bucket_bytes
    )
    numel = sum(p.numel() for p in model.parameters())
    resident_state = int((1.0 - config.offload_fraction) * numel * 16)  # fp32 master, m, v, grad
    _, activations = _activation_pool_bytes(config, itemsize)
    need = weights + grad_buffers + resident_state
    need += activations if config.activation_offload else 0
    return max(int(need * 1.25), need + 256 * _KIB)


def run_demo(config: DemoConfig, *, echo: Callable[[str], None] = print) -> DemoResult:
    """Train, print progress and the report, write the files; returns what was measured.

    Under torchrun: every rank trains, rank 0 alone prints and writes the files."""
    ranks = _ranks_from_env(config.batch)
    if ranks.rank == 0:  # the one that writes the files: refused before training, not after
        _check_out(config.out)
    if ranks.world_size > 1:
        _join_process_group(ranks, choose_accelerator()[0])
        if ranks.rank != 0:
            echo = _silent
    try:
        return _run(config, ranks, echo)
    finally:
        if ranks.world_size > 1:
            dist.destroy_process_group()


def _check_out(out: Path) -> None:
    """Create ``out`` and write a file in it, so that a folder the run cannot write is
    refused now, naming ``--out``, rather than after every step has trained."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as exc:
        raise ValueError(
            f"--out {str(out)!r} is not a folder the demo can write its files to "
            f"({exc.strerror or exc}); give one that can be created and written, e.g. "
            f"--out {DemoConfig.out}"
        ) from exc


def _silent(line: str) -> None:
    """The echo of ranks other than 0."""


def _run(config: DemoConfig, ranks: _Ranks, echo: Callable[[str], None]) -> DemoResult:
    torch.manual_seed(config.seed)
    corpus = CharCorpus.build(seed=config.seed)
    shape = GPTConfig(
        vocab_size=corpus.vocab_size,
        seq_len=config.seq_len,
        layers=config.layers,
        hidden=config.hidden,
        heads=config.heads,
    )
    model = TinyGPT(shape)
    itemsize = 4  # fp32 training: the demo compares against torch's defaults
    budget = config.device_budget or _default_budget(model, config, itemsize)
    acc = _accelerator(budget, config.link_bandwidth)
    model.to(acc.device)
    no_offload = _model_state_bytes(model)
    echo(
        f"zero-offload demo: TinyGPT, {config.layers} x {config.hidden} hidden "
        f"({model.parameter_count():,} parameters, fp32) on {acc.name} ({acc.device}), "
        f"corpus {len(corpus.text):,} characters, {corpus.vocab_size} symbols"
        + (
            f", {ranks.world_size} ranks ({config.batch // ranks.world_size} sequences each)"
            if ranks.world_size > 1
            else ""
        )
    )
    optimizer = OffloadAdamW(
        model.parameters(),
        lr=config.lr,
        weight_decay=0.01,
        accelerator=acc,
        config=OffloadConfig(
            bucket_bytes=config.bucket_bytes, offload_fraction=config.offload_fraction
        ),
    )
    activations = _ActivationOffload(optimizer, config, itemsize)
    model.runner = activations.runner() or model.runner
    in_use = acc.memory_stats()["in_use"]
    verdict = "does not fit: offload needed" if no_offload > budget else "would fit"
    echo(
        f"device budget {format_bytes(budget)}; without offload the model states alone need "
        f"{format_bytes(no_offload)} ({verdict}); with OffloadAdamW the library holds "
        f"{format_bytes(in_use)} ({len(optimizer.buckets)} buckets, offload_fraction "
        f"{config.offload_fraction})"
    )
    echo(f"activation offload: {activations.status}")
    result = DemoResult(activation_offload=activations.status)
    try:
        result = _train(model, optimizer, corpus, config, ranks, echo, result)
    finally:
        activations.close()
        optimizer.close()
    return result


def _train(
    model: TinyGPT,
    optimizer: OffloadAdamW,
    corpus: CharCorpus,
    config: DemoConfig,
    ranks: _Ranks,
    echo: Callable[[str], None],
    result: DemoResult,
) -> DemoResult:
    generator = torch.Generator().manual_seed(config.seed)
    device = optimizer.accelerator.device
    manager = optimizer.manager
    tokens = config.batch * config.seq_len
    began = time.perf_counter()
    with profile(optimizer) as prof:
        for step in range(config.steps):
            started = time.perf_counter()
            exposed_before = sum(manager.exposed_seconds.values())
            for group in optimizer.param_groups:
                group["lr"] = _lr_at(step, config)
            # Every rank draws the same global batch (same seed) and trains on its share.
            inputs, targets = corpus.batch(generator, batch=config.batch, seq_len=config.seq_len)
            share = config.batch // ranks.world_size
            rows = slice(ranks.rank * share, (ranks.rank + 1) * share)
            loss = model(inputs[rows].to(device), targets[rows].to(device))
            optimizer.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            value = _global_mean(loss, ranks)  # synchronisation point: the progress line
            prof.step()
            if not math.isfinite(value):
                raise RuntimeError(f"loss became {value} at step {step + 1}; lower --lr")
            result.losses.append(value)
            seconds = time.perf_counter() - started
            exposed = sum(manager.exposed_seconds.values()) - exposed_before
            echo(
                f"step {step + 1:>4}/{config.steps}  loss {value:.4f}  "
                f"{tokens / seconds:>9,.0f} tokens/s  exposed transfers {exposed * 1e3:6.2f} ms"
            )
    result.seconds = time.perf_counter() - began
    first, last = result.loss_drop
    echo(
        f"\nloss {first:.3f} -> {last:.3f} ({(last - first) / first:+.0%}) in "
        f"{config.steps} steps, {result.seconds:.1f} s\n"
    )
    result.profile = prof.to_dict()
    if ranks.rank == 0:
        echo(f'sample after training: "{_sample(model, corpus, device)}"\n')
        echo(prof.report())
        result.files = _write_outputs(prof, config.out, echo)
    return result


def _global_mean(loss: torch.Tensor, ranks: _Ranks) -> float:
    """The loss over the whole global batch (the mean of the ranks' equal shares)."""
    value = loss.detach().float().reshape(1).clone()
    if ranks.world_size > 1:
        dist.all_reduce(value)
        value /= ranks.world_size
    return float(value.item())


@torch.no_grad()
def _sample(model: TinyGPT, corpus: CharCorpus, device: torch.device, length: int = 60) -> str:
    """Greedy continuation of "The " (the blocks run plainly: nothing to save for backward)."""
    runner, model.runner = model.runner, lambda block, x: block(x)
    try:
        ids = torch.tensor([[corpus.alphabet.index(c) for c in "The "]], device=device)
        for _ in range(length):
            logits = model(ids[:, -model.config.seq_len :])
            ids = torch.cat([ids, logits[:, -1:].argmax(-1)], dim=1)
    finally:
        model.runner = runner
    return corpus.decode(ids.cpu()).replace("\n", " / ")


def _write_outputs(prof: Any, out: Path, echo: Callable[[str], None]) -> dict[str, Path]:
    out.mkdir(parents=True, exist_ok=True)
    files = {"trace": prof.export_chrome_trace(out / "trace.json")}
    prof.to_json(out / "profile.json")
    files["json"] = out / "profile.json"
    echo(f"\nChrome trace: {files['trace']} (open in https://ui.perfetto.dev or chrome://tracing)")
    echo(f"profile JSON: {files['json']}")
    try:
        files["plot"] = prof.plot(out / "traffic.png")
        echo(f"plot: {files['plot']}")
    except ImportError as exc:
        echo(f"plot: skipped ({exc})")
    return files
