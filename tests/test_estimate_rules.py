"""The estimator's rows for every optimizer rule (issue 37), against the pools each rule's
optimizer builds (``tests/helpers/rule_pools.py``: a bf16 TinyGPT of 4 blocks in 8 KiB
buckets, everything offloaded).

1. One rank, each of the six rules: the "ZeRO-Offload" row's device bytes (the weights and
   the gradient buffers) and host bytes are the built pools exactly, estimated from the
   module (its parameters' shapes) and from its ``ModelShape`` (O(1) in the layers); the
   parameter offload row's window, gradient buffers and units' host pools for Lion,
   Adafactor and Muon; the NVMe split (host pool, I/O buffers, records) of Lion, Adagrad,
   Adafactor and Muon, and with parameter offload of Adafactor and Muon.
2. Two gloo ranks, Adafactor and Muon (each parameter whole in one rank's shard, the
   shard the bucket's largest rank share: Note [a whole parameter has one owner]) and
   Lion (flat-range shards): the same, the host per node both ranks' pools. Muon's weight
   shadows (``overlap_step``) and gradient accumulators, per shard, on one rank and two.
3. The shape's buckets, planned once each with the owners' history replayed (Note [a
   whole-parameter rule's buckets are planned one by one]), give what planning every
   parameter gives, over rules, ranks, bucket sizes, dtypes and shapes, and the buckets by
   shape (what the NVMe, accumulator and shadow rows read for such a rule) are the
   packer's; 10^5 layers plan fast.
4. What a rule changes beyond its pools: the paper's rows count its state; rows the library
   refuses for it are left out with the reason (``MemoryEstimate.left_out``); the API and
   ``zero-offload estimate --optimizer`` take every rule's name and refuse another, listing
   the names.
5. ``moments_dtype="bfloat16"`` (``OffloadConfig.moments_dtype``): the rows size the
   fields each rule keeps in that dtype at 2 bytes (AdamW and Adam 12 -> 8 bytes per
   parameter, Lion and Adagrad 8 -> 6; Adafactor and Muon unchanged, their state fp32):
   every rule's rows against the built pools on one rank, AdamW and Lion on two gloo ranks,
   parameter offload and the NVMe split; the paper rows' ``K``; the API's and the CLI's
   ``--moments-dtype`` and their refusal of another value.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from zero_offload import OffloadConfig, cli
from zero_offload.estimate import CONFIGURATIONS, OPTIMIZERS, ModelShape, estimate, offload_bytes
from zero_offload.estimate.buckets import shape_bucket_shapes
from zero_offload.estimate.nvme import io_bytes, total_bytes
from zero_offload.estimate.pools import module_bucket_shapes, rule_state, shape_offload_bytes
from zero_offload.estimate.rows import Context
from zero_offload.estimate.subjects import ModuleSubject, ShapeSubject
from zero_offload.estimate.tiered import NvmeState, ParamNvme
from zero_offload.memory.storage import IO_ALIGNMENT
from zero_offload.optim.rule import RULES

from .helpers.dist import run_ranks
from .helpers.models import host_accelerator
from .helpers.rule_pools import (
    BUCKET_BYTES,
    FACADES,
    SHAPE,
    built_extras,
    built_param_pools,
    built_pools,
    model,
)

GiB = 2**30
WHOLE = ("adafactor", "muon")


def _row(
    source: object,
    rule: str,
    world: int = 1,
    name: str = "ZeRO-Offload",
    moments_dtype: str = "float32",
) -> object:
    result = estimate(
        source,
        dtype=torch.bfloat16,
        bucket_bytes=BUCKET_BYTES,
        world_size=world,
        device_memory=GiB,
        host_memory=16 * GiB,
        optimizer=rule,
        moments_dtype=moments_dtype,
    )
    return {row.name: row for row in result.rows}[name]


def test_every_rule_has_a_facade_and_a_name() -> None:
    assert set(OPTIMIZERS) == set(RULES) == set(FACADES)


# -- 1. one rank ------------------------------------------------------------------------------


@pytest.mark.parametrize("rule", OPTIMIZERS)
def test_one_rank_rows_are_the_built_pools(rule: str) -> None:
    built = built_pools(rule)
    for source in (model(), SHAPE):  # the module's shapes, and the shape's own planning
        row = _row(source, rule)
        assert row.device_model_states + row.device_buffers == built["device"], source  # type: ignore[attr-defined]
        assert row.host == built["host"], source  # type: ignore[attr-defined]
    # The state is what the rule keeps: per element, and for Adafactor and Muon by shape.
    numel = SHAPE.params
    per_element = rule_state(rule).bytes_per_element
    if rule in WHOLE:
        assert per_element * numel < built["state"] < 12 * numel
    else:
        assert built["state"] == per_element * numel


@pytest.mark.parametrize("rule", ["lion", "adafactor", "muon"])
def test_one_rank_parameter_offload_rows_are_the_built_pools(rule: str) -> None:
    """With ``offload_parameters=True`` each unit's host pool holds its buckets' state,
    Adafactor's and Muon's shaped state included (Note [rules that read a whole
    parameter])."""
    built = built_param_pools(rule)
    row = _row(SHAPE, rule, name="ZeRO-Offload + parameter offload")  # units: a shape's
    assert row.device_model_states == built["window"]  # type: ignore[attr-defined]
    assert row.device_buffers == built["device"]  # type: ignore[attr-defined]
    assert row.host == built["host"]  # type: ignore[attr-defined]


@pytest.mark.parametrize("budget", [0, 300_000, 10**9])
@pytest.mark.parametrize("rule", ["lion", "adagrad", "adafactor", "muon"])
def test_one_rank_nvme_tiers_are_the_built_split(rule: str, budget: int, tmp_path: Path) -> None:
    """``nvme_dir`` with ``host_budget``: the state records hold the rule's fields, so the
    split, the host pool and the I/O buffers are the rule's (as in
    tests/test_estimate_nvme.py for AdamW); Adafactor's and Muon's records follow whole
    parameters and their shaped state stays in RAM (Note [NVMe tiles follow whole
    parameters])."""
    facade, hyper = FACADES[rule]
    config = OffloadConfig(bucket_bytes=BUCKET_BYTES, nvme_dir=tmp_path, host_budget=budget)
    opt = facade(model().parameters(), **hyper, config=config, accelerator=host_accelerator())
    try:
        pools = opt.manager.pool_stats()
        host_pool = sum(p["capacity_bytes"] for n, p in pools.items() if n.endswith(".host"))
        disk = sum(f.stat().st_size for f in tmp_path.rglob("*") if f.is_file())
    finally:
        opt.close()
    ctx = Context(itemsize=2, world_size=1, ranks_per_node=1, bucket_bytes=BUCKET_BYTES, rule=rule)
    subject = ShapeSubject(SHAPE, ctx)
    host, disk_estimate = NvmeState.tiers(subject, budget)
    assert host == host_pool + (io_bytes(subject.bucket_groups(), ctx) if disk_estimate else 0)
    assert disk_estimate <= disk <= disk_estimate + IO_ALIGNMENT
    assert disk_estimate > 0 if budget == 0 else True  # 300 kB holds Adafactor's 4 B each
    assert disk_estimate == 0 if budget == 10**9 else True


@pytest.mark.parametrize("state_budget", [0, 10**9])
@pytest.mark.parametrize("rule", ["adafactor", "muon"])
def test_one_rank_parameter_offload_with_nvme_state_is_the_built_split(
    rule: str, state_budget: int, tmp_path: Path
) -> None:
    """``offload_parameters`` with ``nvme_dir``: every home stays in RAM for a rule that
    reads whole parameters, and ``host_budget`` holds them first, the state in what is left
    (Note [homes on NVMe]): the homes-in-RAM row's tiers, with the budget the state's."""
    ctx = Context(itemsize=2, world_size=1, ranks_per_node=1, bucket_bytes=BUCKET_BYTES, rule=rule)
    subject = ShapeSubject(SHAPE, ctx)
    homes = total_bytes(subject.unit_groups(), ctx, "home")  # type: ignore[arg-type]
    facade, hyper = FACADES[rule]
    net = model()
    config = OffloadConfig(
        bucket_bytes=BUCKET_BYTES,
        nvme_dir=tmp_path,
        host_budget=homes + state_budget,
        offload_parameters=True,
    )
    opt = facade(
        net.parameters(), **hyper, config=config, accelerator=host_accelerator(), model=net
    )
    try:
        pools = opt.manager.pool_stats()
        host_pool = sum(
            p["capacity_bytes"] for n, p in pools.items() if n.endswith((".host", ".bounce"))
        )
        disk = sum(f.stat().st_size for f in tmp_path.rglob("*") if f.is_file())
    finally:
        opt.close()
    host, disk_estimate = ParamNvme.tiers(subject, state_budget)
    groups = subject.unit_groups()
    assert host == host_pool + (io_bytes(groups, ctx) if disk_estimate else 0)  # type: ignore[arg-type]
    assert disk_estimate <= disk <= disk_estimate + IO_ALIGNMENT
    assert (disk_estimate == 0) == (state_budget == 10**9)


# -- 2. two ranks -----------------------------------------------------------------------------


@pytest.mark.parametrize("rule", ["adafactor", "muon", "lion"])
def test_two_rank_rows_are_each_ranks_built_pools(rule: str, tmp_path: Path) -> None:
    results = run_ranks(2, "rule_pools", tmp_path, rule=rule)
    assert results[0]["device"] == results[1]["device"]  # every rank's pools are alike
    assert results[0]["host"] == results[1]["host"]
    for source in (model(), SHAPE):
        row = _row(source, rule, world=2)
        assert row.device_model_states + row.device_buffers == results[0]["device"], source  # type: ignore[attr-defined]
        assert row.host == results[0]["host"] + results[1]["host"], source  # type: ignore[attr-defined]
    if rule in WHOLE:  # the shards' padding: more than half of one rank's weights each
        assert results[0]["device"] > _row(SHAPE, "lion", world=2).device_model_states  # type: ignore[attr-defined]


_ACC = "ZeRO-Offload + ckpt, micro-batches summed on the "
_SHADOW = "ZeRO-Offload + ckpt + overlap_step, weight shadow on the device"


@pytest.mark.parametrize("world", [1, 2])
def test_shadow_and_accumulator_rows_hold_the_built_pools(world: int, tmp_path: Path) -> None:
    """Muon: the weight shadows and the accumulators are per shard, so on two ranks they
    are ``own_whole``'s shards (the buckets' padded lengths), not ``1/N`` of a bucket."""
    if world == 1:
        ranks = [built_extras("muon")]
    else:
        ranks = run_ranks(world, "rule_extras", tmp_path, rule="muon")
    assert all(r == ranks[0] for r in ranks)  # every rank's pools are alike
    built = ranks[0]
    rows = {
        name: _row(SHAPE, "muon", world, name)
        for name in ("ZeRO-Offload + checkpointing", _ACC + "device", _ACC + "host", _SHADOW)
    }
    base = rows["ZeRO-Offload + checkpointing"]
    shadow, on_device, on_host = rows[_SHADOW], rows[_ACC + "device"], rows[_ACC + "host"]
    # overlap_step, one micro-batch: the shadows on the device, each bucket's spare staging
    # on the host, no accumulator (Note [overlap_step's device extras follow the budget]).
    extras = built[".weight_shadow"]
    assert shadow.device_buffers - base.device_buffers == extras > 0  # type: ignore[attr-defined]
    assert shadow.host - base.host == world * built[".grad_staging_spare"]  # type: ignore[attr-defined]
    assert on_device.device_buffers - base.device_buffers == built[".grad_acc_dev"] > 0  # type: ignore[attr-defined]
    assert on_device.host - base.host == world * built[".grad_acc"]  # type: ignore[attr-defined]
    spare = built[".grad_acc"] + built[".grad_staging_spare"]
    assert on_host.host - base.host == world * spare  # type: ignore[attr-defined]


# -- 3. the shape's planning ------------------------------------------------------------------

SHAPES = [
    SHAPE,
    ModelShape(layers=7, hidden=96, heads=4, vocab=77, seq_len=32, arch="llama", kv_heads=2),
    ModelShape(layers=9, hidden=40, heads=4, vocab=33, seq_len=8, tied=True),
    ModelShape(
        layers=6, hidden=48, heads=4, vocab=40, seq_len=8, arch="qwen2", kv_heads=2, experts=3,
        shared_ffn=32,
    ),
]  # fmt: skip


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s.arch}{s.layers}")
@pytest.mark.parametrize("rule", ["adamw", "lion", "adafactor", "muon"])
def test_the_shape_plans_what_every_parameter_plans(shape: ModelShape, rule: str) -> None:
    params = shape.parameter_shapes()
    for world in (1, 2, 3, 8):
        for bucket_bytes in (4096, 8192, 65536):
            for itemsize in (2, 4):
                kwargs = {"itemsize": itemsize, "bucket_bytes": bucket_bytes}
                want = offload_bytes(params, **kwargs, world_size=world, rule=rule)
                assert shape_offload_bytes(shape, **kwargs, world_size=world, rule=rule) == want
                buckets = shape_bucket_shapes(shape, bucket_numel=bucket_bytes // itemsize)
                flat = tuple(b for run, repeats in buckets for _ in range(repeats) for b in run)
                assert flat == module_bucket_shapes(tuple(params), itemsize, bucket_bytes)


@pytest.mark.parametrize("rule", ["lion", "adafactor", "muon"])
def test_a_modules_larger_members_plan_what_their_parameters_plan(rule: str) -> None:
    """The search's members of a module (it plus whole buckets of 1-D parameters, packed
    first): with a rule that reads whole parameters on several ranks the extra buckets move
    ``own_whole``'s owners of the module's, and the pools still equal planning them all."""
    params = SHAPE.parameter_shapes()
    for world in (1, 2, 3):
        ctx = Context(
            itemsize=2, world_size=world, ranks_per_node=world, bucket_bytes=8192, rule=rule
        )
        module = ModuleSubject(params, ctx)
        for extra in (1, 2, 5):
            member = module.member(module.params + extra * 4096)
            want = offload_bytes(
                params + [(4096,)] * extra,
                itemsize=2,
                bucket_bytes=8192,
                world_size=world,
                rule=rule,
            )
            assert member.offload_pools() == want, (world, extra)


def test_a_long_model_is_planned_in_o1_layers() -> None:
    """GPT-2's widths, 8 ranks: the owners' history settles into a period, so 10^5 layers
    plan as fast as a few (the search for the largest model asks dozens of sizes)."""
    import time

    shape = ModelShape(layers=100_000, hidden=768, heads=12, vocab=50257, seq_len=1024)
    began = time.perf_counter()
    weights, _, host = shape_offload_bytes(
        shape, itemsize=2, bucket_bytes=32 * 2**20, world_size=8, rule="adafactor"
    )
    assert time.perf_counter() - began < 10
    assert host > 4 * shape.params // 8 and weights >= 2 * shape.params


# -- 4. beyond the pools ----------------------------------------------------------------------


def test_the_paper_rows_count_the_rules_state() -> None:
    rows = {rule: _row(SHAPE, rule, name="no offload (DDP)") for rule in OPTIMIZERS}
    p = SHAPE.params
    assert rows["adamw"].device_model_states == (2 + 2 + 12) * p  # type: ignore[attr-defined]
    assert rows["lion"].device_model_states == (2 + 2 + 8) * p  # type: ignore[attr-defined]
    # Adafactor: the master and the factors; Muon: the master, and the momentum or moments.
    assert (2 + 2 + 4) * p < rows["adafactor"].device_model_states < (2 + 2 + 5) * p  # type: ignore[attr-defined]
    assert (2 + 2 + 8) * p <= rows["muon"].device_model_states <= (2 + 2 + 12) * p  # type: ignore[attr-defined]


def test_rows_a_rule_is_refused_are_left_out_with_the_reason() -> None:
    def left(rule: str, world: int) -> dict[str, str]:
        result = estimate(
            SHAPE, world_size=world, device_memory=GiB, host_memory=GiB, optimizer=rule
        )
        names = {row.name for row in result.rows}
        out = {row.name: row.reason for row in result.left_out}
        assert not names & set(out)
        return out

    for rule in ("adamw", "lion", "adagrad"):  # elementwise: every row, sized for the rule
        assert left(rule, 1) == left(rule, 2) == {}
    two = left("muon", 2)
    assert "partition_parameters" in two["ZeRO-Offload + ZeRO-3 (shards on the device)"]
    assert "offload_parameters" in two["ZeRO-Offload + parameter offload"]
    assert "nvme_dir" in two["ZeRO-Offload + NVMe state + checkpointing"]
    one = left("adafactor", 1)
    assert "ZeRO-Offload + parameter offload" not in one  # runs on one rank: a row
    assert "ZeRO-Offload + NVMe state + checkpointing" not in one  # so does NVMe state
    assert "homes" in one["params and state on NVMe + checkpointing"]  # homes stay in RAM
    assert set(one) == {
        row.name for row in CONFIGURATIONS if "params and state on NVMe" in row.name
    }


def test_a_bad_optimizer_name_lists_the_names() -> None:
    with pytest.raises(ValueError, match=r"optimizer must be one of adamw, adam, lion.*got 'sgd'"):
        estimate(SHAPE, optimizer="sgd")


def test_the_cli_takes_the_optimizer(capsys: pytest.CaptureFixture[str]) -> None:
    flags = ["--layers", "4", "--hidden", "32", "--heads", "4", "--vocab", "50", "--seq-len", "16"]
    flags += ["--bucket-bytes", "8KiB", "--device-memory", "1GiB", "--host-memory", "16GiB"]
    assert cli.main(["estimate", *flags, "--optimizer", "muon", "--world-size", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["optimizer"] == "muon" and out["left_out"]
    rows = {row["name"]: row for row in out["rows"]}
    assert rows["ZeRO-Offload"]["host"] == _row(SHAPE, "muon", world=2).host  # type: ignore[attr-defined]
    assert cli.main(["estimate", *flags]) == 0  # adamw by default
    assert "optimizer adamw" in capsys.readouterr().out
    assert cli.main(["estimate", *flags, "--optimizer", "sgd"]) == 2
    err = capsys.readouterr().err
    assert "--optimizer" in err and "invalid choice: 'sgd'" in err
    assert all(name in err for name in OPTIMIZERS)


# -- 5. moments in bf16 -----------------------------------------------------------------------

#: Host state bytes per parameter of each elementwise rule, (fp32 moments, bf16 moments):
#: the fp32 master (4) and each moment (4, or 2 in bf16). Adafactor and Muon keep their
#: shaped state in fp32 whatever ``moments_dtype`` (``state_fields`` ignores it).
STATE_BYTES = {"adamw": (12, 8), "adam": (12, 8), "lion": (8, 6), "adagrad": (8, 6)}
BF16 = "bfloat16"


@pytest.mark.parametrize("rule", OPTIMIZERS)
def test_one_rank_rows_with_bf16_moments_are_the_built_pools(rule: str) -> None:
    built = built_pools(rule, moments_dtype=BF16)
    for source in (model(), SHAPE):
        row = _row(source, rule, moments_dtype=BF16)
        assert row.device_model_states + row.device_buffers == built["device"], source  # type: ignore[attr-defined]
        assert row.host == built["host"], source  # type: ignore[attr-defined]
    fp32_host = _row(SHAPE, rule).host  # type: ignore[attr-defined]
    if rule in STATE_BYTES:
        assert built["state"] == STATE_BYTES[rule][1] * SHAPE.params
        assert built["host"] < fp32_host
    else:
        assert built["host"] == fp32_host


def test_bf16_moments_take_adamw_from_12_to_8_bytes_per_parameter() -> None:
    """4 master + 2 + 2: the built state, the rule's fields as the estimator reads them, and
    the paper rows' ``K`` (mixed precision; in fp32 training the weights are the master,
    so 8 -> 4)."""
    numel, p = SHAPE.params, SHAPE.params
    for moments_dtype, per_param in (("float32", 12), (BF16, 8)):
        assert built_pools("adamw", moments_dtype=moments_dtype)["state"] == per_param * numel
        assert rule_state("adamw", moments_dtype).bytes_per_element == per_param
        ddp = _row(SHAPE, "adamw", name="no offload (DDP)", moments_dtype=moments_dtype)
        assert ddp.device_model_states == (2 + 2 + per_param) * p  # type: ignore[attr-defined]
    for rule, (fp32, bf16) in STATE_BYTES.items():
        for moments_dtype, per_param in (("float32", fp32), (BF16, bf16)):
            for itemsize in (2, 4):
                ctx = Context(
                    itemsize=itemsize,
                    world_size=1,
                    ranks_per_node=1,
                    bucket_bytes=BUCKET_BYTES,
                    rule=rule,
                    moments_dtype=moments_dtype,
                )
                assert ctx.state_bytes == per_param - (4 if itemsize == 4 else 0), ctx


@pytest.mark.parametrize("rule", ["adamw", "lion"])
def test_one_rank_parameter_offload_rows_with_bf16_moments_are_the_built_pools(rule: str) -> None:
    built = built_param_pools(rule, moments_dtype=BF16)
    row = _row(SHAPE, rule, name="ZeRO-Offload + parameter offload", moments_dtype=BF16)
    assert row.device_model_states == built["window"]  # type: ignore[attr-defined]
    assert row.device_buffers == built["device"]  # type: ignore[attr-defined]
    assert row.host == built["host"]  # type: ignore[attr-defined]


@pytest.mark.parametrize("budget", [0, 300_000])
@pytest.mark.parametrize("rule", ["adamw", "lion"])
def test_one_rank_nvme_tiers_with_bf16_moments_are_the_built_split(
    rule: str, budget: int, tmp_path: Path
) -> None:
    """The records, the I/O buffers and the host budget's split all hold bf16 moments."""
    facade, hyper = FACADES[rule]
    config = OffloadConfig(
        bucket_bytes=BUCKET_BYTES, nvme_dir=tmp_path, host_budget=budget, moments_dtype=BF16
    )
    opt = facade(model().parameters(), **hyper, config=config, accelerator=host_accelerator())
    try:
        pools = opt.manager.pool_stats()
        host_pool = sum(p["capacity_bytes"] for n, p in pools.items() if n.endswith(".host"))
        disk = sum(f.stat().st_size for f in tmp_path.rglob("*") if f.is_file())
    finally:
        opt.close()
    ctx = Context(
        itemsize=2,
        world_size=1,
        ranks_per_node=1,
        bucket_bytes=BUCKET_BYTES,
        rule=rule,
        moments_dtype=BF16,
    )
    subject = ShapeSubject(SHAPE, ctx)
    host, disk_estimate = NvmeState.tiers(subject, budget)
    assert disk_estimate > 0
    assert host == host_pool + io_bytes(subject.bucket_groups(), ctx)
    assert disk_estimate <= disk <= disk_estimate + IO_ALIGNMENT
    fp32 = ShapeSubject(SHAPE, dataclasses.replace(ctx, moments_dtype="float32"))
    assert disk_estimate < NvmeState.tiers(fp32, budget)[1]  # the records shrink


