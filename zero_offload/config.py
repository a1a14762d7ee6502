"""Configuration: small frozen dataclasses, validated once at construction.

Every field documents its unit and default. A bad value raises ``ValueError`` naming the
field, the value and the allowed range, so a mistake surfaces where it was made and not
deep inside a training step.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass

__all__ = [
    "DEVICE_BUDGET_ENV",
    "AcceleratorConfig",
    "format_bytes",
    "parse_bytes",
]

#: Environment variable holding the host accelerator's device budget ("8GiB", "512MB", "1000000").
DEVICE_BUDGET_ENV = "ZERO_OFFLOAD_DEVICE_BUDGET"

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "k": 2**10,
    "m": 2**20,
    "g": 2**30,
    "t": 2**40,
}
_BYTES_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: int | str, *, name: str = "value") -> int:
    """Parse a byte count: an int, or a string such as ``"8GiB"``, ``"512MB"``, ``"1e9"``.

    Binary units (KiB, MiB, GiB, TiB, and the bare K/M/G/T) are powers of 1024; decimal
    units (KB, MB, GB, TB) are powers of 1000. Raises ``ValueError`` naming ``name``.
    """
    if isinstance(value, bool):
        raise TypeError(f"{name} must be a byte count (int or a string like '8GiB'), got a bool")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"{name} must be >= 0 bytes, got {value}")
        return value
    if not isinstance(value, str):
        raise TypeError(
            f"{name} must be a byte count (int or a string like '8GiB'), "
            f"got {type(value).__name__} {value!r}"
        )
    match = _BYTES_RE.match(value)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(
            f"{name}={value!r} is not a byte count; use an integer or a number with a unit "
            f"such as '8GiB', '512MiB', '2GB' (units: {', '.join(sorted(k for k in _UNITS if k))})"
        )
    number = float(match.group(1))
    return int(number * _UNITS[unit])


def format_bytes(nbytes: float) -> str:
    """Human-readable binary size: ``format_bytes(3 * 2**30) == '3.00 GiB'``."""
    size = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.2f} {unit}"
        size /= 1024
    raise RuntimeError("unreachable: format_bytes loop always returns (bug)")


def _check_positive_finite(name: str, value: float, *, allow_zero: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    low_ok = value >= 0 if allow_zero else value > 0
    if not (math.isfinite(value) and low_ok):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be a finite number {bound}, got {value!r}")


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
    """

    device_budget: int | str | None = None
    link_bandwidth: float | None = None
    link_latency: float = 0.0

    def __post_init__(self) -> None:
        if self.device_budget is not None:
            budget = parse_bytes(self.device_budget, name="AcceleratorConfig.device_budget")
            if budget <= 0:
                raise ValueError(
                    f"AcceleratorConfig.device_budget must be > 0 bytes, got {self.device_budget!r}"
                )
            object.__setattr__(self, "device_budget", budget)
        if self.link_bandwidth is not None:
            _check_positive_finite("AcceleratorConfig.link_bandwidth", self.link_bandwidth)
        _check_positive_finite("AcceleratorConfig.link_latency", self.link_latency, allow_zero=True)

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
