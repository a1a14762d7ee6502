"""ZeRO-3 with parameter offload and NVMe (ZeRO-Infinity across ranks): with several gloo ranks
and ``nvme_dir``, each rank's home shard of a bucket beyond its ``host_budget`` lives in a
weight file under ``nvme_dir/rank{r}`` (Note [sharded homes on NVMe] in
params/sharded_fetch.py). Bitwise parity with the same stage-3 run with every home in RAM
(ranks with budgets of their own and leaving blocks out too), and with one process within
test_zero3.py's tolerance; ``model.state_dict()`` gathered from disk; the disk bytes of each
step against their formula; a corrupted weight tile on one rank, a full disk on one rank (the
other rank does not hang); the files gone at close and at garbage collection; the
estimator's rows against a real two-rank build. The disk is real (tmp dirs)."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from zero_offload import OffloadConfig
from zero_offload.estimate import ModelShape, estimate
from zero_offload.estimate.nvme import io_buffer_bytes, total_bytes
from zero_offload.estimate.rows import ActivationMode, Context, Limits
from zero_offload.estimate.subjects import ShapeSubject
from zero_offload.estimate.tiered import Homes, ParamNvme
from zero_offload.memory.storage import IO_ALIGNMENT
from zero_offload.weights.nvme_home import home_ring_bytes, weight_file_bytes

from .helpers.zero3 import one_process, run
from .helpers.zero3_nvme import DISK, nvme_corrupted, nvme_full, nvme_pools, nvme_train
from .test_zero3 import DTYPES, _close_to_one_process, _max_diff

STEPS = 3
TILE = 1024  # tile_elements of every build here (_zero3.make_opt's default)
BUCKET = 16 * 1024  # bucket_bytes of the estimator's check
#: Per rank: the first home shards (in bucket order) fit in RAM, the rest and every bucket's
#: master and moments go to disk (Note [homes on NVMe]: the budget holds the homes first).
HOST_BUDGET = 40_000


@pytest.fixture(scope="module", params=DTYPES)
def two_ranks(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict:
    dtype = request.param
    out = tmp_path_factory.mktemp(f"nvme_{str(dtype).split('.')[-1]}")
    (out / "ram").mkdir()
    return {
        "nvme": run(2, nvme_train, out, dtype=dtype, steps=STEPS, host_budget=HOST_BUDGET),
        "ram": run(2, nvme_train, out / "ram", dtype=dtype, steps=STEPS, host_budget=None),
        "one": one_process(dtype=dtype, steps=STEPS),
    }


def test_homes_on_disk_train_bitwise_like_homes_in_ram_and_like_one_process(
    two_ranks: dict,
) -> None:
    nvme, ram, one = two_ranks["nvme"], two_ranks["ram"], two_ranks["one"]
    for rank in range(2):
        kinds = nvme[rank]["kinds"]
        # Some homes in RAM (their state on disk), the others in weight files.
        assert "NvmeHomeState" in kinds and "NvmeState" in kinds, kinds
        assert "NvmeHomeState" not in ram[rank]["kinds"]
        assert nvme[rank]["losses"] == ram[rank]["losses"]
        assert _max_diff(nvme[rank]["weights"], ram[rank]["weights"]) == 0.0
        assert nvme[rank]["gathers"] == ram[rank]["gathers"]  # the same gathers, in lockstep
        _close_to_one_process(nvme[rank]["weights"], one["weights"], STEPS)
        # model.state_dict() before close: the gathered weights, read from disk.
        entries = nvme[rank]["state_dict"]
        for name, weight in zip(nvme[rank]["names"], nvme[rank]["weights"], strict=True):
            assert torch.equal(entries[name].cpu(), weight.cpu()), name
    assert _max_diff(nvme[0]["weights"], nvme[1]["weights"]) == 0.0


@pytest.mark.parametrize("dtype", DTYPES)
def test_clipping_and_checkpointing_with_homes_on_disk(dtype: torch.dtype, tmp_path: Path) -> None:
    """The norm clipped every step (0.05 is below the gradients' norm) and every block
    recomputed in the backward with its unit gathered again (ours, the block inputs on the
    host): with homes and state on disk, bitwise the run with every home in RAM, and one
    process within test_zero3.py's tolerance."""
    kwargs = {"dtype": dtype, "steps": STEPS, "clip": 0.05, "ckpt": "offload"}
    (tmp_path / "ram").mkdir()
    disk = run(2, "train", tmp_path, host_budget=HOST_BUDGET, **kwargs)
    ram = run(2, "train", tmp_path / "ram", **kwargs)
    one = one_process(**kwargs)
    assert min(one["norms"]) > 0.05  # every step clips
    for rank in range(2):
        assert "NvmeHomeState" in disk[rank]["kinds"], disk[rank]["kinds"]  # homes on disk
        assert "NvmeHomeState" not in ram[rank]["kinds"]
        assert disk[rank]["norms"] == ram[rank]["norms"]
        assert _max_diff(disk[rank]["weights"], ram[rank]["weights"]) == 0.0
        _close_to_one_process(disk[rank]["weights"], one["weights"], STEPS)


def test_each_rank_keeps_its_shards_in_its_own_directory_and_removes_them_at_close(
    two_ranks: dict,
) -> None:
    for rank, result in enumerate(two_ranks["nvme"]):
        assert result["dir"].endswith(f"nvme/rank{rank}")
        files = result["files_before_close"]
        mine = [f for f in files if f.startswith(f"rank{rank}/")]
        weights = [f for f in mine if f.endswith(".weights.zo-state")]
        assert weights and len(weights) == len(result["weight_files"])
        assert all(path.startswith(result["dir"] + "/") for path in result["weight_files"])
        # After its close, nothing of this rank's is left (the other may still be closing).
        assert not [f for f in result["files_after_close"] if f.startswith(f"rank{rank}/")]


def test_disk_bytes_per_step_against_the_formula(two_ranks: dict) -> None:
    """Per step, on each rank, with ``D(real) = weight_file_bytes(real)`` (the records of
    one home shard, Note [a weight file's records]):

    - weights written: the step's CPU Adam writes every record that holds real elements,
      ``sum D(real)`` over the home shards with ``real > 0`` (a rank whose shard of a bucket
      is all padding updates nothing there);
    - weights read: the step reads those same records before updating them, the forward
      fetches every unit from disk (the step made every slot stale: Note [a sharded unit]),
      and the backward every unit but the last ``ring`` of the forward (still in their
      slots); each fetch reads all of a shard's records, ``D(real)`` each.
    """
    for result in two_ranks["nvme"]:
        s = result["itemsize"]
        units = result["unit_homes"]
        per_unit = [sum(weight_file_bytes(real, TILE, s) for real in unit) for unit in units]
        assert per_unit == result["unit_disk"]  # what the files measure on disk
        updated = sum(weight_file_bytes(r, TILE, s) for unit in units for r in unit if r > 0)
        kept = sum(per_unit[-result["ring"] :])
        fetched = sum(per_unit) + sum(per_unit) - kept
        assert updated > 0 and fetched > 0
        disk = result["disk"]
        for before, after in itertools.pairwise(disk):
            moved = {name: after[name] - before[name] for name in DISK}
            assert moved["weights_written"] == updated
            assert moved["weights_read"] == updated + fetched
            assert moved["state_written"] > 0 and moved["state_read"] > 0


def test_three_ranks_with_their_own_budgets_leaving_blocks_out(tmp_path: Path) -> None:
    """Three ranks whose budgets differ (rank 0 keeps every home in RAM, rank 1 some, rank 2
    none: their disk reads come at different times) and which leave different blocks out:
    the gathers still match (Note [sharded homes on NVMe]) and training is bitwise the run
    with every home in RAM. Uneven pieces (parameters straddle three shards). The optimizer
    is dropped and collected instead of closed: each rank's finalizer gathers the weights
    from disk, on every rank alike, and removes its files."""
    kwargs = {"dtype": torch.float32, "steps": 3, "uneven": True}
    (tmp_path / "ram").mkdir()
    budgets = [10**9, HOST_BUDGET // 2, 1]
    nvme = run(3, nvme_train, tmp_path, host_budget=budgets, release="gc", **kwargs)
    ram = run(3, nvme_train, tmp_path / "ram", host_budget=None, **kwargs)
    assert "NvmeHomeState" not in nvme[0]["kinds"]
    assert set(nvme[2]["kinds"]) == {"NvmeHomeState"}
    for rank in range(3):
        assert nvme[rank]["losses"] == ram[rank]["losses"]
        assert _max_diff(nvme[rank]["weights"], ram[rank]["weights"]) == 0.0
        weights = [f for f in nvme[rank]["files_before_close"] if f.endswith(".weights.zo-state")]
        assert len([f for f in weights if f.startswith(f"rank{rank}/")]) == len(
            nvme[rank]["weight_files"]
        )
        assert not [f for f in nvme[rank]["files_after_close"] if f.startswith(f"rank{rank}/")]


def test_a_corrupted_weight_tile_on_one_rank_names_it_and_the_other_does_not_hang(
    tmp_path: Path,
) -> None:
    timeout = 3.0
    results = run(2, nvme_corrupted, tmp_path, timeout=timeout)
    bad = results[1]
    assert bad["type"] == "StorageError", bad
    assert bad["tiles"] > 1
    message = bad["error"]
    assert f"rank 1/2 {bad['unit']}" in message, message
    assert bad["path"] in message and "/rank1/" in bad["path"]
    assert "checksum mismatch in record 1" in message
    other = results[0]
    assert other["type"] in ("CollectiveError", "StorageError"), other
    if other["type"] == "CollectiveError":
        assert "rank 0/2" in other["error"] and "all_gather of unit" in other["error"]
    assert other["seconds"] < timeout + 5.0 + 2.0  # + the roll call's grace


def test_a_full_disk_on_one_rank_is_refused_naming_it(tmp_path: Path) -> None:
    timeout = 3.0
    results = run(2, nvme_full, tmp_path, timeout=timeout)
    full = results[1]
    assert full["type"] == "StorageFull", full
    assert full["error"].startswith("rank 1:") and "nvme/rank1" in full["error"]
    assert full["files"] == []  # nothing left half-written
    other = results[0]  # built; its first gather has nobody to gather with
    assert other["type"] == "CollectiveError", other
    assert other["seconds"] < timeout + 5.0 + 2.0


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_estimators_stage_three_nvme_rows_are_a_real_builds_per_rank_and_per_node(
    dtype: torch.dtype, tmp_path: Path
) -> None:
    """The "params and state on NVMe" row on two ranks, two per node: per rank it is
    ``ParamNvme.tiers``, what each rank builds with the budget the row gives it (its host
    pool and bounce ring exactly, with the tier's I/O buffers; its weight and state files
    within a page of metadata, rank 0's shards holding the most real elements); per node it
    is two ranks' host and disk."""
    shape = ModelShape(layers=3, hidden=64, heads=4, vocab=50, seq_len=32)
    ctx = Context(itemsize=dtype.itemsize, world_size=2, ranks_per_node=2, bucket_bytes=BUCKET)
    subject = ShapeSubject(shape, ctx)
    budget = 60_000  # per rank: some home shards, no state
    host, disk = ParamNvme.tiers(subject, budget, homes=Homes.NVME)
    results = run(2, nvme_pools, tmp_path, dtype=dtype, budget=budget, bucket_bytes=BUCKET)
    for rank, result in enumerate(results):
        assert result["homes_on_disk"] > 0
        built = result["host"] + io_buffer_bytes()  # the tier's I/O buffers: not a pool
        if rank == 0:
            assert built == host
            assert disk <= result["disk"] <= disk + IO_ALIGNMENT
        else:
            assert built <= host and result["disk"] <= disk + IO_ALIGNMENT
    # The row, given the node's host that leaves each rank ``budget`` for homes and state
    # beside its gradient staging, the I/O buffers, the weight tile ring (at the default
    # tile_elements, as nvme_pools builds) and the window (Note [homes on NVMe];
    # tiered.ParamNvme.bytes), is two such ranks.
    window = subject.param_offload_pools()[0]  # type: ignore[index]
    fixed = total_bytes(subject.unit_groups(), ctx, "grad") + io_buffer_bytes()  # type: ignore[arg-type]
    fixed += home_ring_bytes(OffloadConfig().tile_elements, dtype.itemsize) + window
    configuration = ParamNvme("nvme", ActivationMode.CHECKPOINTED, Homes.NVME)
    _, act_host = subject.activations(ActivationMode.CHECKPOINTED)
    node = Limits(device=None, host=2 * (budget + fixed) + act_host, host_reserve=0)
    row = configuration.bytes(subject, node)
    assert row is not None
    assert (row.host, row.disk) == (2 * host + act_host, 2 * disk)
    table = estimate(shape, dtype=dtype, world_size=2, ranks_per_node=2, bucket_bytes=BUCKET)
    assert {r.name: r for r in table.rows}["params and state on NVMe + checkpointing"].library == (
        "yes"
    )
