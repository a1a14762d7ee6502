"""Shared fixtures: every accelerator that exists on this machine.

``ZERO_OFFLOAD_STRICT=1`` makes every host accelerator strict (read by ``HostAccelerator``,
as ``ZERO_OFFLOAD_CHECK_RACES`` is) and, here, checks every op of every test for host
memory mixed with device memory (``strict_device_checks``; see ``accelerator/strict.py``).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from zero_offload.accelerator import Accelerator, CudaAccelerator, HostAccelerator
from zero_offload.accelerator.strict import strict_device_checks, strict_enabled_by_env
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


@pytest.fixture(autouse=True)
def _strict_device_checks() -> Iterator[None]:
    """Under ``ZERO_OFFLOAD_STRICT=1``, run the test with host/device mixing checked."""
    if not strict_enabled_by_env():
        yield
        return
    with strict_device_checks():
        yield
