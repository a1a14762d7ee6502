"""Saves that fail or are killed leave the previous checkpoint loadable, bitwise (Note
[atomic replacement] in ``zero_offload/fileio.py``); ``meta.pt`` is never unpickled as code;
a full disk raises ``StorageFull`` naming the bytes.

CUDA form (``cuda_form``): the in-process tests build through tests/helpers, so their model,
data, accelerator and optimizer are on ``cuda:0`` under ``--accelerator=cuda``; the test that
kills a child mid-save builds on the host accelerator in the child, and stays host only."""

from __future__ import annotations

import errno
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from zero_offload import OffloadAdamW, OffloadConfig, fileio
from zero_offload.checkpoint_io import load_consolidated, save_consolidated
from zero_offload.errors import StorageFull
from zero_offload.optim.checkpoint import streaming as state_stream
from zero_offload.optim.checkpoint.streaming import load_streaming, save_streaming
from zero_offload.optim.update.modes import StepFailed

from .helpers.models import batches, host_accelerator, lm_loss, make_pair, train

REPO = Path(__file__).resolve().parents[1]


def _opt(model: torch.nn.Module, **extra: object) -> OffloadAdamW:
    config = OffloadConfig(bucket_bytes=16384, tile_elements=1024, **extra)  # type: ignore[arg-type]
    return OffloadAdamW(model.parameters(), lr=1e-3, config=config, accelerator=host_accelerator())


def _files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def _saved_then_trained(path: Path) -> tuple[OffloadAdamW, dict[str, bytes]]:
    """An optimizer saved to ``path`` after one step and trained one step more, with the
    files of that save (what a failed save must leave as they are)."""
    model, _ = make_pair()
    opt = _opt(model)
    train(model, opt, batches(1))
    save_streaming(opt, path)
    good = _files(path)
    train(model, opt, batches(1))
    return opt, good


def _siblings(path: Path) -> list[str]:
    return sorted(p.name for p in path.parent.iterdir() if p.name != path.name)


def _loaded_state(path: Path) -> dict:
    """A fresh optimizer's ``state_dict()`` after loading the streamed checkpoint ``path``."""
    model, _ = make_pair()
    opt = _opt(model)
    load_streaming(opt, path)
    state = opt.state_dict()
    opt.close()
    return state


def _assert_states_equal(a: dict, b: dict) -> None:
    assert a["state"].keys() == b["state"].keys()
    for index, entry in a["state"].items():
        for name, value in entry.items():
            other = b["state"][index][name]
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(other)), (index, name)
    assert a["param_groups"] == b["param_groups"]


# -- killed mid-save -------------------------------------------------------------------------

_CHILD = """
import os, shutil, signal, sys
sys.path.insert(0, {repo!r})
from pathlib import Path
from tests.helpers.models import batches, make_pair, train
from tests.test_atomic_saves import _opt
from zero_offload import fileio
from zero_offload.optim.checkpoint.streaming import save_streaming
root = Path({root!r})
model, _ = make_pair()
opt = _opt(model)
data = batches(4)
train(model, opt, data[:2])
save_streaming(opt, root / "ckpt")
save_streaming(opt, root / "old")
train(model, opt, data[2:])
save_streaming(opt, root / "new")

def die():
    os.kill(os.getpid(), signal.SIGKILL)

point = {point!r}
if point == "writing":  # the first fsync: every byte written, nothing durable yet
    fileio._fsync = lambda fd: die()
elif point == "between-renames":  # the old checkpoint renamed away, the new not in place
    real_replace, calls = fileio._replace, []
    def replace(src, dst):
        calls.append(src)
        if len(calls) == 2:
            die()
        real_replace(src, dst)
    fileio._replace = replace
else:  # "removing-old": the new checkpoint in place, the old one not yet removed
    real_rmtree = fileio._rmtree
    fileio._rmtree = lambda path, **kw: die() if str(path).endswith(".old") else real_rmtree(
        path, **kw)
save_streaming(opt, root / "ckpt")
print("not killed", flush=True)
"""


