"""The estimator's rows with NVMe: the state split a host budget makes (Note [the host budget
decides the split] in zero_offload/estimate/nvme.py) against a real OffloadAdamW with
nvme_dir, the bytes per tier against their formulas, and "largest that fits" with a disk."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zero_offload.accelerator import HostAccelerator
from zero_offload.config import AcceleratorConfig, OffloadConfig
from zero_offload.demo.model import GPTConfig, TinyGPT
from zero_offload.estimate import ModelShape, estimate
from zero_offload.estimate.in_flight import IN_FLIGHT_RANKS_NOT_YET, ParamInFlight, ring_bytes
from zero_offload.estimate.nvme import bucket_tiers, io_buffer_bytes
from zero_offload.estimate.rows import ActivationMode, Context, Limits
from zero_offload.estimate.subjects import CountSubject, ShapeSubject
from zero_offload.estimate.tiered import Homes, NvmeState, ParamNvme
from zero_offload.memory.storage import IO_ALIGNMENT
from zero_offload.optim import OffloadAdamW

GiB, MiB = 2**30, 2**20
SHAPE = ModelShape(layers=3, hidden=64, heads=4, vocab=50, seq_len=32)
BUCKET = 16 * 1024


def _rows(result: object) -> dict[str, object]:
    return {row.name: row for row in result.rows}  # type: ignore[attr-defined]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("budget", [0, 300_000, 10**9])
@pytest.mark.parametrize("params", [False, True], ids=["weights-on-device", "param-offload"])
def test_nvme_state_split_matches_a_real_optimizer(
    tmp_path: Path, budget: int, dtype: torch.dtype, params: bool
) -> None:
    # NvmeState against OffloadAdamW(nvme_dir=...); ParamNvme against
    # OffloadAdamW(offload_parameters=True, nvme_dir=...): the units' buckets (units last to
    # first) placed by plan_nvme, the budget holding the homes first (each bucket's weight
    # staging), then the state (Note [homes on NVMe]); the homes beyond it in weight files,
    # with the weight tile ring in the pool and the window's bounce ring a pool of its own.
    model = TinyGPT(GPTConfig(vocab_size=50, seq_len=32, layers=3, hidden=64, heads=4)).to(dtype)
    acc = HostAccelerator(AcceleratorConfig(device_budget="256MiB"))
    config = OffloadConfig(
        bucket_bytes=BUCKET, nvme_dir=tmp_path, host_budget=budget, offload_parameters=params
    )
    extra = {"model": model, "layers": model.blocks} if params else {}
    opt = OffloadAdamW(model.parameters(), accelerator=acc, config=config, **extra)  # type: ignore[arg-type]
    try:
        locations = {b.store.location for b in opt.buckets}
        pools = opt.manager.pool_stats()
        host_pool = sum(
            p["capacity_bytes"] for name, p in pools.items() if name.endswith((".host", ".bounce"))
        )
        homes_on_disk = any(getattr(b.store, "home", None) for b in opt.buckets)
        disk = sum(f.stat().st_size for f in tmp_path.rglob("*") if f.is_file())
    finally:
        opt.close()
    # Each budget places the buckets differently: all on NVMe, some of each, all in RAM.
    # With parameter offload the homes take the budget first: 300 kB holds some homes, no
    # bucket's state.
    mixed = {"nvme"} if params else {"host", "nvme"}
    assert locations == {0: {"nvme"}, 300_000: mixed, 10**9: {"host"}}[budget]
    ctx = Context(itemsize=dtype.itemsize, world_size=1, ranks_per_node=1, bucket_bytes=BUCKET)
    assert homes_on_disk == (params and budget < 10**9)
    subject = ShapeSubject(SHAPE, ctx)
    if params:
        host, disk_estimate = ParamNvme.tiers(subject, budget, homes=Homes.NVME)
        if budget == 10**9:  # every home in RAM: the homes-in-RAM row is that placement
            assert ParamNvme.tiers(subject, budget) == (host, disk_estimate)
    else:
        host, disk_estimate = NvmeState.tiers(subject, budget)
    # Host: the pool exactly, plus the tier's I/O buffers (not a pool) when a bucket spills.
    assert host == host_pool + (io_buffer_bytes() if disk_estimate else 0)
    # Disk: the state records (and weight records) exactly; the files add at most a page
    # of metadata.
    assert disk_estimate <= disk <= disk_estimate + IO_ALIGNMENT
    assert (disk_estimate == 0) == (budget == 10**9)  # the big budget keeps everything in RAM


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("budget", [None, 0, 300_000, 10**9], ids=["no-nvme", "0", "300k", "1e9"])
def test_in_flight_staging_rows_match_a_real_optimizer(
    tmp_path: Path, budget: int | None, dtype: torch.dtype
) -> None:
    # ParamInFlight against OffloadAdamW(offload_parameters=True, grad_staging="in_flight"),
    # the state in RAM (no nvme_dir) or split by a host budget, which holds the homes first
    # (Note [homes on NVMe]): the host pool (every bucket's gradient staging left out), the
    # bounce ring's pool when a home is in a weight file and the ring's pool, exactly.
    model = TinyGPT(GPTConfig(vocab_size=50, seq_len=32, layers=3, hidden=64, heads=4)).to(dtype)
    acc = HostAccelerator(AcceleratorConfig(device_budget="256MiB"))
    nvme = {} if budget is None else {"nvme_dir": tmp_path, "host_budget": budget}
    config = OffloadConfig(
        bucket_bytes=BUCKET, offload_parameters=True, grad_staging="in_flight", **nvme
    )
    opt = OffloadAdamW(
        model.parameters(), accelerator=acc, config=config, model=model, layers=model.blocks
    )
    try:
        pools = opt.manager.pool_stats()
        host_pool = sum(
            p["capacity_bytes"] for name, p in pools.items() if name.endswith((".host", ".bounce"))
        )
        ring = sum(
            p["capacity_bytes"] for name, p in pools.items() if name.endswith(".grad_staging_ring")
        )
        homes_on_disk = any(getattr(b.store, "home", None) for b in opt.buckets)
        disk = sum(f.stat().st_size for f in tmp_path.rglob("*") if f.is_file())
    finally:
        opt.close()
    ctx = Context(itemsize=dtype.itemsize, world_size=1, ranks_per_node=1, bucket_bytes=BUCKET)
    subject = ShapeSubject(SHAPE, ctx)
    assert ring == ring_bytes(subject.unit_groups(), ctx)[1] > 0  # type: ignore[arg-type]
    assert homes_on_disk == (budget is not None and budget < 10**9)
    if budget is None:
        row = ParamInFlight("in flight", ActivationMode.CHECKPOINTED).bytes(
            subject, Limits(device=None, host=None, host_reserve=0)
        )
        assert row is not None and (row.host, row.disk) == (host_pool + ring, 0)
        # Against parameter offload with per-bucket staging: less every bucket's own.
        own = ring_bytes(subject.unit_groups(), ctx)[0]  # type: ignore[arg-type]
        assert row.host == subject.param_offload_pools()[2] - own + ring  # type: ignore[index]
        return
    host, disk_estimate = ParamInFlight.tiers(subject, budget, homes=Homes.NVME)
    if budget == 10**9:  # every home in RAM: the homes-in-RAM row is that placement
        assert ParamInFlight.tiers(subject, budget) == (host, disk_estimate)
    assert host == host_pool + ring + (io_buffer_bytes() if disk_estimate else 0)
    # Against ParamNvme's placement of the same budget: less every bucket's own gradient
    # staging, plus the ring.
    own = ring_bytes(subject.unit_groups(), ctx)[0]  # type: ignore[arg-type]
    nvme_host, nvme_disk = ParamNvme.tiers(subject, budget, homes=Homes.NVME)
    assert (host, disk_estimate) == (nvme_host - own + ring, nvme_disk)
    assert disk_estimate <= disk <= disk_estimate + IO_ALIGNMENT
    assert (disk_estimate == 0) == (budget == 10**9)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_in_flight_auto_budget_is_the_estimators(
    tmp_path: Path, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    # host_budget="auto" with in-flight staging: the optimizer resolves the budget less
    # what is in RAM with a ring whatever the placement (the ring, the I/O buffers, the
    # weight tile ring and the bounce ring as large as the window), and holds the homes
    # first (Note [homes on NVMe]), as the estimator's row does from the host memory. A
    # machine whose RAM is all available, sized so that every home and about half the
    # state fit: both split the state alike, to the byte.
    from collections import namedtuple

    from zero_offload.memory import host_ram
    from zero_offload.weights.nvme_home import home_ring_bytes

    ctx = Context(itemsize=dtype.itemsize, world_size=1, ranks_per_node=1, bucket_bytes=BUCKET)
    subject = ShapeSubject(SHAPE, ctx)
    own, ring = ring_bytes(subject.unit_groups(), ctx)  # type: ignore[arg-type]
    window = subject.param_offload_pools()[0]  # type: ignore[index]
    fixed = ring + io_buffer_bytes() + home_ring_bytes(OffloadConfig().tile_elements, ctx.itemsize)
    homes = own  # each home is as large as its bucket's gradient staging
    # The reserve (2 GiB), the fixed part and the bounce ring, every home, some state.
    ram = 2 * GiB + fixed + window + homes + 300_000
    Memory = namedtuple("Memory", "total available")
    monkeypatch.setattr(host_ram.psutil, "virtual_memory", lambda: Memory(ram, ram))
    monkeypatch.setattr(host_ram, "cgroup_memory", lambda: None)  # no container limit
    model = TinyGPT(GPTConfig(vocab_size=50, seq_len=32, layers=3, hidden=64, heads=4)).to(dtype)
    acc = HostAccelerator(AcceleratorConfig(device_budget="256MiB"))
    config = OffloadConfig(
        bucket_bytes=BUCKET,
        offload_parameters=True,
        grad_staging="in_flight",
        nvme_dir=tmp_path,
        host_budget="auto",
    )
    opt = OffloadAdamW(
        model.parameters(), accelerator=acc, config=config, model=model, layers=model.blocks
    )
    try:
        locations = {b.store.location for b in opt.buckets}
        pools = opt.manager.pool_stats()
        host_pool = sum(p["capacity_bytes"] for name, p in pools.items() if name.endswith(".host"))
        ring_pool = sum(
            p["capacity_bytes"] for name, p in pools.items() if name.endswith(".grad_staging_ring")
        )
        homes_on_disk = any(getattr(b.store, "home", None) for b in opt.buckets)
    finally:
        opt.close()
    assert locations == {"host", "nvme"}
    assert not homes_on_disk
    host, disk = ParamInFlight.tiers(subject, homes + 300_000, homes=Homes.NVME)
    assert host == host_pool + ring_pool + io_buffer_bytes() and disk > 0
    row = _rows(
        estimate(
            SHAPE,
            device_memory=GiB,
            host_memory=ram,
            disk_memory="1GB",
            bucket_bytes=BUCKET,
            dtype=dtype,
        )
    )
    in_flight = row["params and state on NVMe + in-flight staging + ckpt"]
    assert (in_flight.host, in_flight.disk) == (host, disk)  # type: ignore[attr-defined]


def test_param_nvme_tiers_need_units() -> None:
    ctx = Context(itemsize=2, world_size=1, ranks_per_node=1, bucket_bytes=BUCKET)
    with pytest.raises(ValueError, match="CountSubject"):
        ParamNvme.tiers(CountSubject(10**6, ctx), None)


def test_nvme_rows_agree_with_the_in_ram_rows_when_the_host_is_large() -> None:
    # With room for everything, the NVMe rows hold what the in-RAM rows hold, and no disk.
    rows = _rows(estimate(SHAPE, device_memory=GiB, host_memory="64GiB", bucket_bytes=BUCKET))
    nvme = rows["ZeRO-Offload + NVMe state + checkpointing"]
    ram = rows["ZeRO-Offload + checkpointing"]
    assert (nvme.host, nvme.disk, nvme.device_total) == (ram.host, 0, ram.device_total)  # type: ignore[attr-defined]
    # Parameter offload + NVMe state, homes in RAM, is parameter offload with every bucket's
    # state in RAM: the same pools (the homes are the weight staging), no disk.
    param = rows["ZeRO-Offload + param offload + checkpointing"]
    combined = rows["param offload + NVMe state + checkpointing"]
    assert (combined.host, combined.disk) == (param.host, 0)  # type: ignore[attr-defined]
    assert combined.device_total == param.device_total  # type: ignore[attr-defined]


def test_per_parameter_bytes_of_the_combined_rows_at_scale() -> None:
    # Llama-3-8B, bf16, host large enough for all state: 2 bytes per parameter (the home, its
    # bucket's weight staging) + 2 (gradient staging, every bucket) + 12 (master, exp_avg,
    # exp_avg_sq), as parameter offload alone; the homes fit, so the row with the weights
    # movable to NVMe places them in RAM too (Note [homes on NVMe]). (Alignment: well under
    # 1%.)
    result = estimate("llama-3-8b", device_memory="24GiB", host_memory="1TiB", disk_memory="1TB")
    p, rows = result.params, _rows(result)
    homes_in_ram = rows["param offload + NVMe state + checkpointing"]
    movable = rows["params and state on NVMe + checkpointing"]
    assert homes_in_ram.host == pytest.approx(16 * p, rel=0.005)  # type: ignore[attr-defined]
    assert homes_in_ram.host == rows["ZeRO-Offload + param offload + checkpointing"].host  # type: ignore[attr-defined]
    assert homes_in_ram.disk == 0 and movable.disk == 0  # type: ignore[attr-defined]
    assert movable.host == homes_in_ram.host  # type: ignore[attr-defined]
    # A small host pushes the state to the disk: most of its 12 bytes per parameter are
    # records there, while homes and gradient staging keep 4 bytes per parameter in RAM.
    small = _rows(
        estimate("llama-3-8b", device_memory="24GiB", host_memory="48GiB", disk_memory="1TB")
    )
    row = small["param offload + NVMe state + checkpointing"]
    assert row.fits and row.host <= 48 * GiB - host_reserve_of(48 * GiB)  # type: ignore[attr-defined]
    assert row.host > 4 * p and row.disk > 8 * p and row.host + row.disk >= 16 * p  # type: ignore[attr-defined]
    # Smaller still, the state is all on disk and the homes go too, past what fits beside
    # the gradient staging (2 bytes per parameter, every bucket, in this library): the
    # movable row has less in RAM and 2 more bytes per parameter on disk, at most.
    tiny = _rows(
        estimate("llama-3-8b", device_memory="24GiB", host_memory="24GiB", disk_memory="1TB")
    )
    fixed, movable = (
        tiny["param offload + NVMe state + checkpointing"],
        tiny["params and state on NVMe + checkpointing"],
    )
    assert movable.host < fixed.host and 2 * p < movable.host < 4 * p  # type: ignore[attr-defined]
    assert fixed.disk < movable.disk <= fixed.disk + 2.01 * p  # type: ignore[attr-defined]


def test_per_parameter_bytes_of_the_in_flight_rows_at_scale() -> None:
    # Llama-3-8B, bf16. In-flight staging drops every bucket's 2-byte gradient staging for
    # a ring of two buffers of the largest bucket (the embedding, 128256 x 4096): 14 bytes
    # per parameter plus 2 GiB with the state in RAM; with the state on NVMe and a small
    # host, 2 in RAM (the homes) wherever the state is, the rest on the disk.
    big = _rows(estimate("llama-3-8b", device_memory="24GiB", host_memory="1TiB"))
    p = estimate("llama-3-8b").params
    ring = 2 * 128256 * 4096 * 2
    per_bucket = big["ZeRO-Offload + param offload + checkpointing"]
    for name in (
        "param offload + in-flight staging + checkpointing",
        "param offload + NVMe state + in-flight staging + ckpt",
    ):
        row = big[name]
        assert row.host == pytest.approx(14 * p + ring, rel=0.005), name  # type: ignore[attr-defined]
        assert row.host < per_bucket.host - 2 * p + ring + 2**20, name  # type: ignore[attr-defined]
        assert row.device_total == per_bucket.device_total and row.disk == 0, name  # type: ignore[attr-defined]
        assert row.library == "yes" and "no gradient clipping" in row.conditions, name  # type: ignore[attr-defined]
    small = _rows(
        estimate("llama-3-8b", device_memory="24GiB", host_memory="48GiB", disk_memory="1TB")
    )
    row = small["param offload + NVMe state + in-flight staging + ckpt"]
    assert row.fits and row.host <= 48 * GiB - host_reserve_of(48 * GiB)  # type: ignore[attr-defined]
    assert row.host > 2 * p and row.disk > 8 * p  # type: ignore[attr-defined]
    assert row.host + row.disk >= 14 * p  # type: ignore[attr-defined]
    # Several ranks: ZeRO-3, an estimate.
    two = _rows(estimate("llama-3-8b", world_size=2, device_memory="24GiB", host_memory="1TiB"))
    assert two["param offload + in-flight staging + checkpointing"].library == "not yet"  # type: ignore[attr-defined]


def host_reserve_of(host: int) -> int:
    from zero_offload.estimate import host_reserve

    return host_reserve(host)


def test_the_state_records_are_the_states_bytes_rounded_to_pages() -> None:
    tiers = bucket_tiers(16 * MiB, itemsize=2, bucket_bytes=32 * MiB, world_size=1)
    assert tiers.state == 12 * 16 * MiB  # master, exp_avg, exp_avg_sq: fp32
    assert tiers.record == tiers.state  # whole 4 KiB pages already
    assert tiers.staging == 2 * 2 * 16 * MiB and tiers.home == tiers.grad == 2 * 16 * MiB
    sharded = bucket_tiers(16 * MiB, itemsize=2, bucket_bytes=32 * MiB, world_size=8)
    assert sharded.state == tiers.state // 8  # each rank its shard


def test_library_column_says_what_runs() -> None:
    one = _rows(estimate(SHAPE, device_memory=GiB, host_memory=GiB, bucket_bytes=BUCKET))
    assert one["ZeRO-Offload + NVMe state + checkpointing"].library == "yes"  # type: ignore[attr-defined]
    assert one["ZeRO-Offload + parameter offload"].library == "yes"  # type: ignore[attr-defined]
    assert one["ZeRO-3"].library == "paper"  # type: ignore[attr-defined]
    # Parameter offload with nvme_dir runs on one rank, the homes in RAM or on NVMe.
    for name in (
        "param offload + NVMe state + checkpointing",
        "params and state on NVMe + checkpointing",
    ):
        row = one[name]
        assert (row.library, row.not_run) == ("yes", ""), name  # type: ignore[attr-defined]
    many = estimate(SHAPE, world_size=16, ranks_per_node=8, device_memory=GiB, host_memory=GiB)
    # ZeRO-3 with offload runs (tests/test_zero3.py builds it), with nvme_dir too
    # (tests/test_zero3_nvme.py); in-flight staging is refused on several ranks.
    assert _rows(many)["ZeRO-Offload + parameter offload"].library == "yes"  # type: ignore[attr-defined]
    for name in (
        "param offload + NVMe state + checkpointing",
        "params and state on NVMe + checkpointing",
    ):
        row = _rows(many)[name]
        assert (row.library, row.not_run) == ("yes", ""), name  # type: ignore[attr-defined]
    in_flight = _rows(many)["params and state on NVMe + in-flight staging + ckpt"]
    assert in_flight.not_run == IN_FLIGHT_RANKS_NOT_YET  # type: ignore[attr-defined]
    text = many.table()
    assert IN_FLIGHT_RANKS_NOT_YET in text
    assert "8 ranks per node" in text


def test_stage_three_with_offload_shards_the_host_per_rank() -> None:
    # 16 ranks, 8 per node: each rank holds 1/16 of the host state, a node 8 of them; the
    # device window holds gathered units, as one rank's does.
    # Each bucket is padded to a multiple of 16 x 256 elements: under 1% at these widths.
    shape = ModelShape(layers=8, hidden=2048, heads=16, vocab=32000, seq_len=64, arch="llama")
    kwargs = {"device_memory": 8 * GiB, "host_memory": "256GiB"}
    one = _rows(estimate(shape, **kwargs))["ZeRO-Offload + parameter offload"]
    many = _rows(estimate(shape, world_size=16, ranks_per_node=8, **kwargs))[
        "ZeRO-Offload + parameter offload"
    ]
    assert many.device_model_states == pytest.approx(one.device_model_states, rel=0.01)  # type: ignore[attr-defined]
    assert many.host == pytest.approx(one.host / 2, rel=0.01)  # type: ignore[attr-defined]


@settings(max_examples=25, deadline=None)
@given(
    layers=st.integers(1, 6),
    hidden=st.sampled_from([64, 128]),
    host_scale=st.floats(0.0, 3.0),
    disk_scale=st.floats(0.0, 3.0),
    world=st.sampled_from([1, 4]),
)
def test_largest_never_contradicts_fits_with_a_disk(
    layers: int, hidden: int, host_scale: float, disk_scale: float, world: int
) -> None:
    shape = ModelShape(layers=layers, hidden=hidden, heads=4, vocab=300, seq_len=16)
    need = 16 * shape.params
    result = estimate(
        shape,
        world_size=world,
        device_memory=max(MiB, 4 * shape.params),
        host_memory=2 * GiB + int(host_scale * need) + 256 * MiB,
        disk_memory=MiB + int(disk_scale * need),
        bucket_bytes="16KiB",
    )
    for row in result.rows:
        assert row.fits is not None, row.name
        if row.fits:
            assert row.largest_fitting_params >= shape.params, row
            assert row.disk <= result.disk_memory  # type: ignore[operator]
            assert row.host <= result.host_memory - result.host_reserve  # type: ignore[operator]
        else:
            assert row.largest_fitting_params < shape.params, row


@pytest.mark.parametrize(
    ("value", "needles"),
    [("2", ["disk_memory='2'", "no unit", "'2GiB'"]), (2048, ["disk_memory=2048", "'2048GiB'"])],
)
def test_a_disk_size_needs_a_unit(value: str | int, needles: list[str]) -> None:
    with pytest.raises(ValueError) as info:
        estimate(10**6, device_memory=GiB, host_memory=GiB, disk_memory=value)
    for needle in needles:
        assert needle in str(info.value)


def test_the_cli_takes_a_disk(capsys: pytest.CaptureFixture[str]) -> None:
    from zero_offload.cli import main

    argv = ["estimate", "--params", "7B", "--device-memory", "24GiB", "--host-memory", "64GiB"]
    assert main([*argv, "--disk-memory", "1TB"]) == 0
    out = capsys.readouterr().out
    assert "NVMe 931.32 GiB per node" in out and "ZeRO-Offload + NVMe state" in out
    assert main([*argv, "--disk-memory", "1"]) != 0
    assert "--disk-memory" in capsys.readouterr().err
