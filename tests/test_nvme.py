"""The NVMe storage tier (memory/storage.py, with storage_file.py, io_engine.py and
io_buffers.py) and optimizer state on it (optim/state/nvme.py, optim/checkpoint/streaming.py):
parity with the in-RAM optimizer, memory and disk bytes against their formulas, streamed
checkpoints, and injected faults. The disk is real (tmp dirs).

CUDA form (``cuda_form``): the optimizer-level tests build through tests/helpers, so under
``--accelerator=cuda`` the model, data, accelerator and optimizer are on ``cuda:0`` and the
state on disk; bitwise stays bitwise. Host only: the storage tier's own tests, the host memory
and RSS formulas, the children and gloo ranks (they build on the host accelerator), the
event timing of the profiler's records and the simulated link."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import warnings
from datetime import timedelta
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from zero_offload import OffloadAdamW, OffloadConfig
from zero_offload.errors import StorageError, StorageFull
from zero_offload.memory import io_engine
from zero_offload.memory.storage import IO_ALIGNMENT, IOBufferState, StorageTier, aligned
from zero_offload.memory.traffic import CopyRecord, Direction
from zero_offload.optim.checkpoint.streaming import load_streaming, save_streaming
from zero_offload.optim.state.nvme import NvmeState, StateNotInHostRam
from zero_offload.optim.state.placement import POOL_ALIGNMENT
from zero_offload.optim.update.modes import StepFailed

from .helpers.dist import data, free_port, train_steps
from .helpers.models import batches, host_accelerator, lm_loss, make_pair, max_diff, train

REPO = Path(__file__).resolve().parents[1]
SHM = Path("/dev/shm")

# Small buckets, four tiles each: every step crosses the ring of I/O buffers many times.
BUCKET_BYTES = 16384
TILE = 1024


def _config(**extra: object) -> OffloadConfig:
    return OffloadConfig(bucket_bytes=BUCKET_BYTES, tile_elements=TILE, **extra)  # type: ignore[arg-type]


def _opt(model: torch.nn.Module, **extra: object) -> OffloadAdamW:
    return OffloadAdamW(
        model.parameters(),
        lr=1e-3,
        betas=(0.9, 0.95),
        weight_decay=0.1,
        config=_config(**extra),
        accelerator=host_accelerator(),
    )


def _state_bytes(opt: OffloadAdamW) -> int:
    """Master and moments of every bucket, as the host pool would hold them (aligned)."""
    a = lambda n: -(-n // POOL_ALIGNMENT) * POOL_ALIGNMENT  # noqa: E731
    return sum(3 * a(4 * b.layout.shard_numel) for b in opt.buckets)


def _nvme_buckets(opt: OffloadAdamW) -> list[NvmeState]:
    return [b.store for b in opt.buckets if isinstance(b.store, NvmeState)]


def _quarter_budget(dtype: torch.dtype) -> tuple[int, int]:
    """(state bytes of the model's optimizer, a host budget a quarter of it)."""
    model, _ = make_pair(dtype)
    opt = _opt(model)
    total = _state_bytes(opt)
    opt.close()
    return total, total // 4


def _nvme_state(backend: NvmeState) -> dict[str, torch.Tensor]:
    """A bucket's fields read back from disk (checksums verified), as flat CPU tensors."""
    parts: dict[str, list[torch.Tensor]] = {}

    def take(lo: int, hi: int, fields: dict[str, torch.Tensor]) -> None:
        for name, view in fields.items():
            parts.setdefault(name, []).append(view.clone())

    backend.stream_fields(take)
    return {name: torch.cat(chunks) for name, chunks in parts.items()}


def _params_equal(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))


# -- the storage tier ----------------------------------------------------------------------


def _tier(root: Path, **kwargs: object) -> StorageTier:
    kwargs.setdefault("needed_bytes", 1 << 20)
    kwargs.setdefault("buffer_bytes", 3 * IO_ALIGNMENT)
    return StorageTier(root, rank=0, accelerator=host_accelerator(), **kwargs)  # type: ignore[arg-type]


def _roundtrip(tier: StorageTier) -> None:
    file = tier.create_file("t", slots=3, record_bytes=tier.buffer_bytes)
    out, back = tier.buffers[0], tier.buffers[1]
    for slot in range(3):
        out.transition(IOBufferState.FREE, IOBufferState.HELD)
        out.data.copy_(torch.arange(out.data.numel(), dtype=torch.int64).to(torch.uint8) + slot)
        file.submit_write(slot, out).synchronize()
        out.settle()
    for slot in range(3):
        file.submit_read(slot, back).synchronize()
        expected = torch.arange(back.data.numel(), dtype=torch.int64).to(torch.uint8) + slot
        assert torch.equal(back.data, expected)
        back.settle()


