"""A damaged checkpoint file is refused naming it, and nothing is loaded: a streamed
checkpoint's ``meta.pt`` (its zip records' CRC-32s are checked: Note [the metadata is
checked too] in ``optim/checkpoint/stream_meta.py``; before, a flipped bit of the saved lr
loaded silently), a truncated one, a truncated consolidated file (before: torch's bare
``OSError``), and a state of another rule (the reason names both rules)."""

from __future__ import annotations

import shutil
import struct
from pathlib import Path

import pytest
import torch

from zero_offload import OffloadAdagrad, save_consolidated
from zero_offload.checkpoint_io import load_consolidated

from .helpers.models import batches, lm_loss, make_pair, offload_opt


def _trained(tmp_path: Path):
    model, _ = make_pair()
    opt = offload_opt(model, lr=0.01)
    ((tokens, targets),) = batches(1)
    opt.backward(lm_loss(model, tokens, targets))
    opt.step()
    opt.save_streaming(tmp_path / "streamed")
    save_consolidated(opt, tmp_path / "whole.pt")
    return model, opt


def test_a_flipped_bit_in_the_metadata_is_refused(tmp_path: Path) -> None:
    _, opt = _trained(tmp_path)
    meta = tmp_path / "bad" / "rank0" / "meta.pt"
    shutil.copytree(tmp_path / "streamed", tmp_path / "bad")
    raw = bytearray(meta.read_bytes())
    at = raw.find(struct.pack(">d", 0.01))  # the saved lr, as pickle writes a float
    assert at > 0
    raw[at + 1] ^= 0x01  # lr 0.0104...: loaded silently before
    meta.write_bytes(bytes(raw))
    before = opt.param_groups[0]["lr"]
    with pytest.raises(ValueError, match=r"meta\.pt: record .* fails its CRC-32"):
        opt.load_streaming(tmp_path / "bad")
    assert opt.param_groups[0]["lr"] == before
    meta.write_bytes(bytes(raw[: len(raw) // 2]))  # truncated
    with pytest.raises(ValueError, match=r"meta\.pt: not a readable .*truncated"):
        opt.load_streaming(tmp_path / "bad")
    opt.load_streaming(tmp_path / "streamed")  # the good one still loads
    opt.close()


def test_a_truncated_consolidated_file_is_refused_naming_it(tmp_path: Path) -> None:
    _, opt = _trained(tmp_path)
    whole = tmp_path / "whole.pt"
    cut = tmp_path / "cut.pt"
    cut.write_bytes(whole.read_bytes()[: whole.stat().st_size // 2])
    with pytest.raises(ValueError, match=r"cut\.pt'?: not a readable checkpoint"):
        load_consolidated(opt, cut)
    load_consolidated(opt, whole)
    opt.close()


def test_another_rules_state_names_both_rules(tmp_path: Path) -> None:
    model, opt = _trained(tmp_path)
    sd = opt.state_dict()
    opt.close()
    other = OffloadAdagrad(model.parameters(), lr=0.01)
    with pytest.raises(ValueError, match=r"'adamw' rule's fields are not the 'adagrad' rule's"):
        other.load_state_dict(sd)
    other.close()
    assert torch.is_tensor(next(iter(sd["state"].values()))["exp_avg"])