@pytest.mark.parametrize("rule", ["adamw", "lion"])
def test_two_rank_rows_with_bf16_moments_are_each_ranks_built_pools(
    rule: str, tmp_path: Path
) -> None:
    results = run_ranks(2, "rule_pools", tmp_path, rule=rule, moments_dtype=BF16)
    assert results[0]["device"] == results[1]["device"]
    assert results[0]["host"] == results[1]["host"]
    for source in (model(), SHAPE):
        row = _row(source, rule, world=2, moments_dtype=BF16)
        assert row.device_model_states + row.device_buffers == results[0]["device"], source  # type: ignore[attr-defined]
        assert row.host == results[0]["host"] + results[1]["host"], source  # type: ignore[attr-defined]
    # Each rank keeps half the state, in bf16 moments (the staging aside).
    per_param = STATE_BYTES[rule][1]
    assert results[0]["state"] + results[1]["state"] == per_param * SHAPE.params


def test_a_bad_moments_dtype_names_the_values() -> None:
    with pytest.raises(
        ValueError, match=r"moments_dtype must be one of float32, bfloat16.*got 'float16'"
    ):
        estimate(SHAPE, moments_dtype="float16")


def test_the_cli_takes_the_moments_dtype(capsys: pytest.CaptureFixture[str]) -> None:
    flags = ["--layers", "4", "--hidden", "32", "--heads", "4", "--vocab", "50", "--seq-len", "16"]
    flags += ["--bucket-bytes", "8KiB", "--device-memory", "1GiB", "--host-memory", "16GiB"]
    assert cli.main(["estimate", *flags, "--moments-dtype", BF16, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["moments_dtype"] == BF16
    rows = {row["name"]: row for row in out["rows"]}
    assert rows["ZeRO-Offload"]["host"] == _row(SHAPE, "adamw", moments_dtype=BF16).host  # type: ignore[attr-defined]
    assert rows["ZeRO-Offload"]["host"] < _row(SHAPE, "adamw").host  # type: ignore[attr-defined]
    assert cli.main(["estimate", *flags, "--optimizer", "lion", "--moments-dtype", BF16]) == 0
    assert "optimizer lion with bfloat16 moments" in capsys.readouterr().out
    assert cli.main(["estimate", *flags, "--moments-dtype", "float16"]) == 2
    err = capsys.readouterr().err
    assert "--moments-dtype" in err and "invalid choice: 'float16'" in err
    assert "float32" in err and BF16 in err