@pytest.mark.parametrize(
    ("point", "survivor"),
    [("writing", "old"), ("between-renames", "old"), ("removing-old", "new")],
)
def test_a_save_killed_at_any_point_leaves_a_loadable_checkpoint(
    tmp_path: Path, point: str, survivor: str
) -> None:
    code = _CHILD.format(repo=str(REPO), root=str(tmp_path), point=point)
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert child.returncode == -signal.SIGKILL, child.stderr[-2000:]
    rank_dir = tmp_path / "ckpt" / "rank0"
    if point == "between-renames":
        assert not rank_dir.exists() and (tmp_path / "ckpt" / "rank0.old").is_dir()
    _assert_states_equal(_loaded_state(tmp_path / "ckpt"), _loaded_state(tmp_path / survivor))
    # Loading finished the interrupted swap: one checkpoint directory, no .old.
    assert (rank_dir / "meta.pt").exists() and not (tmp_path / "ckpt" / "rank0.old").exists()
    # The next save clears the dead writer's staging directory.
    model, _ = make_pair()
    opt = _opt(model)
    save_streaming(opt, tmp_path / "ckpt")
    assert _siblings(rank_dir) == []
    opt.close()


# -- failed saves -----------------------------------------------------------------------------


@pytest.mark.cuda_form
def test_an_emergency_save_after_a_failed_step_keeps_the_last_good_checkpoint(
    tmp_path: Path,
) -> None:
    model, _ = make_pair()
    opt = _opt(model, nvme_dir=tmp_path / "nvme", host_budget=1)
    train(model, opt, batches(2))
    save_streaming(opt, tmp_path / "ckpt")
    good = _files(tmp_path / "ckpt")
    victim = next(b.store for b in opt.buckets if getattr(b.store, "file", None) is not None)
    fd = os.open(victim.file.path, os.O_WRONLY)
    os.pwrite(fd, b"\x7f" * 8, victim.file.offset(1) + 8)
    os.close(fd)
    lm_loss(model, *batches(1)[0]).backward()
    with pytest.raises(StepFailed):
        opt.step()
    opt.zero_grad()
    with pytest.raises(Exception, match="refuses to read"):
        save_streaming(opt, tmp_path / "ckpt")  # the bad bucket cannot be read
    assert _files(tmp_path / "ckpt") == good  # the last good checkpoint, as it was
    assert _siblings(tmp_path / "ckpt" / "rank0") == []  # and no staging left behind
    load_streaming(opt, tmp_path / "ckpt")  # the way out still works
    opt.close()


def _fake_statvfs(monkeypatch: pytest.MonkeyPatch, *, blocks: int | None, avail: int) -> None:
    real = os.statvfs

    def fake(path: object) -> os.statvfs_result:
        fields = list(real(path))  # type: ignore[arg-type]
        fields[4] = avail  # f_bavail
        if blocks is not None:
            fields[2] = blocks  # f_blocks
        return os.statvfs_result(fields)

    monkeypatch.setattr(os, "statvfs", fake)


@pytest.mark.cuda_form
def test_a_full_disk_refuses_the_save_naming_the_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    opt, good = _saved_then_trained(tmp_path / "ckpt")
    _fake_statvfs(monkeypatch, blocks=None, avail=2)
    frsize = os.statvfs(tmp_path).f_frsize
    needed = sum(b.layout.real_in(0, b.layout.padded_numel) * 12 for b in opt.buckets)
    with pytest.raises(StorageFull) as caught:
        save_streaming(opt, tmp_path / "ckpt")
    message = str(caught.value)
    assert f"needs {needed // 1024}" in message or f"({needed} bytes)" in message, message
    assert f"({2 * frsize} bytes) is free" in message and "as it was" in message
    assert _files(tmp_path / "ckpt") == good
    opt.close()


@pytest.mark.cuda_form
def test_enospc_mid_save_raises_storage_full_and_keeps_the_old_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    opt, good = _saved_then_trained(tmp_path / "ckpt")
    real_private_file = fileio.private_file
    limit = 20000  # bytes the "disk" takes before it is full (a quota, say)

    class Quota:
        def __init__(self, path: Path) -> None:
            self.handle = real_private_file(path)

        def write(self, data: memoryview) -> int:
            if self.handle.tell() + len(data) > limit:
                raise OSError(errno.ENOSPC, "No space left on device")
            return self.handle.write(data)

        def __enter__(self) -> Quota:
            return self

        def __exit__(self, *exc: object) -> None:
            self.handle.close()

    monkeypatch.setattr(state_stream, "private_file", Quota)
    with pytest.raises(StorageFull, match=r"is full .*after writing .* bytes.*as it was"):
        save_streaming(opt, tmp_path / "ckpt")
    assert _files(tmp_path / "ckpt") == good
    assert _siblings(tmp_path / "ckpt" / "rank0") == []
    opt.close()


