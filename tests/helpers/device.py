"""The accelerator a test runs on, and the torch device its model and data live on (issue 36).

One value decides both: the test's accelerator kind, "host" (the default: the host
accelerator, the model and data on the CPU) or "cuda" (a ``CudaAccelerator`` on ``cuda:0``,
the model and data there). tests/conftest.py sets it to "cuda" for the duration of a test
only when the run is ``--accelerator=cuda`` and the test declares a CUDA form
(``pytest.mark.cuda_form``); every other test, in every run, gets "host". So a helper can
never move a test that did not ask for it, and a test that asked cannot stay on the CPU
through the helpers (tests/test_cuda_switch.py checks the helpers under "cuda" on a machine
without a GPU).

Tests that pick the kind themselves (the ``accel_kind`` fixture) build their accelerator with
``tests.conftest.make_accelerator`` and are not affected.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from zero_offload import AcceleratorConfig, CudaAccelerator, HostAccelerator
from zero_offload.accelerator import Accelerator

KINDS = ("host", "cuda")
#: The GPU of a cuda run: cuda:0 (one GPU is what a GPU check has).
CUDA_INDEX = 0
#: The device of each kind: the host accelerator's "device" memory is CPU memory.
DEVICES = {"host": torch.device("cpu"), "cuda": torch.device("cuda", CUDA_INDEX)}
#: The running test's kind; only ``running_on`` changes it.
_kind = ["host"]


def run_kind() -> str:
    """The running test's accelerator kind: "host" or "cuda"."""
    return _kind[0]


def run_device() -> torch.device:
    """The torch device the running test's model and data live on (``cpu`` or ``cuda:0``)."""
    return DEVICES[_kind[0]]


@contextmanager
def running_on(kind: str) -> Iterator[None]:
    """Within the block, the helpers build for ``kind``; the previous kind after it."""
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r} is not an accelerator kind; use one of {KINDS}")
    before = _kind[0]
    _kind[0] = kind
    try:
        yield
    finally:
        _kind[0] = before


def run_accelerator(**config: object) -> Accelerator:
    """A fresh accelerator of the running test's kind, 256 MiB of device budget unless told.

    Under "cuda", the ``CudaAccelerator`` of ``cuda:0`` (``index=0``): the device the model and
    data are on. Fields only the host has (``link_bandwidth``) make ``CudaAccelerator`` raise,
    so a test that needs them is ``simulator_only``.
    """
    config.setdefault("device_budget", "256MiB")
    cfg = AcceleratorConfig(**config)  # type: ignore[arg-type]
    if _kind[0] == "cuda":
        return CudaAccelerator(cfg, index=CUDA_INDEX)
    return HostAccelerator(cfg)


def on_device(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` on the running test's device (the same tensor when it is already there)."""
    return tensor.to(run_device())


__all__ = [
    "CUDA_INDEX",
    "DEVICES",
    "KINDS",
    "on_device",
    "run_accelerator",
    "run_device",
    "run_kind",
    "running_on",
]
