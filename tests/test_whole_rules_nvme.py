"""NVMe state for the rules that read whole parameters (issue 37): ``OffloadAdafactor`` and
``OffloadMuon`` with ``nvme_dir``, Note [NVMe tiles follow whole parameters] in
zero_offload/optim/state/nvme_plan.py.

1. The tiles of such a bucket are runs of whole parameters; a parameter larger than
   ``tile_elements`` is a tile of its own, and the record (the I/O buffers) holds it.
2. Bitwise the host-RAM store over several steps (the same kernel on the same bytes):
   Adafactor (factored 2-D, unfactored 1-D, parameters larger than a tile) and Muon
   (matrices, and AdamW for the rest), fp32 and bf16, with clipping and 2 micro-batches;
   the master read back from disk and the shaped state too. With a ``host_budget`` that
   keeps some buckets in RAM and puts the rest on NVMe, the same; and with the delayed
   update (``overlap_step``) and steps announced during backward.
3. ``state_dict()`` refuses NVMe state as for every rule, naming the streaming calls.
4. With parameter offload the homes stay in host RAM, the state on NVMe past the budget:
   bitwise; a budget that would put homes on NVMe is refused, naming the bytes that work.
"""

from __future__ import annotations

import itertools
import pathlib
from typing import Any

import pytest
import torch

from zero_offload import OffloadAdafactor, OffloadConfig, OffloadMuon
from zero_offload.optim.state.nvme import StateNotInHostRam
from zero_offload.optim.state.nvme_plan import whole_parameter_tiles
from zero_offload.optim.state.whole_nvme import WholeParameterNvmeState
from zero_offload.partition import plan_buckets

from .helpers.models import batches, host_accelerator, lm_loss, make_pair
from .test_rules_param_offload import _gpt, assert_same, weight_bytes
from .test_rules_param_offload import _opt as _offload_opt
from .test_rules_param_offload import _train as _offload_train

STEPS = 4
MICRO = 2
TILE = 1024
RULES = {
    "adafactor": (OffloadAdafactor, {"lr": 3e-2, "weight_decay": 0.05, "beta2_decay": -0.5}),
    "muon": (OffloadMuon, {"lr": 0.02, "adamw_lr": 3e-3}),
}


def _build(
    rule: str, model: torch.nn.Module, accelerator: Any = None, **config: Any
) -> torch.optim.Optimizer:
    facade, hyper = RULES[rule]
    config = {"bucket_bytes": 8192, "tile_elements": TILE, "max_grad_norm": 0.5, **config}
    return facade(model.parameters(), **hyper, config=OffloadConfig(**config),
                  accelerator=accelerator or host_accelerator())  # fmt: skip


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[float]:
    """``STEPS`` steps of ``MICRO`` micro-batches each, clipped (``max_grad_norm``); the
    gradient norms the optimizer saw, to show clipping was active."""
    data = batches(STEPS * MICRO)
    norms = []
    for i in range(0, len(data), MICRO):
        for tokens, targets in data[i : i + MICRO]:
            lm_loss(model, tokens, targets).backward()
        opt.step()
        norms.append(float(opt.last_grad_norm))  # type: ignore[attr-defined]
        opt.zero_grad()
    return norms


def _state(store: Any) -> dict[str, torch.Tensor]:
    """A bucket's per-element fields (read back from disk for NVMe) and shaped state, flat,
    and the tiles ``stream_fields`` walks (the same in either placement)."""
    parts: dict[str, list[torch.Tensor]] = {}
    tiles: list[tuple[int, int]] = []

    def take(lo: int, hi: int, fields: dict[str, torch.Tensor]) -> None:
        tiles.append((lo, hi))
        for name, view in fields.items():
            parts.setdefault(name, []).append(view.detach().cpu().clone())

    store.stream_fields(take)
    out = {name: torch.cat(chunks) for name, chunks in parts.items()}
    out["tiles"] = torch.tensor(tiles)  # host: the tile boundaries, bookkeeping
    for i in range(len(store.layout.slots)):
        for name, view in store.param_state(i).items():
            out[f"{i}.{name}"] = view.detach().cpu().clone()
    return out


