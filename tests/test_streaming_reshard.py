"""A streamed checkpoint loads on another number of ranks than saved it (Note [a streamed
checkpoint on another world size] in ``optim/checkpoint/reshard.py``): saved on 2 gloo ranks
and loaded in one process, saved in one process and loaded on 2 ranks, state in host RAM or
on NVMe on either side. What it loads is what a consolidated checkpoint of the same save
loads, bitwise (``opt.state_dict()`` equal), and so is the training that goes on from it;
a corrupted or missing file of a saved rank, a checkpoint whose rank directories come from
different saves, and a rule that reads whole parameters are refused on every rank, naming
the file and the rank, before anything loads.

One process saves first (``_one_rank``), then one spawn of 2 ranks loads those checkpoints
and saves its own (``_two_ranks``), which the test process loads last.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from zero_offload import OffloadAdafactor, OffloadConfig
from zero_offload.checkpoint_io import load_consolidated, save_consolidated
from zero_offload.optim.state.placement import POOL_ALIGNMENT

from .helpers.dist import data, free_port, join_gloo, train_steps
from .helpers.models import host_accelerator, make_pair, offload_opt

FP32_ATOL = 1e-5  # another world size against one process (tests/test_zero3.py)
SAVED_AT = 2  # steps before the save
STEPS = 4  # steps in all: the resumes train SAVED_AT..STEPS-1
#: 1024-element buckets, so some of 2 ranks' shards are padding only (a bucket of two 32-element
#: biases), and the saved tiles and the new shards' tiles cross each other's bounds (a
#: 3072-element parameter alone in its bucket: 2 ranks split it at 1536 and tile each half
#: from there, one rank's tiles end at 1024, 2048 and 3072).
CONFIG: dict[str, Any] = {"bucket_bytes": 4096, "tile_elements": 1024}


def _opt(model: torch.nn.Module, root: Path, nvme: bool, rank: int = 0) -> Any:
    extra = {"nvme_dir": root / f"nvme-{rank}-{id(model)}", "host_budget": 1} if nvme else {}
    return offload_opt(model, **CONFIG, **extra)


def _resumed(root: Path, model_file: str) -> torch.nn.Module:
    model, _ = make_pair(seed=1)  # another init: everything must come from the files
    model.load_state_dict(torch.load(root / model_file, weights_only=True))
    return model


def _state(opt: Any) -> dict[str, Any]:
    return opt.state_dict()["state"]


def _same_state(a: dict[str, Any], b: dict[str, Any]) -> bool:
    if a.keys() != b.keys():
        return False
    for index, entry in a.items():
        other = b[index]
        if entry.keys() != other.keys():
            return False
        for name, value in entry.items():
            if isinstance(value, torch.Tensor):
                if not torch.equal(value, other[name]):
                    return False
            elif value != other[name]:
                return False
    return True


def _weights(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _corrupt(source: Path, target: Path, rank: int, bucket: int, tile: int) -> None:
    """A copy of ``source`` with one byte of saved rank ``rank``'s tile ``tile`` of
    ``bucket`` flipped."""
    shutil.copytree(source, target)
    meta = torch.load(target / f"rank{rank}" / "meta.pt", weights_only=True)
    lo = meta["buckets"][bucket]["tiles"][tile][0]
    row = sum(torch.empty(0, dtype=getattr(torch, d.split(".")[1])).element_size()
              for _, d in meta["buckets"][bucket]["fields"])  # fmt: skip
    path = target / f"rank{rank}" / f"bucket{bucket}.bin"
    data_ = bytearray(path.read_bytes())
    data_[lo * row + 1] ^= 0xFF
    path.write_bytes(bytes(data_))


def _one_rank(root: Path) -> dict[str, Any]:
    """One process trains SAVED_AT steps with its state in host RAM and on NVMe, saves
    streamed checkpoints of both and a consolidated one, and an Adafactor checkpoint."""
    pairs = data(STEPS)
    for nvme in (False, True):
        model, _ = make_pair()
        opt = _opt(model, root, nvme)
        train_steps(model, opt, pairs[:SAVED_AT], 0, 1)
        opt.save_streaming(root / ("one_nvme" if nvme else "one_host"))
        if not nvme:
            save_consolidated(opt, root / "one.pt")
            torch.save(model.state_dict(), root / "one_model.pt")
            layouts = [b.layout for b in opt.buckets]
        opt.close()
    model, _ = make_pair()
    opt = OffloadAdafactor(model.parameters(), lr=1e-2, config=OffloadConfig(**CONFIG),
                           accelerator=host_accelerator())  # fmt: skip
    train_steps(model, opt, pairs[:1], 0, 1)
    opt.save_streaming(root / "one_adafactor")
    opt.close()

    def split(numel: int) -> int:  # 2 ranks' shard (Note [who owns which shard])
        return -(-numel // POOL_ALIGNMENT) * POOL_ALIGNMENT // 2

    assert any(split(lay.numel) >= lay.numel for lay in layouts)  # rank 1: padding only
    # A tile that only rank 1 of 2 reads: the last of the largest bucket, past 2 ranks' split.
    layout = max(layouts, key=lambda lay: lay.numel)
    tiles = torch.load(root / "one_host" / "rank0" / "meta.pt", weights_only=True)["buckets"]
    last = len(tiles[layout.index]["tiles"]) - 1
    assert tiles[layout.index]["tiles"][last][0] >= split(layout.numel)  # the case is there
    _corrupt(root / "one_host", root / "one_corrupt", 0, layout.index, last)
    return {"bucket": layout.index}


def _two_ranks(rank: int, world: int, port: int, out: str) -> None:
    join_gloo(rank, world, port)
    root, pairs, result = Path(out), data(STEPS), {}
    # Saved on one process, loaded here: streamed (host, NVMe) against consolidated.
    model = _resumed(root, "one_model.pt")
    reference = _opt(model, root, False, rank)
    load_consolidated(reference, root / "one.pt")
    expected_state = _state(reference)
    train_steps(model, reference, pairs[SAVED_AT:], rank, world)
    expected = _weights(model)
    reference.close()
    for nvme in (False, True):
        name = "one_nvme" if nvme else "one_host"
        model = _resumed(root, "one_model.pt")
        opt = _opt(model, root, nvme, rank)
        opt.load_streaming(root / name)
        if not nvme:
            result["state"] = _same_state(_state(opt), expected_state)
        train_steps(model, opt, pairs[SAVED_AT:], rank, world)
        result[name] = _same(_weights(model), expected)
        if not nvme:  # refused on both ranks, though rank 1 alone reads the corrupted tile
            before = _state(opt)
            try:
                opt.load_streaming(root / "one_corrupt")
            except ValueError as exc:
                result["corrupt"] = str(exc)
            result["corrupt_unchanged"] = _same_state(_state(opt), before)
        opt.close()
    model, _ = make_pair()
    opt = OffloadAdafactor(model.parameters(), lr=1e-2, config=OffloadConfig(**CONFIG),
                           accelerator=host_accelerator())  # fmt: skip
    try:
        opt.load_streaming(root / "one_adafactor")
    except ValueError as exc:
        result["adafactor"] = str(exc)
    opt.close()
    # Saved here, loaded by the test's process: host and NVMe state, one more step later.
    for nvme in (False, True):
        model, _ = make_pair()
        opt = _opt(model, root, nvme, rank)
        train_steps(model, opt, pairs[:SAVED_AT], rank, world)
        opt.save_streaming(root / ("two_nvme" if nvme else "two_host"))
        if not nvme:
            save_consolidated(opt, root / "two.pt")
            if rank == 0:
                torch.save(model.state_dict(), root / "two_model.pt")
            train_steps(model, opt, pairs[SAVED_AT : SAVED_AT + 1], rank, world)
            opt.save_streaming(root / "two_later")
        opt.close()
    torch.save(result, root / f"two.rank{rank}.pt")
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("reshard")
    one = _one_rank(root)
    mp.spawn(_two_ranks, args=(2, free_port(), str(root)), nprocs=2)
    ranks = [torch.load(root / f"two.rank{r}.pt", weights_only=True) for r in range(2)]
    return {"root": root, "one": one, "ranks": ranks}


def test_saved_on_one_rank_loads_on_two_as_the_consolidated_checkpoint(saved: dict) -> None:
    """Each rank's state is what load_consolidated gives it, bitwise, and so is the training
    from there, with the state in host RAM and on NVMe."""
    for rank, result in enumerate(saved["ranks"]):
        assert result["state"], rank
        assert result["one_host"], rank
        assert result["one_nvme"], rank


def _one_process_reference(root: Path) -> tuple[dict[str, Any], list[torch.Tensor]]:
    pairs = data(STEPS)
    model = _resumed(root, "two_model.pt")
    opt = _opt(model, root, False)
    load_consolidated(opt, root / "two.pt")
    state = _state(opt)
    train_steps(model, opt, pairs[SAVED_AT:], 0, 1)
    opt.close()
    return state, _weights(model)


@pytest.mark.parametrize(
    ("name", "nvme"),
    [("two_host", False), ("two_nvme", False), ("two_host", True)],
    ids=["host-to-host", "nvme-to-host", "host-to-nvme"],
)
def test_saved_on_two_ranks_loads_on_one_as_the_consolidated_checkpoint(
    saved: dict, name: str, nvme: bool
) -> None:
    root = saved["root"]
    state, expected = _one_process_reference(root)
    model = _resumed(root, "two_model.pt")
    opt = _opt(model, root, nvme)
    opt.load_streaming(root / name)
    if not nvme:
        assert _same_state(_state(opt), state)
    train_steps(model, opt, data(STEPS)[SAVED_AT:], 0, 1)
    opt.close()
    assert _same(_weights(model), expected)


def test_the_resume_on_one_process_is_the_uninterrupted_run_within_tolerance(saved: dict) -> None:
    """As for load_consolidated: the first SAVED_AT steps reduced 2 ranks' gradients in
    another order than one process does."""
    root = saved["root"]
    model = _resumed(root, "two_model.pt")
    opt = _opt(model, root, False)
    opt.load_streaming(root / "two_host")
    train_steps(model, opt, data(STEPS)[SAVED_AT:], 0, 1)
    opt.close()
    reference, _ = make_pair()
    opt = _opt(reference, root, False)
    train_steps(reference, opt, data(STEPS), 0, 1)
    opt.close()
    pairs = zip(_weights(model), _weights(reference), strict=True)
    assert max((a - b).abs().max().item() for a, b in pairs) < FP32_ATOL


def _refused(root: Path, name: str) -> str:
    """Load ``name`` into a trained one-process optimizer: the refusal, its state unchanged."""
    model = _resumed(root, "two_model.pt")
    opt = _opt(model, root, False)
    load_consolidated(opt, root / "two.pt")
    before = _state(opt)
    with pytest.raises(ValueError) as caught:
        opt.load_streaming(root / name)
    assert _same_state(_state(opt), before)  # nothing was loaded
    opt.close()
    return str(caught.value)


def test_a_corrupted_file_of_a_saved_rank_is_refused_naming_it(saved: dict) -> None:
    root, bucket = saved["root"], saved["one"]["bucket"]
    _corrupt(root / "two_host", root / "two_corrupt", 1, bucket, 0)
    message = _refused(root, "two_corrupt")
    assert f"rank1/bucket{bucket}.bin (saved rank 1)" in message and "checksum" in message
    assert "nothing was loaded" in message


def test_a_missing_saved_rank_or_file_is_refused_naming_it(saved: dict) -> None:
    root, bucket = saved["root"], saved["one"]["bucket"]
    shutil.copytree(root / "two_host" / "rank0", root / "two_missing" / "rank0")
    message = _refused(root, "two_missing")
    assert "rank1/meta.pt does not exist" in message and "saved rank 1" in message
    shutil.copytree(root / "two_host", root / "two_no_bucket")
    (root / "two_no_bucket" / "rank1" / f"bucket{bucket}.bin").unlink()
    message = _refused(root, "two_no_bucket")
    assert f"rank1/bucket{bucket}.bin (saved rank 1) cannot be read" in message


def test_rank_directories_of_different_saves_are_refused(saved: dict) -> None:
    """Every saved rank's save id is read, though one process has only rank 0."""
    root = saved["root"]
    shutil.copytree(root / "two_host" / "rank0", root / "two_mixed" / "rank0")
    shutil.copytree(root / "two_later" / "rank1", root / "two_mixed" / "rank1")
    message = _refused(root, "two_mixed")
    assert "saved rank(s) [1] are from another save" in message


def test_a_refusal_on_one_rank_is_raised_on_every_rank(saved: dict) -> None:
    """Saved on one process, loaded on 2: rank 1 alone reads the corrupted tile; both
    refuse and neither loads anything."""
    ranks, bucket = saved["ranks"], saved["one"]["bucket"]
    assert f"rank 1/2: {saved['root']}/one_corrupt/rank0/bucket{bucket}.bin" in ranks[1]["corrupt"]
    assert "refused on rank(s) [1], so on every rank" in ranks[0]["corrupt"]
    assert all(result["corrupt_unchanged"] for result in ranks)


def test_a_rule_that_reads_whole_parameters_is_refused_naming_it(saved: dict) -> None:
    for rank, result in enumerate(saved["ranks"]):
        message = result["adafactor"]
        assert f"rank {rank}/2" in message and "'adafactor' rule reads whole" in message
        assert "save_consolidated" in message and "nothing was loaded" in message