def test_direct_io_on_the_disk(tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning on a real disk
        tier = _tier(tmp_path)
    assert tier.direct
    assert all(b.data.data_ptr() % IO_ALIGNMENT == 0 for b in tier.buffers)
    assert len(tier.buffers) == 4
    _roundtrip(tier)
    tier.close()
    assert not (tmp_path / "rank0").exists()


def _refuses_o_direct(directory: Path) -> bool:
    probe = directory / "zo-probe"
    try:
        os.close(os.open(probe, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600))
    except OSError:
        return True
    finally:
        probe.unlink(missing_ok=True)
    return False


@pytest.mark.skipif(not SHM.is_dir(), reason="needs a tmpfs at /dev/shm")
def test_tmpfs_with_o_direct_or_the_buffered_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    """tmpfs refuses O_DIRECT before Linux 6.6 and accepts it since: where it accepts it,
    the refusal is simulated (EINVAL from open, what older kernels and FUSE return)."""
    root = SHM / f"zo-test-{os.getpid()}"
    root.mkdir()
    if not _refuses_o_direct(root):
        real_open = os.open

        def old_tmpfs(path: object, flags: int, *args: object) -> int:
            if flags & os.O_DIRECT:
                raise OSError(22, "Invalid argument")
            return real_open(path, flags, *args)  # type: ignore[arg-type]

        monkeypatch.setattr(os, "open", old_tmpfs)
    tier = _tier(root)
    with pytest.warns(UserWarning, match=r"refuses O_DIRECT .* falls back to buffered I/O"):
        tier.create_file("probe", slots=1, record_bytes=IO_ALIGNMENT)
    assert not tier.direct
    _roundtrip(tier)
    tier.close()
    monkeypatch.undo()
    assert not (root / "rank0").exists()
    root.rmdir()


@pytest.mark.cuda_form
@pytest.mark.skipif(not SHM.is_dir(), reason="needs a tmpfs at /dev/shm")
def test_optimizer_on_a_buffered_fallback_trains_like_in_ram(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real_open = os.open
    monkeypatch.setattr(
        os,
        "open",
        lambda p, flags, *a: (
            (_ for _ in ()).throw(OSError(22, "Invalid argument"))
            if flags & os.O_DIRECT
            else real_open(p, flags, *a)
        ),
    )
    root = SHM / f"zo-test-opt-{os.getpid()}"
    model, ref = make_pair()
    with pytest.warns(UserWarning, match="refuses O_DIRECT"):
        opt = _opt(model, nvme_dir=root, host_budget=1)
    ropt = _opt(ref)
    train(model, opt, batches(3))
    train(ref, ropt, batches(3))
    assert _params_equal(model, ref)
    opt.close()
    ropt.close()
    root.rmdir()


def test_corrupted_record_is_caught_by_its_checksum(tmp_path: Path) -> None:
    tier = _tier(tmp_path)
    file = tier.create_file("c", slots=2, record_bytes=tier.buffer_bytes)
    buffer = tier.buffers[0]
    buffer.transition(IOBufferState.FREE, IOBufferState.HELD)
    buffer.data.fill_(7)
    file.submit_write(1, buffer).synchronize()
    buffer.settle()
    fd = os.open(file.path, os.O_WRONLY)
    os.pwrite(fd, b"\x00" * 16, file.offset(1) + 100)  # a bit flip from outside
    os.fsync(fd)
    os.close(fd)
    file.submit_read(1, buffer)
    with pytest.raises(StorageError, match=r"checksum mismatch in record 1 of .*c\.zo-state"):
        buffer.settle()  # waits for the read, which raises; the buffer is FREE again
    assert buffer.state is IOBufferState.FREE
    with pytest.raises(RuntimeError, match="record 0 read before written"):
        file.submit_read(0, buffer)
    file.submit_read(1, buffer)  # a read does not fail the file: the record is still bad
    with pytest.raises(StorageError, match="checksum mismatch in record 1"):
        buffer.settle()
    tier.close()


def test_full_disk_is_refused_with_the_numbers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = os.statvfs

    def tiny(path: object) -> os.statvfs_result:
        stats = real(path)  # type: ignore[arg-type]
        fields = list(stats)
        fields[4] = 3  # f_bavail: three blocks free
        return os.statvfs_result(fields)

    monkeypatch.setattr(os, "statvfs", tiny)
    free = 3 * real(tmp_path).f_frsize
    with pytest.raises(StorageFull) as caught:
        _tier(tmp_path, needed_bytes=10 << 20)
    message = str(caught.value)
    assert f"({10 << 20} bytes)" in message and f"({free} bytes) is free" in message
    assert str(tmp_path / "rank0") in message and "nvme_dir" in message
    assert not (tmp_path / "rank0").exists()  # the lock went with the refusal


@pytest.mark.cuda_form
def test_full_disk_at_optimizer_construction(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, ref = make_pair()
    real = os.statvfs
    monkeypatch.setattr(
        os, "statvfs", lambda p: os.statvfs_result([*list(real(p))[:4], 0, *list(real(p))[5:]])
    )
    with pytest.raises(StorageFull, match=r"needs .* on disk under .*rank0, but only 0 B"):
        _opt(model, nvme_dir=tmp_path, host_budget=1)
    assert _params_equal(model, ref)  # the model keeps its weights
    assert not list(tmp_path.iterdir())


_KEEP_ALIVE = """
import sys, time, torch
sys.path.insert(0, {repo!r})
from tests.helpers.models import make_pair, host_accelerator
from zero_offload import OffloadAdamW, OffloadConfig
model, _ = make_pair()
opt = OffloadAdamW(model.parameters(), accelerator=host_accelerator(),
                   config=OffloadConfig(bucket_bytes=16384, tile_elements=1024,
                                        nvme_dir={root!r}, host_budget=1))
print("ready", flush=True)
if {wait}:
    time.sleep(600)
"""


def _child(root: Path, *, wait: bool) -> subprocess.Popen:
    code = _KEEP_ALIVE.format(repo=str(REPO), root=str(root), wait=wait)
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None and child.stdout.readline().strip() == "ready"
    return child


def test_files_go_at_interpreter_exit_without_close(tmp_path: Path) -> None:
    child = _child(tmp_path, wait=False)
    assert child.wait(timeout=60) == 0
    assert not list(tmp_path.iterdir())  # atexit closed the tier


def test_a_killed_run_leaves_a_stale_directory_which_is_cleaned(tmp_path: Path) -> None:
    child = _child(tmp_path, wait=True)
    directory = tmp_path / "rank0"
    try:
        # A live owner: refused, naming its pid.
        with pytest.raises(ValueError, match=rf"in use by the live process {child.pid}"):
            _tier(tmp_path)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=60)
    stale = list(directory.glob("*.zo-state"))
    assert stale and (directory / "LOCK").exists()  # killed: nothing cleaned up
    model, _ = make_pair()
    with pytest.warns(UserWarning, match=rf"left by process {child.pid}, which is gone"):
        opt = _opt(model, nvme_dir=tmp_path, host_budget=1)
    assert not any(path.exists() for path in stale)
    assert f"{os.getpid()}" in (directory / "LOCK").read_text()
    opt.close()
    assert not directory.exists()


def test_a_lock_from_another_host_is_refused(tmp_path: Path) -> None:
    directory = tmp_path / "rank0"
    directory.mkdir()
    (directory / "LOCK").write_text("some-other-host\n12345\n")
    with pytest.raises(ValueError, match="locked by pid 12345 on host 'some-other-host'"):
        _tier(tmp_path)
    assert (directory / "LOCK").exists()  # refused: left alone


# -- the optimizer on NVMe ---------------------------------------------------------------


@pytest.mark.cuda_form
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_state_four_times_the_host_budget_trains_bitwise_like_in_ram(
    tmp_path: Path, dtype: torch.dtype
) -> None:
    total, budget = _quarter_budget(dtype)
    model, ref = make_pair(dtype)
    opt = _opt(model, nvme_dir=tmp_path, host_budget=budget)
    ropt = _opt(ref)
    nvme = _nvme_buckets(opt)
    assert total >= 4 * budget and len(nvme) >= 3 * len(opt.buckets) // 4
    assert all(len(b.tier.buffers) == 4 for b in nvme)
    data = batches(20)
    for tokens, targets in data:
        ours = lm_loss(model, tokens, targets)
        ours.backward()
        theirs = lm_loss(ref, tokens, targets)
        theirs.backward()
        assert ours.item() == theirs.item()
        opt.step()
        ropt.step()
        opt.zero_grad()
        ropt.zero_grad()
        assert _params_equal(model, ref)
    # The state on disk is the in-RAM state, bit for bit.
    for bucket, rbucket in zip(opt.buckets, ropt.buckets, strict=True):
        if isinstance(bucket.store, NvmeState):
            disk = _nvme_state(bucket.store)
            real = bucket.store.real
            for name, tensor in rbucket.store.state_tensors().items():
                assert torch.equal(disk[name], tensor[:real]), (bucket.layout.index, name)
    opt.close()
    assert not list(tmp_path.iterdir())


@pytest.mark.cuda_form
@pytest.mark.parametrize(
    ("moments", "amsgrad"),
    [("bfloat16", False), ("float32", True)],
    ids=["bf16-moments", "amsgrad"],
)
def test_other_state_layouts_on_nvme_are_bitwise(
    tmp_path: Path, moments: str, amsgrad: bool
) -> None:
    model, ref = make_pair(torch.bfloat16)
    opts = []
    for m, extra in ((model, {"nvme_dir": tmp_path, "host_budget": 1}), (ref, {})):
        opts.append(
            OffloadAdamW(
                m.parameters(),
                lr=1e-3,
                amsgrad=amsgrad,
                config=_config(moments_dtype=moments, **extra),
                accelerator=host_accelerator(),
            )
        )
    nvme = _nvme_buckets(opts[0])
    assert nvme and nvme[0].state_names()[-1] == ("max_exp_avg_sq" if amsgrad else "exp_avg_sq")
    train(model, opts[0], batches(5))
    train(ref, opts[1], batches(5))
    assert _params_equal(model, ref)
    for o in opts:
        o.close()


@pytest.mark.cuda_form
@pytest.mark.parametrize("mode", ["overlap_step", "step_during_backward"])
def test_update_modes_on_nvme_are_bitwise_the_in_ram_ones(tmp_path: Path, mode: str) -> None:
    """The delayed update (on the host worker) and the step announced in backward (each
    bucket stepped as its gradients land) stream NVMe buckets in bucket order too."""
    extra = {"overlap_step": True} if mode == "overlap_step" else {}
    model, ref = make_pair(torch.bfloat16)
    opt = _opt(model, nvme_dir=tmp_path, host_budget=1, **extra)
    ropt = _opt(ref, **extra)
    assert len(_nvme_buckets(opt)) == len(opt.buckets)
    for tokens, targets in batches(6):
        for m, o in ((model, opt), (ref, ropt)):
            loss = lm_loss(m, tokens, targets)
            if mode == "step_during_backward":
                o.backward(loss, step=True)
            else:
                loss.backward()
                o.step()
            o.zero_grad()
        if mode == "step_during_backward":
            assert _params_equal(model, ref)
    opt.flush_pending_update()
    ropt.flush_pending_update()
    assert _params_equal(model, ref)
    opt.close()
    ropt.close()


def test_host_memory_against_the_formula(tmp_path: Path) -> None:
    _, budget = _quarter_budget(torch.bfloat16)
    model, _ = make_pair(torch.bfloat16)
    opt = _opt(model, nvme_dir=tmp_path, host_budget=budget)
    a = lambda n: -(-n // POOL_ALIGNMENT) * POOL_ALIGNMENT  # noqa: E731
    host_state = 0
    for bucket in opt.buckets:
        k = bucket.layout.shard_numel
        if isinstance(bucket.store, NvmeState):
            # An NVMe bucket holds only its gradient staging and weight staging (bf16), no
            # master, no moments, and no accumulator with one micro-batch.
            blocks = [bucket.gradients.staging_block, bucket.store.weights_home()[1]]
            assert not hasattr(bucket.store, "master")
            assert sum(block.size for block in blocks) == 2 * a(2 * k)
            assert bucket.gradients.accumulators.pool is None
        else:
            host_state += 3 * a(4 * k)  # master, exp_avg, exp_avg_sq, fp32
    assert host_state <= budget  # the budget bounds the master and moments in host RAM
    tier = _nvme_buckets(opt)[0].tier
    record = aligned(3 * 4 * TILE)  # master + two fp32 moments per tile, 4 KiB-aligned
    assert tier.buffer_bytes == record
    # The fixed buffers: four records, plus one alignment's slack to carve them aligned.
    assert tier._raw.numel() == 4 * record + IO_ALIGNMENT
    opt.close()


def test_rss_grows_by_the_host_formula_not_by_the_state(tmp_path: Path) -> None:
    # One-time costs first, so that they are not counted: numba compiling the kernels, the
    # engine's threads, the allocator's first arenas.
    warm = torch.nn.Linear(64, 64).bfloat16()
    wopt = OffloadAdamW(
        warm.parameters(),
        config=OffloadConfig(nvme_dir=tmp_path / "warm", host_budget=1),
        accelerator=host_accelerator(),
    )
    warm(torch.randn(2, 64).bfloat16()).float().sum().backward()
    wopt.step()
    wopt.close()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(1024, 1024) for _ in range(8))).bfloat16()
    n = sum(p.numel() for p in model.parameters())  # 8.4M parameters
    x = torch.randn(8, 1024).bfloat16()
    model(x).float().square().mean().backward()  # autograd's buffers exist before we start
    model.zero_grad()
    process = psutil.Process()
    rss = process.memory_info().rss
    opt = OffloadAdamW(
        model.parameters(),
        config=OffloadConfig(
            bucket_bytes=4 << 20, tile_elements=1 << 16, nvme_dir=tmp_path, host_budget=1
        ),
        accelerator=host_accelerator(),
    )
    assert len(_nvme_buckets(opt)) == len(opt.buckets)
    for _ in range(3):
        model(x).float().square().mean().backward()
        opt.step()
        opt.zero_grad()
    growth = process.memory_info().rss - rss
    pools = opt.manager.pool_stats()
    host = sum(p["capacity_bytes"] for name, p in pools.items() if name.endswith(".host"))
    device = sum(p["capacity_bytes"] for name, p in pools.items() if name.endswith(".device"))
    assert host == sum(2 * aligned(2 * b.layout.shard_numel, POOL_ALIGNMENT) for b in opt.buckets)
    bound = (
        host  # gradient staging and weight staging, bf16: 4 bytes per parameter
        + device  # "device" memory is host RAM on the host accelerator: weights, grad buffers
        + (4 * aligned(12 * (1 << 16)) + IO_ALIGNMENT)  # the tier's four I/O buffers
        + (8 << 20)  # allocator slack (measured: under 1 MiB)
    )
    state = 12 * n  # fp32 master and two fp32 moments: on disk, not in RAM
    assert bound < state  # so state held in RAM would break the bound below
    assert growth <= bound, (growth, bound)
    opt.close()


@pytest.mark.cuda_form
def test_disk_bytes_per_step_are_read_once_and_written_once(tmp_path: Path) -> None:
    _, budget = _quarter_budget(torch.float32)
    model, _ = make_pair()
    opt = _opt(model, nvme_dir=tmp_path, host_budget=budget)
    nvme = _nvme_buckets(opt)
    # Every tile of every NVMe bucket read once and written once: master and two fp32
    # moments, each field padded to 4 KiB on its own (a short last tile only to its length).
    per_step = 0
    for b in nvme:
        full, rest = divmod(b.real, TILE)
        per_step += full * 3 * aligned(4 * TILE) + (3 * aligned(4 * rest) if rest else 0)
    assert per_step == sum(b.file.nbytes for b in nvme)
    state = sum(12 * b.real for b in nvme)  # the state's own bytes
    assert state <= per_step < state + len(nvme) * 3 * IO_ALIGNMENT
    # The first bucket's first two tiles (B - 2 with 4 buffers) of a step are read at the
    # end of the previous step: the first step after construction reads them on its own.
    first = nvme[0]
    ahead = sum(first.file.length(t) for t in range(min(2, first.tiles)))
    counters = opt.manager.counters
    for i, (tokens, targets) in enumerate(batches(4)):
        read = counters.bytes(Direction.NVME_READ)
        written = counters.bytes(Direction.NVME_WRITE)
        lm_loss(model, tokens, targets).backward()
        opt.step()
        opt.zero_grad()
        assert counters.bytes(Direction.NVME_READ) - read == per_step + (ahead if i == 0 else 0)
        assert counters.bytes(Direction.NVME_WRITE) - written == per_step
    opt.close()


def test_the_profilers_listeners_see_every_nvme_transfer(tmp_path: Path) -> None:
    model, _ = make_pair()
    opt = _opt(model, nvme_dir=tmp_path, host_budget=1)
    seen: list[CopyRecord] = []
    unsubscribe = opt.manager.subscribe(
        lambda r: seen.append(r) if isinstance(r, CopyRecord) else None
    )
    train(model, opt, batches(1))
    unsubscribe()
    disk = [r for r in seen if r.direction in (Direction.NVME_READ, Direction.NVME_WRITE)]
    assert sum(r.nbytes for r in disk) == opt.manager.counters.bytes(
        Direction.NVME_READ
    ) + opt.manager.counters.bytes(Direction.NVME_WRITE) - sum(
        b.file.nbytes for b in _nvme_buckets(opt)
    )  # construction wrote every tile once before the subscription
    for record in disk:  # the next step's first tiles may still be in flight
        record.end.synchronize()
    assert all(r.end.completed_at() is not None and r.stream == "nvme" for r in disk)
    assert all(r.start.completed_at() <= r.end.completed_at() for r in disk)
    opt.close()


@pytest.mark.cuda_form
def test_state_dict_names_the_streaming_calls(tmp_path: Path) -> None:
    model, _ = make_pair()
    opt = _opt(model, nvme_dir=tmp_path, host_budget=1)
    train(model, opt, batches(1))
    with pytest.raises(StateNotInHostRam, match=r"save_streaming\(opt, path\)"):
        opt.state_dict()
    with pytest.raises(StateNotInHostRam, match="load_streaming"):
        opt.state[next(model.parameters())]
    opt.close()


@pytest.mark.cuda_form
@pytest.mark.parametrize("resume_budget", [1, None], ids=["resume-on-nvme", "resume-in-ram"])
def test_streamed_checkpoint_resumes_bitwise(tmp_path: Path, resume_budget: int | None) -> None:
    _, budget = _quarter_budget(torch.bfloat16)
    model, _ = make_pair(torch.bfloat16)
    opt = _opt(model, nvme_dir=tmp_path / "nvme", host_budget=budget)
    data = batches(8)
    train(model, opt, data[:4])
    save_streaming(opt, tmp_path / "ckpt")
    saved_weights = {k: v.clone() for k, v in model.state_dict().items()}
    train(model, opt, data[4:])

    resumed, _ = make_pair(torch.bfloat16, seed=1)  # other initial weights
    resumed.load_state_dict(saved_weights)
    extra = {} if resume_budget is None else {"nvme_dir": tmp_path / "nvme2", "host_budget": 1}
    ropt = _opt(resumed, **extra)
    load_streaming(ropt, tmp_path / "ckpt")
    train(resumed, ropt, data[4:])
    assert _params_equal(model, resumed)
    opt.close()
    ropt.close()


@pytest.mark.cuda_form
def test_streamed_checkpoint_refuses_a_corrupted_tile_before_loading(tmp_path: Path) -> None:
    model, _ = make_pair()
    opt = _opt(model, nvme_dir=tmp_path / "nvme", host_budget=1)
    train(model, opt, batches(2))
    save_streaming(opt, tmp_path / "ckpt")
    before = _nvme_state(_nvme_buckets(opt)[0])
    target = tmp_path / "ckpt" / "rank0" / "bucket0.bin"
    data = bytearray(target.read_bytes())
    data[40] ^= 0xFF
    target.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"bucket0\.bin: tile \[0, 1024\) fails its checksum"):
        load_streaming(opt, tmp_path / "ckpt")
    after = _nvme_state(_nvme_buckets(opt)[0])
    assert all(torch.equal(before[k], after[k]) for k in before)  # nothing was loaded
    opt.close()


