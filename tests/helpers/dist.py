"""Spawned gloo ranks on the host accelerator: the scenarios the multi-rank tests run.

``run_ranks(world, scenario, out_dir, **kwargs)`` starts ``world`` processes (spawn, a free
port on 127.0.0.1), each joins a gloo group, runs ``SCENARIOS[scenario](rank, world,
out_dir, **kwargs)`` and saves what it returns to ``out_dir/<scenario>.rank<r>.pt``;
``run_ranks`` returns those results in rank order.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from zero_offload import (
    CollectiveError,
    OffloadAdagrad,
    OffloadAdamW,
    OffloadConfig,
    OffloadLion,
)
from zero_offload.checkpoint_io import (
    consolidated_state_dict,
    load_consolidated,
    save_consolidated,
)
from zero_offload.collectives import make_comm, reduce_scatter_avg

from .models import batches, host_accelerator, lm_loss, make_pair, offload_opt
from .rule_pools import SCENARIOS as RULE_POOL_SCENARIOS
from .whole_ranks import SCENARIOS as WHOLE_SCENARIOS

#: Global batch of every multi-rank test: 6 sequences, so 2 and 3 ranks get equal shares.
GLOBAL_BATCH = 6


def shard_batch(tokens: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s equal, contiguous share of the global batch."""
    per = tokens.shape[0] // world
    return tokens[rank * per : (rank + 1) * per]


