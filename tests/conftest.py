"""Shared fixtures: every accelerator that exists on this machine."""

from __future__ import annotations

import pytest
import torch

from zero_offload.accelerator import Accelerator, CudaAccelerator, HostAccelerator
from zero_offload.config import AcceleratorConfig

ACCELERATOR_KINDS = [
    "host",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.cuda,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
        ],
    ),
]


def make_accelerator(kind: str, **config: object) -> Accelerator:
    """A fresh accelerator of ``kind`` ("host" or "cuda") with the given config fields."""
    cfg = AcceleratorConfig(**config)  # type: ignore[arg-type]
    return HostAccelerator(cfg) if kind == "host" else CudaAccelerator(cfg)


@pytest.fixture(params=ACCELERATOR_KINDS)
def accel_kind(request: pytest.FixtureRequest) -> str:
    """Each accelerator kind available here: "host" always, "cuda" with a GPU."""
    return request.param
