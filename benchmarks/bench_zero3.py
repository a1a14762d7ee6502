"""ZeRO-3 with parameter offload at 1, 2 and 4 gloo ranks, side by side with FSDP2 and
DeepSpeed ZeRO-3.

    python benchmarks/bench_zero3.py [--quick] [--rounds N] [--worlds 1 2 4]

An fp32 GPT-style model (``TinyGPT``) trains on random tokens, global batch 8, each rank
(a process joined over gloo on 127.0.0.1) on its equal share. Under a per-rank device
budget of half the model's weights, ours needs stage 3: stage 2 keeps the whole weights on
the device and is refused at that budget (checked at world size 1, shown in the header).
At each world size, in the same processes, one model each, the same initial weights,
batches and AdamW hyper-parameters (``_runs.LR``, ``BETAS``, ``WEIGHT_DECAY``):

- ``ours``: ``OffloadAdamW`` with ``OffloadConfig(offload_parameters=True)`` on the host
  accelerator under the budget (ZeRO-3 with offload on several ranks, one rank unsharded);
- ``fsdp2``: ``fully_shard`` on each of the same units (token and position embeddings,
  each block, final norm, head) and the root, ``torch.optim.AdamW``;
- ``fsdp2_cpu_offload``: the same with ``CPUOffloadPolicy(pin_memory=False)`` (pinning needs
  CUDA);
- ``deepspeed``: ZeRO stage 3 with ``offload_param`` and ``offload_optimizer`` on the CPU,
  where DeepSpeed imports; otherwise the table says "not installed".

Timing: warm-up rounds, then interleaved rounds (each round one training step of every
implementation, ``_common.time_samples``) with a barrier before the clock starts and
before it stops, so a sample is the slowest rank's step; p10 / median / p90. Per rank and
per step: collective bytes (ours: its own counters, ``opt.comm.counters``; the others: what
their calls to torch.distributed's all-gather, reduce-scatter and all-reduce move, counted
on the way in; all-gather counts the gathered bytes, reduce-scatter its input, as ours
does), and ours' host-device copies (H2D weights, D2H gradients, its manager's counters;
FSDP2 on the CPU has no device to copy to). Per rank: ours' device peak is the accelerator ledger's (library-owned device bytes:
the window of gathered units and the gradient buffers; activations are not counted, and on
the host accelerator they are ordinary memory); its host bytes are its pinned pools (fp32
master, moments and gradient staging, its shard). FSDP2 runs on the CPU here, so it has no
device: its row gives the bytes of its sharded parameters, gradients and AdamW state per
rank, measured from their local shards (on a GPU FSDP2 keeps them on the device, with
CPUOffloadPolicy on the host), and the largest unit it gathers whole. Losses: the global
batch's loss at every step (the mean of the ranks' losses on equal shares), compared
between every pair. All ranks share this machine's cores: the step times at 2 and 4 ranks
measure overhead, not speed-up.
"""

from __future__ import annotations

import abc
import argparse
import importlib.util
import itertools
import os
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import join_gloo, machine, spawn_ranks, spread, time_samples, write_json
from _runs import BETAS, LR, WEIGHT_DECAY

from zero_offload import AcceleratorConfig, HostAccelerator, OffloadAdamW, OffloadConfig
from zero_offload.demo.model import GPTConfig, TinyGPT
from zero_offload.errors import DeviceBudgetExceeded
from zero_offload.memory.traffic import Category, Direction

SIZES = {
    "quick": GPTConfig(vocab_size=512, seq_len=32, layers=8, hidden=96, heads=4),
    "full": GPTConfig(vocab_size=2048, seq_len=64, layers=8, hidden=256, heads=4),
}
GLOBAL_BATCH = 8  # 1, 2 and 4 ranks get equal shares
#: The per-rank device budget, a fraction of the model's fp32 weights: stage 2 does not fit.
BUDGET_FRACTION = 0.5
BUCKET_BYTES = 256 * 1024
IMPLS = ("ours", "fsdp2", "fsdp2_cpu_offload", "deepspeed")
COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce")
COPIES = ("h2d_weights", "d2h_gradients")
MiB = 1 << 20


def _model(shape: GPTConfig) -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(shape)


def _units(model: TinyGPT) -> list[torch.nn.Module]:
    """The modules ours makes units of (docs/parameter-offload.md), in forward order."""
    return [model.tokens, model.positions, *model.blocks, model.norm, model.head]


def _budget(shape: GPTConfig) -> int:
    weights = sum(p.numel() * p.element_size() for p in _model(shape).parameters())
    return int(BUDGET_FRACTION * weights)