@pytest.mark.cuda_form
def test_write_error_mid_step_names_bucket_and_file_and_leaves_others_intact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, ref = make_pair()
    opt = _opt(model, nvme_dir=tmp_path / "nvme", host_budget=1)
    ropt = _opt(ref)
    data = batches(3)
    train(model, opt, data[:2])
    train(ref, ropt, data[:2])
    save_streaming(opt, tmp_path / "ckpt")
    nvme = _nvme_buckets(opt)
    before = {b.layout.index: _nvme_state(b) for b in nvme}

    calls = {"n": 0}
    real = io_engine._pwritev
    fail_at = 3 * len(nvme)  # a few buckets into the step (4 chunks... of 1 MiB: 1 each)

    def flaky(fd: int, buffers: list, offset: int) -> int:
        calls["n"] += 1
        if calls["n"] == fail_at:
            raise OSError(5, "Input/output error (injected)")
        return real(fd, buffers, offset)

    monkeypatch.setattr(io_engine, "_pwritev", flaky)
    lm_loss(model, *data[2]).backward()
    with pytest.raises(StepFailed) as caught:
        opt.step()
    monkeypatch.setattr(io_engine, "_pwritev", real)
    cause = caught.value.__cause__
    assert isinstance(cause, StorageError)
    failed = next(b for b in nvme if b.file is not None and b.file.state.value == "failed")
    message = str(cause)
    assert f"bucket {failed.layout.index}:" in message and str(failed.file.path) in message
    assert "every other bucket is intact" in message and "load_streaming" in message
    # The other buckets: stepped ones equal the in-RAM optimizer after the step, the rest
    # are as before it; every one reads back with good checksums.
    lm_loss(ref, *data[2]).backward()
    ropt.step()
    stepped = [int(i) for i in str(caught.value).split("buckets [")[1].split("]")[0].split(",")]
    by_index = {b.layout.index: b for b in ropt.buckets}
    for backend in nvme:
        index = backend.layout.index
        if index == failed.layout.index:
            continue
        state = _nvme_state(backend)
        want = (
            {k: v[: backend.real] for k, v in by_index[index].store.state_tensors().items()}
            if index in stepped
            else before[index]
        )
        assert all(torch.equal(state[k], want[k]) for k in want), index
    with pytest.raises(StorageError, match="refuses to"):
        _nvme_state(failed)
    # The way out the message names: reload the checkpoint, which rewrites every tile.
    opt.zero_grad()
    load_streaming(opt, tmp_path / "ckpt")
    assert _nvme_state(failed)["master"].shape[0] == failed.real
    opt.close()
    ropt.close()


