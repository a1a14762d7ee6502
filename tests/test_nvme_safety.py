"""The NVMe directory: checked at construction, private, locked atomically (Notes [the
directory is checked and private] and [stale directories] in
``zero_offload/memory/state_dir.py``), and no false or unexplained ``StorageFull``."""

from __future__ import annotations

import errno
import multiprocessing
import os
import stat
import time
from pathlib import Path

import pytest
import torch

from zero_offload import OffloadAdamW, OffloadConfig
from zero_offload.errors import StorageFull
from zero_offload.memory.state_dir import StateDirectory, check_nvme_dir
from zero_offload.memory.storage import IO_ALIGNMENT, StorageTier

from .helpers.models import host_accelerator


def _tier(root: Path | str, **kwargs: object) -> StorageTier:
    kwargs.setdefault("needed_bytes", 1 << 20)
    kwargs.setdefault("buffer_bytes", 3 * IO_ALIGNMENT)
    return StorageTier(root, rank=0, accelerator=host_accelerator(), **kwargs)  # type: ignore[arg-type]


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


# -- the lock is atomic ---------------------------------------------------------------------------


def _racer(root: str, rounds: int, start, holders, overlaps, taken) -> None:
    for _ in range(rounds):
        start.wait()
        directory = StateDirectory(root, rank=0)
        try:
            directory.acquire()
        except ValueError:
            continue  # the other one has it: refused, as it must be
        with holders.get_lock():
            holders.value += 1
            if holders.value > 1:
                overlaps.value += 1
        with taken.get_lock():
            taken.value += 1
        time.sleep(0.0005)  # hold it a moment, so that the other try lands inside
        with holders.get_lock():
            holders.value -= 1
        directory.release()


def test_two_processes_racing_for_the_lock_never_both_hold_it(tmp_path: Path) -> None:
    rounds = 150
    context = multiprocessing.get_context("fork")
    start = context.Barrier(2, timeout=60)
    holders, overlaps, taken = (context.Value("i", 0) for _ in range(3))
    procs = [
        context.Process(
            target=_racer, args=(str(tmp_path), rounds, start, holders, overlaps, taken)
        )
        for _ in range(2)
    ]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=240)
        assert proc.exitcode == 0
    assert overlaps.value == 0
    assert rounds <= taken.value <= 2 * rounds  # every round someone had it
    assert not (tmp_path / "rank0").exists()  # the last one out removed it


def test_a_tier_refuses_a_directory_a_live_tier_of_another_process_holds(tmp_path: Path) -> None:
    context = multiprocessing.get_context("fork")
    ready, done = context.Event(), context.Event()
    proc = context.Process(target=_hold, args=(str(tmp_path), ready, done))
    proc.start()
    try:
        assert ready.wait(60)
        with pytest.raises(ValueError, match=rf"in use by the live process {proc.pid}"):
            _tier(tmp_path)
    finally:
        done.set()
        proc.join(60)
    _tier(tmp_path).close()  # released with its holder


def _hold(root: str, ready, done) -> None:
    directory = StateDirectory(root, rank=0)
    directory.acquire()
    ready.set()
    done.wait(60)
    directory.release()


def test_a_lock_naming_a_dead_process_or_torn_is_stale(tmp_path: Path) -> None:
    directory = tmp_path / "rank0"
    directory.mkdir(mode=0o700)
    (directory / "x.zo-state").write_bytes(b"old")
    (directory / "LOCK").write_text("garbage")  # torn: its writer died writing it
    with pytest.warns(UserWarning, match=r"left by process \?, which is gone"):
        tier = _tier(tmp_path)
    assert not (directory / "x.zo-state").exists()
    assert _mode(directory / "LOCK") == 0o600
    tier.close()


# -- nvme_dir is checked and private --------------------------------------------------------------


def test_files_and_directories_are_private_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        tier = _tier(tmp_path / "new" / "nvme")
        file = tier.create_file("f", slots=1, record_bytes=IO_ALIGNMENT)
    finally:
        os.umask(old)
    assert _mode(tmp_path / "new" / "nvme") == 0o700
    assert _mode(tier.directory) == 0o700
    assert _mode(tier.directory / "LOCK") == 0o600 and _mode(file.path) == 0o600
    tier.close()