def _batches(shape: GPTConfig, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        ids = torch.randint(0, shape.vocab_size, (GLOBAL_BATCH, shape.seq_len), generator=gen)
        out.append((ids, (ids * 7 + 3) % shape.vocab_size))
    return out


#: torch.distributed functions counted: (kind, which argument's bytes). All-gather counts
#: the gathered output, reduce-scatter its input (as ours counts them).
WIRE_OPS = {
    "all_gather_single": ("all_gather", 0),
    "all_gather_into_tensor": ("all_gather", 0),
    "reduce_scatter_single": ("reduce_scatter", 1),
    "reduce_scatter_tensor": ("reduce_scatter", 1),
    "all_reduce": ("all_reduce", 0),
}
#: The keyword names the counted argument may be passed by, per position.
WIRE_KEYWORDS = {0: ("output_tensor", "output", "tensor"), 1: ("input_tensor", "input")}


class WireCounter:
    """Bytes moved by torch.distributed's all-gather, reduce-scatter and all-reduce calls,
    by the implementation whose step is running (``current``). Installed by wrapping the
    module functions FSDP2 and DeepSpeed call; a lock, since collectives may be issued
    from other threads."""

    def __init__(self) -> None:
        self.current = ""
        self.bytes: dict[str, dict[str, int]] = {}
        self._lock = threading.Lock()

    def install(self) -> None:
        for name, (kind, index) in WIRE_OPS.items():
            original = getattr(dist, name, None)
            if original is not None:
                setattr(dist, name, self._wrap(original, kind, index))

    def _wrap(self, original: Any, kind: str, index: int) -> Any:
        def counted(*args: Any, **kwargs: Any) -> Any:
            tensor = args[index] if len(args) > index else None
            for key in WIRE_KEYWORDS[index]:
                tensor = kwargs.get(key, tensor)
            if isinstance(tensor, torch.Tensor):
                with self._lock:
                    per = self.bytes.setdefault(self.current, {})
                    per[kind] = per.get(kind, 0) + tensor.numel() * tensor.element_size()
            return original(*args, **kwargs)

        return counted

    def snapshot(self, impl: str) -> dict[str, int]:
        with self._lock:
            return dict(self.bytes.get(impl, {}))


class Trainer(abc.ABC):
    """One implementation on this rank: its model, the step, the losses it saw."""

    def __init__(self, name: str, data: list, rank: int, world: int) -> None:
        self.name = name
        self._data = iter(data)
        self._rank, self._world = rank, world
        self.losses: list[float] = []  # this rank's share's loss, every step

    def step(self) -> None:
        ids, targets = next(self._data)
        per = GLOBAL_BATCH // self._world
        share = slice(self._rank * per, (self._rank + 1) * per)
        self.losses.append(self._train(ids[share], targets[share]))

    @abc.abstractmethod
    def _train(self, ids: torch.Tensor, targets: torch.Tensor) -> float:
        """One training step on this rank's share; returns its loss."""

    def bytes_moved(self, wire: WireCounter) -> dict[str, int]:
        """Bytes moved so far, by kind: the collectives (``COLLECTIVES``), and where the
        implementation counts them, host-device copies (``COPIES``)."""
        return wire.snapshot(self.name)

    @abc.abstractmethod
    def memory(self) -> dict[str, Any]:
        """What this implementation holds per rank (bytes), by kind."""


class Ours(Trainer):
    def __init__(self, shape: GPTConfig, budget: int, data: list, rank: int, world: int):
        super().__init__("ours", data, rank, world)
        self.model = _model(shape)
        self.accelerator = HostAccelerator(AcceleratorConfig(device_budget=budget))
        self.opt = OffloadAdamW(
            self.model.parameters(),
            lr=LR,
            betas=BETAS,
            weight_decay=WEIGHT_DECAY,
            config=OffloadConfig(
                offload_parameters=True, prefetch_layers=1, bucket_bytes=BUCKET_BYTES
            ),
            accelerator=self.accelerator,
            model=self.model,
        )

    def _train(self, ids: torch.Tensor, targets: torch.Tensor) -> float:
        loss = self.model(ids, targets)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()
        self.opt.manager.synchronize()  # the step's copies are part of its time
        return loss.item()

    def bytes_moved(self, wire: WireCounter) -> dict[str, int]:
        counters = self.opt.manager.counters  # every copy goes through the manager
        moved = {
            "h2d_weights": counters.bytes(Direction.H2D, Category.WEIGHTS),
            "d2h_gradients": counters.bytes(Direction.D2H, Category.GRADIENTS),
        }
        comm = self.opt.comm  # None at one rank: nothing is sharded, nothing moves between
        if comm is not None:
            moved.update({op: c["bytes"] for op, c in comm.counters.snapshot().items()})
        return moved

    def memory(self) -> dict[str, Any]:
        host = sum(p.capacity for p in self.opt.manager.pools if p.name.endswith(".host"))
        return {
            "device_peak": self.accelerator.memory_stats()["peak"],
            "host_bytes": host,
        }

    def close(self) -> None:
        self.opt.close()  # collective with several ranks: every rank closes in turn


class Fsdp2(Trainer):
    def __init__(self, shape: GPTConfig, data: list, rank: int, world: int, *, offload: bool):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

        super().__init__("fsdp2_cpu_offload" if offload else "fsdp2", data, rank, world)
        self.offload = offload
        self.model = _model(shape)
        self.unit_bytes = [
            sum(p.numel() * p.element_size() for p in unit.parameters())
            for unit in _units(self.model)
        ]
        mesh = init_device_mesh("cpu", (world,))
        policy = {"offload_policy": CPUOffloadPolicy(pin_memory=False)} if offload else {}
        for unit in _units(self.model):
            fully_shard(unit, mesh=mesh, **policy)
        fully_shard(self.model, mesh=mesh, **policy)
        self.opt = torch.optim.AdamW(
            self.model.parameters(), lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY
        )
        self.state_bytes = 0

    def _train(self, ids: torch.Tensor, targets: torch.Tensor) -> float:
        loss = self.model(ids, targets)
        loss.backward()
        self.opt.step()
        if not self.state_bytes:  # the warm-up step: the sizes never change after it
            self.state_bytes = self._sharded_state_bytes()  # before zero_grad frees grads
        self.opt.zero_grad()
        return loss.item()

    def _sharded_state_bytes(self) -> int:
        """This rank's local shards of the parameters, their gradients and AdamW's state."""

        def local(t: Any) -> int:
            t = t.to_local() if hasattr(t, "to_local") else t
            return t.numel() * t.element_size()

        total = 0
        for p in self.model.parameters():
            total += local(p) + (local(p.grad) if p.grad is not None else 0)
            state = self.opt.state.get(p, {})
            total += sum(local(v) for v in state.values() if isinstance(v, torch.Tensor))
        return total

    def memory(self) -> dict[str, Any]:
        return {"sharded_state_bytes": self.state_bytes, "largest_unit": max(self.unit_bytes)}


class DeepSpeed(Trainer):
    """ZeRO-3 with parameters and optimizer state offloaded to the CPU (DeepSpeed's own
    engine and CPU Adam); built only where ``deepspeed`` imports."""

    def __init__(self, shape: GPTConfig, data: list, rank: int, world: int):
        import deepspeed

        super().__init__("deepspeed", data, rank, world)
        self.model = _model(shape)
        config = {
            "train_micro_batch_size_per_gpu": GLOBAL_BATCH // world,
            "gradient_accumulation_steps": 1,
            "optimizer": {
                "type": "AdamW",
                "params": {"lr": LR, "betas": list(BETAS), "weight_decay": WEIGHT_DECAY},
            },
            "zero_optimization": {
                "stage": 3,
                "offload_param": {"device": "cpu"},
                "offload_optimizer": {"device": "cpu"},
            },
        }
        self.engine, *_ = deepspeed.initialize(
            model=self.model, model_parameters=self.model.parameters(), config=config
        )

    def _train(self, ids: torch.Tensor, targets: torch.Tensor) -> float:
        device = self.engine.device
        loss = self.engine(ids.to(device), targets.to(device))
        self.engine.backward(loss)
        self.engine.step()
        return loss.item()

    def memory(self) -> dict[str, Any]:
        return {}  # DeepSpeed's own memory report is not wired in: the row says "—"


def _stage2_refusal(shape: GPTConfig, budget: int) -> str:
    """What stage 2 (weights resident on the device) says at ``budget``."""
    model = _model(shape)
    try:
        opt = OffloadAdamW(
            model.parameters(),
            lr=LR,
            config=OffloadConfig(bucket_bytes=BUCKET_BYTES),
            accelerator=HostAccelerator(AcceleratorConfig(device_budget=budget)),
        )
    except DeviceBudgetExceeded as error:
        return f"refused: {str(error).split(':')[0]}"
    opt.close()
    return "fits"


def _rank_main(
    rank: int, world: int, port: int, size: str, warmup: int, rounds: int, out: str
) -> None:
    join_gloo(rank, world, port)  # at one rank too: FSDP2 needs a process group
    shape = SIZES[size]
    budget = _budget(shape)
    data = _batches(shape, warmup + rounds)
    wire = WireCounter()
    wire.install()
    ours = Ours(shape, budget, data, rank, world)
    trainers: dict[str, Trainer] = {
        "ours": ours,
        "fsdp2": Fsdp2(shape, data, rank, world, offload=False),
        "fsdp2_cpu_offload": Fsdp2(shape, data, rank, world, offload=True),
    }
    status = {name: "ran" for name in trainers}
    if importlib.util.find_spec("deepspeed") is None:
        status["deepspeed"] = "not installed"
    else:
        try:
            trainers["deepspeed"] = DeepSpeed(shape, data, rank, world)
            status["deepspeed"] = "ran"
        except Exception as error:  # reported in the table: DeepSpeed does not run here
            status["deepspeed"] = f"failed: {type(error).__name__}: {error}"[:160]

    def timed(trainer: Trainer) -> Any:
        def call() -> None:
            wire.current = trainer.name
            trainer.step()

        return call

    fns = {name: timed(trainer) for name, trainer in trainers.items()}
    for _ in range(warmup):  # numba, pools, FSDP2's lazy init, ours' forward order
        for fn in fns.values():
            fn()
    before = {name: t.bytes_moved(wire) for name, t in trainers.items()}
    samples = time_samples(fns, rounds=rounds, warmup=0, sync=dist.barrier)
    result: dict[str, Any] = {"world_size": world, "status": status, "impls": {}}
    for name, trainer in trainers.items():
        after = trainer.bytes_moved(wire)
        result["impls"][name] = {
            "samples": samples[name],
            "losses": trainer.losses,
            "bytes_per_step": {op: (after[op] - before[name].get(op, 0)) / rounds for op in after},
            **trainer.memory(),
        }
    ours.close()  # the others hold nothing a collective must release
    if world == 1:
        result["stage2"] = _stage2_refusal(shape, budget)
    result["params"] = sum(p.numel() for p in _model(shape).parameters())
    result["budget"] = budget
    torch.save(result, Path(out) / f"world{world}.rank{rank}.pt")
    dist.destroy_process_group()


def _combine(ranks: list[dict]) -> dict:
    """One world size's row from its ranks: a sample is the slowest rank's, a loss the mean
    of the ranks' (equal shares), bytes the largest rank's."""
    first = ranks[0]
    row: dict[str, Any] = {
        "world_size": first["world_size"],
        "status": first["status"],
        "impls": {},
    }
    for name in first["impls"]:
        per = [r["impls"][name] for r in ranks]
        samples = [max(s) for s in zip(*(p["samples"] for p in per), strict=True)]
        losses = [sum(x) / len(x) for x in zip(*(p["losses"] for p in per), strict=True)]
        combined = {
            "spread_s": spread(samples),
            "losses": losses,
            "bytes_per_step": per[0]["bytes_per_step"],
        }
        for key in ("device_peak", "host_bytes", "sharded_state_bytes", "largest_unit"):
            if key in per[0]:
                combined[key] = max(p[key] for p in per)
        row["impls"][name] = combined
    return row


def _mib(nbytes: float | None) -> str:
    return "—" if nbytes is None else f"{nbytes / MiB:.2f}"


def _collectives(moved: dict[str, float]) -> float:
    return sum(moved.get(op, 0) for op in COLLECTIVES)


def _max_dloss(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def _report(rows: list[dict], header: dict) -> None:
    print(
        f"\nZeRO-3, {header['size']} GPT fp32 ({header['params'] / 1e6:.2f}M parameters, "
        f"{_mib(4 * header['params'])} MiB of weights), global batch {GLOBAL_BATCH}, gloo on "
        f"this host; per-rank device budget {_mib(header['budget'])} MiB (stage 2 at this "
        f"budget: {header['stage2']}); {header['warmup']} warm-up + {header['rounds']} "
        "interleaved rounds\n"
    )
    print(
        "| ranks | implementation | step ms p10 / median / p90 | ours ÷ this | "
        "device peak MiB/rank | host or sharded state MiB/rank | "
        "collectives MiB/step (all-gather + reduce-scatter + all-reduce) | "
        "host-device MiB/step (H2D weights + D2H gradients) | max abs Δloss vs ours |"
    )
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        impls, world = row["impls"], row["world_size"]
        ours = impls["ours"]
        for name in IMPLS:
            if name not in impls:
                print(f"| {world} | {name} | {row['status'][name]} | | | | | | |")
                continue
            impl = impls[name]
            p = {k: 1e3 * v for k, v in impl["spread_s"].items()}
            ratio = ours["spread_s"]["median"] / impl["spread_s"]["median"]
            moved = impl["bytes_per_step"]
            wire = " + ".join(_mib(moved.get(op, 0)) for op in COLLECTIVES)
            copies = (
                " + ".join(_mib(moved[op]) for op in COPIES)
                if all(op in moved for op in COPIES)
                else "not counted (no device)"
            )
            if name == "ours":
                device, state = _mib(impl["device_peak"]), f"{_mib(impl['host_bytes'])} host"
            elif name.startswith("fsdp2"):
                where = "host" if name == "fsdp2_cpu_offload" else "device (the CPU here)"
                device = f"no device (largest unit {_mib(impl['largest_unit'])})"
                state = f"{_mib(impl['sharded_state_bytes'])} {where}"
            else:
                device, state = "—", "—"
            dloss = _max_dloss(impl["losses"], ours["losses"])
            print(
                f"| {world} | {name} | {p['p10']:.1f} / {p['median']:.1f} / {p['p90']:.1f} "
                f"| {ratio:.2f} | {device} | {state} | {wire} | {copies} | {dloss:.2e} |"
            )
    print("\nRatios, ours / other (median step time; collective bytes per step):")
    for row in rows:
        impls = row["impls"]
        ours = impls["ours"]
        parts = []
        for name in IMPLS[1:]:
            if name in impls:
                step = ours["spread_s"]["median"] / impls[name]["spread_s"]["median"]
                theirs = _collectives(impls[name]["bytes_per_step"])
                mine = _collectives(ours["bytes_per_step"])
                wire = f"{mine / theirs:.2f}" if theirs else "—"
                parts.append(f"{name}: step {step:.2f}, collectives {wire}")
        print(f"- {row['world_size']} ranks: " + "; ".join(parts))
    print("\nmax abs Δloss between every pair (global loss, every step incl. warm-up):")
    for row in rows:
        impls = row["impls"]
        pairs = [
            f"{a}-{b} {_max_dloss(impls[a]['losses'], impls[b]['losses']):.2e}"
            for a, b in itertools.combinations(impls, 2)
        ]
        print(f"- {row['world_size']} ranks: " + ", ".join(pairs))
    base = rows[0]["impls"]["ours"]["losses"]
    across = ", ".join(
        f"{row['world_size']} ranks {_max_dloss(row['impls']['ours']['losses'], base):.2e}"
        for row in rows[1:]
    )
    if across:
        print(f"- ours against ours at {rows[0]['world_size']} rank(s): {across}")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a 1M-parameter model, 5 rounds")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds (default 10)")
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4], help="world sizes")
    parser.add_argument("--rank", nargs=7, help=argparse.SUPPRESS)  # a spawned rank's args
    args = parser.parse_args(argv)
    if args.rank:
        rank, world, port, size, warmup, rounds, out = args.rank
        _rank_main(int(rank), int(world), int(port), size, int(warmup), int(rounds), out)
        return {}
    size = "quick" if args.quick else "full"
    rounds = args.rounds or (5 if args.quick else 10)
    warmup = 1 if args.quick else 2
    bad = [w for w in args.worlds if w < 1 or GLOBAL_BATCH % w]
    if bad or rounds < 1:
        raise ValueError(
            f"--worlds must divide the global batch {GLOBAL_BATCH} (1, 2, 4 or 8) and "
            f"--rounds be >= 1, got worlds {args.worlds}, rounds {rounds}"
        )
    rows, header = [], {}
    with tempfile.TemporaryDirectory() as out:
        for world in args.worlds:
            spawn_ranks(
                world,
                lambda rank, port, world=world: [
                    os.path.abspath(__file__),
                    *("--rank", str(rank), str(world), str(port), size),
                    *(str(warmup), str(rounds), out),
                ],
                what="bench_zero3",
                env={"OMP_WAIT_POLICY": "PASSIVE"},  # docs/threads.md
            )
            ranks = [
                torch.load(Path(out) / f"world{world}.rank{r}.pt", weights_only=False)
                for r in range(world)
            ]
            header.setdefault("stage2", ranks[0].get("stage2", "not checked"))
            header.update(params=ranks[0]["params"], budget=ranks[0]["budget"])
            rows.append(_combine(ranks))
    header.update(size=size, warmup=warmup, rounds=rounds)
    _report(rows, header)
    result = {"machine": machine(), **header, "rows": rows}
    path = write_json("bench_zero3", result)
    print(f"JSON: {path}")
    return result


if __name__ == "__main__":
    main()
