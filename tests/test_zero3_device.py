"""ZeRO-3 with the shards on the device (``OffloadConfig(partition_parameters=True)`` on
several gloo ranks, Note [shards on the device] in params/device_shards.py): bitwise parity
with ZeRO-3 with parameter offload (the same math: the same shards gathered in the same
order, the same CPU Adam on the same host state), parity with one process on the global
batch within tests/test_zero3.py's tolerances (its module docstring says why), with
accumulation, clipping, activation checkpointing and a state-dict resume; device bytes per
rank against their formula; collective bytes per step against the paper's 3Ψ; one rank; and
the configurations refused.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from zero_offload import OffloadConfig
from zero_offload.estimate import ModelShape, estimate
from zero_offload.memory.align import aligned
from zero_offload.optim.constructor_checks import check_param_offload, windows_parameters
from zero_offload.optim.state.placement import GRAD_BUFFERS, POOL_ALIGNMENT

from .helpers.zero3 import SEQ, VOCAB
from .helpers.zero3_device import one_process, run
from .test_zero3 import _close_to_one_process, _max_diff, _per_step

STEPS = 4
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]


def _a(nbytes: int) -> int:
    return aligned(nbytes, POOL_ALIGNMENT)


def _device_formula(result: dict) -> int:
    """Each rank's device bytes under ZeRO-3 with the shards on the device."""
    buckets = result["buckets"]  # (padded_numel, shard_numel, itemsize) per bucket
    # This rank's shard of every bucket, training dtype (DeviceHomes): Ψ_bytes / N, padded.
    shards = sum(_a(shard * itemsize) for _, shard, itemsize in buckets)
    # The window: each slot as large as the largest unit placed in it, a unit being its
    # buckets' whole padded bytes, each aligned (Note [a unit always returns to its slot]).
    slot_bytes: dict[int, int] = {}
    for slot, unit in zip(result["slot_of_unit"], result["unit_buckets"], strict=True):
        slot_bytes[slot] = max(slot_bytes.get(slot, 0), sum(_a(b) for b in unit))
    window = sum(slot_bytes.values())
    # The gradient buffers: GRAD_BUFFERS of the largest bucket's padded bytes (one filling
    # while the previous one is reduce-scattered and copied to the host).
    grads = GRAD_BUFFERS * _a(max(padded * itemsize for padded, _, itemsize in buckets))
    # Micro-batches summed on the device: an fp32 accumulator of each bucket's shard (Note
    # [micro-batches add up on the device]), taken at the second accumulating step.
    sums = sum(_a(4 * shard) for _, shard, _ in buckets) if result["device_sums"] else 0
    return shards + window + grads + sums