def test_a_directory_another_user_owns_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "theirs"
    root.mkdir(mode=0o700)
    os.chown(root, 65534, 65534)
    with pytest.raises(ValueError, match=r"OffloadConfig.nvme_dir=.*owned by uid 65534"):
        _tier(root)
    assert not (root / "rank0").exists()


def test_a_directory_others_can_write_to_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "open"
    root.mkdir()
    os.chmod(root, 0o777)
    with pytest.raises(ValueError, match=r"mode 0o777, so other users can write to it"):
        _tier(root)
    os.chmod(root, 0o755)  # others may read the directory listing, not write
    _tier(root).close()


def test_a_rank_directory_others_can_write_to_is_refused(tmp_path: Path) -> None:
    (tmp_path / "rank0").mkdir()
    os.chmod(tmp_path / "rank0", 0o777)
    with pytest.raises(ValueError, match=r"rank0 has mode 0o777"):
        _tier(tmp_path)


def test_home_is_expanded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    config = OffloadConfig(nvme_dir="~/zo-nvme")
    assert config.nvme_dir == str(tmp_path / "zo-nvme")
    assert check_nvme_dir("~/other") == tmp_path / "other"
    assert _mode(tmp_path / "other") == 0o700


def test_os_errors_name_the_setting_and_the_path(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(ValueError, match=r"OffloadConfig.nvme_dir=.*a-file exists and is not a"):
        _tier(blocker)
    with pytest.raises(OSError, match=r"OffloadConfig.nvme_dir=.*cannot create .*a-file/sub") as e:
        _tier(blocker / "sub")
    assert e.value.errno in (errno.ENOTDIR, errno.EEXIST)


def test_nvme_dir_is_checked_at_construction_when_nothing_goes_there(tmp_path: Path) -> None:
    """The whole state fits host RAM (the default budget), yet a bad nvme_dir is refused
    when the optimizer is built, naming the setting and the path; a missing one is created
    (0700), with ``~`` expanded."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    for bad, error, says in [
        (blocker, ValueError, "exists and is not a"),
        (blocker / "sub", OSError, "cannot create"),
    ]:
        model = torch.nn.Linear(4, 4)
        with pytest.raises(error, match=rf"OffloadConfig.nvme_dir=.*{says}"):
            OffloadAdamW(
                model.parameters(),
                config=OffloadConfig(nvme_dir=bad),
                accelerator=host_accelerator(),
            )
        assert model.weight.device.type == "cpu"  # the model is left as it was
    fresh = tmp_path / "fresh" / "nvme"
    opt = OffloadAdamW(
        torch.nn.Linear(4, 4).parameters(),
        config=OffloadConfig(nvme_dir=fresh),
        accelerator=host_accelerator(),
    )
    assert all(b.store.location == "host" for b in opt.buckets)  # nothing went to NVMe
    assert _mode(fresh) == 0o700
    opt.close()


# -- free space -----------------------------------------------------------------------------------


def _fake_statvfs(monkeypatch: pytest.MonkeyPatch, *, blocks: int, avail: int) -> None:
    real = os.statvfs

    def fake(path: object) -> os.statvfs_result:
        fields = list(real(path))  # type: ignore[arg-type]
        fields[2], fields[4] = blocks, avail  # f_blocks, f_bavail
        return os.statvfs_result(fields)

    monkeypatch.setattr(os, "statvfs", fake)


def test_a_filesystem_that_reports_no_size_is_not_full(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ramfs reports 0 blocks, 0 free: unknown, not full."""
    _fake_statvfs(monkeypatch, blocks=0, avail=0)
    tier = _tier(tmp_path, needed_bytes=1 << 30)
    assert tier.free_bytes() is None
    tier.create_file("f", slots=2, record_bytes=IO_ALIGNMENT)
    tier.close()


def test_enospc_from_fallocate_says_full_or_quota(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = _tier(tmp_path)

    def quota(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", quota)
    with pytest.raises(
        StorageFull, match=r"refused to allocate it \(ENOSPC: full, or over a quota"
    ):
        tier.create_file("f", slots=2, record_bytes=IO_ALIGNMENT)
    assert not list(tier.directory.glob("*.zo-state"))
    tier.close()
