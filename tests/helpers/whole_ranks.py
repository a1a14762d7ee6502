"""The multi-rank scenarios of the rules that read whole parameters (Adafactor, Muon; Note [a
whole parameter has one owner] in zero_offload/partition.py), run by ``dist.run_ranks``.

``build(rule, model, clip=...)`` is the optimizer every scenario and the one-rank runs of
tests/test_whole_rules_ranks.py use, so both sides step with the same options.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from zero_offload import OffloadAdafactor, OffloadConfig, OffloadMuon
from zero_offload.checkpoint_io import consolidated_state_dict, load_consolidated, save_consolidated

from .models import batches, host_accelerator, lm_loss, make_pair

#: Global batch of every step: 6 sequences, 3 per rank on 2 ranks.
GLOBAL_BATCH = 6
HYPER = {
    "adafactor": {"lr": 3e-2, "weight_decay": 0.05},
    "muon": {"lr": 0.02, "adamw_lr": 3e-3},
}


def build(
    rule: str, model: nn.Module, *, clip: float | None = None, overlap: bool = False
) -> torch.optim.Optimizer:
    """``rule``'s facade over ``model`` with small buckets (several per model, several
    parameters per bucket, so the owners differ within a bucket); ``overlap``: with
    ``overlap_step``."""
    facade = {"adafactor": OffloadAdafactor, "muon": OffloadMuon}[rule]
    config = OffloadConfig(
        bucket_bytes=8192, tile_elements=1024, max_grad_norm=clip, overlap_step=overlap
    )
    return facade(model.parameters(), **HYPER[rule], config=config,
                  accelerator=host_accelerator())  # fmt: skip


def data(steps: int, micro: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """``steps`` global steps of ``micro`` micro-batches each."""
    flat = batches(steps * micro, batch=GLOBAL_BATCH)
    return [flat[i : i + micro] for i in range(0, len(flat), micro)]


def share(pair: tuple[torch.Tensor, torch.Tensor], rank: int, world: int) -> tuple:
    """Rank ``rank``'s contiguous share of a global micro-batch (all of it with ``world`` 1)."""
    per = GLOBAL_BATCH // world
    return tuple(t[rank * per : (rank + 1) * per] for t in pair)


def train(model: nn.Module, opt: Any, steps: list, rank: int, world: int) -> list[float]:
    """Each step: every micro-batch's share backward, then one step; the norms seen."""
    norms = []
    for micro in steps:
        for pair in micro:
            opt.backward(lm_loss(model, *share(pair, rank, world)))
        opt.step()
        norms.append(opt.last_grad_norm)
        opt.zero_grad()
    return norms


def weights(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def owners(opt: Any) -> dict[int, int | None]:
    """Which rank owns each parameter (by position), from the optimizer's layouts."""
    return {
        slot.index: bucket.layout.owner(slot)
        for bucket in opt.buckets
        for slot in bucket.layout.slots
    }


def scenario_whole_train(
    rank: int,
    world: int,
    out: Path,
    *,
    rule: str,
    steps: int,
    micro: int,
    clip: float | None,
    overlap: bool = False,
    same_batch: bool = False,
) -> dict:
    """Each rank trains on its share of every global micro-batch (``same_batch``: on all of
    it); ``overlap``: with ``overlap_step``, the last update flushed."""
    model, _ = make_pair()
    opt = build(rule, model, clip=clip, overlap=overlap)
    norms = train(model, opt, data(steps, micro), *((0, 1) if same_batch else (rank, world)))
    opt.flush_pending_update()
    result = {"weights": weights(model), "norms": norms, "owners": owners(opt)}
    opt.close()
    return result


def scenario_whole_resume(
    rank: int, world: int, out: Path, *, rule: str, steps: int, dtype: torch.dtype
) -> dict:
    """Every rank backs the whole global batch (so the averaged gradient is exactly the
    one-rank one): an uninterrupted run, and runs resumed halfway from this rank's
    ``state_dict()``, from a consolidated checkpoint and from a streaming one (each rank its
    own records, Note [shaped state in a streamed checkpoint]); weights in ``dtype``."""
    plan, half = data(steps, 1), steps // 2
    model, twin = make_pair(dtype)
    _, third = make_pair(dtype)
    _, fourth = make_pair(dtype)
    opt = build(rule, model)
    train(model, opt, plan[:half], 0, 1)
    sharded = opt.state_dict()
    save_consolidated(opt, out / f"{rule}.pt")
    opt.save_streaming(out / f"{rule}-streamed")
    merged = consolidated_state_dict(opt)
    for other in (twin, third, fourth):
        other.load_state_dict(model.state_dict())
    train(model, opt, plan[half:], 0, 1)
    resumed = {}
    for name, other in (("sharded", twin), ("consolidated", third), ("streaming", fourth)):
        again = build(rule, other)
        if name == "sharded":
            again.load_state_dict(sharded)
        elif name == "streaming":
            again.load_streaming(out / f"{rule}-streamed")
        else:
            load_consolidated(again, out / f"{rule}.pt")
        train(other, again, plan[half:], 0, 1)
        resumed[name] = weights(other)
        again.close()
    result = {
        "weights": weights(model),
        "resumed": resumed,
        "sharded": sharded,
        "merged": merged,
        "owners": owners(opt),
    }
    opt.close()
    return result


SCENARIOS = {"whole_train": scenario_whole_train, "whole_resume": scenario_whole_resume}
