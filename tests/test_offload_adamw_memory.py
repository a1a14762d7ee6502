"""Device memory against a formula, and tile pipelining against a slow simulated link."""

from __future__ import annotations

import time

import torch
from torch import nn

from zero_offload import AcceleratorConfig, HostAccelerator, OffloadAdamW, OffloadConfig
from zero_offload.memory.traffic import Category, CopyRecord, Direction
from zero_offload.optim.state.placement import GRAD_BUFFERS

from .helpers.models import batches, make_pair, offload_opt, train

ALIGN = 512


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def test_peak_device_bytes_stay_within_the_formula() -> None:
    model, _ = make_pair(torch.bfloat16, layers=3, dim=64, vocab=256)
    acc = HostAccelerator(AcceleratorConfig(device_budget="64MiB"))
    bucket_bytes = 16384
    opt = offload_opt(model, accelerator=acc, bucket_bytes=bucket_bytes)
    acc.ledger.reset_peak()
    train(model, opt, batches(4, vocab=256))
    params = sum(p.numel() for p in model.parameters())
    buckets = len(opt.buckets)
    # Every term of the device bytes the library may hold:
    weights = 2 * params  # training-dtype (bf16) weights, 2 bytes each
    padding = buckets * ALIGN  # each bucket padded to a multiple of 256 elements (512 bytes)
    # Two gradient buffers of the largest bucket: bucket_bytes, or one parameter larger than
    # that (it gets a bucket of its own), plus its padding.
    largest = max(bucket_bytes, 2 * max(p.numel() for p in model.parameters()))
    grads = GRAD_BUFFERS * (largest + ALIGN)
    formula = weights + padding + grads
    peak = acc.memory_stats()["peak"]
    assert peak <= formula, (peak, formula)
    # And far below what keeping everything on the device would take: weights 2 + grads 2 +
    # fp32 master, exp_avg, exp_avg_sq 12 = 16 bytes per parameter.
    assert peak * 6 <= 16 * params
    # The pool never needed more than two gradient buffers at once.
    device_pool = opt.manager.pools[0]
    stats = device_pool.stats()
    assert stats["peak_bytes_in_use"] <= stats["capacity_bytes"]
    assert stats["defragmentations"] == 0  # same blocks every step: no fragmentation