def data(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return batches(steps, batch=GLOBAL_BATCH)


def train_steps(model, opt, pairs, rank: int, world: int, *, clip: float | None = None):
    """Each rank trains on its share of each global batch; returns the grad norms seen."""
    norms = []
    for tokens, targets in pairs:
        loss = lm_loss(model, shard_batch(tokens, rank, world), shard_batch(targets, rank, world))
        opt.backward(loss)
        if clip is not None:
            opt.clip_grad_norm_(clip)
        opt.step()
        norms.append(opt.last_grad_norm)
        opt.zero_grad()
    return norms


def _weights(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def scenario_train(rank: int, world: int, out: Path, *, steps: int, clip: float | None) -> dict:
    model, _ = make_pair()
    opt = offload_opt(model, max_grad_norm=clip)
    pairs = data(steps)
    comm0 = opt.comm.counters.snapshot()
    d2h0 = opt.manager.counters.snapshot()
    norms = train_steps(model, opt, pairs[:1], rank, world)  # one step, measured alone
    traffic = {
        "comm_before": comm0,
        "comm_after": opt.comm.counters.snapshot(),
        "d2h_before": d2h0,
        "d2h_after": opt.manager.counters.snapshot(),
        "padded": [b.layout.padded_numel for b in opt.buckets],
        "slots": [len(b.layout.slots) for b in opt.buckets],
        "shard": [b.layout.shard_numel for b in opt.buckets],
        "owned_real": [b.layout.real_in(*b.shard) for b in opt.buckets],
        "host_pool": sum(p.capacity for p in opt.manager.pools if p.name.endswith(".host")),
    }
    norms += train_steps(model, opt, pairs[1:], rank, world)
    result = {"weights": _weights(model), "norms": norms, "traffic": traffic}
    opt.close()
    return result


def scenario_rule_train(
    rank: int, world: int, out: Path, *, rule: str, hyper: dict, steps: int, clip: float | None
) -> dict:
    """``scenario_train`` for another rule's facade ("lion", "adagrad") with ``hyper``."""
    model, _ = make_pair()
    facade = {"lion": OffloadLion, "adagrad": OffloadAdagrad}[rule]
    config = OffloadConfig(bucket_bytes=8192, tile_elements=1024, max_grad_norm=clip)
    opt = facade(model.parameters(), **hyper, config=config, accelerator=host_accelerator())
    norms = train_steps(model, opt, data(steps), rank, world)
    result = {"weights": _weights(model), "norms": norms}
    opt.close()
    return result


def scenario_accumulate(
    rank: int, world: int, out: Path, *, windows: list[int], accumulation: str, clip: float | None
) -> dict:
    """Micro-batches of ``windows`` (per step) with ``grad_accumulation=accumulation``."""
    model, _ = make_pair()
    opt = offload_opt(model, max_grad_norm=clip, grad_accumulation=accumulation)
    pairs = data(sum(windows))
    norms, i = [], 0
    for micro in windows:
        for tokens, targets in pairs[i : i + micro]:
            share = shard_batch(tokens, rank, world), shard_batch(targets, rank, world)
            opt.backward(lm_loss(model, *share))
        i += micro
        opt.step()
        norms.append(opt.last_grad_norm)
        opt.zero_grad()
    on_device = [b.gradients.device_sum is not None for b in opt.buckets]
    result = {"weights": _weights(model), "norms": norms, "on_device": on_device}
    opt.close()
    return result


def scenario_overlap(
    rank: int, world: int, out: Path, *, steps: int, shadow: bool, landing: str = "at_step"
) -> dict:
    """``overlap_step`` with 2 micro-batches a step, with the delayed update's device weight
    shadows or (``shadow=False``) without (Note [the delayed update lands in a shadow]);
    ``landing``: ``OffloadConfig.overlap_landing``."""
    import zero_offload.optim.shadow as shadow_mod

    if not shadow:
        shadow_mod.WeightShadows.take = lambda self, **_: None  # type: ignore[method-assign]
    model, _ = make_pair()
    opt = offload_opt(model, overlap_step=True, overlap_landing=landing)
    pairs = data(2 * steps)
    for i in range(0, len(pairs), 2):
        for tokens, targets in pairs[i : i + 2]:
            share = shard_batch(tokens, rank, world), shard_batch(targets, rank, world)
            opt.backward(lm_loss(model, *share))
        opt.step()
        opt.zero_grad()
    opt.flush_pending_update()
    notes = dict(opt.manager.step_notes)
    result = {
        "weights": _weights(model),
        "shadowed": sum(v for k, v in notes.items() if k.endswith(".shadowed_buckets")),
    }
    opt.close()
    return result


def scenario_overflow(rank: int, world: int, out: Path, *, steps: int, bad_step: int) -> dict:
    """fp16: rank 1 alone produces an inf in one gradient element at ``bad_step``."""
    model, _ = make_pair(torch.float16)
    opt = offload_opt(model)
    state = {"step": 0}

    def poison(grad: torch.Tensor) -> torch.Tensor:
        if rank == 1 and state["step"] == bad_step:
            grad = grad.clone()
            grad.view(-1)[0] = float("inf")
        return grad

    model.head.bias.register_hook(poison)
    scales = []
    for state["step"], (tokens, targets) in enumerate(data(steps)):
        loss = lm_loss(model, shard_batch(tokens, rank, world), shard_batch(targets, rank, world))
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        scales.append(opt.loss_scale)
    result = {"weights": _weights(model), "skipped": opt.skipped_steps, "scales": scales}
    opt.close()
    return result


def scenario_save(rank: int, world: int, out: Path, *, steps: int) -> dict:
    model, _ = make_pair()
    opt = offload_opt(model)
    train_steps(model, opt, data(steps), rank, world)
    save_consolidated(opt, out / "opt.pt")
    if rank == 0:
        torch.save(model.state_dict(), out / "model.pt")
    shard = opt.state_dict()
    opt.close()
    return {"shard_keys": sorted(shard["state"])}


def resume(rank: int, world: int, out: Path, *, first: int, steps: int) -> list[torch.Tensor]:
    """Load model.pt and opt.pt from ``out`` and train steps ``first..steps-1``."""
    model, _ = make_pair(seed=1)  # different init: everything must come from the files
    model.load_state_dict(torch.load(out / "model.pt", weights_only=True))
    opt = offload_opt(model)
    load_consolidated(opt, out / "opt.pt")
    train_steps(model, opt, data(steps)[first:], rank, world)
    opt.close()
    return _weights(model)


def scenario_resume(rank: int, world: int, out: Path, *, first: int, steps: int) -> dict:
    return {"weights": resume(rank, world, out, first=first, steps=steps)}


def scenario_failure(rank: int, world: int, out: Path, *, fail_step: int, timeout: float) -> dict:
    """Rank 1 raises at ``fail_step`` and then stays alive without reaching a collective."""
    model, _ = make_pair()
    opt = offload_opt(model, collective_timeout=timeout)
    for step, (tokens, targets) in enumerate(data(fail_step + 2)):
        # Line the ranks up first (under pytest on two cores they may start seconds apart,
        # more than the short timeout), so the clock measures the failure alone.
        dist.barrier()
        began = time.perf_counter()
        try:
            if rank == 1 and step == fail_step:
                raise RuntimeError("rank 1 fails on purpose")
            loss = lm_loss(
                model, shard_batch(tokens, rank, world), shard_batch(targets, rank, world)
            )
            opt.backward(loss)
            opt.step()
            opt.zero_grad()
        except CollectiveError as exc:
            return {
                "error": str(exc),
                "type": "CollectiveError",
                "seconds": _since(began),
                "step": step,
            }
        except RuntimeError as exc:
            if rank == 1:
                time.sleep(timeout + 2)  # alive but absent: the others must not wait for us
                return {"error": str(exc), "type": type(exc).__name__, "seconds": 0.0}
            return {"error": str(exc), "type": type(exc).__name__, "seconds": _since(began)}
    return {"error": None}


def scenario_collectives(rank: int, world: int, out: Path) -> dict:
    """fp16 averaging near the fp16 limit, and a consolidated checkpoint of an optimizer
    built on a process group that leaves global rank 0 out."""
    comm = make_comm(None, timeout=30.0)
    flat = torch.full((4 * world,), 40000.0, dtype=torch.float16)  # sum overflows, mean not
    mean = reduce_scatter_avg(flat, comm=comm, what="fp16 test buffer").tolist()
    group = dist.new_group(list(range(1, world)))  # every rank must call new_group
    gathered = None
    if rank >= 1:
        layer = torch.nn.Linear(4, 4)
        opt = OffloadAdamW(layer.parameters(), process_group=group, accelerator=host_accelerator())
        layer(torch.ones(2, 4)).sum().backward()
        opt.step()
        state = consolidated_state_dict(opt)  # dst=0 is group rank 0, global rank 1
        gathered = None if state is None else sorted(state["state"])
        opt.close()
    return {"mean": mean, "gathered": gathered}


def uneven_skip(step: int, rank: int) -> set[str]:
    """Which blocks rank ``rank`` leaves unused at ``step`` (a router, a conditional branch):
    ranks disagree at most steps, and at step 2 every rank skips block 1."""
    if step == 2:
        return {"block1"}
    which = (step + rank) % 3
    return {f"block{which}"} if which < 2 else set()


def uneven_loss(model, tokens, targets, *, skip: set[str]) -> torch.Tensor:
    """TinyTransformer's loss with the blocks in ``skip`` left out."""
    x = model.embed(tokens)
    for i, block in enumerate(model.blocks):
        if f"block{i}" not in skip:
            x = block(x)
    logits = model.head(model.norm(x))
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def scenario_uneven(rank: int, world: int, out: Path, *, steps: int) -> dict:
    """Ranks leave different blocks unused; several buckets, some smaller than one
    parameter (bucket_bytes 8192 < in_proj_weight), whole buckets without a gradient on a
    rank (Note [ranks in lockstep])."""
    model, _ = make_pair()
    opt = offload_opt(model)
    for step, (tokens, targets) in enumerate(data(steps)):
        loss = uneven_loss(
            model,
            shard_batch(tokens, rank, world),
            shard_batch(targets, rank, world),
            skip=uneven_skip(step, rank),
        )
        loss.backward()
        opt.step()
        model.zero_grad()  # as HF Trainer clears
    result = {"weights": _weights(model)}
    opt.close()
    return result


def _since(began: float) -> float:
    return time.perf_counter() - began


def scenario_user_collectives(rank: int, world: int, out: Path, *, steps: int) -> dict:
    """The loop issues collectives of its own on the default group from the main thread
    (as Lightning's SIGTERM-flag broadcast does) while backward's reduce-scatters run on
    the comm stream's thread: Note [a process group of the optimizer's own]. Rank 0's comm
    stream is held back and rank 1's main thread waits, so on one shared group the two
    ranks would issue them in opposite orders."""
    import time

    model, _ = make_pair()
    opt = offload_opt(model, collective_timeout=20.0)
    stream = opt._ranks.stream
    flags = []

    def user_collectives(grad: torch.Tensor) -> torch.Tensor:
        # Runs on the main thread mid-backward, after the later buckets were handed on.
        if rank == 1:
            time.sleep(0.1)
        flag = torch.tensor([float(rank)])
        dist.all_reduce(flag)
        stop = torch.tensor([1.0 if rank == 0 else 0.0])
        dist.broadcast(stop, src=0)
        flags.append((flag.item(), stop.item()))
        return grad

    for tokens, targets in data(steps):
        if rank == 0:
            stream.submit(lambda: time.sleep(0.1))  # this rank's reduce-scatters go late
        x = model.embed(shard_batch(tokens, rank, world))
        x.register_hook(user_collectives)
        for block in model.blocks:
            x = block(x)
        logits = model.head(model.norm(x))
        loss = torch.nn.functional.cross_entropy(
            logits.float().flatten(0, 1), shard_batch(targets, rank, world).flatten()
        )
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
    result = {"weights": _weights(model), "flags": flags}
    opt.close()
    return result


SCENARIOS: dict[str, Callable[..., dict]] = {
    "train": scenario_train,
    "rule_train": scenario_rule_train,
    "accumulate": scenario_accumulate,
    "overlap": scenario_overlap,
    "overflow": scenario_overflow,
    "save": scenario_save,
    "resume": scenario_resume,
    "failure": scenario_failure,
    "collectives": scenario_collectives,
    "uneven": scenario_uneven,
    "user_collectives": scenario_user_collectives,
    **WHOLE_SCENARIOS,
    **RULE_POOL_SCENARIOS,
}


def join_gloo(rank: int, world: int, port: int) -> None:
    """A spawned rank joins the gloo group on 127.0.0.1:``port``."""
    torch.set_num_threads(1)  # several ranks share two cores
    os.environ.setdefault("ZERO_OFFLOAD_DEVICE_BUDGET", "256MiB")
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=60),
    )


