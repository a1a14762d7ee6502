"""Parameter offload with the optimizer state on NVMe (OffloadConfig(offload_parameters=True,
nvme_dir=...)): each unit's training-dtype home is its bucket's pinned ``weights_staging``,
the master and moments stream from the storage tier. Bitwise parity against the same model
trained with its weights resident and with parameter offload alone, writes between steps,
the files' cleanup, and a corrupted state tile. The disk is real (tmp dirs).

CUDA form (``cuda_form``, docs/gpu.md): the model (test_param_offload's ``gpt``), its batches
and the accelerator are the running test's (tests/helpers/device.py), so under
``--accelerator=cuda`` the window is on ``cuda:0`` and the homes and state stream between the
GPU, pinned RAM and the disk."""

from __future__ import annotations

import functools
import gc
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from zero_offload import OffloadAdamW, OffloadConfig
from zero_offload.accelerator import Accelerator
from zero_offload.errors import StorageFull
from zero_offload.optim.state.nvme import NvmeState
from zero_offload.optim.state.placement import POOL_ALIGNMENT
from zero_offload.optim.update.modes import StepFailed
from zero_offload.params import UnitState

from .helpers.device import on_device, run_accelerator
from .test_param_offload import SEQ, VOCAB, gpt

pytestmark = pytest.mark.cuda_form

STEPS = 3
MICRO = 2  # micro-batches per step: the fp32 accumulator path
CLIP = 0.05  # below the gradients' norm: every step clips


def _accelerator() -> Accelerator:
    return run_accelerator(device_budget="64MiB")


def _opt(
    model: torch.nn.Module,
    *,
    offload: bool,
    accelerator: Accelerator | None = None,
    **config: object,
) -> OffloadAdamW:
    config.setdefault("bucket_bytes", 16384)
    config.setdefault("tile_elements", 1024)
    return OffloadAdamW(
        model.parameters(),
        lr=1e-3,
        betas=(0.9, 0.95),
        weight_decay=0.1,
        config=OffloadConfig(offload_parameters=offload, max_grad_norm=CLIP, **config),  # type: ignore[arg-type]
        accelerator=accelerator or _accelerator(),
        **({"model": model} if offload else {}),
    )


def _train(
    model: torch.nn.Module, opt: OffloadAdamW, steps: int = STEPS, *, seed: int = 1
) -> list[float]:
    gen = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        for _ in range(MICRO):
            ids = on_device(torch.randint(0, VOCAB, (2, SEQ), generator=gen))
            loss = model(ids, ids)
            loss.backward()
            losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return losses