@pytest.mark.cuda_form
def test_corrupted_tile_on_disk_fails_the_step_by_its_checksum(tmp_path: Path) -> None:
    model, _ = make_pair()
    opt = _opt(model, nvme_dir=tmp_path, host_budget=1)
    train(model, opt, batches(1))
    victim = _nvme_buckets(opt)[2]
    fd = os.open(victim.file.path, os.O_WRONLY)
    os.pwrite(fd, np.full(8, 0x7F, dtype=np.uint8).tobytes(), victim.file.offset(1) + 8)
    os.fsync(fd)
    os.close(fd)
    lm_loss(model, *batches(1)[0]).backward()
    with pytest.raises(StepFailed) as caught:
        opt.step()
    message = str(caught.value.__cause__)
    assert f"bucket {victim.layout.index}:" in message
    assert "checksum mismatch in record 1" in message and str(victim.file.path) in message
    opt.close()


@pytest.mark.cuda_form
def test_host_budget_auto_and_validation(tmp_path: Path) -> None:
    config = OffloadConfig(nvme_dir=tmp_path)
    assert config.host_budget == "auto"
    model, ref = make_pair()
    opt = _opt(model, nvme_dir=tmp_path)  # this machine's RAM holds it all: no NVMe bucket
    assert not _nvme_buckets(opt)
    ropt = _opt(ref)
    train(model, opt, batches(2))
    train(ref, ropt, batches(2))
    assert _params_equal(model, ref)
    assert not list(tmp_path.iterdir())  # no tier was opened
    opt.close()
    ropt.close()
    with pytest.raises(ValueError, match="host_budget=1024 needs nvme_dir"):
        OffloadConfig(host_budget=1024)
    with pytest.raises(ValueError, match="host_budget='plenty' is not a byte count"):
        OffloadConfig(nvme_dir=tmp_path, host_budget="plenty")
    assert OffloadConfig(nvme_dir=tmp_path, host_budget="48GiB").host_budget == 48 << 30


