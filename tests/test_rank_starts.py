"""Ranks start alike and stop cleanly, on two spawned gloo ranks.

- Every rank starts from rank 0's weights (Note [every rank starts from rank 0's weights] in
  ``optim/rank_starts.py``): ranks that built the model without a common seed train as torch
  DDP does (it broadcasts rank 0's weights at its construction), with stage 2 and with
  ZeRO-3 (parameter offload, and the shards on the device). Before, each rank's shard of
  the master came from its own initial weights, and every rank trained a silent mix.
- ``save_pretrained`` with whole weights on every rank (stage 2) called on every rank: rank
  0 alone writes (before, the ranks raced on one directory's staged files); called on rank
  0 alone it still works (no collective). ``master_weights=True`` on several ranks names
  the world size instead of asking for the ``optimizer=`` it was given.
- ``save_pretrained`` under ZeRO-3 called on rank 0 only raises ``CollectiveError`` within
  ``collective_timeout`` (before, it hung in a broadcast without a deadline).
- ``close()`` after a ``CollectiveError`` the loop already caught releases quietly (before,
  it raised the same failure again, wrapped in a ``StreamError``).
- The refusal of parameters whose storage was replaced names a plain accelerate
  ``Accelerator`` (DDP) and ``OffloadAccelerator``.
"""

from __future__ import annotations

import copy
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from zero_offload import (
    CollectiveError,
    OffloadAdamW,
    OffloadConfig,
    hf_export,
    save_pretrained,
)
from zero_offload.demo.model import GPTConfig, TinyGPT

from .helpers.dist import data, join_gloo, shard_batch, spawn_ranks
from .helpers.models import host_accelerator, lm_loss, make_pair, offload_opt, torch_adamw
from .helpers.zero3 import batches as gpt_batches
from .helpers.zero3 import share

SEED = 100  # rank r builds its model from SEED + r: no common seed
TIMEOUT = 4.0  # collective_timeout of the failing cases, seconds


def _stage2_beside_ddp(rank: int, world: int) -> dict:
    """Stage 2 on unseeded ranks, and torch DDP + AdamW on the same unseeded ranks."""
    model, ref = make_pair(seed=SEED + rank)
    ddp = DistributedDataParallel(ref)  # rank 0's weights, everywhere
    ropt = torch_adamw(ref)
    opt = offload_opt(model)
    started = [p.detach().clone() for p in model.parameters()]
    for tokens, targets in data(2):
        share_ = shard_batch(tokens, rank, world), shard_batch(targets, rank, world)
        lm_loss(ddp, *share_).backward()
        ropt.step()
        ropt.zero_grad()
        opt.backward(lm_loss(model, *share_))
        opt.step()
        opt.zero_grad()
    result = {
        "started": started,
        "ours": [p.detach().clone() for p in model.parameters()],
        "ddp": [p.detach().clone() for p in ref.parameters()],
    }
    opt.close()
    return result


def _zero3_beside_ddp(rank: int, world: int, switch: str) -> dict:
    """ZeRO-3 (``switch``: offload_parameters or partition_parameters) on unseeded ranks,
    and torch DDP + AdamW on the same unseeded ranks."""
    torch.manual_seed(SEED + rank)
    model = TinyGPT(GPTConfig(vocab_size=64, seq_len=16, layers=2, hidden=32, heads=4))
    ref = copy.deepcopy(model)
    ddp = DistributedDataParallel(ref)
    ropt = torch_adamw(ref)
    config = OffloadConfig(bucket_bytes=8192, tile_elements=1024, **{switch: True})
    opt = OffloadAdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1,
                       config=config, model=model, accelerator=host_accelerator())  # fmt: skip
    for ids, targets in gpt_batches(2):
        ids, targets = share(ids, rank, world), share(targets, rank, world)
        ddp(ids, targets).backward()
        ropt.step()
        ropt.zero_grad()
        model(ids, targets).backward()
        opt.step()
        opt.zero_grad()
    ours = {k: v.detach().clone() for k, v in model.state_dict().items()}  # collective
    result = {"ours": ours, "ddp": {k: v.detach().clone() for k, v in ref.state_dict().items()}}
    opt.close()
    return result