def test_budget_for_weights_alone_is_not_enough_and_says_so() -> None:
    model, _ = make_pair(torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    acc = HostAccelerator(AcceleratorConfig(device_budget=2 * params + 1024))
    try:
        offload_opt(model, accelerator=acc)
    except MemoryError as exc:
        assert "gradient buffers" in str(exc)
    else:
        raise AssertionError("a budget without room for gradient buffers was accepted")


def test_tile_pipelining_hides_the_weight_copies_behind_the_cpu_update(monkeypatch) -> None:
    """Each tile's host-to-device weight copy is issued as soon as CPU Adam wrote the tile,
    before the next tile is updated, and runs on the copy stream while the CPU goes on.

    Structural, not timed (the machine is shared): the order of the updates and the copies'
    issues, and that the first copy (on a slow simulated link, so it is still running)
    started before the CPU finished the last tile."""
    from zero_offload.optim.rule import adamw as offloaded
    from zero_offload.optim.rule import tiles as rule_tiles

    tiles = 16
    tile_elements = 2**14
    numel = tiles * tile_elements
    torch.manual_seed(0)
    model = nn.Linear(numel // 1024, 1024, bias=False)
    # A link slow enough that one tile's copy (64 KiB) takes about 5 ms.
    acc = HostAccelerator(
        AcceleratorConfig(device_budget="512MiB", link_bandwidth=64 * 2**10 / 5e-3)
    )
    opt = OffloadAdamW(
        model.parameters(),
        lr=1e-3,
        config=OffloadConfig(bucket_bytes=64 * 2**20, tile_elements=tile_elements),
        accelerator=acc,
    )
    log: list[tuple[str, object]] = []  # ("update", end time) and ("copy", CopyRecord)
    real_adam_step = offloaded.adam_step

    def adam_step(*args, **kwargs) -> None:
        real_adam_step(*args, **kwargs)
        log.append(("update", time.perf_counter()))

    def listen(record) -> None:
        if isinstance(record, CopyRecord) and record.direction is Direction.H2D:
            log.append(("copy", record))

    monkeypatch.setattr(offloaded, "adam_step", adam_step)
    # One tile per launch. Left alone, a launch also takes every later tile whose gradient has
    # already landed (Note [a launch spans the tiles that landed]; tests/test_step_costs.py),
    # so how many launches there are depends on how fast the gradients land: on an idle
    # machine all but the first had, and two launches were made, not 16.
    monkeypatch.setattr(rule_tiles, "LAUNCH_ELEMENTS", 1)
    unsubscribe = opt.manager.subscribe(listen)
    try:
        model(torch.randn(2, numel // 1024)).sum().backward()
        opt.step()
        opt.manager.synchronize()
    finally:
        unsubscribe()
    kinds = [kind for kind, _ in log]
    # One bucket, one shard: update tile 0, copy it, update tile 1, copy it, ...
    assert kinds == ["update", "copy"] * tiles, kinds
    copies = [record for kind, record in log if kind == "copy"]
    assert all(record.category is Category.WEIGHTS for record in copies)
    assert [record.nbytes for record in copies] == [4 * tile_elements] * tiles
    last_update = log[-2][1]
    first_copy_started = copies[0].began()
    assert first_copy_started is not None and first_copy_started < last_update
    opt.close()


def test_construction_releases_each_buckets_original_weights_as_it_goes(monkeypatch) -> None:
    """Note [construction holds one copy]: once a bucket holds its parameters, their
    original storage is gone, so construction never holds two copies of the model (the
    peak is one bucket above the final footprint)."""
    from torch.multiprocessing.reductions import StorageWeakRef

    from zero_offload.views import param_views

    model, _ = make_pair()
    originals = {id(p): StorageWeakRef(p.untyped_storage()) for p in model.parameters()}
    built: list[list[int]] = []  # after each bucket: ids of the parameters bucketed so far
    alive_after: list[int] = []  # ... and how many of those still have their old storage
    init = param_views.ParamViews.__init__

    def record(self, layout, params, pool) -> None:
        init(self, layout, params, pool)
        built.append([id(p) for p in params] + (built[-1] if built else []))
        alive_after.append(sum(not originals[i].expired() for i in built[-1]))

    monkeypatch.setattr(param_views.ParamViews, "__init__", record)
    opt = offload_opt(model)
    assert len(built) == len(opt.buckets) > 3
    assert alive_after == [0] * len(built)


def test_resident_temporaries_are_reserved_in_the_ledger(monkeypatch) -> None:
    """Note [resident temporaries are counted]: the scaled-gradient and reconcile tiles of
    a resident bucket are reserved in the device ledger while they live."""
    model, _ = make_pair(torch.bfloat16)
    opt = offload_opt(model, offload_fraction=0.0, max_grad_norm=1e-3, tile_elements=1024)
    ledger = opt.accelerator.ledger
    reserved: list[tuple[int, str]] = []
    original = ledger.reserve

    def record(nbytes: int, *, what: str) -> None:
        reserved.append((nbytes, what))
        original(nbytes, what=what)

    monkeypatch.setattr(ledger, "reserve", record)
    in_use = opt.accelerator.memory_stats()["in_use"]
    train(model, opt, batches(1))  # clipping binds: every gradient tile is scaled
    with torch.no_grad():
        model.head.weight.add_(1.0)  # written outside: the next step reconciles
    train(model, opt, batches(1))
    steps = [n for n, what in reserved if "step temporaries" in what]
    reconciles = [n for n, what in reserved if "reconcile temporaries" in what]
    assert steps and all(n == 8 * 1024 for n in steps)  # two fp32 tiles
    assert reconciles and all(n <= 7 * 1024 for n in reconciles)  # fp32 + bf16 + mask
    assert opt.accelerator.memory_stats()["in_use"] == in_use  # all released again
