"""Integer settings: Python, numpy and torch integers are accepted (and stored as ``int``);
other types raise ``TypeError`` naming the field; out-of-range values ``ValueError``."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from zero_offload import OffloadConfig
from zero_offload.config import LossScalerConfig


@pytest.mark.parametrize(
    "make", [int, np.int64, np.int32, np.uint64, lambda v: torch.tensor(v)], ids=str
)
def test_numpy_and_torch_integers_are_ints(make) -> None:
    config = OffloadConfig(
        tile_elements=make(4096),
        prefetch_layers=make(3),
        bucket_bytes=make(65536),
        speculation_bytes=make(1 << 20),
    )
    for name, want in (
        ("tile_elements", 4096),
        ("prefetch_layers", 3),
        ("bucket_bytes", 65536),
        ("speculation_bytes", 1 << 20),
    ):
        value = getattr(config, name)
        assert type(value) is int and value == want, (name, value)
    scaler = LossScalerConfig(growth_interval=np.int64(10), hysteresis=torch.tensor(3))
    assert type(scaler.growth_interval) is int and type(scaler.hysteresis) is int


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("tile_elements", 4096.0),
        ("tile_elements", "4096"),
        ("tile_elements", True),
        ("prefetch_layers", 1.5),
        ("prefetch_layers", None),
        ("prefetch_layers", np.float64(2)),
        ("prefetch_layers", torch.tensor(2.0)),
        ("bucket_bytes", np.float32(65536)),
    ],
)
def test_wrong_types_raise_type_error_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(TypeError, match=rf"OffloadConfig\.{field}"):
        OffloadConfig(**{field: value})  # type: ignore[arg-type]


def test_out_of_range_raises_value_error() -> None:
    with pytest.raises(ValueError, match=r"OffloadConfig\.prefetch_layers must be an int >= 0"):
        OffloadConfig(prefetch_layers=np.int64(-1))
    with pytest.raises(ValueError, match=r"OffloadConfig\.tile_elements must be an int >= 1024"):
        OffloadConfig(tile_elements=torch.tensor(8))
