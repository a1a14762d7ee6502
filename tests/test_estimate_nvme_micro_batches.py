"""The rows with NVMe state and several micro-batches a step (``Window.DEVICE`` and
``Window.HOST`` in zero_offload/estimate/accumulation.py) against the pools OffloadAdamW
builds with ``nvme_dir`` over two steps of 4 micro-batches, and the one-micro-batch rows
against one: device and host to the byte, the disk to the state files' page of metadata.
Each row's ``host_budget`` (Note [the accumulators sit beside the host budget]) is given to
the optimizer, so the split the estimate makes is the one built."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from zero_offload import OffloadAdamW, OffloadConfig
from zero_offload.accelerator import HostAccelerator
from zero_offload.config import AcceleratorConfig
from zero_offload.demo.model import GPTConfig, TinyGPT
from zero_offload.estimate import CONFIGURATIONS, ModelShape, estimate, host_reserve
from zero_offload.estimate.accumulation import Window
from zero_offload.estimate.nvme import io_bytes, total_bytes
from zero_offload.estimate.rows import Context, Limits
from zero_offload.estimate.subjects import ShapeSubject
from zero_offload.estimate.tiered import NvmeState, ParamNvme
from zero_offload.memory.storage import IO_ALIGNMENT

_CFG = GPTConfig(vocab_size=100, seq_len=32, layers=4, hidden=64, heads=4)
_SHAPE = ModelShape(layers=4, hidden=64, heads=4, vocab=100, seq_len=32)
_BUCKET = 65536
_ROWS = {
    "ZeRO-Offload": "ZeRO-Offload + NVMe state + checkpointing",
    "param offload": "param offload + NVMe state + checkpointing",
    "params on NVMe": "params and state on NVMe + checkpointing",
}
_SUMMED = {
    "ZeRO-Offload": "ZeRO-Offload + NVMe state + ckpt, micro-batches summed on the ",
    "param offload": "param offload + NVMe state + ckpt, micro-batches summed on the ",
    "params on NVMe": "params and state on NVMe + ckpt, micro-batches summed on the ",
}


def _configuration(family: str, window: Window) -> NvmeState | ParamNvme:
    name = _ROWS[family] if window is Window.ONE else _SUMMED[family] + window.name.lower()
    (found,) = [c for c in CONFIGURATIONS if c.name == name]
    assert isinstance(found, (NvmeState, ParamNvme)) and found.window is window
    return found


def _built(
    tmp: Path, family: str, *, host_budget: int, device_budget: int, micro_batches: int
) -> dict[str, object]:
    """The pools and state files after two steps of ``micro_batches`` micro-batches."""
    torch.manual_seed(0)
    net = TinyGPT(_CFG).to(torch.bfloat16)
    acc = HostAccelerator(AcceleratorConfig(device_budget=device_budget))
    params = family != "ZeRO-Offload"
    config = OffloadConfig(
        bucket_bytes=_BUCKET, nvme_dir=tmp, host_budget=host_budget, offload_parameters=params
    )
    extra = {"model": net, "layers": net.blocks} if params else {}
    opt = OffloadAdamW(net.parameters(), lr=1e-3, accelerator=acc, config=config, **extra)  # type: ignore[arg-type]
    gen = torch.Generator().manual_seed(1)
    try:
        for _ in range(2):
            for _ in range(micro_batches):
                ids = torch.randint(0, 100, (2, 32), generator=gen)
                opt.backward(net(ids, ids))
            opt.step()
            opt.zero_grad()
        pools = opt.manager.pools
        return {
            "device": sum(p.capacity for p in pools if p.kind == "device"),
            "host": sum(p.capacity for p in pools if p.kind != "device"),
            "locations": {b.store.location for b in opt.buckets},
            "disk": sum(f.stat().st_size for f in tmp.rglob("*") if f.is_file()),
        }
    finally:
        opt.close()


def _limits(family: str) -> Limits:
    """Host memory that leaves the one-micro-batch row a state budget of 2 MB (most
    buckets' state in RAM, the rest on NVMe: 2.6 MB in all); the device roomy."""
    subject = ShapeSubject(_SHAPE, Context(itemsize=2, world_size=1, ranks_per_node=1, bucket_bytes=_BUCKET))  # fmt: skip
    probe = 4 * 2**30
    probed = Limits(device=2**30, host=probe, host_reserve=host_reserve(probe))
    fixed = probe - probed.host_reserve - _configuration(family, Window.ONE).state_budget(subject, probed)  # type: ignore[operator]  # fmt: skip
    host = host_reserve(probe) + fixed + 2_000_000
    assert host_reserve(host) == host_reserve(probe)  # the 2 GiB floor either way
    return Limits(device=2**30, host=host, host_reserve=host_reserve(host))


@pytest.mark.parametrize("window", list(Window), ids=lambda w: w.name.lower())
@pytest.mark.parametrize("family", list(_ROWS))
def test_nvme_rows_hold_the_built_pools_with_micro_batches(
    tmp_path: Path, family: str, window: Window
) -> None:
    ctx = Context(itemsize=2, world_size=1, ranks_per_node=1, bucket_bytes=_BUCKET)
    subject = ShapeSubject(_SHAPE, ctx)
    configuration, limits = _configuration(family, window), _limits(family)
    row = configuration.bytes(subject, limits)
    budget = configuration.state_budget(subject, limits)
    assert row is not None and budget is not None
    one = _configuration(family, Window.ONE).bytes(subject, limits)
    assert one is not None
    device_budget = 2**30  # room for every device accumulator
    if window is Window.HOST:  # the one-micro-batch row's device pools: no room for them
        device_budget = int((one.model_states + one.buffers) * 1.01)
    groups = subject.bucket_groups() if family == "ZeRO-Offload" else subject.unit_groups()
    assert groups is not None
    if family == "param offload":  # the state's budget beside every home, which come first
        budget += total_bytes(groups, ctx, "home")
    built = _built(
        tmp_path,
        family,
        host_budget=budget,
        device_budget=device_budget,
        micro_batches=1 if window is Window.ONE else 4,
    )
    if family == "ZeRO-Offload":  # the budget splits the state: some buckets in RAM
        assert built["locations"] == {"host", "nvme"}
    assert row.model_states + row.buffers == built["device"]
    # Host: every pool, plus the NVMe tier's I/O buffers (not a pool: memory/storage.py).
    assert row.disk  # some state on NVMe: the tier's I/O buffers
    assert row.host == built["host"] + io_bytes(groups, ctx)
    assert row.disk <= built["disk"] <= row.disk + IO_ALIGNMENT  # type: ignore[operator]
    # The accumulators take their room from the state's budget: more of it on NVMe.
    assert row.disk > one.disk or window is Window.ONE


def test_the_summed_nvme_rows_say_where_they_add_up_and_the_budget_they_need() -> None:
    # Where several micro-batches add up (the accumulating rows' own condition), and the
    # host_budget in bytes they need; the rows of one micro-batch a step hold without one,
    # so the north star's choices (tests/test_estimate_north_star.py) stay theirs.
    rows = estimate(_SHAPE, bucket_bytes=_BUCKET, device_memory="1GiB", host_memory="16GiB").rows
    by_name = {r.name: r for r in rows}
    for family in _ROWS:
        assert not by_name[_ROWS[family]].conditions
        for where in ("device", "host"):
            summed = by_name[_SUMMED[family] + where].conditions
            in_ram = by_name["ZeRO-Offload + ckpt, micro-batches summed on the " + where].conditions
            assert summed.startswith(in_ram + ", with OffloadConfig(host_budget=...) in bytes")