def _entry(rank: int, world: int, port: int, scenario: str, out: str, kwargs: dict) -> None:
    join_gloo(rank, world, port)
    result = SCENARIOS[scenario](rank, world, Path(out), **kwargs)
    torch.save(result, Path(out) / f"{scenario}.rank{rank}.pt")
    if scenario == "failure":
        # A collective that timed out leaves a thread blocked in the backend; the normal
        # interpreter shutdown would abort on it, so leave at once (as a launcher would).
        os._exit(0)
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


#: How many times ``spawn_ranks`` picks another port when rank 0 could not listen on one.
PORT_TRIES = 3


def spawn_ranks(fn: Callable[..., None], world: int, *args: Any) -> None:
    """``mp.spawn(fn, args=(world, port, *args), nprocs=world)`` on a free port. The port is
    free when picked, but another process (a lingering rank's gloo socket takes ports from
    the same ephemeral range) may take it before rank 0's store listens on it: the ranks
    then fail with EADDRINUSE, and are run again on another port."""
    for attempt in range(PORT_TRIES):
        try:
            mp.spawn(fn, args=(world, free_port(), *args), nprocs=world)
            return
        except mp.ProcessRaisedException as exc:
            if "EADDRINUSE" not in str(exc) or attempt == PORT_TRIES - 1:
                raise


def run_ranks(world: int, scenario: str, out: Path, **kwargs: Any) -> list[dict]:
    """Run ``scenario`` on ``world`` spawned gloo ranks; their results in rank order."""
    spawn_ranks(_entry, world, scenario, str(out), kwargs)
    return [torch.load(out / f"{scenario}.rank{r}.pt", weights_only=False) for r in range(world)]