@pytest.fixture(scope="module", params=DTYPES)
def two_ranks(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Shards on the device and shards in host homes on two ranks, and one process."""
    dtype = request.param
    out = tmp_path_factory.mktemp(f"device_{str(dtype).split('.')[-1]}")
    return {
        "device": run(2, "train", out, mode="device", dtype=dtype, steps=STEPS),
        "offload": run(2, "train", out, mode="offload", dtype=dtype, steps=STEPS),
        "one": one_process(out, mode="stage2", dtype=dtype, steps=STEPS),
        "out": out,
        "dtype": dtype,
    }


def test_two_ranks_equal_zero3_with_offload_bitwise_and_one_process(two_ranks: dict) -> None:
    device, offload, one = two_ranks["device"], two_ranks["offload"], two_ranks["one"]
    for rank in range(2):
        assert device[rank]["offloader"] == "DeviceShardOffloader"
        assert offload[rank]["offloader"] == "ShardedParamOffloader"
        assert _max_diff(device[rank]["weights"], offload[rank]["weights"]) == 0.0
        assert device[rank]["norms"] == offload[rank]["norms"]
        _close_to_one_process(device[rank]["weights"], one["weights"])
    assert _max_diff(device[0]["weights"], device[1]["weights"]) == 0.0


def test_device_bytes_per_rank_are_the_shards_the_window_and_the_gradient_buffers(
    two_ranks: dict,
) -> None:
    """The peak of the device ledger over the steps is the formula, exactly (the pools are
    allocated once); against ZeRO-3 with offload the shards are the only addition, a
    ``1/N`` share of the model's padded bytes."""
    for device, offload in zip(two_ranks["device"], two_ranks["offload"], strict=True):
        assert device["peak"] == _device_formula(device)
        assert device["construction_peak"] == device["peak"]  # one copy of the model
        shards = device["capacity"]["homes"]
        assert device["peak"] - offload["peak"] == shards
        psi = sum(padded * itemsize for padded, _, itemsize in device["buckets"])
        assert psi / 2 <= shards <= psi / 2 + len(device["buckets"]) * POOL_ALIGNMENT
        # The host state is ZeRO-Offload's either way: the same pool.
        assert device["capacity"]["host"] == offload["capacity"]["host"]


def test_collective_bytes_per_step_are_three_psi(two_ranks: dict) -> None:
    """As tests/test_zero3.py measures for the host homes: Ψ reduce-scattered, Ψ gathered
    for the forward and Ψ for the backward, less the units still in their ring slot from
    the forward (the last ``ring`` units: no tied units here)."""
    for device, offload in zip(two_ranks["device"], two_ranks["offload"], strict=True):
        unit_bytes = [sum(unit) for unit in device["unit_buckets"]]
        psi = sum(unit_bytes)
        ring = len(set(device["slot_of_unit"]))
        kept = sum(unit_bytes[-ring:])
        for moved in _per_step(device["counters"]):
            assert moved["reduce_scatter"] == psi
            assert moved["all_gather"] == 2 * psi - kept
            assert 2.5 * psi < moved["reduce_scatter"] + moved["all_gather"] <= 3 * psi
        assert device["profiled"] == offload["profiled"]
        assert device["profiled"]["all-gather"] == STEPS * (2 * psi - kept)


def test_fetches_cross_no_tier_only_the_updated_shard_goes_to_the_device(two_ranks: dict):
    """With the shards on the device a fetch copies nothing H2D; each step copies this
    rank's updated shard into its device home: the real (not padding) elements of each
    bucket's shard. With host homes every gather is fed by an H2D copy of the shard."""
    for device, offload in zip(two_ranks["device"], two_ranks["offload"], strict=True):
        shard_bytes = sum(shard * itemsize for _, shard, itemsize in device["buckets"])
        padding = sum(
            (padded - real) * itemsize
            for (padded, _, itemsize), real in zip(
                device["buckets"], device["param_numel"], strict=True
            )
        )
        per_step = device["h2d_weights"] / STEPS
        assert shard_bytes - padding <= per_step <= shard_bytes
        assert offload["h2d_weights"] > 1.5 * device["h2d_weights"]


def test_a_resume_from_state_dicts_is_bitwise_the_run_without_it(two_ranks: dict) -> None:
    """After 2 steps the model's state dict (gathered, collective) and each rank's optimizer
    state dict are saved; a fresh model with other weights and a fresh optimizer load both
    (the model's through the parameters: each written unit goes home and to its device
    shard) and train on: bitwise the uninterrupted run."""
    dtype = two_ranks["dtype"]
    out = two_ranks["out"] / "resume"
    out.mkdir()
    resumed = run(2, "train", out, mode="device", dtype=dtype, steps=STEPS, resume_at=2)
    for rank in range(2):
        assert _max_diff(resumed[rank]["weights"], two_ranks["device"][rank]["weights"]) == 0.0
        assert resumed[rank]["norms"] == two_ranks["device"][rank]["norms"]


@pytest.mark.parametrize(
    ("world", "dtype", "micro", "clip", "ckpt", "checked"),
    [
        pytest.param(2, torch.bfloat16, 3, 0.05, "torch", False, id="2-bf16-accum-clip-torch"),
        pytest.param(3, torch.float32, 2, 0.05, "offload", True, id="3-fp32-accum-clip-offload"),
        pytest.param(3, torch.bfloat16, 1, 0.05, None, False, id="3-bf16-clip"),
    ],
)
def test_accumulation_clipping_and_checkpointing(
    world: int,
    dtype: torch.dtype,
    micro: int,
    clip: float,
    ckpt: str | None,
    checked: bool,
    tmp_path: Path,
) -> None:
    """3 ranks give uneven shards (parameters straddle them); micro-batches accumulate into
    each step; the norm is clipped every step; each block recomputes its forward in the
    backward with its unit gathered from the device shards. ``checked``: the device-shard
    run under the race checker and strict mode, with a slow link (a missing wait between
    the streams that write and gather the device homes raises)."""
    kwargs = {"dtype": dtype, "steps": STEPS, "micro": micro, "clip": clip, "ckpt": ckpt}
    device = run(world, "train", tmp_path, mode="device", checked=checked, **kwargs)
    offload = run(world, "train", tmp_path, mode="offload", **kwargs)
    one = one_process(tmp_path, mode="stage2", **kwargs)
    assert min(one["norms"]) > clip  # every step clips
    for rank in range(world):
        assert _max_diff(device[rank]["weights"], offload[rank]["weights"]) == 0.0
        assert device[rank]["norms"] == offload[rank]["norms"]
        _close_to_one_process(device[rank]["weights"], one["weights"])
        assert device[rank]["device_sums"] == (micro > 1)
        assert device[rank]["peak"] == _device_formula(device[rank])
        rel = 1e-4 if dtype == torch.float32 else 1e-2
        assert device[rank]["norms"] == pytest.approx(one["norms"], rel=rel)


def test_one_rank_is_the_optimizer_without_partitioning(tmp_path: Path) -> None:
    """One rank's shard is the whole model: no window, no device homes, bitwise the
    optimizer built without the switch (model= is accepted and unused)."""
    partitioned = one_process(tmp_path, mode="device", dtype=torch.bfloat16, steps=2)
    plain = one_process(tmp_path, mode="stage2", dtype=torch.bfloat16, steps=2)
    assert partitioned["offloader"] is None
    assert _max_diff(partitioned["weights"], plain["weights"]) == 0.0
    assert partitioned["capacity"] == plain["capacity"]


def test_which_switches_mean_which_stage() -> None:
    several = SimpleNamespace(where=lambda: "rank 1/2")
    cases = {
        # (offload_parameters, partition_parameters): (one rank, several ranks) windowed
        (False, False): (False, False),  # stage 2
        (True, False): (True, True),  # parameter offload; several: ZeRO-3 with offload
        (False, True): (False, True),  # one: as stage 2; several: shards on the device
        (True, True): (True, True),  # the same as offload_parameters alone
    }
    for (offload, partition), expected in cases.items():
        config = OffloadConfig(offload_parameters=offload, partition_parameters=partition)
        assert (windows_parameters(config, None), windows_parameters(config, several)) == expected


def test_refused_configurations_name_the_argument_and_the_fix() -> None:
    with pytest.raises(TypeError, match=r"partition_parameters must be a bool, got 1"):
        OffloadConfig(partition_parameters=1)  # type: ignore[arg-type]
    for kwargs, pattern in [
        ({"offload_fraction": 0.5}, r"offload_fraction=0\.5.*set offload_fraction=1\.0"),
        ({"overlap_step": True}, r"overlap_step=True.*set overlap_step=False"),
        ({"nvme_dir": "/tmp/x"}, r"nvme_dir='/tmp/x'.*set nvme_dir=None"),
    ]:
        with pytest.raises(ValueError, match=rf"partition_parameters=True.*{pattern}"):
            OffloadConfig(partition_parameters=True, **kwargs)
    # NVMe with both switches is parameter offload's configuration (refused on several
    # ranks by check_param_offload, accepted on one).
    OffloadConfig(partition_parameters=True, offload_parameters=True, nvme_dir="/tmp/x")

    several = SimpleNamespace(where=lambda: "rank 1/2")
    model = torch.nn.Linear(2, 2)
    partition = OffloadConfig(partition_parameters=True)
    with pytest.raises(ValueError, match=r"partition_parameters=True\) needs the model"):
        check_param_offload(partition, several, None, None)
    check_param_offload(partition, several, model, None)  # ZeRO-3, shards on the device
    check_param_offload(partition, None, model, None)  # one rank: accepted, unused
    check_param_offload(partition, None, None, None)
    with pytest.raises(ValueError, match=r"model= and layers= are for parameter offload"):
        check_param_offload(OffloadConfig(), several, model, None)


def test_the_estimators_row_is_what_two_ranks_build(two_ranks: dict) -> None:
    """The estimator's "ZeRO-Offload + ZeRO-3 (shards on the device)" row on two ranks is
    the measured pools: the window and the shards, the gradient buffers, the host state."""
    dtype = two_ranks["dtype"]
    shape = ModelShape(layers=4, hidden=32, heads=4, vocab=VOCAB, seq_len=SEQ)
    table = estimate(shape, dtype=dtype, world_size=2, device_memory=2**30, bucket_bytes=8192)
    row = {row.name: row for row in table.rows}["ZeRO-Offload + ZeRO-3 (shards on the device)"]
    assert row.library == "yes"
    for result in two_ranks["device"]:
        capacity = result["capacity"]
        assert row.device_model_states == capacity["window"] + capacity["homes"]
        assert row.device_buffers == capacity["device"]
        assert row.host == 2 * capacity["host"]  # per node: both ranks
