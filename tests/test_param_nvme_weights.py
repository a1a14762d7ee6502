"""The weights themselves on NVMe (ZeRO-Infinity's ``offload_param: nvme``): with parameter
offload and ``nvme_dir``, the training-dtype homes of the units that do not fit
``host_budget`` live in weight files of the storage tier, fetched through the window's
bounce ring and written by the step tile by tile (Notes [homes on NVMe] in
``optim/state/nvme_plan.py``, [homes on NVMe are fetched through a bounce ring] in
``params/home_store.py``). Bitwise parity against a resident build, the disk actually read,
host memory against the formula, a corrupted weight tile, a full disk, the files' cleanup,
state-dict copies, and a safetensors round trip. The disk is real (tmp dirs).

CUDA form (``cuda_form``, docs/gpu.md): the models, batches and accelerators come from the
device-aware builders of test_param_offload_nvme, test_param_offload and test_build_anywhere,
so under ``--accelerator=cuda`` the window is on ``cuda:0`` and each fetch reads the disk into
the bounce ring and copies it to the GPU. State dict entries of NVMe homes are host copies,
compared with the parameters on the entries' device."""

from __future__ import annotations

import functools
import gc
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from transformers import GPT2LMHeadModel

from zero_offload import load_pretrained, save_pretrained
from zero_offload.errors import StorageError, StorageFull
from zero_offload.memory.storage import IO_ALIGNMENT
from zero_offload.memory.traffic import Category, Direction
from zero_offload.optim.state.nvme import NvmeState
from zero_offload.optim.state.nvme_weights import NvmeHomeState
from zero_offload.optim.state.placement import POOL_ALIGNMENT
from zero_offload.params import UnitState
from zero_offload.weights.nvme_home import home_ring_bytes

from .helpers.device import on_device
from .test_build_anywhere import make_opt, on_meta, saved, train
from .test_param_offload import SEQ, VOCAB, gpt
from .test_param_offload_nvme import STEPS, _assert_same, _opt, _train, _weights

pytestmark = pytest.mark.cuda_form
TILE = 1024  # tile_elements of every build here (_opt's default)