def _weights(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _assert_same(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(a, b), i


def _host_budget(make: functools.partial) -> int:
    """A host budget that holds about half the buckets' state: the rest goes to NVMe."""
    model = make()
    opt = _opt(model, offload=True)
    total = sum(
        sum(t.numel() * t.element_size() for t in b.store.state_tensors().values())
        for b in opt.buckets
    )
    opt.close()
    return total // 2


def _nvme_opt(make: functools.partial, root: Path) -> tuple[torch.nn.Module, OffloadAdamW]:
    model = make()
    opt = _opt(model, offload=True, nvme_dir=root, host_budget=_host_budget(make))
    return model, opt


@pytest.mark.parametrize(
    ("dtype", "tied"), [(torch.float32, False), (torch.bfloat16, True)], ids=["fp32", "bf16-tied"]
)
def test_trains_bitwise_like_resident_and_like_parameter_offload_alone(
    tmp_path: Path, dtype: torch.dtype, tied: bool
) -> None:
    make = functools.partial(gpt, dtype, layers=3, tied=tied)
    results = {}
    for name, config in (("resident", {"offload": False}), ("offload", {"offload": True})):
        model = make()
        opt = _opt(model, **config)  # type: ignore[arg-type]
        results[name] = (_train(model, opt), _weights(model))
        opt.close()
    model, opt = _nvme_opt(make, tmp_path)
    locations = {b.store.location for b in opt.buckets}
    assert locations == {"host", "nvme"}, locations  # both kinds of home
    for bucket in opt.buckets:  # each unit's home is its store's pinned training-dtype copy
        home, _ = bucket.store.weights_home()
        assert bucket.views.home is home and home.dtype == dtype
    losses = _train(model, opt)
    assert all(u.state is UnitState.ON_HOST for u in opt.param_offloader.units)
    got = _weights(model)
    opt.close()
    for name, (want_losses, want) in results.items():
        assert losses == want_losses, name
        _assert_same(got, want)
    _assert_same(_weights(model), got)  # the model keeps its weights after close


def test_a_write_between_steps_reaches_the_nvme_bucket_home(tmp_path: Path) -> None:
    """Note [weights written outside the optimizer]: the master of an NVMe bucket takes the
    written weights from its home (the parameters point there between uses), not from the
    device slot, which holds another unit's weights by then; as parameter offload alone
    does, bit for bit."""
    make = functools.partial(gpt, torch.float32, layers=3)
    runs = []
    for root in (None, tmp_path):
        model = make()
        extra = {} if root is None else {"nvme_dir": root, "host_budget": 1}  # all on NVMe
        opt = _opt(model, offload=True, **extra)  # type: ignore[arg-type]
        _train(model, opt, 1)
        with torch.no_grad():  # the last block shares its slot with units fetched after it
            for param in model.blocks[-1].parameters():
                param.mul_(0.5)
        losses = _train(model, opt, 2)
        if root is not None:
            assert all(isinstance(b.store, NvmeState) for b in opt.buckets)
        runs.append((losses, _weights(model)))
        opt.close()
    (want_losses, want), (losses, got) = runs
    assert losses == want_losses
    _assert_same(got, want)


def test_files_go_at_close_and_at_garbage_collection(tmp_path: Path) -> None:
    make = functools.partial(gpt, torch.bfloat16, layers=2)
    for close in (True, False):
        root = tmp_path / str(close)
        model = make()
        opt = _opt(model, offload=True, nvme_dir=root, host_budget=1)
        _train(model, opt, 1)
        files = [b.store.file.path for b in opt.buckets if isinstance(b.store, NvmeState)]
        assert files and all(os.path.exists(f) for f in files)
        if close:
            opt.close()
        else:
            del opt
            gc.collect()
        assert not list(root.iterdir()), close
        ids = on_device(torch.randint(0, VOCAB, (2, SEQ)))
        assert torch.isfinite(model(ids, ids))  # the model works without the optimizer


def test_a_corrupted_state_tile_names_the_bucket_and_the_file(tmp_path: Path) -> None:
    model = gpt(torch.float32, layers=2)
    opt = _opt(model, offload=True, nvme_dir=tmp_path, host_budget=1)
    _train(model, opt, 1)
    buckets = [b for b in opt.buckets if isinstance(b.store, NvmeState) and b.store.tiles > 1]
    victim = buckets[len(buckets) // 2]
    path = victim.store.file.path
    fd = os.open(path, os.O_WRONLY)
    os.pwrite(fd, np.full(8, 0x7F, dtype=np.uint8).tobytes(), victim.store.file.offset(1) + 8)
    os.fsync(fd)
    os.close(fd)
    ids = on_device(torch.randint(0, VOCAB, (2, SEQ)))
    model(ids, ids).backward()
    with pytest.raises(StepFailed) as caught:
        opt.step()
    message = str(caught.value.__cause__)
    assert f"bucket {victim.layout.index}" in message
    assert "checksum mismatch in record 1" in message and str(path) in message
    opt.close()


def test_streamed_checkpoint_resumes_bitwise(tmp_path: Path) -> None:
    """save_streaming / load_streaming with every bucket's state on NVMe; an eval forward
    before the save leaves units on the device, which neither call may disturb."""
    make = functools.partial(gpt, torch.bfloat16, layers=3)
    model, opt = _nvme_opt(make, tmp_path / "nvme")
    _train(model, opt, 2)
    with torch.no_grad():
        ids = on_device(torch.randint(0, VOCAB, (2, SEQ)))
        model(ids, ids)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    opt.save_streaming(tmp_path / "ckpt")
    want_losses = _train(model, opt, 2, seed=2)
    want = _weights(model)
    opt.close()
    resumed, opt = _nvme_opt(make, tmp_path / "nvme2")
    resumed.load_state_dict(weights)
    opt.load_streaming(tmp_path / "ckpt")
    losses = _train(resumed, opt, 2, seed=2)
    got = _weights(resumed)
    opt.close()
    assert losses == want_losses
    _assert_same(got, want)


def test_a_full_disk_is_refused_at_construction_and_the_model_keeps_its_weights(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = gpt(torch.bfloat16, layers=2)
    before = _weights(model)
    real = os.statvfs

    def full(path: object) -> os.statvfs_result:
        fields = list(real(path))  # type: ignore[arg-type]
        fields[4] = 0  # f_bavail: nothing free
        return os.statvfs_result(fields)

    monkeypatch.setattr(os, "statvfs", full)
    accelerator = _accelerator()
    with pytest.raises(StorageFull, match=r"needs .* on disk under .*rank0, but only 0 B"):
        _opt(model, offload=True, nvme_dir=tmp_path, host_budget=1, accelerator=accelerator)
    # Construction undone: the weights are the model's, the window went back to the budget.
    _assert_same(_weights(model), before)
    assert accelerator.memory_stats()["in_use"] == 0
    assert not list(tmp_path.iterdir())
    monkeypatch.undo()
    opt = _opt(model, offload=True, nvme_dir=tmp_path, host_budget=1, accelerator=accelerator)
    _train(model, opt, 1)
    opt.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_host_memory_against_the_formula(tmp_path: Path, dtype: torch.dtype) -> None:
    make = functools.partial(gpt, dtype, layers=3)
    _model, opt = _nvme_opt(make, tmp_path)
    a = lambda n: -(-n // POOL_ALIGNMENT) * POOL_ALIGNMENT  # noqa: E731
    s = dtype.itemsize
    expected = 0
    for bucket in opt.buckets:
        k = bucket.layout.shard_numel
        assert bucket.views.home is bucket.store.weights_home()[0]  # the unit's home
        if isinstance(bucket.store, NvmeState):
            # the home (weight staging) + gradient staging; master and moments on disk
            expected += a(s * k) + a(s * k)
        else:
            expected += 3 * a(4 * k)  # master, exp_avg, exp_avg_sq (fp32)
            expected += a(s * k)  # gradient staging
            expected += a(s * k) if dtype != torch.float32 else 0  # the home; fp32: the master
    pools = opt.manager.pool_stats()
    host = sum(p["capacity_bytes"] for name, p in pools.items() if name.endswith(".host"))
    # One micro-batch so far: no fp32 accumulator pool; nothing else of the model in RAM.
    assert host == expected
    opt.close()
