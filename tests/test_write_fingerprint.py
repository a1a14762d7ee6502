"""The GPU fingerprint that finds weights written through ``param.data`` (Note [weights
written outside the optimizer] in ``views/param_views.py``) sees a permutation: two weights
swapped inside one parameter change its fingerprint. The device path is forced here (on the
host accelerator the weights are host-addressable and hashed with xxh3)."""

from __future__ import annotations

import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from zero_offload.views import fingerprints

from .helpers.models import mlp, mlp_batches, mlp_loss, mlp_opt, mlp_torch_adamw

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_swapping_two_values_changes_only_their_ranges_fingerprint(dtype: torch.dtype) -> None:
    flat = torch.randn(97, generator=torch.Generator().manual_seed(0)).to(dtype)
    ranges = [(0, 40), (40, 41), (41, 97)]
    before = fingerprints.device_fingerprints(flat, ranges)
    swapped = flat.clone()
    swapped[[3, 17]] = flat[[17, 3]]
    # The plain sum of bit patterns (the old fingerprint) cannot tell them apart.
    ints = fingerprints.SAME_SIZE_INT[flat.element_size()]
    assert flat.view(ints).sum(dtype=torch.int64) == swapped.view(ints).sum(dtype=torch.int64)
    after = fingerprints.device_fingerprints(swapped, ranges)
    assert (after != before).tolist() == [True, False, False]
    # Swapping a value with a zero, and moving the zero, is a write too.
    zeroed = flat.clone()
    zeroed[50] = 0
    moved = zeroed.clone()
    moved[[50, 60]] = zeroed[[60, 50]]
    changes = fingerprints.device_fingerprints(moved, ranges) != fingerprints.device_fingerprints(
        zeroed, ranges
    )
    assert changes.tolist() == [False, False, True]
    # Same values, same fingerprints (the check must not see writes that did not happen).
    assert torch.equal(fingerprints.device_fingerprints(flat.clone(), ranges), before)


def test_chunks_give_the_fingerprint_of_the_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    flat = torch.randn(1000, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    ranges = [(0, 999), (999, 1000)]
    whole = fingerprints.device_fingerprints(flat, ranges)
    monkeypatch.setattr(fingerprints, "DEVICE_CHUNK", 7)
    assert torch.equal(fingerprints.device_fingerprints(flat, ranges), whole)


def test_a_swap_through_param_data_is_seen_on_the_device_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Swap two weights of a parameter through ``p.data`` between steps: torch steps from
    the swapped weights, and so must we, with the device fingerprint deciding."""
    monkeypatch.setattr(fingerprints, "host_addressable", lambda flat: False)
    model, reference = mlp(), mlp()
    opt, ref = mlp_opt(model), mlp_torch_adamw(reference)
    data = mlp_batches(2)
    for m, o in ((model, opt), (reference, ref)):
        mlp_loss(m, *data[0]).backward()
        o.step()
        o.zero_grad()
    assert all(isinstance(b.views._stamp[1], torch.Tensor) for b in opt.buckets)  # device path
    with torch.no_grad():
        for m in (model, reference):
            weight = m[0].weight.data.view(-1)
            weight[[2, 9]] = weight[[9, 2]].clone()
    written = [p for b in opt.buckets for p in b.views.changed_params()]
    assert [p is model[0].weight for p in written] == [True]
    for m, o in ((model, opt), (reference, ref)):
        mlp_loss(m, *data[1]).backward()
        o.step()
        o.zero_grad()
    opt.close()
    for ours, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        assert (ours - theirs).abs().max().item() < 1e-5


# -- Note [one fingerprint pass per bucket] ---------------------------------------------


class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def _per_slot(flat: torch.Tensor, ranges: list[tuple[int, int]]) -> torch.Tensor:
    """The fingerprints slot by slot, chunk by chunk (how they were taken before)."""
    ints = flat.view(fingerprints.SAME_SIZE_INT[flat.element_size()])
    out = []
    for start, end in ranges:
        total = torch.zeros((), dtype=torch.int64)
        for lo in range(start, end, fingerprints.DEVICE_CHUNK):
            hi = min(end, lo + fingerprints.DEVICE_CHUNK)
            total += fingerprints.mixed_terms(ints[lo:hi], lo).sum()
        out.append(total)
    return torch.stack(out)


@pytest.mark.parametrize("chunk", [5, 64, 1 << 22])
def test_one_pass_per_bucket_gives_the_slot_by_slot_fingerprints(
    chunk: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Same numbers as summing each slot's terms (slots with gaps between them, slots
    crossing chunk ends, a slot inside one chunk), so a remembered stamp stays valid."""
    monkeypatch.setattr(fingerprints, "DEVICE_CHUNK", chunk)
    gen = torch.Generator().manual_seed(2)
    flat = (torch.randn(700, generator=gen) * 1e30).to(torch.float32)  # large bit patterns
    ranges = [(0, 3), (8, 70), (70, 71), (128, 500), (512, 700)]
    assert torch.equal(fingerprints.device_fingerprints(flat, ranges), _per_slot(flat, ranges))


def test_a_bucket_of_many_parameters_costs_the_ops_of_one_pass() -> None:
    """400 small parameters in one bucket: the ops dispatched do not grow with the number of
    parameters (slot by slot it was about 9 per parameter: 3,600 here)."""
    flat = torch.randn(400 * 64).to(torch.bfloat16)
    many = [(i * 64, i * 64 + 60) for i in range(400)]
    with _CountOps() as counted:
        fingerprints.device_fingerprints(flat, many)
    with _CountOps() as fewer:
        fingerprints.device_fingerprints(flat, many[:10])
    with _CountOps() as one:  # one large parameter per chunk: summed directly, as before
        fingerprints.device_fingerprints(flat, [(0, len(flat))])
    assert counted.ops == fewer.ops <= 32, (counted.ops, fewer.ops)  # views, slices included
    assert one.ops <= 20, one.ops  # slot by slot: about the same for one parameter


def test_the_write_check_reads_the_device_once_per_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With several buckets on the device path, ``step()`` reads the comparisons on the host
    once (one synchronisation), not once per bucket."""
    monkeypatch.setattr(fingerprints, "host_addressable", lambda flat: False)
    reads: list[str] = []
    tolist = torch.Tensor.tolist

    def counted(self: torch.Tensor) -> object:
        caller = sys._getframe(1).f_code.co_filename
        if caller.endswith("param_views.py"):
            reads.append(caller)
        return tolist(self)

    model = mlp()
    opt = mlp_opt(model)
    assert len(opt.buckets) >= 3
    data = mlp_batches(3)
    monkeypatch.setattr(torch.Tensor, "tolist", counted)
    for x, y in data:
        mlp_loss(model, x, y).backward()
        reads.clear()
        opt.step()
        opt.zero_grad()
        assert len(reads) == 1, len(reads)
    opt.close()