def _exports(rank: int, out: Path) -> dict:
    """Stage 2: ``save_pretrained`` on every rank, then on rank 0 alone, then
    ``master_weights=True``."""
    model, _ = make_pair()
    opt = offload_opt(model)
    pairs = data(2)
    tokens, targets = pairs[0]
    opt.backward(lm_loss(model, shard_batch(tokens, rank, 2), shard_batch(targets, rank, 2)))
    opt.step()
    opt.zero_grad()
    real, written = hf_export._write_shard, []

    def recording(path: Path, entries: list) -> None:
        written.append(path.name)
        real(path, entries)

    hf_export._write_shard = recording
    try:
        every = save_pretrained(model, out / "export", optimizer=opt, max_shard_size="20KB")
        dist.barrier()  # the files are complete once rank 0 returned
        alone = None
        if rank == 0:  # no collective: the other rank goes on to train
            alone = save_pretrained(model, out / "alone", optimizer=opt)
    finally:
        hf_export._write_shard = real
    tokens, targets = pairs[1]
    opt.backward(lm_loss(model, shard_batch(tokens, rank, 2), shard_batch(targets, rank, 2)))
    opt.step()  # both ranks still in step
    master = None
    try:
        save_pretrained(model, out / "master", optimizer=opt, master_weights=True)
    except ValueError as exc:
        master = str(exc)
    exported = {p.name: None for p in every}
    if rank == 0:
        from safetensors.torch import load_file

        exported = {}
        for path in every:
            exported.update(load_file(path))
    opt.close()
    return {
        "every": [str(p) for p in every],
        "alone": None if alone is None else [str(p) for p in alone],
        "written": written,
        "master": master,
        "exported": exported,
        "trained": {k: v.detach().clone() for k, v in model.state_dict().items()},
    }


def _starts_entry(rank: int, world: int, port: int, out: str) -> None:
    join_gloo(rank, world, port)
    result = {
        "stage2": _stage2_beside_ddp(rank, world),
        "offload_parameters": _zero3_beside_ddp(rank, world, "offload_parameters"),
        "partition_parameters": _zero3_beside_ddp(rank, world, "partition_parameters"),
        "exports": _exports(rank, Path(out)),
    }
    torch.save(result, Path(out) / f"starts.rank{rank}.pt")
    dist.destroy_process_group()


def test_unseeded_ranks_train_as_ddp_and_stage2_exports_write_once(tmp_path: Path) -> None:
    spawn_ranks(_starts_entry, 2, str(tmp_path))
    results = [torch.load(tmp_path / f"starts.rank{r}.pt", weights_only=False) for r in range(2)]
    first, _ = make_pair(seed=SEED)  # rank 0's initial weights
    for rank, result in enumerate(results):
        stage2 = result["stage2"]
        for started, init in zip(stage2["started"], first.parameters(), strict=True):
            assert torch.equal(started, init.detach()), rank  # rank 0's, bit for bit
        for ours, ddp in zip(stage2["ours"], stage2["ddp"], strict=True):
            assert (ours - ddp).abs().max().item() < 1e-5, rank
        for switch in ("offload_parameters", "partition_parameters"):
            ours, ddp = result[switch]["ours"], result[switch]["ddp"]
            assert ours.keys() == ddp.keys()
            for key in ddp:
                assert (ours[key] - ddp[key]).abs().max().item() < 1e-5, (rank, switch, key)
    # stage 2's export: rank 0 writes, rank 1 returns the same paths without writing
    ranks = [result["exports"] for result in results]
    assert ranks[0]["every"] == ranks[1]["every"] and len(ranks[0]["every"]) > 1
    assert ranks[0]["written"] and ranks[1]["written"] == [], ranks[1]["written"]
    assert ranks[0]["alone"] == [str(tmp_path / "alone" / "model.safetensors")]
    assert ranks[1]["alone"] is None
    exported = ranks[0]["exported"]
    trained = ranks[0]["trained"]
    assert exported.keys() <= trained.keys() and exported
    for rank, exports in enumerate(ranks):
        master = exports["master"]
        assert master is not None and master.startswith(f"rank {rank}/2: "), master
        assert "pass optimizer=" not in master, master
        assert "2 ranks" in master and "master_weights=False" in master, master
        assert "save_consolidated" in master, master


