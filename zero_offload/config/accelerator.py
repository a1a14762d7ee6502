"""The accelerator's settings (``zero_offload.accelerator`` reads them)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from .values import check_positive_finite, parse_bytes

__all__ = ["DEVICE_BUDGET_ENV", "AcceleratorConfig"]

#: Environment variable holding the host accelerator's device budget ("8GiB", "512MB", "1000000").
DEVICE_BUDGET_ENV = "ZERO_OFFLOAD_DEVICE_BUDGET"


@dataclass(frozen=True)
class AcceleratorConfig:
    """Settings of the accelerator (see ``zero_offload.accelerator``).

    Attributes:
        device_budget: bytes of "device" memory the library may use, an int or a string such
            as ``"8GiB"``. Default ``None``: read ``ZERO_OFFLOAD_DEVICE_BUDGET``, and if that is
            unset, the GPU's total memory on CUDA or half of this machine's RAM on the host
            accelerator. Must be > 0.
        link_bandwidth: simulated bandwidth of copies between device and host, in bytes per
            second, host accelerator only. Default ``None``: no simulated link, copies run at
            memory speed. Must be > 0.
        link_latency: simulated fixed cost of each copy, in seconds. Default 0.0. Must be >= 0
            and only applies when a copy goes over the simulated link.
        check_races: host accelerator only: raise ``StreamRaceError`` when two streams touch
            a buffer with no wait ordering them (see ``accelerator/race_checker.py``).
            Default ``None``: read ``ZERO_OFFLOAD_CHECK_RACES`` ("1" turns it on), else off.
            On CUDA use PyTorch's own ``TORCH_CUDA_SANITIZER=1`` instead.
        strict: host accelerator only: behave as CUDA would where CUDA differs from a CPU
            (compute events complete after they are recorded, host memory mixed with device
            memory raises, each thread has its own current device, the accelerator being
            device 1 of 2); see ``accelerator/strict.py``. Default ``None``: read
            ``ZERO_OFFLOAD_STRICT`` ("1" turns it on), else off.
    """

    device_budget: int | str | None = None
    link_bandwidth: float | None = None
    link_latency: float = 0.0
    check_races: bool | None = None
    strict: bool | None = None

    def __post_init__(self) -> None:
        if self.device_budget is not None:
            budget = parse_bytes(self.device_budget, name="AcceleratorConfig.device_budget")
            if budget <= 0:
                raise ValueError(
                    f"AcceleratorConfig.device_budget must be > 0 bytes, got {self.device_budget!r}"
                )
            object.__setattr__(self, "device_budget", budget)
        if self.link_bandwidth is not None:
            check_positive_finite("AcceleratorConfig.link_bandwidth", self.link_bandwidth)
        check_positive_finite("AcceleratorConfig.link_latency", self.link_latency, allow_zero=True)
        if self.check_races is not None and not isinstance(self.check_races, bool):
            raise TypeError(
                f"AcceleratorConfig.check_races must be True, False or None (read "
                f"ZERO_OFFLOAD_CHECK_RACES), got {type(self.check_races).__name__} "
                f"{self.check_races!r}"
            )
        if self.strict is not None and not isinstance(self.strict, bool):
            raise TypeError(
                f"AcceleratorConfig.strict must be True, False or None (read "
                f"ZERO_OFFLOAD_STRICT), got {type(self.strict).__name__} {self.strict!r}"
            )

    @property
    def simulates_link(self) -> bool:
        """Whether copies between device and host go over a simulated link."""
        return self.link_bandwidth is not None or self.link_latency > 0

    def resolved_device_budget(self, default: int, default_reason: str) -> tuple[int, str]:
        """The budget in force and where it came from (config, environment, or the default)."""
        if self.device_budget is not None:
            return int(self.device_budget), "config"
        env = os.environ.get(DEVICE_BUDGET_ENV)
        if env:
            budget = parse_bytes(env, name=DEVICE_BUDGET_ENV)
            if budget <= 0:
                raise ValueError(f"{DEVICE_BUDGET_ENV} must be > 0 bytes, got {env!r}")
            return budget, f"environment {DEVICE_BUDGET_ENV}"
        return default, default_reason
