"""Shared fixtures: every accelerator that exists on this machine; hypothesis profiles.

``ZERO_OFFLOAD_STRICT=1`` makes every host accelerator strict (read by ``HostAccelerator``,
as ``ZERO_OFFLOAD_CHECK_RACES`` is) and, here, checks every op of every test for host
memory mixed with device memory (``strict_device_checks``; see ``accelerator/strict.py``).
"""

from __future__ import annotations

import os

# The suite runs as docs/threads.md tells users to launch training: with OMP_WAIT_POLICY=PASSIVE,
# which torch's OpenMP runtime reads once, when torch is loaded (below, unless a plugin already
# did: then zero_offload.kernels warns, as it would for a user). Without it torch's idle threads
# spin beside numba's on a 2-core machine and the suite runs slower, and every run printed the
# warning meant for users. tests/test_thread_budget.py checks the warning itself in
# subprocesses and under monkeypatch.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from collections.abc import Iterator

import pytest
import torch
from hypothesis import HealthCheck, settings

from zero_offload.accelerator import Accelerator, CudaAccelerator, HostAccelerator
from zero_offload.accelerator.strict import strict_device_checks, strict_enabled_by_env
from zero_offload.config import AcceleratorConfig

# Hypothesis profiles, chosen with HYPOTHESIS_PROFILE (default "ci"). "ci": derandomized (the
# same examples on every run, so a failure is reproducible and CI is not flaky) and bounded;
# tests that set no max_examples get 25, and tests/helpers/properties.py's scaled() sizes the
# expensive ones from this budget. "long": fresh random examples, 10x as many, for nightly
# runs (HYPOTHESIS_PROFILE=long pytest tests/test_properties.py tests/test_kernels_bitwise.py).
_RELAXED = [HealthCheck.too_slow, HealthCheck.data_too_large]
settings.register_profile(
    "ci", max_examples=25, derandomize=True, deadline=None, suppress_health_check=_RELAXED
)
settings.register_profile(
    "long", max_examples=250, deadline=None, suppress_health_check=_RELAXED, print_blob=True
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

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