def test_a_file_size_limit_mid_save_names_the_file_and_keeps_the_old_checkpoint(
    tmp_path: Path,
) -> None:
    """A real ``ulimit -f`` (RLIMIT_FSIZE; Python ignores SIGXFSZ, so the write fails with
    EFBIG): the save used to raise the bare "[Errno 27] File too large" with no file, no
    bytes and no advice (Note [a write that cannot finish] in fileio.py)."""
    import resource

    opt, good = _saved_then_trained(tmp_path / "ckpt")
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4000, limits[1]))  # bytes a file may hold
    try:
        with pytest.raises(OSError, match=r"outgrew .*after .* bytes.*ulimit -f.*as it was") as got:
            save_streaming(opt, tmp_path / "ckpt")
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
    assert got.value.errno == errno.EFBIG and str(tmp_path / "ckpt") in str(got.value)
    assert _files(tmp_path / "ckpt") == good
    assert _siblings(tmp_path / "ckpt" / "rank0") == []
    opt.close()


def test_a_quota_mid_save_is_storage_full(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """EDQUOT (a user's quota) is a full disk to the user: it was a bare "Disk quota
    exceeded" (Note [a write that cannot finish] in fileio.py)."""
    real_private_file = fileio.private_file

    class Quota:
        def __init__(self, path: Path) -> None:
            self.handle = real_private_file(path)

        def write(self, data: memoryview) -> int:
            raise OSError(errno.EDQUOT, "Disk quota exceeded")

        def __enter__(self) -> Quota:
            return self

        def __exit__(self, *exc: object) -> None:
            self.handle.close()

    model, _ = make_pair()
    opt = _opt(model)
    train(model, opt, batches(1))
    monkeypatch.setattr(state_stream, "private_file", Quota)
    with pytest.raises(StorageFull, match=r"is full \(Disk quota exceeded"):
        save_streaming(opt, tmp_path / "ckpt")
    assert not (tmp_path / "ckpt" / "rank0").exists()  # nothing half-written is left
    assert _siblings(tmp_path / "ckpt" / "rank0") == []
    opt.close()


@pytest.mark.cuda_form
def test_a_filesystem_reporting_no_size_is_not_full(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ramfs says 0 blocks of 0 free: unknown, not full."""
    model, _ = make_pair()
    opt = _opt(model)
    train(model, opt, batches(1))
    _fake_statvfs(monkeypatch, blocks=0, avail=0)
    assert fileio.free_bytes(tmp_path) is None
    save_streaming(opt, tmp_path / "ckpt")
    load_streaming(opt, tmp_path / "ckpt")
    opt.close()


@pytest.mark.cuda_form
def test_a_failed_consolidated_save_keeps_the_previous_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, _ = make_pair()
    opt = _opt(model)
    train(model, opt, batches(1))
    path = tmp_path / "opt.pt"
    save_consolidated(opt, path)
    good = path.read_bytes()
    train(model, opt, batches(1))
    real_save = torch.save

    def torn(obj: object, handle: object) -> None:
        real_save(obj, handle)  # every byte written ...
        raise OSError(errno.EIO, "Input/output error (injected)")  # ... then the disk fails

    monkeypatch.setattr(torch, "save", torn)
    with pytest.raises(OSError, match="could not write the checkpoint"):
        save_consolidated(opt, path)
    monkeypatch.undo()
    assert path.read_bytes() == good and _siblings(path) == []
    load_consolidated(opt, path)
    opt.close()


# -- files and directories are private ----------------------------------------------------------


@pytest.mark.cuda_form
def test_checkpoints_are_private_whatever_the_umask(tmp_path: Path) -> None:
    model, _ = make_pair()
    opt = _opt(model)
    train(model, opt, batches(1))
    old = os.umask(0)
    try:
        save_streaming(opt, tmp_path / "a" / "ckpt")
        save_consolidated(opt, tmp_path / "b" / "opt.pt")
    finally:
        os.umask(old)
    mode = lambda p: stat.S_IMODE(p.stat().st_mode)  # noqa: E731
    for directory in (tmp_path / "a", tmp_path / "a" / "ckpt", tmp_path / "a" / "ckpt" / "rank0"):
        assert mode(directory) == 0o700, directory
    files = [*sorted((tmp_path / "a" / "ckpt" / "rank0").iterdir()), tmp_path / "b" / "opt.pt"]
    assert files and all(mode(p) == 0o600 for p in files), [(p, oct(mode(p))) for p in files]
    opt.close()


# -- meta.pt is data, never code ----------------------------------------------------------------


class _Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (os.mkdir, (str(self.marker),))


@pytest.mark.cuda_form
def test_a_pickle_payload_in_meta_is_refused_and_never_runs(tmp_path: Path) -> None:
    model, _ = make_pair()
    opt = _opt(model)
    train(model, opt, batches(1))
    save_streaming(opt, tmp_path / "ckpt")
    meta_path = tmp_path / "ckpt" / "rank0" / "meta.pt"
    meta = torch.load(meta_path, weights_only=True)
    meta["skipped_steps"] = _Payload(tmp_path / "pwned")
    torch.save(meta, meta_path)
    # The payload is real: an unrestricted load of the same kind of object runs it.
    torch.save({"x": _Payload(tmp_path / "control")}, tmp_path / "control.pt")
    torch.load(tmp_path / "control.pt", weights_only=False)
    assert (tmp_path / "control").is_dir()
    before = opt.state_dict()
    with pytest.raises(ValueError, match=r"meta\.pt holds objects other than plain data") as caught:
        load_streaming(opt, tmp_path / "ckpt")
    assert "arbitrary code" in str(caught.value) and "nothing was loaded" in str(caught.value)
    assert not (tmp_path / "pwned").exists()
    _assert_states_equal(before, opt.state_dict())
    opt.close()


@pytest.mark.cuda_form
def test_a_swap_that_fails_half_way_is_undone_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    opt, good = _saved_then_trained(tmp_path / "ckpt")
    real_replace, calls = fileio._replace, []

    def replace(src: object, dst: object) -> None:
        calls.append(src)
        if len(calls) == 2:  # the old one is aside, the new one cannot be put in place
            raise OSError(errno.EIO, "Input/output error (injected)")
        real_replace(src, dst)

    monkeypatch.setattr(fileio, "_replace", replace)
    with pytest.raises(OSError, match="injected"):
        save_streaming(opt, tmp_path / "ckpt")
    monkeypatch.undo()
    assert _files(tmp_path / "ckpt") == good
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["rank0"]
    opt.close()


@pytest.mark.cuda_form
def test_a_previous_version_that_cannot_be_removed_warns_and_the_save_stands(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The new checkpoint is in place when ``name.old`` is removed: failing that is not a
    failed save. It warns; the next load finds the new checkpoint and removes the old."""
    model, _ = make_pair()
    opt = _opt(model)
    train(model, opt, batches(1))
    save_streaming(opt, tmp_path / "ckpt")
    train(model, opt, batches(1))
    real_rmtree = fileio._rmtree

    def rmtree(path: object, *args: object, **kwargs: object) -> None:
        if str(path).endswith(".old") and not kwargs.get("ignore_errors"):
            raise OSError(errno.EBUSY, "Device or resource busy (injected)")
        real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(fileio, "_rmtree", rmtree)
    with pytest.warns(RuntimeWarning, match=r"saved .*ckpt.*could not remove .*rank0\.old"):
        save_streaming(opt, tmp_path / "ckpt")
    monkeypatch.undo()
    new = _files(tmp_path / "ckpt" / "rank0")
    assert (tmp_path / "ckpt" / "rank0.old").is_dir()
    load_streaming(opt, tmp_path / "ckpt")  # the new one, and the old one goes
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["rank0"]
    assert _files(tmp_path / "ckpt" / "rank0") == new
    opt.close()
