"""The memory estimator: the paper's accounting, and ours against the manager's measured use."""

from __future__ import annotations

import pytest
import torch

from zero_offload.accelerator import HostAccelerator
from zero_offload.config import AcceleratorConfig, OffloadConfig
from zero_offload.demo.model import GPTConfig, TinyGPT
from zero_offload.estimate import ModelShape, estimate, offload_adamw_bytes
from zero_offload.optim import OffloadAdamW
from zero_offload.partition import plan_buckets

GiB = 2**30


def _rows(result: object) -> dict[str, object]:
    return {row.name: row for row in result.rows}  # type: ignore[attr-defined]


@pytest.mark.parametrize("bucket_bytes", [64 * 1024, 1024 * 1024])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_offload_estimate_matches_the_managers_measured_use(
    bucket_bytes: int, dtype: torch.dtype
) -> None:
    shape = ModelShape(layers=2, hidden=64, heads=4, vocab=50, seq_len=32)
    model = TinyGPT(GPTConfig(vocab_size=50, seq_len=32, layers=2, hidden=64, heads=4)).to(dtype)
    acc = HostAccelerator(AcceleratorConfig(device_budget="256MiB"))
    opt = OffloadAdamW(
        model.parameters(), accelerator=acc, config=OffloadConfig(bucket_bytes=bucket_bytes)
    )
    try:
        device_measured = acc.memory_stats()["in_use"]  # the device pool: the ledger's whole use
        host_measured = sum(p.capacity for p in opt.manager.pools if p.kind != "device")
    finally:
        opt.close()
    for source in (model, shape):  # the module's exact shapes, and the shape's formula
        row = _rows(estimate(source, dtype=dtype, bucket_bytes=bucket_bytes, device_memory=GiB))[
            "ZeRO-Offload"
        ]
        device = row.device_model_states + row.device_buffers  # type: ignore[attr-defined]
        assert device == pytest.approx(device_measured, rel=0.10)
        assert row.host == pytest.approx(host_measured, rel=0.10)  # type: ignore[attr-defined]


def test_model_shape_counts_the_demo_models_parameters() -> None:
    shape = ModelShape(layers=3, hidden=96, heads=4, vocab=40, seq_len=48)
    model = TinyGPT(GPTConfig(vocab_size=40, seq_len=48, layers=3, hidden=96, heads=4))
    assert estimate(shape, device_memory=GiB).params == model.parameter_count()
    assert [tuple(p.shape) for p in model.parameters()] == shape.parameter_shapes()


def test_paper_accounting_for_mixed_precision_adam() -> None:
    params, world = 10**9, 8
    rows = _rows(estimate(params, world_size=world, dtype="bfloat16", device_memory=80 * GiB))
    # ZeRO paper, 2 + 2 + 12 bytes per parameter: weights, gradients, Adam state (K = 12).
    assert rows["no offload (DDP)"].device_model_states == 16 * params  # type: ignore[attr-defined]
    assert rows["ZeRO-1"].device_model_states == 4 * params + 12 * params // world  # type: ignore[attr-defined]
    assert rows["ZeRO-2"].device_model_states == 2 * params + 14 * params // world  # type: ignore[attr-defined]
    offload = rows["ZeRO-Offload"]
    # Ours: bf16 weights stay (2 bytes); host per rank holds the fp32 master and two moments
    # (12) plus bf16 gradient and weight staging (4), split over the ranks; a node holds all
    # its ranks' shares. No fp32 accumulator with one micro-batch per step (Note [no
    # accumulator for one backward]).
    assert offload.device_model_states == pytest.approx(2 * params, rel=0.01)  # type: ignore[attr-defined]
    assert offload.host == pytest.approx(16 * params, rel=0.01)  # type: ignore[attr-defined]


def test_fp32_adam_needs_sixteen_bytes_per_parameter() -> None:
    rows = _rows(estimate(10**6, dtype="float32", device_memory=GiB, host_memory=GiB))
    assert rows["no offload (DDP)"].device_model_states == 16 * 10**6  # type: ignore[attr-defined]


def test_what_fits_and_the_largest_model() -> None:
    shape = ModelShape(layers=48, hidden=1600, heads=25, vocab=50257, seq_len=1024)
    result = estimate(shape, device_memory=16 * GiB, host_memory=512 * GiB)
    rows = _rows(result)
    assert rows["no offload (DDP)"].fits is False  # type: ignore[attr-defined]
    assert rows["ZeRO-Offload + checkpointing"].fits is True  # type: ignore[attr-defined]
    ddp = rows["no offload (DDP)"].largest_fitting_params  # type: ignore[attr-defined]
    ours = rows["ZeRO-Offload + activation offload"].largest_fitting_params  # type: ignore[attr-defined]
    assert ours > 5 * ddp
    device = rows["ZeRO-Offload + checkpointing"]
    assert device.device_activations < rows["ZeRO-Offload"].device_activations  # type: ignore[attr-defined]
    text = result.table()
    assert "ZeRO-Offload + activation offload" in text and "largest that fits" in text
    assert result.to_dict()["rows"][0]["device_total"] == rows["no offload (DDP)"].device_total  # type: ignore[attr-defined]


def test_default_memory_is_this_machines() -> None:
    result = estimate(10**6)
    assert result.host_memory is not None and result.host_memory > 0
    if not torch.cuda.is_available():
        assert result.device_memory is None and "device" not in result.rows[0].name
        assert all(row.fits is None for row in result.rows)


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"model": 0}, TypeError),
        ({"model": "big"}, ValueError),  # a string names a config: none is called "big"
        ({"model": 3.5}, TypeError),
        ({"model": 10, "world_size": 0}, ValueError),
        ({"model": 10, "dtype": "int8"}, ValueError),
        ({"model": 10, "world_size": 2, "ranks_per_node": 3}, ValueError),
    ],
)
def test_bad_inputs_name_the_argument(kwargs: dict[str, object], error: type[Exception]) -> None:
    with pytest.raises(error):
        estimate(**kwargs)  # type: ignore[arg-type]


def test_bad_shape_is_refused() -> None:
    with pytest.raises(ValueError, match="heads"):
        ModelShape(layers=1, hidden=10, heads=3, vocab=5, seq_len=4)


def test_pool_sizes_count_the_slot_alignment_exactly() -> None:
    # Odd parameter sizes: each slot is aligned to 16 elements (Note [slots are aligned]),
    # and the estimator plans the same buckets, gaps included, as the optimizer.
    model = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Linear(5, 3))
    shapes = [tuple(p.shape) for p in model.parameters()]
    acc = HostAccelerator(AcceleratorConfig(device_budget="256MiB"))
    opt = OffloadAdamW(model.parameters(), accelerator=acc, config=OffloadConfig(bucket_bytes=4096))
    try:
        device = sum(p.capacity for p in opt.manager.pools if p.kind == "device")
        host = sum(p.capacity for p in opt.manager.pools if p.kind != "device")
    finally:
        opt.close()
    weights, grad_buffers, host_bytes = offload_adamw_bytes(shapes, itemsize=4, bucket_bytes=4096)
    assert (weights + grad_buffers, host_bytes) == (device, host)
    gapless = 35 + 5 + 15 + 3
    assert (
        sum(b.numel for b in plan_buckets([list(enumerate(shapes))], bucket_numel=1024)) > gapless
    )
