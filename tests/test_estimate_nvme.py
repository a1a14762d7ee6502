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
from zero_offload.estimate.nvme import bucket_tiers, io_buffer_bytes
from zero_offload.estimate.rows import ZERO3_NOT_YET, Context, CountSubject, ShapeSubject
from zero_offload.estimate.tiered import PARAMS_NVME_NOT_YET, NvmeState, ParamNvme
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
    # NvmeState against OffloadAdamW(nvme_dir=...); ParamNvme (homes in RAM) against
    # OffloadAdamW(offload_parameters=True, nvme_dir=...): the units' buckets (units last to
    # first) placed by plan_nvme, every unit's home (its bucket's weight staging) in the pool.
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
        host_pool = sum(p["capacity_bytes"] for name, p in pools.items() if name.endswith(".host"))
        disk = sum(f.stat().st_size for f in tmp_path.rglob("*") if f.is_file())
    finally:
        opt.close()
    # Each budget places the buckets differently: all on NVMe, some of each, all in RAM.
    assert locations == {0: {"nvme"}, 300_000: {"host", "nvme"}, 10**9: {"host"}}[budget]
    ctx = Context(itemsize=dtype.itemsize, world_size=1, ranks_per_node=1, bucket_bytes=BUCKET)
    row = ParamNvme if params else NvmeState
    host, disk_estimate = row.tiers(ShapeSubject(SHAPE, ctx), budget)
    # Host: the pool exactly, plus the tier's I/O buffers (not a pool) when a bucket spills.
    assert host == host_pool + (io_buffer_bytes() if disk_estimate else 0)
    # Disk: the state records exactly; the files add at most a page of metadata.
    assert disk_estimate <= disk <= disk_estimate + IO_ALIGNMENT
    assert (disk_estimate == 0) == (budget == 10**9)  # the big budget keeps everything in RAM


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
    # Llama-3-8B, bf16, host large enough for all state. Homes in RAM (what the library
    # runs): 2 bytes per parameter (the home, its bucket's weight staging) + 2 (gradient
    # staging, every bucket) + 12 (master, exp_avg, exp_avg_sq), as parameter offload alone.
    # Homes on NVMe (not run yet): 12 in RAM, plus gradient staging for the two buckets in
    # flight (as large as the device's two gradient buffers), bounce buffers as large as the
    # device window and the tier's I/O buffers; the homes' 2 bytes per parameter on disk.
    # (Alignment: well under 1%.)
    result = estimate("llama-3-8b", device_memory="24GiB", host_memory="1TiB", disk_memory="1TB")
    p, rows = result.params, _rows(result)
    homes_in_ram = rows["param offload + NVMe state + checkpointing"]
    homes_on_disk = rows["params and state on NVMe + checkpointing"]
    in_flight = homes_in_ram.device_buffers  # type: ignore[attr-defined]
    window = homes_in_ram.device_model_states  # type: ignore[attr-defined]
    assert homes_in_ram.host == pytest.approx(16 * p, rel=0.005)  # type: ignore[attr-defined]
    assert homes_in_ram.host == rows["ZeRO-Offload + param offload + checkpointing"].host  # type: ignore[attr-defined]
    assert homes_in_ram.disk == 0  # type: ignore[attr-defined]
    on_disk_host = 12 * p + in_flight + window + io_buffer_bytes()
    assert homes_on_disk.host == pytest.approx(on_disk_host, rel=0.005)  # type: ignore[attr-defined]
    assert homes_on_disk.disk == pytest.approx(2 * p, rel=0.005)  # type: ignore[attr-defined]
    # A small host pushes the state to the disk: most of its 12 bytes per parameter are
    # records there. Homes in RAM keep 4 bytes per parameter in RAM (home and gradient
    # staging) wherever the state is; homes on NVMe put 2 more on the disk.
    small = _rows(
        estimate("llama-3-8b", device_memory="24GiB", host_memory="48GiB", disk_memory="1TB")
    )
    for name, in_ram, total in (
        ("params and state on NVMe + checkpointing", 0, 14),
        ("param offload + NVMe state + checkpointing", 4, 16),
    ):
        row = small[name]
        assert row.fits and row.host <= 48 * GiB - host_reserve_of(48 * GiB), name  # type: ignore[attr-defined]
        assert row.host > in_ram * p and row.disk > 8 * p, name  # type: ignore[attr-defined]
        assert row.host + row.disk >= total * p, name  # type: ignore[attr-defined]


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
    # Parameter offload with nvme_dir runs on one rank, the homes in RAM; with the weights
    # themselves on NVMe it is an estimate.
    homes_in_ram = one["param offload + NVMe state + checkpointing"]
    assert (homes_in_ram.library, homes_in_ram.not_run) == ("yes", "")  # type: ignore[attr-defined]
    combined = one["params and state on NVMe + checkpointing"]
    assert combined.library == "not yet" and "weights on NVMe" in combined.not_run  # type: ignore[attr-defined]
    assert "ZeRO-3" not in combined.not_run  # type: ignore[attr-defined]
    many = estimate(SHAPE, world_size=16, ranks_per_node=8, device_memory=GiB, host_memory=GiB)
    # ZeRO-3 with offload runs (tests/test_zero3.py builds it); with nvme_dir it is refused.
    assert _rows(many)["ZeRO-Offload + parameter offload"].library == "yes"  # type: ignore[attr-defined]
    param = _rows(many)["param offload + NVMe state + checkpointing"]
    assert param.library == "not yet" and param.not_run == ZERO3_NOT_YET  # type: ignore[attr-defined]
    combined = _rows(many)["params and state on NVMe + checkpointing"]
    assert combined.not_run == f"{PARAMS_NVME_NOT_YET}; {ZERO3_NOT_YET}"  # type: ignore[attr-defined]
    text = many.table()
    assert ZERO3_NOT_YET in text
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