def _same_bits(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


# -- 1. the tiles --------------------------------------------------------------------------


def test_tiles_are_runs_of_whole_parameters() -> None:
    """Small parameters share a tile up to ``tile_elements``; a larger one is its own tile
    (with its alignment gap); the tiles cover the bucket's real elements."""
    sizes = [(100,), (300,), (700,), (2500,), (40,), (1000,)]
    (bucket,) = plan_buckets([list(enumerate(sizes))], bucket_numel=1 << 20)
    tiles = whole_parameter_tiles(bucket, TILE)
    assert sum(tiles) == bucket.real_in(0, bucket.padded_numel)
    bounds = list(itertools.pairwise([0, *itertools.accumulate(tiles)]))
    for slot in bucket.slots:  # no slot crosses a boundary
        assert any(lo <= slot.offset and slot.end <= hi for lo, hi in bounds)
    assert max(tiles) >= 2500 and sum(n > TILE for n in tiles) == 1


# -- 2. bitwise the host-RAM store -------------------------------------------------------


@pytest.mark.cuda_form
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rule", sorted(RULES))
def test_bitwise_the_host_store(rule: str, dtype: torch.dtype, tmp_path: pathlib.Path) -> None:
    model, twin = make_pair(dtype)
    opt = _build(rule, model, nvme_dir=str(tmp_path), host_budget=1)
    ref = _build(rule, twin)
    assert {b.store.location for b in opt.buckets} == {"nvme"}
    assert all(isinstance(b.store, WholeParameterNvmeState) for b in opt.buckets)
    record = opt.buckets[0].store.record
    larger = max(s.numel for b in opt.buckets for s in b.layout.slots)
    assert larger > TILE and record.whole and record.capacity >= larger  # held whole
    shapes = {len(s.shape) for b in opt.buckets for s in b.layout.slots}
    assert shapes == {1, 2}  # factored and unfactored; Muon and its AdamW
    # The master on disk, the shaped state in host RAM, as the host store keeps it.
    assert opt.placement.host == sum(b.store.param_state_bytes() for b in opt.buckets) > 0
    assert opt.placement.nvme == 4 * opt.placement.parameters
    assert opt.placement.host + opt.placement.nvme == ref.placement.host
    norms = _train(model, opt)
    assert _train(twin, ref) == norms
    assert max(norms) > 0.5  # clipping was active
    assert _same_bits(model, twin)
    for ours, theirs in zip(opt.buckets, ref.buckets, strict=True):
        mine, host = _state(ours.store), _state(theirs.store)
        assert mine.keys() == host.keys()
        for name in host:
            assert torch.equal(mine[name], host[name]), name
    opt.close()
    ref.close()


@pytest.mark.cuda_form
@pytest.mark.parametrize("rule", sorted(RULES))
def test_a_host_budget_splits_the_buckets_bitwise(rule: str, tmp_path: pathlib.Path) -> None:
    """Buckets in bucket order stay in RAM while their state fits, the rest go to NVMe."""
    model, twin = make_pair(torch.bfloat16)
    probe = _build(rule, make_pair(torch.bfloat16)[0])
    budget = probe.placement.host // 3  # a third of the host state: some buckets fit
    probe.close()
    opt = _build(rule, model, nvme_dir=str(tmp_path), host_budget=budget)
    ref = _build(rule, twin)
    assert {b.store.location for b in opt.buckets} == {"host", "nvme"}
    assert _train(model, opt) == _train(twin, ref)
    assert _same_bits(model, twin)
    opt.close()
    ref.close()


@pytest.mark.cuda_form
@pytest.mark.parametrize("mode", ["overlap_step", "announced_in_flight"])
@pytest.mark.parametrize("rule", sorted(RULES))
def test_other_update_modes_bitwise(rule: str, mode: str, tmp_path: pathlib.Path) -> None:
    """The one-step delayed update, and steps announced during backward over in-flight
    gradient staging, read and write the records as the plain step does."""
    config: dict[str, Any] = {"overlap_step": True}
    if mode == "announced_in_flight":
        config = {"grad_staging": "in_flight", "max_grad_norm": None}  # refused together
    model, twin = make_pair(torch.bfloat16)
    opt = _build(rule, model, nvme_dir=str(tmp_path), host_budget=1, **config)
    ref = _build(rule, twin, **config)
    assert {b.store.location for b in opt.buckets} == {"nvme"}
    for m, o in ((model, opt), (twin, ref)):
        for tokens, targets in batches(STEPS):
            loss = lm_loss(m, tokens, targets)
            if mode == "announced_in_flight":
                o.backward(loss, step=True)  # type: ignore[attr-defined]
            else:
                loss.backward()
            o.step()
            o.zero_grad()
    assert _same_bits(model, twin)
    opt.close()
    ref.close()


@pytest.mark.simulator_only(reason="the race checker and strict mode, over a slow link")
@pytest.mark.parametrize("rule", sorted(RULES))
def test_under_the_race_checker_over_a_slow_link(rule: str, tmp_path: pathlib.Path) -> None:
    """Gradient tiles land late, every stream access is checked (strict mode too): the
    records are read after their gradient, and the bits are still the host store's."""
    slow = host_accelerator(link_latency=0.002, check_races=True, strict=True)
    model, twin = make_pair(torch.bfloat16)
    opt = _build(rule, model, slow, nvme_dir=str(tmp_path), host_budget=1)
    ref = _build(rule, twin)
    assert _train(model, opt) == _train(twin, ref)
    assert _same_bits(model, twin)
    opt.close()
    ref.close()


@pytest.mark.cuda_form
@pytest.mark.parametrize("rule", sorted(RULES))
def test_with_parameter_offload_bitwise(rule: str, tmp_path: pathlib.Path) -> None:
    """``offload_parameters`` with ``nvme_dir``: the homes in host RAM (the budget holds
    them first, Note [homes on NVMe]), the state beside them where it fits and on NVMe
    past that; bitwise the same run with all of it in RAM."""
    budget = weight_bytes(_gpt()) // 3
    want = _gpt()
    opt = _offload_opt(rule, want, budget, offload=True)
    want_losses = _offload_train(want, opt, STEPS)
    opt.close()
    model = _gpt()
    homes = weight_bytes(model) + (64 << 10)  # every home, aligned, and a little state
    opt = _offload_opt(rule, model, budget, offload=True, nvme_dir=str(tmp_path),
                       host_budget=homes)  # fmt: skip
    assert {b.store.location for b in opt.buckets} == {"host", "nvme"}
    assert _offload_train(model, opt, STEPS) == want_losses
    opt.close()
    assert_same(model, want)


# -- 3. checkpoints ----------------------------------------------------------------------


@pytest.mark.cuda_form
@pytest.mark.parametrize("rule", sorted(RULES))
def test_state_dict_names_the_streaming_calls(rule: str, tmp_path: pathlib.Path) -> None:
    model, _ = make_pair()
    opt = _build(rule, model, nvme_dir=str(tmp_path), host_budget=1)
    _train(model, opt)
    with pytest.raises(StateNotInHostRam, match=r"save_streaming\(opt, path\)"):
        opt.state_dict()
    opt.close()


# -- 4. refusals -------------------------------------------------------------------------


@pytest.mark.parametrize("rule", sorted(RULES))
def test_homes_on_nvme_are_refused_naming_the_budget_that_works(
    rule: str, tmp_path: pathlib.Path
) -> None:
    """With parameter offload every home stays in host RAM; a budget too small for them is
    refused at construction, naming the bytes that would do."""
    budget = weight_bytes(_gpt()) // 3
    with pytest.raises(ValueError, match=r"host_budget=1 leaves 1 bytes .* homes of only 0 of "
                       r"\d+ buckets; this optimizer's rule reads whole parameters, so with "
                       r"offload_parameters=True every home stays in host RAM .* Give "
                       r"host_budget at least \d+ bytes"):  # fmt: skip
        _offload_opt(rule, _gpt(), budget, offload=True, nvme_dir=str(tmp_path), host_budget=1)
