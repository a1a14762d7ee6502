"""``ActivationOffloadConfig``: how activations leave the device and come back."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..activation_sizes import (
    DEFAULT_DEVICE_POOL_BYTES,
    DEFAULT_HOST_POOL_BYTES,
    checkpoint_pool_bytes,
)
from ..config import parse_bytes_with_unit

__all__ = ["TIERS", "ActivationOffloadConfig"]

#: Storage tiers activations can be offloaded to. An NVMe tier plugs in later, as another
#: value here and another ``Tier`` in the memory manager.
TIERS = ("host",)

#: Smallest pool the offloader builds, bytes: one alignment unit of a ``BlockPool``.
_MIN_POOL_BYTES = 512
#: Upper bound on ``prefetch_depth`` (layers); deeper prefetch only holds more device memory.
_MAX_PREFETCH_DEPTH = 1024


@dataclass(frozen=True)
class ActivationOffloadConfig:
    """Settings of an ``ActivationOffloader``; validated at construction.

    Attributes:
        prefetch_depth: how many layers ahead of recomputation (checkpoint groups; single
            saved tensors for ``offload_activations``) backward copies activations back to the
            device. 0 copies each one back only when it is needed. Default 1. In [0, 1024].
        min_bytes: saved tensors smaller than this many bytes stay on the device (a copy's
            fixed cost outweighs the memory). Default 1 MiB. An int or a string such as
            ``"256KiB"``, >= 0.
        host_pool_bytes: bytes of the host pool (pinned where the accelerator supports it)
            that holds offloaded activations; allocated once, at construction. It must hold
            every activation of one forward pass that is offloaded. Default 1 GiB. >= 512.
        device_pool_bytes: bytes of the device pool that reloaded activations are copied
            into, counted against the device budget; allocated once, at construction. It
            must hold ``prefetch_depth + 1`` layers' activations. Default 256 MiB. >= 512.
        max_offloads_in_flight: copies to the host that may still be pending when a new
            activation is saved; beyond that the forward waits for the oldest, which bounds
            the device memory held by activations on their way out. Default 2. >= 0.
        tier: where offloaded activations live: ``"host"`` (pinned host memory). Default
            ``"host"``; the only tier for now.
    """

    prefetch_depth: int = 1
    min_bytes: int | str = 1 << 20
    host_pool_bytes: int | str = DEFAULT_HOST_POOL_BYTES
    device_pool_bytes: int | str = DEFAULT_DEVICE_POOL_BYTES
    max_offloads_in_flight: int = 2
    tier: str = "host"

    @classmethod
    def for_checkpoints(
        cls, checkpoint_bytes: int, layers: int, **fields: Any
    ) -> ActivationOffloadConfig:
        """A config whose pools hold ``layers`` checkpointed layers' saved inputs of
        ``checkpoint_bytes`` each (micro-batch x sequence x hidden x the dtype's bytes, for
        a transformer block), with ``fields`` (``prefetch_depth``, ``min_bytes``, ...) as
        given; see Note [pools sized for checkpointed layers] in activation_sizes.py. ``zero-offload estimate``
        prints the sizes for a model shape."""
        for name in ("host_pool_bytes", "device_pool_bytes"):
            if name in fields:
                raise TypeError(
                    f"ActivationOffloadConfig.for_checkpoints sizes {name} itself; build "
                    f"ActivationOffloadConfig({name}=...) to set it by hand"
                )
        depth = fields.get("prefetch_depth", cls.prefetch_depth)
        _check_int_range("prefetch_depth", depth, 0, _MAX_PREFETCH_DEPTH)
        host, device = checkpoint_pool_bytes(checkpoint_bytes, layers, prefetch_depth=depth)
        return cls(host_pool_bytes=host, device_pool_bytes=device, **fields)

    def __post_init__(self) -> None:
        _check_int_range("prefetch_depth", self.prefetch_depth, 0, _MAX_PREFETCH_DEPTH)
        _check_int_range("max_offloads_in_flight", self.max_offloads_in_flight, 0, None)
        for name, low in (
            ("min_bytes", 0),
            ("host_pool_bytes", _MIN_POOL_BYTES),
            ("device_pool_bytes", _MIN_POOL_BYTES),
        ):
            nbytes = parse_bytes_with_unit(
                getattr(self, name), name=f"ActivationOffloadConfig.{name}"
            )
            if nbytes < low:
                raise ValueError(
                    f"ActivationOffloadConfig.{name} must be >= {low} bytes, got "
                    f"{getattr(self, name)!r}"
                )
            object.__setattr__(self, name, nbytes)
        if self.tier not in TIERS:
            raise ValueError(
                f"ActivationOffloadConfig.tier must be one of {TIERS}, got {self.tier!r}; "
                f"only pinned host memory is implemented so far"
            )


def _check_int_range(name: str, value: int, low: int, high: int | None) -> None:
    in_range = low <= value and (high is None or value <= high)
    if isinstance(value, bool) or not isinstance(value, int) or not in_range:
        bounds = f"[{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(
            f"ActivationOffloadConfig.{name} must be an int in {bounds}, got {value!r}"
        )