def test_host_budget_auto_in_a_container_is_a_share_of_its_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A 64 GiB job on a 1 TiB node with half the node free: "auto" is the job's headroom less
    # 10% of the job's limit (Note [host RAM in a container]), not the node's free RAM less
    # 10% of the node (about 410 GiB: the state would be pinned past the job's limit).
    from collections import namedtuple

    from zero_offload.memory import host_ram
    from zero_offload.optim.state.nvme_plan import resolve_host_budget

    Memory = namedtuple("Memory", "total available")
    monkeypatch.setattr(host_ram.psutil, "virtual_memory", lambda: Memory(2**40, 2**39))
    config = OffloadConfig(nvme_dir=tmp_path)
    monkeypatch.setattr(host_ram, "cgroup_memory", lambda: None)
    assert resolve_host_budget(config, other_host_bytes=2**30) == 2**39 - 2**40 // 10 - 2**30
    monkeypatch.setattr(host_ram, "cgroup_memory", lambda: (64 * 2**30, 4 * 2**30))
    reserve = int(64 * 2**30 * 0.10)  # 6.4 GiB, above the 2 GiB floor
    assert resolve_host_budget(config, other_host_bytes=2**30) == 60 * 2**30 - reserve - 2**30
    monkeypatch.setattr(host_ram, "cgroup_memory", lambda: (64 * 2**30, 62 * 2**30))
    assert resolve_host_budget(config, other_host_bytes=2**30) == 0  # nothing left: all NVMe
    assert (
        resolve_host_budget(OffloadConfig(nvme_dir=tmp_path, host_budget=5), other_host_bytes=9)
        == 5
    )


