"""Construction under parameter offload from CPU weights (pageable or pinned) and from
device weights, homes in RAM or on NVMe: the host peak the ledger records against a formula
(Note [homes are pinned unit by unit] in optim/unit_pools.py), below what one pool pinned
whole would hold, and training afterwards bitwise equal to a build from the meta device
plus the checkpoint (zero_offload.load_pretrained).

CUDA form (``cuda_form``, docs/gpu.md): the accelerator and the batches come from
tests/helpers/device.py, so under ``--accelerator=cuda`` the window is on ``cuda:0``, the
"pinned" originals are pinned by the CUDA accelerator and the caller's "device" weights are
the model moved to ``cuda:0`` (``to_device``; on the host accelerator, host memory registered
as device memory). The peaks are the library's own counts (its pools, the originals it has
not released), the same on either kind. Host only: the unit planner's arithmetic (no
accelerator)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from zero_offload import OffloadAdamW, OffloadConfig, load_pretrained
from zero_offload.accelerator import Accelerator
from zero_offload.accelerator.strict import MEMORY, MemoryKind
from zero_offload.memory.manager import TieredMemoryManager
from zero_offload.optim.unit_pools import plan_units
from zero_offload.partition import BucketLayout, ParamSlot
from zero_offload.weights.source import on_device as in_device_memory

from .helpers.device import on_device, run_accelerator, run_device, run_kind

VOCAB = 128
SEQ = 16


def config(dtype: torch.dtype) -> GPT2Config:
    return GPT2Config(
        n_layer=4,  # several units, so one unit is well below the model
        n_embd=32,
        n_head=2,
        vocab_size=VOCAB,
        n_positions=32,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
        torch_dtype=dtype,
    )


def gpt2(dtype: torch.dtype) -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(config(dtype)).to(dtype)


def to_pinned(model: torch.nn.Module, acc: Accelerator) -> None:
    """Each weight moved into host memory the accelerator pinned (the caller's, not the
    optimizer's: the ledger does not count it)."""
    for param in model.parameters():
        nbytes = param.numel() * param.element_size()
        memory = acc.allocate_host(nbytes, pinned=True).view(param.dtype).view(param.shape)
        memory.copy_(param.detach())
        param.data = memory


def to_device(model: torch.nn.Module) -> None:
    """Each weight moved into memory registered as device memory, as the caller's
    ``model.to("cuda")`` would leave it. In a CUDA form, that: the model on ``cuda:0``."""
    if run_kind() == "cuda":
        model.to(run_device())
        return
    for param in model.parameters():
        memory = torch.empty(param.shape, dtype=param.dtype)  # host: simulated device memory
        MEMORY.register(memory, MemoryKind.DEVICE, "the caller's model on the GPU")
        memory.copy_(param.detach())
        param.data = memory


def options(homes: str, tmp: Path, model_bytes: int) -> dict[str, object]:
    out: dict[str, object] = {"offload_parameters": True, "bucket_bytes": 8192}
    out["tile_elements"] = 1024
    if homes != "ram":
        out["nvme_dir"] = str(tmp)
        # Half the model's bytes: the first homes (bucket order) stay in RAM, the rest and
        # their state go to NVMe (Note [homes on NVMe]); a mix of both kinds of unit.
        out["host_budget"] = model_bytes // 2
    if homes == "nvme-in-flight":  # the ring replaces each bucket's gradient staging, so a
        out["grad_staging"] = "in_flight"  # unit homed on NVMe pins less than it frees
    return out


def build(model: torch.nn.Module, acc: Accelerator, **kwargs: object) -> OffloadAdamW:
    return OffloadAdamW(
        model.parameters(),
        lr=1e-2,
        accelerator=acc,
        config=OffloadConfig(**kwargs),  # type: ignore[arg-type]
        model=model,
    )


def train(model: torch.nn.Module, opt: OffloadAdamW) -> None:
    gen = torch.Generator().manual_seed(1)
    for _ in range(2):
        tokens = on_device(torch.randint(0, VOCAB, (2, SEQ), generator=gen))
        model(input_ids=tokens, labels=tokens).loss.backward()
        opt.step()
        opt.zero_grad()
    opt.flush_pending_update()


def host_bytes(opt: OffloadAdamW) -> int:
    """What the ledger counts as the library's host memory (Note [construction peaks])."""
    pools = sum(p.capacity for p in opt.manager.pools if p.kind != "device")
    return pools + sum(len(t.buffers) * t.buffer_bytes for t in opt.manager.storage)


def unit_pool_bytes(opt: OffloadAdamW) -> list[int]:
    return [p.capacity for p in opt.manager.pools if ".unit" in p.name and p.name.endswith(".host")]


def nbytes(params: object) -> int:
    return sum(p.numel() * p.element_size() for p in params)  # type: ignore[attr-defined]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8)


@pytest.mark.cuda_form
# In-flight staging: training steps in step(), so the ring grows (a warning, after the build).
@pytest.mark.filterwarnings("ignore:OffloadConfig.grad_staging='in_flight'.:UserWarning")
@pytest.mark.parametrize("homes", ["ram", "nvme", "nvme-in-flight"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("where", ["cpu", "pinned", "device"])
def test_host_peak_is_the_final_footprint_not_final_plus_model(
    tmp_path: Path, where: str, dtype: torch.dtype, homes: str
) -> None:
    acc = run_accelerator()
    model = gpt2(dtype)
    model_bytes = nbytes(model.parameters())  # every parameter is trainable (M below)
    if where == "pinned":
        to_pinned(model, acc)
    elif where == "device":
        to_device(model)
        assert all(in_device_memory(p) for p in model.parameters())
    opt = build(model, acc, **options(homes, tmp_path / "built", model_bytes))
    peaks = opt.construction_peaks
    units = opt.param_offloader.units
    # M: the originals in host memory during the build (device weights move to the host
    # first, Note [originals on the device leave first]).
    originals = model_bytes
    # U: the largest unit's original bytes (the "plus one unit").
    largest_unit = max(nbytes(unit.spec.params) for unit in units)
    # F: the final host footprint: the unit pools, the segment-wide buffers and the bounce
    # ring (homes on NVMe), as the ledger counts it.
    final = host_bytes(opt)
    pools = unit_pool_bytes(opt)
    bounce = sum(p.capacity for p in opt.manager.pools if p.name.endswith(".bounce"))
    # F0: what was pinned before any unit's pool: the NVMe I/O buffers, the in-flight
    # staging ring, the homes' weight tile ring (the bounce ring comes after every unit).
    before_units = final - sum(pools) - bounce
    # One pool per unit that needs host bytes: every unit, but those whose homes are all on
    # NVMe with in-flight staging (their gradient staging is the ring's).
    assert len(pools) == len(units) or (homes == "nvme-in-flight" and len(pools) < len(units))
    # The formula: the running total falls through the units that pin less than they free
    # and rises through the rest, so its top is where it started or where it ends.
    assert peaks.host == max(before_units + originals, final)
    if homes == "ram":
        # Every home in RAM: a unit's pool holds at least its originals, so the peak is the
        # final footprint, within the rule of final + one unit.
        assert peaks.host == final <= final + largest_unit
    # The old build pinned one pool of every unit's bytes beside every original (then the
    # bounce ring): max(F0 + pools + M, F). Never above it, and strictly below wherever it
    # was above the final footprint (always with the homes in RAM: the bounce is 0).
    old = max(before_units + sum(pools) + originals, final)
    assert peaks.host <= old
    if before_units + sum(pools) + originals > final:
        assert peaks.host < old
    # Device: the final footprint, or the model the caller had on it, nothing added.
    device_final = sum(p.capacity for p in opt.manager.pools if p.kind == "device")
    device_model = model_bytes if where == "device" else 0
    assert peaks.device == max(device_final, device_model)

    # Parity: the same weights built from the meta device and the checkpoint.
    checkpoint = tmp_path / "checkpoint"
    gpt2(dtype).save_pretrained(checkpoint)
    with torch.device("meta"):
        meta = GPT2LMHeadModel(config(dtype)).to(dtype)
    load_pretrained(meta, checkpoint)
    ref_acc = run_accelerator()
    ref = build(meta, ref_acc, **options(homes, tmp_path / "reference", model_bytes))
    assert sorted(unit_pool_bytes(ref)) == sorted(pools)  # built in another order (M = 0)
    train(model, opt)
    train(meta, ref)
    for (name, param), expected in zip(model.named_parameters(), meta.parameters(), strict=True):
        assert torch.equal(bits(param), bits(expected)), name
    ref.close()
    opt.close()


@pytest.mark.cuda_form
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_meta_build_peak_is_the_final_footprint_plus_one_tensor(
    tmp_path: Path, dtype: torch.dtype
) -> None:
    checkpoint = tmp_path / "checkpoint"
    gpt2(dtype).save_pretrained(checkpoint)
    largest_tensor = max(nbytes([p]) for p in gpt2(dtype).parameters())
    with torch.device("meta"):
        meta = GPT2LMHeadModel(config(dtype)).to(dtype)
    model = load_pretrained(meta, checkpoint)
    opt = build(model, run_accelerator(), offload_parameters=True, bucket_bytes=8192)
    final = host_bytes(opt)
    # No original in host memory (M = 0): the running total only rises, to F, and the one
    # tensor being read sits beside a unit's slot (device), not beside its pool: at most
    # F plus that tensor, at least F (it is measured).
    assert final <= opt.construction_peaks.host <= final + largest_tensor
    opt.close()


def _layout(index: int, numel: int) -> BucketLayout:
    slot = ParamSlot(index=index, shape=(numel,), offset=0, numel=numel)
    return BucketLayout(
        index=index, group=0, slots=(slot,), numel=numel, padded_numel=numel, world_size=1
    )


def test_units_that_free_more_than_they_pin_are_built_first() -> None:
    # Buckets 0-3 in units 0, 0, 1, 2; bucket 3 is resident (no host bytes). Unit 0 pins
    # 4096 and frees 1024 (rises); unit 1 needs 0 bytes (a home on NVMe with in-flight
    # staging) and frees 2048 (falls); unit 2 pins nothing (resident) and frees 1024.
    layouts = [_layout(i, 256) for i in range(4)]
    unit = {0: 0, 1: 0, 2: 1, 3: 2}
    host = {0: 2048, 1: 2048, 2: 0}
    freed = {0: 512, 1: 512, 2: 2048, 3: 1024}
    builds = plan_units(
        layouts,
        unit_of=lambda b: unit[b.index],
        host_bytes=host,
        freed=lambda b: freed[b.index],
        alignment=512,
    )
    assert [b.unit for b in builds] == [1, 2, 0]  # falling ones first, in bucket order
    assert [b.capacity for b in builds] == [0, 0, 4096]
    assert [b.freed for b in builds] == [2048, 1024, 1024]
    assert [[layout.index for layout in b.layouts] for b in builds] == [[2], [3], [0, 1]]


@pytest.mark.cuda_form
@pytest.mark.parametrize("where", ["cpu", "device"])
def test_a_unit_pool_refused_half_way_leaves_the_model_as_it_was(
    where: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    acc = run_accelerator()
    model = gpt2(torch.float32)
    if where == "device":
        to_device(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    create = TieredMemoryManager.create_pool
    calls = {"units": 0}  # the manager is built inside OffloadAdamW: patch its class

    def refusing(self: TieredMemoryManager, tier: object, capacity: int, **kw: object) -> object:
        if str(kw.get("name", "")).endswith(".host") and ".unit" in str(kw["name"]):
            calls["units"] += 1
            if calls["units"] == 3:  # two units built, the third refused
                raise MemoryError("injected: host RAM refused")
        return create(self, tier, capacity, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(TieredMemoryManager, "create_pool", refusing)
    with pytest.raises(MemoryError, match="injected"):
        build(model, acc, offload_parameters=True, bucket_bytes=8192)
    monkeypatch.setattr(TieredMemoryManager, "create_pool", create)
    assert calls["units"] == 3
    for name, param in model.named_parameters():
        assert in_device_memory(param) == (where == "device"), name
        assert torch.equal(param, before[name]), name
    assert acc.memory_stats()["in_use"] == 0  # every device pool given back
    opt = build(model, acc, offload_parameters=True, bucket_bytes=8192)  # and it builds now
    opt.close()
