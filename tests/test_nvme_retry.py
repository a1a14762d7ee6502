"""A failed NVMe step, then retries (Note [a failed write leaves the others intact] in
``optim/state/nvme.py``): the failure is blamed on the bucket whose file broke, however its
reads were issued, and steps retried after ``zero_grad()`` neither mark healthy buckets'
files FAILED nor step a bucket twice; reloading the checkpoint trains on."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from zero_offload import OffloadAdamW
from zero_offload.errors import StorageError
from zero_offload.memory import io_engine
from zero_offload.optim.checkpoint.streaming import load_streaming, save_streaming
from zero_offload.optim.state.nvme import NvmeState
from zero_offload.optim.update.modes import StepFailed

from .helpers.models import batches, lm_loss, make_pair, train
from .test_nvme import _nvme_buckets, _opt

VICTIM = 3  # the NVMe bucket whose file breaks (the 4th: three healthy ones step before it)


def _failed(opt: OffloadAdamW) -> list[int]:
    return [s.layout.index for s in _nvme_buckets(opt) if s.file.state.value == "failed"]


def _disk_state_of(store: NvmeState) -> torch.Tensor:
    """One NVMe bucket's state as read back from disk (checksums verified), flat."""
    parts: list[torch.Tensor] = []
    store.stream_fields(lambda lo, hi, f: parts.extend(v.clone() for v in f.values()))
    return torch.cat(parts)


def _disk_state(opt: OffloadAdamW) -> dict[int, torch.Tensor]:
    """Every healthy NVMe bucket's state as read back from disk."""
    return {
        store.layout.index: _disk_state_of(store)
        for store in _nvme_buckets(opt)
        if store.file.state.value != "failed"
    }


def _break_record(store: NvmeState, record: int) -> None:
    fd = os.open(store.file.path, os.O_WRONLY)
    os.pwrite(fd, np.full(8, 0x7F, dtype=np.uint8).tobytes(), store.file.offset(record) + 8)
    os.fsync(fd)
    os.close(fd)


# Records 0 and 1 are read ahead by the previous bucket's update (the ring's depth is 2),
# record 2 (the last of the victim's 3) by the bucket's own.
@pytest.mark.parametrize("record", [1, 2])
def test_a_broken_record_is_blamed_on_its_bucket_and_retries_change_nothing(
    tmp_path: Path, record: int
) -> None:
    model, ref = make_pair()
    opt, ropt = _opt(model, nvme_dir=tmp_path / "nvme", host_budget=1), _opt(ref)
    data = batches(4)
    train(model, opt, data[:1])
    train(ref, ropt, data[:1])
    save_streaming(opt, tmp_path / "ckpt")
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    assert len(_nvme_buckets(opt)) > VICTIM + 1  # healthy buckets before and after the victim
    victim = _nvme_buckets(opt)[VICTIM]
    _break_record(victim, record)

    lm_loss(model, *data[1]).backward()
    with pytest.raises(StepFailed) as caught:
        opt.step()
    cause = caught.value.__cause__
    assert isinstance(cause, StorageError)
    assert str(cause).startswith(f"bucket {victim.layout.index}:")
    assert f"checksum mismatch in record {record}" in str(cause)
    assert _failed(opt) == [victim.layout.index]
    opt.zero_grad()
    steps = [b.steps.copy() for b in opt.buckets]
    before = _disk_state(opt)

    for _retry in range(3):
        lm_loss(model, *data[1]).backward()
        with pytest.raises(StorageError) as refused:
            opt.step()
        message = str(refused.value)
        assert message.startswith(f"bucket {victim.layout.index}:")
        assert "refuses before changing anything" in message and "load_streaming" in message
        opt.zero_grad()
        assert _failed(opt) == [victim.layout.index]  # no healthy file marked FAILED
        assert all(np.array_equal(a, b.steps) for a, b in zip(steps, opt.buckets, strict=True))
        after = _disk_state(opt)
        assert after.keys() == before.keys()
        assert all(torch.equal(after[i], before[i]) for i in before)  # nothing stepped again

    # The way out the messages name: reload (the model too), and training goes on as if
    # the failed step had never happened.
    load_streaming(opt, tmp_path / "ckpt")
    model.load_state_dict(weights)
    assert _failed(opt) == []
    train(model, opt, data[1:])
    train(ref, ropt, data[1:])
    opt.close()
    ropt.close()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters(), strict=True))


def test_reading_ahead_into_a_failed_file_is_not_the_readers_failure(tmp_path: Path) -> None:
    """The previous bucket's update reads the next bucket's first tiles ahead; when that
    file is FAILED the read is left to the next bucket's own update (which refuses, naming
    it), instead of failing the previous bucket and marking its healthy file FAILED."""
    model, _ = make_pair()
    opt = _opt(model, nvme_dir=tmp_path, host_budget=1)
    train(model, opt, batches(1))
    previous, victim = _nvme_buckets(opt)[VICTIM - 1], _nvme_buckets(opt)[VICTIM]
    victim.file.fail()
    previous.disk.group.prefetch_after(previous.disk, 2)  # raised "refuses to read" in bucket 2
    assert all(stream is not victim.disk for stream, _, _ in previous.disk.group.prefetched)
    assert _failed(opt) == [victim.layout.index]
    with pytest.raises(StorageError, match=f"^bucket {victim.layout.index}: its NVMe state"):
        victim.check_usable()
    opt.close()


def test_a_failed_read_ahead_nobody_uses_is_not_the_next_callers_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The last bucket's update reads the first bucket's first tiles ahead for the next
    step. When those reads fail and another bucket's stream comes first (a checkpoint, a
    read of its state), the failure is not that bucket's: the unused reads are dropped and
    the first bucket reports its own error when it reads the tiles itself."""
    model, _ = make_pair()
    opt = _opt(model, nvme_dir=tmp_path, host_budget=1)
    train(model, opt, batches(1))
    stores = _nvme_buckets(opt)
    first, other, last = stores[0], stores[1], stores[-1]
    group = first.disk.group
    for _, _, buffer in group.prefetched:  # the step's own read-ahead, read already
        buffer.settle()
    group.prefetched.clear()
    real = io_engine._preadv

    def broken(fd: int, buffers: list, offset: int) -> int:
        if fd == first.file.fd:
            raise OSError(5, "Input/output error (injected)")
        return real(fd, buffers, offset)

    monkeypatch.setattr(io_engine, "_preadv", broken)
    group.prefetch_after(last.disk, 2)  # the first bucket's tiles 0 and 1, failing
    assert [stream for stream, _, _ in group.prefetched] == [first.disk, first.disk]
    _disk_state_of(other)  # used to raise the first bucket's error in this bucket's stream
    assert _failed(opt) == []
    with pytest.raises(StorageError, match=f"^bucket {first.layout.index}: NVMe I/O failed"):
        _disk_state_of(first)
    monkeypatch.undo()
    opt.close()
