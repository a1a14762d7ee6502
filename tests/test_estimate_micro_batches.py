"""Rows a training loop with gradient accumulation can trust: parameter offload with
several micro-batches a step, summed on the device or on the host, against the pools the
optimizer builds (``estimate/accumulation.py``); a module of mixed training dtypes sized
parameter by parameter; ``--params`` refusing what is not a whole count."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from zero_offload import OffloadAdamW, OffloadConfig, cli
from zero_offload.accelerator import HostAccelerator
from zero_offload.config import AcceleratorConfig
from zero_offload.demo.model import GPTConfig, TinyGPT
from zero_offload.estimate import ModelShape, estimate

_CFG = GPTConfig(vocab_size=100, seq_len=32, layers=4, hidden=64, heads=4)
_SHAPE = ModelShape(layers=4, hidden=64, heads=4, vocab=100, seq_len=32)
_BUCKET = 65536
_SUMMED = "param offload + ckpt, micro-batches summed on the "


def _built_param_offload(budget: int) -> dict[str, int]:
    """The pools after two steps of 4 micro-batches with parameter offload."""
    torch.manual_seed(0)
    net = TinyGPT(_CFG).to(torch.bfloat16)
    acc = HostAccelerator(AcceleratorConfig(device_budget=budget))
    config = OffloadConfig(bucket_bytes=_BUCKET, offload_parameters=True)
    opt = OffloadAdamW(net.parameters(), lr=1e-3, accelerator=acc, config=config, model=net)
    gen = torch.Generator().manual_seed(1)
    try:
        for _ in range(2):
            for _ in range(4):
                ids = torch.randint(0, 100, (2, 32), generator=gen)
                opt.backward(net(ids, ids))
            opt.step()
            opt.zero_grad()
        pools = opt.manager.pools
        return {
            "device": sum(p.capacity for p in pools if p.kind == "device"),
            "host": sum(p.capacity for p in pools if p.kind != "device"),
        }
    finally:
        opt.close()


def test_param_offload_with_micro_batches_has_rows_that_hold_the_built_pools() -> None:
    rows = {r.name: r for r in estimate(_SHAPE, bucket_bytes=_BUCKET, device_memory="1GiB", host_memory="16GiB").rows}  # fmt: skip
    plain = rows["ZeRO-Offload + parameter offload"]
    on_device, on_host = rows[_SUMMED + "device"], rows[_SUMMED + "host"]
    zero_offload = "ZeRO-Offload + ckpt, micro-batches summed on the "
    for where in ("device", "host"):  # the same conditions (and marks) as ZeRO-Offload's
        assert rows[_SUMMED + where].conditions == rows[zero_offload + where].conditions
    roomy = _built_param_offload(2**30)  # each bucket's fp32 accumulator on the device
    assert on_device.device_model_states + on_device.device_buffers == roomy["device"]
    assert on_device.host == roomy["host"] > plain.host * 1.2
    # The device budget of the one-micro-batch row: accumulated on the host, with spares.
    tight = _built_param_offload(int((plain.device_model_states + plain.device_buffers) * 1.01))
    assert on_host.device_model_states + on_host.device_buffers == tight["device"]
    assert on_host.host == tight["host"] > plain.host * 1.3


def test_a_mixed_dtype_module_is_sized_parameter_by_parameter() -> None:
    torch.manual_seed(0)
    net = TinyGPT(_CFG).to(torch.bfloat16)
    for module in net.modules():
        if isinstance(module, (nn.LayerNorm, nn.Embedding)):
            module.float()
    acc = HostAccelerator(AcceleratorConfig(device_budget="1GiB"))
    opt = OffloadAdamW(net.parameters(), lr=1e-3, accelerator=acc, config=OffloadConfig(bucket_bytes=_BUCKET))  # fmt: skip
    device = acc.memory_stats()["in_use"]
    host = sum(p.capacity for p in opt.manager.pools if p.kind != "device")
    opt.close()
    kwargs = {"bucket_bytes": _BUCKET, "device_memory": "1GiB", "host_memory": "16GiB"}
    result = estimate(net, **kwargs)
    row = {r.name: r for r in result.rows}["ZeRO-Offload"]
    assert (row.device_model_states + row.device_buffers, row.host) == (device, host)
    assert result.dtype == "bfloat16"  # the dtype of most elements
    # An explicit dtype still sizes every parameter in it.
    as_fp32 = {r.name: r for r in estimate(net, dtype="float32", **kwargs).rows}["ZeRO-Offload"]
    assert as_fp32.device_model_states > row.device_model_states


@pytest.mark.parametrize(
    "value, says",
    [
        ("1.5", "--params='1.5' is not a whole number of parameters; give one, e.g. --params 2"),
        ("1e30", "--params='1e30' is outside [1, 1e15] parameters"),
        ("0", "--params='0' is outside [1, 1e15] parameters"),
    ],
)
def test_params_refuses_what_is_not_a_whole_count(
    value: str, says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["estimate", "--params", value, "--device-memory", "24GiB"]) == 2
    err = capsys.readouterr().err
    assert says in err and len(err.strip().splitlines()) == 1


def test_params_reads_suffixes_exactly(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["estimate", "--params", "1.5e9", "--device-memory", "80GiB", "--host-memory", "1TiB"]
    assert cli.main([*argv, "--json"]) in (0, None)
    assert '"params": 1500000000' in capsys.readouterr().out


def test_the_legend_says_what_the_buffers_column_holds() -> None:
    table = estimate(10**6, device_memory="24GiB", host_memory="64GiB").table()
    assert "buffers: the library's device pools beside the weights" in table
    assert "fp32 gradient accumulators and weight shadows" in table
