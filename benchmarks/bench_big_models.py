"""Big models: step time and bytes per tier for resident weights, parameter offload, and
parameter offload with the optimizer state on NVMe; and a scaled run of the north star.

    python benchmarks/bench_big_models.py [--quick] [--link BYTES_PER_S] [--nvme-dir DIR]
                                          [--north-star] [--rounds N]

Everything runs on the host accelerator with a simulated device-host link of ``--link``
bytes per second (default 2e8), a bf16 ``TinyGPT`` (``zero_offload.demo.model``) built on
the meta device and loaded from a safetensors checkpoint with ``zero_offload.load_pretrained``
(docs/big-models.md), AdamW on the host, the NVMe tier on ``--nvme-dir`` (default: a
temporary directory under the working directory, a real disk).

**Three configurations, one size where all three fit**, stepped in interleaved rounds after
two warm-up steps (so a neighbour's load hits all alike):

- ``resident``: the weights on the device, the state in host RAM (ZeRO-Offload);
- ``param offload``: ``offload_parameters=True``, units fetched ``prefetch_layers`` ahead;
- ``param offload + NVMe``: the same with ``nvme_dir`` and ``host_budget=0``: every bucket's
  master and moments on disk, streamed through the step, and every unit's training-dtype
  weights (its home) in a weight file, read ahead into the window's bounce buffers
  (docs/nvme.md).

Per configuration: p10/median/p90 seconds per step (forward, backward, step, copies
drained), its median over ``resident``'s, and the bytes per step across each boundary (H2D,
D2H, NVMe read, NVMe write, from the memory manager's counters). The NVMe row also gives its
disk throughput (read + write bytes over the step's median time) beside the disk's
``O_DIRECT`` roofline measured here (``bench_nvme.Roofline``: the same bytes read and
written with reads and writes in flight together): a step also computes, so the ratio is a
lower bound on how much of the disk the tier uses.

**``--north-star``** (issue 23): a model whose optimizer state is 8x the host budget and
whose weights are 20x the device budget, built on meta from its checkpoint, parameter
offload with the parameters and the state on NVMe (the host budget, 1.5 bytes per
parameter, holds the first buckets' homes; every other home and all the state are in files),
trained 10 steps and compared bitwise (losses and final weights, ``torch.equal``) with the
same model trained with everything resident (weights on an unlimited device, state in RAM).
The device peak (the accelerator's ledger), the host peak (every byte the accelerator
pinned, live at once) and the disk bytes (the files in ``nvme_dir``) are printed beside the
estimator's figures for that shape (``home_tiers`` and ``param_offload_bytes``,
docs/estimator.md), with the bytes read from and written to the weight files per step.

Writes ``benchmarks/results/bench_big_models.json``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import weakref
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import machine, spread, write_json

import zero_offload
from zero_offload import OffloadAdamW, OffloadConfig
from zero_offload.accelerator.host import HostAccelerator
from zero_offload.config import AcceleratorConfig, format_bytes
from zero_offload.demo.model import GPTConfig, TinyGPT
from zero_offload.memory.traffic import Category, Direction

VOCAB, SEQ, BATCH, HEADS = 256, 32, 4, 4
BOUNDARIES = {
    "h2d": Direction.H2D,
    "d2h": Direction.D2H,
    "nvme_read": Direction.NVME_READ,
    "nvme_write": Direction.NVME_WRITE,
}


class CountingAccelerator(HostAccelerator):
    """The host accelerator, counting the host bytes it hands out that are alive at once
    (pinned homes, staging, the NVMe tier's I/O buffers): the host peak."""

    def __init__(self, config: AcceleratorConfig) -> None:
        super().__init__(config)
        self.host_live = 0
        self.host_peak = 0

    def allocate_host(self, nbytes: int, *, pinned: bool = True) -> torch.Tensor:
        tensor = super().allocate_host(nbytes, pinned=pinned)
        self.host_live += nbytes
        self.host_peak = max(self.host_peak, self.host_live)
        weakref.finalize(tensor, self._freed, nbytes)
        return tensor

    def _freed(self, nbytes: int) -> None:
        self.host_live -= nbytes


def _config(layers: int, hidden: int) -> GPTConfig:
    return GPTConfig(vocab_size=VOCAB, seq_len=SEQ, layers=layers, hidden=hidden, heads=HEADS)


def save_checkpoint(layers: int, hidden: int, directory: Path) -> Path:
    """A bf16 ``TinyGPT``'s weights as one safetensors file (what a hub checkpoint is)."""
    torch.manual_seed(0)
    model = TinyGPT(_config(layers, hidden)).to(torch.bfloat16)
    path = directory / "model.safetensors"
    # Tied weights are stored once, as transformers does; load_pretrained matches any name.
    seen: set[int] = set()
    tensors = {}
    for name, tensor in model.state_dict().items():
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            tensors[name] = tensor.contiguous()
    save_file(tensors, str(path))
    return path


def build(
    layers: int,
    hidden: int,
    checkpoint: Path,
    *,
    budget: int | str,
    link: float | None,
    offload: bool,
    nvme_dir: Path | None = None,
    from_meta: bool = True,
) -> tuple[TinyGPT, OffloadAdamW, CountingAccelerator]:
    """The model built on meta and loaded from ``checkpoint`` (or loaded normally when
    ``from_meta`` is False), and its optimizer."""
    if from_meta:
        with torch.device("meta"):
            model = TinyGPT(_config(layers, hidden)).to(torch.bfloat16)
        zero_offload.load_pretrained(model, checkpoint)
    else:
        from safetensors.torch import load_file

        model = TinyGPT(_config(layers, hidden)).to(torch.bfloat16)
        model.load_state_dict(load_file(str(checkpoint)), strict=False)
    accelerator = CountingAccelerator(AcceleratorConfig(device_budget=budget, link_bandwidth=link))
    config = OffloadConfig(
        bucket_bytes="1MiB",
        offload_parameters=offload,
        prefetch_layers=1,
        **({"nvme_dir": nvme_dir, "host_budget": 0} if nvme_dir is not None else {}),
    )
    extra = {"model": model, "layers": model.blocks} if offload else {}
    opt = OffloadAdamW(model.parameters(), lr=1e-3, config=config, accelerator=accelerator, **extra)
    return model, opt, accelerator


def train_step(model: TinyGPT, opt: OffloadAdamW, ids: torch.Tensor) -> float:
    loss = model(ids, ids)
    loss.backward()
    opt.step()
    opt.zero_grad()
    opt.manager.synchronize()  # the step's copies are part of its time
    return loss.detach().item()


def compare(args: argparse.Namespace, root: Path) -> dict[str, object]:
    layers, hidden = (4, 128) if args.quick else (8, 512)
    checkpoint = save_checkpoint(layers, hidden, root)
    nvme = root / "nvme"
    runs = {
        "resident": build(layers, hidden, checkpoint, budget="8GiB", link=args.link, offload=False),
        "param offload": build(
            layers, hidden, checkpoint, budget="8GiB", link=args.link, offload=True
        ),
        "param offload + NVMe": build(
            layers, hidden, checkpoint, budget="8GiB", link=args.link, offload=True, nvme_dir=nvme
        ),
    }
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen) for _ in range(4)]
    times: dict[str, list[float]] = {name: [] for name in runs}
    moved: dict[str, dict[str, list[int]]] = {
        name: {key: [] for key in BOUNDARIES} for name in runs
    }
    rounds = 3 if args.quick else args.rounds
    for i in range(2 + rounds):
        ids = batches[i % len(batches)]
        for name, (model, opt, _) in runs.items():
            before = {k: opt.manager.counters.bytes(d) for k, d in BOUNDARIES.items()}
            t0 = time.perf_counter()
            train_step(model, opt, ids)
            elapsed = time.perf_counter() - t0
            if i >= 2:  # two warm-up steps: the forward order is learned, kernels compiled
                times[name].append(elapsed)
                for key, direction in BOUNDARIES.items():
                    moved[name][key].append(opt.manager.counters.bytes(direction) - before[key])
    rows = []
    resident_median = statistics.median(times["resident"])
    for name, (_, opt, accelerator) in runs.items():
        row: dict[str, object] = {"config": name, **spread(times[name])}
        row["ratio_to_resident"] = row["median"] / resident_median  # type: ignore[operator]
        row.update({k: int(statistics.median(v)) for k, v in moved[name].items()})
        row["device_peak"] = accelerator.memory_stats()["peak"]
        row["host_peak"] = accelerator.host_peak
        rows.append(row)
        opt.close()
    nvme_row = rows[-1]
    disk_bytes = int(nvme_row["nvme_read"]) + int(nvme_row["nvme_write"])  # type: ignore[call-overload]
    roofline = _roofline(root, max(int(nvme_row["nvme_read"]), 1 << 20))  # type: ignore[call-overload]
    ours = disk_bytes / float(nvme_row["median"])  # type: ignore[arg-type]
    return {
        "layers": layers,
        "hidden": hidden,
        "params": sum(p.numel() for p in TinyGPT(_config(layers, hidden)).parameters()),
        "link_bytes_per_s": args.link,
        "rows": rows,
        "disk": {
            "step_bytes_per_s": ours,
            "roofline_bytes_per_s": roofline,
            "ratio_to_roofline": ours / roofline,
        },
    }