def _export_alone_entry(rank: int, world: int, port: int, out: str) -> None:
    """ZeRO-3: rank 0 calls save_pretrained alone while rank 1 trains on (its forwards'
    gathers are the ones the export's reads meet), then stays alive."""
    join_gloo(rank, world, port)
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(vocab_size=64, seq_len=16, layers=2, hidden=32, heads=4))
    config = OffloadConfig(bucket_bytes=8192, offload_parameters=True, collective_timeout=TIMEOUT)
    opt = OffloadAdamW(model.parameters(), lr=1e-3, config=config, model=model,
                       accelerator=host_accelerator())  # fmt: skip
    pairs = gpt_batches(3)
    ids, targets = (share(t, rank, world) for t in pairs[0])
    model(ids, targets).backward()
    opt.step()
    opt.zero_grad()
    dist.barrier()
    result: dict = {"type": None, "error": None}
    began = time.perf_counter()
    try:
        if rank == 0:
            save_pretrained(model, Path(out) / "export", optimizer=opt)
        else:
            for ids, targets in pairs[1:]:
                ids, targets = share(ids, rank, world), share(targets, rank, world)
                model(ids, targets).backward()
                opt.step()
                opt.zero_grad()
    except Exception as exc:
        result = {"type": type(exc).__name__, "error": str(exc)}
    result["seconds"] = time.perf_counter() - began
    torch.save(result, Path(out) / f"alone.rank{rank}.pt")
    if rank == 1:
        time.sleep(2 * TIMEOUT + 6)  # alive: rank 0 must not wait for its exit
    os._exit(0)  # a timed-out collective leaves a thread blocked in gloo


def test_a_zero3_export_on_rank0_alone_raises_within_the_timeout(tmp_path: Path) -> None:
    spawn_ranks(_export_alone_entry, 2, str(tmp_path))
    first = torch.load(tmp_path / "alone.rank0.pt", weights_only=False)
    assert first["type"] == "CollectiveError", first
    assert first["error"].startswith("rank 0/2: "), first["error"]
    assert "save_pretrained" in first["error"], first["error"]
    assert first["seconds"] < 2 * TIMEOUT + 4, first  # its deadline, not rank 1's exit


def _close_entry(rank: int, world: int, port: int, out: str) -> None:
    """Rank 1 fails before a backward and leaves; rank 0 meets a CollectiveError in that
    step, catches it, and closes its optimizer in ``finally``."""
    join_gloo(rank, world, port)
    model, _ = make_pair()
    opt = offload_opt(model, collective_timeout=TIMEOUT)
    result: dict = {"caught": None, "close": None}
    try:
        for step, (tokens, targets) in enumerate(data(3)):
            if rank == 1 and step == 1:
                raise RuntimeError("rank 1 fails on purpose")
            share_ = shard_batch(tokens, rank, world), shard_batch(targets, rank, world)
            opt.backward(lm_loss(model, *share_))
            opt.step()
            opt.zero_grad()
    except (CollectiveError, RuntimeError) as exc:
        result["caught"] = type(exc).__name__
    finally:
        try:
            opt.close()
        except Exception as exc:
            result["close"] = f"{type(exc).__name__}: {exc}"
    result["closed"] = opt.closed
    torch.save(result, Path(out) / f"close.rank{rank}.pt")
    os._exit(0)  # rank 1 leaves at once, closing its sockets; rank 0's group is unusable


def test_close_after_a_caught_collective_error_is_quiet(tmp_path: Path) -> None:
    spawn_ranks(_close_entry, 2, str(tmp_path))
    first = torch.load(tmp_path / "close.rank0.pt", weights_only=False)
    assert first["caught"] == "CollectiveError", first
    assert first["close"] is None, first["close"]
    assert first["closed"]


def test_replaced_storage_names_ddp_and_offload_accelerator() -> None:
    model, _ = make_pair()
    opt = offload_opt(model)
    param = next(model.parameters())
    param.data = param.data.clone()  # as a plain Accelerator's prepare(model) leaves it
    tokens, targets = data(1)[0]
    lm_loss(model, tokens, targets).backward()
    try:
        opt.step()
    except ValueError as exc:
        message = str(exc)
    else:
        raise AssertionError("the step was not refused")
    finally:
        opt.close()
    assert "no longer uses the storage" in message
    assert "accelerate.Accelerator" in message and "OffloadAccelerator" in message, message
    assert "DistributedDataParallel" in message, message