def _checkpointed(block: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return torch_checkpoint.checkpoint(block, x, use_reentrant=False)


def _homes_on_nvme(model: torch.nn.Module, root: Path) -> object:
    """host_budget=1: every bucket's state and home on NVMe."""
    return _opt(model, offload=True, nvme_dir=root, host_budget=1)


def _weight_files(opt: object) -> list[str]:
    return [b.store.home.path for b in opt.buckets]  # type: ignore[attr-defined]


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_trains_bitwise_like_resident_reading_the_homes_from_disk(
    tmp_path: Path, dtype: torch.dtype, checkpointing: bool
) -> None:
    runner = _checkpointed if checkpointing else None
    make = functools.partial(gpt, dtype, layers=3, tied=dtype == torch.bfloat16, runner=runner)
    model = make()
    opt = _opt(model, offload=False)
    want_losses, want = _train(model, opt), _weights(model)
    opt.close()
    model = make()
    opt = _homes_on_nvme(model, tmp_path)
    assert all(isinstance(b.store, NvmeHomeState) for b in opt.buckets)
    assert all(b.store.weights_staging is None for b in opt.buckets)  # no home in RAM
    counters = opt.manager.counters
    read0 = counters.bytes(Direction.NVME_READ, Category.WEIGHTS)
    written0 = counters.bytes(Direction.NVME_WRITE, Category.WEIGHTS)
    losses = _train(model, opt)
    assert all(u.state is UnitState.ON_HOST for u in opt.param_offloader.units)
    disk = sum(b.store.home.file.nbytes for b in opt.buckets)
    # Every unit is fetched from its weight file at least once per step (a step makes
    # every slot stale), and every weight record is written once per step.
    assert counters.bytes(Direction.NVME_READ, Category.WEIGHTS) - read0 >= STEPS * disk
    assert counters.bytes(Direction.NVME_WRITE, Category.WEIGHTS) - written0 == STEPS * disk
    got = _weights(model)
    opt.close()
    assert losses == want_losses
    _assert_same(got, want)


def test_the_budget_holds_the_homes_first_then_the_state(tmp_path: Path) -> None:
    """Note [homes on NVMe]: host_budget holds the homes first, in bucket order (the rest in
    weight files, their state on NVMe too), then the master and moments."""
    make = functools.partial(gpt, torch.float32, layers=3)
    a = lambda n: -(-n // POOL_ALIGNMENT) * POOL_ALIGNMENT  # noqa: E731
    model = make()
    probe = _homes_on_nvme(model, tmp_path / "probe")
    homes = [a(b.layout.shard_numel * 4) for b in probe.buckets]  # type: ignore[attr-defined]
    states = [3 * h for h in homes]  # fp32 master, exp_avg, exp_avg_sq
    probe.close()  # type: ignore[attr-defined]
    # Every home and the first bucket's state: the rest of the state on NVMe.
    model = make()
    budget = sum(homes) + states[0]
    opt = _opt(model, offload=True, nvme_dir=tmp_path / "a", host_budget=budget)
    kinds = [type(b.store).__name__ for b in opt.buckets]
    assert kinds == ["HostState"] + ["NvmeState"] * (len(kinds) - 1), kinds
    opt.close()
    # Half the homes: the others in weight files, and no state in RAM.
    model = make()
    budget = sum(homes[: len(homes) // 2])
    opt = _opt(model, offload=True, nvme_dir=tmp_path / "b", host_budget=budget)
    on_disk = [isinstance(b.store, NvmeHomeState) for b in opt.buckets]
    assert all(isinstance(b.store, NvmeState) for b in opt.buckets)
    assert on_disk == [False] * (len(homes) // 2) + [True] * (len(homes) - len(homes) // 2)
    first = opt.buckets[0]  # a home in RAM is its store's staging, as before
    assert first.views.home is first.store.weights_home()[0]
    _train(model, opt, 1)
    opt.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_host_memory_against_the_formula(tmp_path: Path, dtype: torch.dtype) -> None:
    model = gpt(dtype, layers=3)
    opt = _homes_on_nvme(model, tmp_path)
    _train(model, opt, 1)
    a = lambda n: -(-n // POOL_ALIGNMENT) * POOL_ALIGNMENT  # noqa: E731
    io = lambda n: -(-n // IO_ALIGNMENT) * IO_ALIGNMENT  # noqa: E731
    s = dtype.itemsize
    host = sum(a(s * b.layout.shard_numel) for b in opt.buckets)  # gradient staging only
    host += home_ring_bytes(TILE, s)  # the step's 3 weight tiles, 4 KiB-aligned
    pools = opt.manager.pool_stats()
    got = sum(p["capacity_bytes"] for name, p in pools.items() if name.endswith(".host"))
    assert got == host  # one micro-batch: no fp32 accumulator; no home, master or moment
    # The bounce ring: per window slot, the records of the largest unit placed there,
    # plus 4 KiB to align them.
    offloader = opt.param_offloader
    per_slot: dict[int, int] = {}
    for unit in offloader.units:
        records = sum(v.nvme_home.staged_bytes for v in unit.views)
        per_slot[unit.slot.index] = max(per_slot.get(unit.slot.index, 0), records)
    bounce = sum(n + IO_ALIGNMENT for n in per_slot.values())
    got = sum(p["capacity_bytes"] for name, p in pools.items() if name.endswith(".bounce"))
    assert got == bounce
    # Each record is one tile of training-dtype weights, 4 KiB-aligned.
    assert all(r == io(TILE * s) for r in [b.store.home.record_bytes for b in opt.buckets])
    # Nothing proportional to the model is left in host RAM: the two pools are the
    # gradient staging (the other helper's item) plus rings sized by tiles and slots.
    opt.close()


def test_a_corrupted_weight_tile_names_the_unit_and_the_file(tmp_path: Path) -> None:
    model = gpt(torch.float32, layers=2)
    opt = _homes_on_nvme(model, tmp_path)
    _train(model, opt, 1)
    victim = max(opt.buckets, key=lambda b: b.store.home.tiles)
    home = victim.store.home
    assert home.tiles > 1
    fd = os.open(home.path, os.O_WRONLY)
    os.pwrite(fd, np.full(8, 0x7F, dtype=np.uint8).tobytes(), home.file.offset(1) + 8)
    os.fsync(fd)
    os.close(fd)
    ids = on_device(torch.randint(0, VOCAB, (2, SEQ)))
    with pytest.raises(StorageError) as caught:
        model(ids, ids)  # the forward fetches the unit from its file
    message = str(caught.value)
    unit = next(u for u in opt.param_offloader.units if victim.views in u.views)
    assert f"unit {unit.index} ({unit.spec.name}) bucket {victim.layout.index}" in message
    assert home.path in message and "checksum mismatch in record 1" in message
    with pytest.warns(UserWarning, match=f"bucket {victim.layout.index} .* is NaN now"):
        opt.close()  # everything else is released; the unreadable weights say so


def test_close_after_two_bad_weight_files_still_removes_every_file(tmp_path: Path) -> None:
    """Two units' weight files go bad (a failing disk); the forward fails naming one, and a
    prefetch of the other holds its own read error. close() raises that error, but only
    after releasing everything: the files and the lock go (they stayed, and a second
    close() did nothing, when the prefetch's error stopped the release early)."""
    model = gpt(torch.float32, layers=2)
    opt = _homes_on_nvme(model, tmp_path)
    _train(model, opt, 1)
    first_two = opt.param_offloader.units[:2]  # the forward's first unit and its prefetch
    victims = [b for b in opt.buckets if any(b.views in u.views for u in first_two)]
    for victim in victims:
        fd = os.open(victim.store.home.path, os.O_WRONLY)
        os.pwrite(fd, np.full(64, 0xFF, dtype=np.uint8).tobytes(), 100)
        os.fsync(fd)
        os.close(fd)
    ids = on_device(torch.randint(0, VOCAB, (2, SEQ)))
    with pytest.raises(StorageError):
        model(ids, ids)
    with pytest.warns(UserWarning, match="is NaN now"), pytest.raises(StorageError):
        opt.close()  # the prefetch's error, raised after the release
    assert not [p for p in tmp_path.rglob("*") if p.is_file()]
    opt.close()  # closed: nothing left to do


def test_a_full_disk_is_refused_at_construction_counting_the_weight_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = gpt(torch.bfloat16, layers=2)
    opt = _homes_on_nvme(model, tmp_path / "probe")
    state = sum(b.store.file.nbytes for b in opt.buckets)
    homes = sum(b.store.home.file.nbytes for b in opt.buckets)
    opt.close()
    before = _weights(model)
    free = state + homes // 2  # enough for the state, not for the homes too
    monkeypatch.setattr(
        "zero_offload.memory.state_dir.StateDirectory.free_bytes", lambda self: free
    )
    with pytest.raises(StorageFull, match=r"needs .* on disk"):
        _homes_on_nvme(model, tmp_path / "full")
    _assert_same(_weights(model), before)
    assert not list((tmp_path / "full").iterdir())
    monkeypatch.undo()
    opt = _homes_on_nvme(model, tmp_path / "full")
    _train(model, opt, 1)
    opt.close()


@pytest.mark.parametrize("close", [True, False], ids=["close", "gc"])
def test_weight_files_go_at_close_and_at_garbage_collection(tmp_path: Path, close: bool) -> None:
    model = gpt(torch.bfloat16, layers=2)
    opt = _homes_on_nvme(model, tmp_path)
    _train(model, opt, 1)
    weights = _weight_files(opt)
    assert weights and all(os.path.exists(f) for f in weights)
    expected = _weights(model)
    if close:
        opt.close()
    else:
        del opt
        gc.collect()
    assert not list(tmp_path.iterdir())
    _assert_same(_weights(model), expected)  # the model keeps its weights from the files
    ids = on_device(torch.randint(0, VOCAB, (2, SEQ)))
    assert torch.isfinite(model(ids, ids))


def test_state_dict_entries_are_copies_whose_writes_reach_the_home(tmp_path: Path) -> None:
    """Note [state dict entries are views of the homes]: an NVMe home gives copies read from
    disk; a write to one is carried home at the next forward or step, as torch's aliasing
    entries would carry it, bit for bit like a write through the parameter."""
    runs = []
    for via_entry in (False, True):
        model = gpt(torch.float32, layers=2)
        opt = _homes_on_nvme(model, tmp_path / str(via_entry))
        _train(model, opt, 1)
        entries = model.state_dict()
        for name, param in model.named_parameters():
            assert torch.equal(entries[name], param.detach().to(entries[name].device)), name
        key = "blocks.1.mlp.0.weight" if "blocks.1.mlp.0.weight" in entries else next(iter(entries))
        with torch.no_grad():
            if via_entry:
                entries[key].mul_(0.5)
            else:
                model.get_parameter(key).mul_(0.5)
        losses = _train(model, opt, 2)
        runs.append((losses, _weights(model)))
        opt.close()
    assert runs[0][0] == runs[1][0]
    _assert_same(runs[1][1], runs[0][1])


def test_load_pretrained_into_nvme_homes_and_save_pretrained_back(tmp_path: Path) -> None:
    path = saved(tmp_path, sharded=True)
    reference = GPT2LMHeadModel.from_pretrained(path)
    ref_opt = make_opt(reference)
    train(reference, ref_opt)
    expected = {n: p.detach().clone() for n, p in reference.named_parameters()}
    ref_opt.close()
    model = load_pretrained(on_meta(), path)
    opt = make_opt(model, offload_parameters=True, nvme_dir=str(tmp_path / "nvme"), host_budget=1)
    assert all(isinstance(b.store, NvmeHomeState) for b in opt.buckets)
    train(model, opt)
    out = tmp_path / "export"
    save_pretrained(model, out, optimizer=opt, max_shard_size="20KB")
    opt.close()
    loaded = GPT2LMHeadModel.from_pretrained(out)
    got = dict(loaded.named_parameters())
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(got[name], value.to(got[name].device)), name  # got: read from files