def _roofline(root: Path, total: int) -> float:
    """Bytes per second of the disk reading and writing ``total`` bytes each with ``O_DIRECT``
    (``bench_nvme.Roofline.overlapped``), median of three after one warm-up."""
    from bench_nvme import Roofline

    from zero_offload.memory.storage import IO_ALIGNMENT

    total = -(-total // IO_ALIGNMENT) * IO_ALIGNMENT
    line = Roofline(root, total, record_bytes=min(total, 4 << 20))
    try:
        line.overlapped()
        samples = []
        for _ in range(3):
            t0 = time.perf_counter()
            line.overlapped()
            samples.append(time.perf_counter() - t0)
    finally:
        line.close()
    return 2 * total / statistics.median(samples)


def north_star(args: argparse.Namespace, root: Path) -> dict[str, object]:
    """Issue 23's scaled proof: state 8x the host budget, weights 20x the device budget."""
    from zero_offload.estimate.pools import param_offload_bytes
    from zero_offload.estimate.rows import Context
    from zero_offload.estimate.shape import ModelShape
    from zero_offload.estimate.subjects import ShapeSubject
    from zero_offload.estimate.tiered import home_tiers

    layers, hidden = (120, 64) if args.quick else (120, 192)
    steps = 10  # the count, --quick too (its model is small)
    checkpoint = save_checkpoint(layers, hidden, root)
    probe = TinyGPT(_config(layers, hidden))
    params = sum(p.numel() for p in probe.parameters())
    weight_bytes, state_bytes = 2 * params, 12 * params  # bf16 weights; fp32 master, m, v
    device_budget, host_budget = weight_bytes // 20, state_bytes // 8
    nvme = root / "north-star-nvme"
    model, opt, accelerator = _build_north_star(
        layers, hidden, checkpoint, device_budget, host_budget, nvme
    )
    construction = opt.construction_peaks
    ref_model, ref_opt, _ = build(
        layers, hidden, checkpoint, budget="64GiB", link=None, offload=False, from_meta=False
    )
    homes_on_disk = sum(1 for b in opt.buckets if getattr(b.store, "home", None) is not None)
    counters = opt.manager.counters
    read0 = counters.bytes(Direction.NVME_READ, Category.WEIGHTS)
    written0 = counters.bytes(Direction.NVME_WRITE, Category.WEIGHTS)
    gen = torch.Generator().manual_seed(2)
    losses, ref_losses = [], []
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
        losses.append(train_step(model, opt, ids))
        ref_losses.append(train_step(ref_model, ref_opt, ids))
    weights_read = (counters.bytes(Direction.NVME_READ, Category.WEIGHTS) - read0) // steps
    weights_written = (counters.bytes(Direction.NVME_WRITE, Category.WEIGHTS) - written0) // steps
    disk = sum(f.stat().st_size for f in nvme.rglob("*") if f.is_file())
    # Read every weight (a released parameter fetches its unit when read).
    bitwise = losses == ref_losses and all(
        torch.equal(a.detach().clone(), b.detach())
        for a, b in zip(model.parameters(), ref_model.parameters(), strict=True)
    )
    shape = ModelShape(layers=layers, hidden=hidden, heads=HEADS, vocab=VOCAB, seq_len=SEQ)
    ctx = Context(itemsize=2, world_size=1, ranks_per_node=1, bucket_bytes=1 << 20)
    subject = ShapeSubject(shape, ctx)
    groups = subject.unit_groups()
    assert groups is not None
    est_host, est_disk = home_tiers(groups, ctx, host_budget, prefetch_layers=0)
    window, grad_buffers, _ = param_offload_bytes(
        shape, itemsize=2, bucket_bytes=1 << 20, prefetch_layers=0
    )
    result = {
        "layers": layers,
        "hidden": hidden,
        "params": params,
        "weight_bytes": weight_bytes,
        "state_bytes": state_bytes,
        "device_budget": device_budget,
        "host_budget": host_budget,
        "steps": steps,
        "bitwise_equal_to_resident": bitwise,
        "buckets": len(opt.buckets),
        "buckets_with_homes_on_nvme": homes_on_disk,
        "weight_file_bytes_read_per_step": weights_read,
        "weight_file_bytes_written_per_step": weights_written,
        "device_peak": accelerator.memory_stats()["peak"],
        "host_peak": accelerator.host_peak,
        "disk_bytes": disk,
        "construction_peaks": {"device": construction.device, "host": construction.host},
        "estimate": {"device": window + grad_buffers, "host": est_host, "disk": est_disk},
    }
    opt.close()
    ref_opt.close()
    return result


def _build_north_star(
    layers: int, hidden: int, checkpoint: Path, device_budget: int, host_budget: int, nvme: Path
) -> tuple[TinyGPT, OffloadAdamW, CountingAccelerator]:
    with torch.device("meta"):
        model = TinyGPT(_config(layers, hidden)).to(torch.bfloat16)
    zero_offload.load_pretrained(model, checkpoint)
    accelerator = CountingAccelerator(AcceleratorConfig(device_budget=device_budget))
    config = OffloadConfig(
        bucket_bytes="1MiB",
        offload_parameters=True,
        prefetch_layers=0,  # a window of two units: weights 20x the device budget
        nvme_dir=nvme,
        host_budget=host_budget,
    )
    opt = OffloadAdamW(
        model.parameters(),
        lr=1e-3,
        config=config,
        accelerator=accelerator,
        model=model,
        layers=model.blocks,
    )
    return model, opt, accelerator


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, a few rounds")
    parser.add_argument("--link", type=float, default=2e8, help="simulated link, bytes/s")
    parser.add_argument("--rounds", type=int, default=15, help="measured rounds")
    parser.add_argument("--nvme-dir", type=Path, default=None, help="a directory on the disk")
    parser.add_argument("--north-star", action="store_true", help="also the scaled north star")
    args = parser.parse_args()
    base = args.nvme_dir if args.nvme_dir is not None else Path.cwd()
    base.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="bench_big_models.", dir=base))
    try:
        result: dict[str, object] = {"machine": machine(), "compare": compare(args, root)}
        if args.north_star:
            result["north_star"] = north_star(args, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    report(result)
    write_json("bench_big_models", result)


def report(result: dict[str, object]) -> None:
    comp = result["compare"]
    assert isinstance(comp, dict)
    print(
        f"TinyGPT bf16, {comp['layers']} layers x {comp['hidden']}, "
        f"{comp['params'] / 1e6:.2f}M parameters, link {comp['link_bytes_per_s'] / 1e6:.0f} MB/s"
    )
    print(
        f"{'config':<22} {'p10 s':>7} {'median':>7} {'p90 s':>7} {'x res':>6} "
        f"{'H2D':>9} {'D2H':>9} {'NVMe rd':>9} {'NVMe wr':>9} {'dev peak':>9} {'host pk':>9}"
    )
    for row in comp["rows"]:
        print(
            f"{row['config']:<22} {row['p10']:>7.3f} {row['median']:>7.3f} {row['p90']:>7.3f} "
            f"{row['ratio_to_resident']:>6.2f} "
            + " ".join(f"{format_bytes(row[k]):>9}" for k in BOUNDARIES)
            + f" {format_bytes(row['device_peak']):>9} {format_bytes(row['host_peak']):>9}"
        )
    disk = comp["disk"]
    print(
        f"NVMe step: {disk['step_bytes_per_s'] / 1e6:.0f} MB/s read+write; O_DIRECT roofline "
        f"{disk['roofline_bytes_per_s'] / 1e6:.0f} MB/s; ratio {disk['ratio_to_roofline']:.2f}"
    )
    star = result.get("north_star")
    if isinstance(star, dict):
        print(
            f"\nnorth star (scaled): {star['params'] / 1e6:.2f}M parameters, weights "
            f"{format_bytes(star['weight_bytes'])} = 20x device budget "
            f"{format_bytes(star['device_budget'])}, state {format_bytes(star['state_bytes'])} "
            f"= 8x host budget {format_bytes(star['host_budget'])}; {star['steps']} steps "
            f"bitwise equal to resident: {star['bitwise_equal_to_resident']}"
        )
        est = star["estimate"]
        for what, measured in (
            ("device", star["device_peak"]),
            ("host", star["host_peak"]),
            ("disk", star["disk_bytes"]),
        ):
            print(
                f"  {what:<7} measured {format_bytes(measured):>10}   "
                f"estimated {format_bytes(est[what]):>10}"
            )
        print(
            f"  homes on NVMe: {star['buckets_with_homes_on_nvme']} of {star['buckets']} "
            f"buckets; weight files read {format_bytes(star['weight_file_bytes_read_per_step'])}"
            f" and written {format_bytes(star['weight_file_bytes_written_per_step'])} per step"
        )
        # host_budget bounds the homes and the master and moments in RAM, not the host peak:
        # the gradient staging, the NVMe I/O buffers and the rings are on top (docs/nvme.md).
        print(
            f"  host peak = {star['host_peak'] / star['host_budget']:.1f}x the host budget "
            "(which bounds the homes and the state kept in RAM; gradient staging, NVMe I/O "
            "buffers and the bounce ring are on top, docs/nvme.md)"
        )
        cons = star["construction_peaks"]
        print(
            f"  construction peaks: device {format_bytes(cons['device'])}, "
            f"host {format_bytes(cons['host'])}"
        )


if __name__ == "__main__":
    main()