def test_accumulators_past_the_host_ram_name_host_budget_and_lose_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The micro-batches' fp32 accumulators are pinned at the first step that accumulates,
    beside the state ``host_budget`` placed (Note [the accumulators sit beside the host
    budget]): where host RAM has no room for them the refusal names ``host_budget`` and the
    note, not a pool's ``capacity_bytes``; the weights are untouched and, with the RAM back,
    the same step trains as an optimizer that never failed."""
    from zero_offload.errors import PoolExhausted
    from zero_offload.memory import host_ram

    model, ref = make_pair()
    opt = _opt(model, nvme_dir=tmp_path / "a", host_budget=1)
    ropt = _opt(ref, nvme_dir=tmp_path / "b", host_budget=1)
    assert _nvme_buckets(opt)
    pairs = data(2)
    # 1000 bytes beyond the pools' safety margin (max(5% of 16 GiB, 1 GiB)): no accumulator fits.
    tight = host_ram.HostRam(2**30 + 1000, 2**34, "host RAM available is", False)
    monkeypatch.setattr(host_ram, "host_ram", lambda: tight)
    with pytest.raises(PoolExhausted) as caught:
        for tokens, targets in pairs:
            opt.backward(lm_loss(model, tokens, targets))
    message = str(caught.value)
    assert "grad_acc" in message and "Lower the micro-batches a step" in message
    assert "OffloadConfig.host_budget" in message
    assert "Note [the accumulators sit beside the host budget]" in message
    assert _params_equal(model, ref)
    monkeypatch.undo()
    for o, m in ((opt, model), (ropt, ref)):
        o.zero_grad()
        for tokens, targets in pairs:
            o.backward(lm_loss(m, tokens, targets))
        o.step()
    assert _params_equal(model, ref)
    opt.close()
    ropt.close()


# -- several ranks ----------------------------------------------------------------------

DIST_STEPS = 8


def _dist_rank(rank: int, world: int, port: int, out: str) -> None:
    """A spawned gloo rank: the same model trained with its state on NVMe (this rank's own
    directory) and in RAM, on this rank's share of each global batch; then a streamed
    checkpoint of the NVMe one, resumed by a fresh optimizer, trains the last steps again."""
    torch.set_num_threads(1)  # two ranks share two cores
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=60),
    )
    root = Path(out)
    pairs = data(DIST_STEPS)
    model, ram_model = make_pair()
    opt = _opt(model, nvme_dir=root / "nvme", host_budget=1)
    ram_opt = _opt(ram_model)
    dirs = sorted({str(b.file.path.parent) for b in _nvme_buckets(opt)})
    shards = [(b.layout.index, b.shard) for b in opt.buckets]
    train_steps(model, opt, pairs[:5], rank, world)
    train_steps(ram_model, ram_opt, pairs, rank, world)
    save_streaming(opt, root / "ckpt")
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    train_steps(model, opt, pairs[5:], rank, world)
    resumed, _ = make_pair(seed=1)
    resumed.load_state_dict(saved)
    ropt = _opt(resumed, nvme_dir=root / "nvme2", host_budget=1)
    load_streaming(ropt, root / "ckpt")
    train_steps(resumed, ropt, pairs[5:], rank, world)
    result = {
        "dirs": dirs,
        "shards": shards,
        "nvme": [p.detach().clone() for p in model.parameters()],
        "ram": [p.detach().clone() for p in ram_model.parameters()],
        "resumed": [p.detach().clone() for p in resumed.parameters()],
    }
    for o in (opt, ram_opt, ropt):
        o.close()
    torch.save(result, root / f"rank{rank}.pt")
    dist.destroy_process_group()


def test_two_gloo_ranks_with_state_on_nvme(tmp_path: Path) -> None:
    mp.spawn(_dist_rank, args=(2, free_port(), str(tmp_path)), nprocs=2)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for r, result in enumerate(ranks):
        assert result["dirs"] == [str(tmp_path / "nvme" / f"rank{r}")]  # its own files
        # NVMe against RAM, same ranks, same collectives: bitwise.
        assert all(torch.equal(a, b) for a, b in zip(result["nvme"], result["ram"], strict=True))
        assert all(
            torch.equal(a, b) for a, b in zip(result["nvme"], result["resumed"], strict=True)
        )
    assert ranks[0]["shards"] != ranks[1]["shards"]  # each rank steps its own shard
    for a, b in zip(ranks[0]["nvme"], ranks[1]["nvme"], strict=True):
        assert torch.equal(a, b)  # the all-gather gives every rank the same weights
    # Against one process on the global batch, as tests/test_dist_offload.py (to 1e-5: the
    # ranks sum the batch in another order).
    model, _ = make_pair()
    single = _opt(model)
    train(model, single, data(DIST_STEPS))
    worst = max(
        (x - y).abs().max().item()
        for x, y in zip(ranks[0]["nvme"], model.parameters(), strict=True)
    )
    assert worst < 1e-5
    single.close()
    assert not list((tmp_path / "nvme").iterdir()) and not list((tmp_path / "nvme2").iterdir())


def test_the_profiler_report_has_nvme_rows(tmp_path: Path) -> None:
    from zero_offload import profile

    model, _ = make_pair()
    opt = _opt(model, nvme_dir=tmp_path / "state", host_budget=1)
    with profile(opt, link_bandwidth=1e9, sample_rss=False) as prof:
        train(model, opt, batches(2))
        prof.step()
    rows = {row["name"]: row for row in prof.to_dict()["transfers"]}
    read, write = rows["optimizer state NVMe read"], rows["optimizer state NVMe write"]
    assert read["bytes"] > 0 and write["bytes"] > 0
    assert read["link_share"] is None  # the disk is not measured against the device link
    assert "NVMe" in prof.report()
    opt.close()


@pytest.mark.cuda_form
def test_a_speculative_step_steps_nvme_buckets_in_step(tmp_path: Path) -> None:
    # NVMe buckets cannot be backed up: a speculative step leaves them to step(), where
    # the coefficient is known; the result is bitwise the ordinary step.
    spec_model, plain_model = make_pair()
    spec = _opt(spec_model, nvme_dir=tmp_path / "a", host_budget=1, speculative_step=True,
                max_grad_norm=1e-3)  # fmt: skip
    plain = _opt(plain_model, nvme_dir=tmp_path / "b", host_budget=1, max_grad_norm=1e-3)
    for tokens, targets in batches(3):
        spec.backward(lm_loss(spec_model, tokens, targets), step=True)
        plain.backward(lm_loss(plain_model, tokens, targets))
        for o in (spec, plain):
            o.step()
            o.zero_grad()
    assert max_diff(spec_model, plain_model) == 0.0
    spec.close()
    plain.close()
