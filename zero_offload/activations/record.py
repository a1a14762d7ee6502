"""One offloaded activation: its lifecycle state and the blocks that hold its bytes.

See Note [activation lifecycle] in ``offloader.py``.
"""

from __future__ import annotations

import enum

import torch

from ..accelerator import Event
from ..memory.block import Block

__all__ = ["ActivationState", "OffloadedActivation", "SavedActivation"]


class ActivationState(enum.Enum):
    """Where an offloaded activation's bytes are, and what that means for memory.

    Transitions (checked in ``ActivationOffloader``): ``MOVING_OUT -> ON_HOST`` when the
    host sees the copy out complete; ``MOVING_OUT -> LANDING`` when compute waited for it
    (the device tensor goes) before the host saw it end, ``LANDING -> ON_HOST`` once it
    does; ``ON_HOST``/``LANDING -> MOVING_IN`` when a reload is issued; ``MOVING_IN ->
    ON_HOST`` (or ``LANDING``, the same rule) when backward takes the reloaded tensor (the
    device block then belongs to that tensor's storage); any state ``-> FREED`` when
    autograd drops it.
    """

    #: The copy to the host block is pending; the device tensor that autograd saved is still
    #: held (and counted as device activation bytes) until the copy's event completes.
    MOVING_OUT = "moving_out"
    #: Compute waited for the copy out, so the device tensor was released, but the host has
    #: not seen the copy end (on a GPU it may still run): the host block is not to be read
    #: on the host yet; a reload queues after ``out_event``. No device memory.
    LANDING = "landing"
    #: The host block holds the bytes, and the host saw the copy out end (``out_event``
    #: synchronized): the activation uses no device memory.
    ON_HOST = "on_host"
    #: A device block is being filled from the host block (a prefetch or a demand load); the
    #: device block is counted as device activation bytes, the host block is kept for re-reads.
    MOVING_IN = "moving_in"
    #: Autograd dropped the activation: the host block is freed (reused once its copies end).
    FREED = "freed"


class OffloadedActivation:
    """The bookkeeping of one offloaded activation; every field guarded by the offloader's lock."""

    __slots__ = (
        "device_tensor",
        "dtype",
        "group",
        "host_block",
        "host_view",
        "in_event",
        "nbytes",
        "out_event",
        "ptr_mod",
        "shape",
        "state",
        "stride",
    )

    def __init__(
        self,
        *,
        group: int,
        dtype: torch.dtype,
        shape: tuple[int, ...],
        stride: tuple[int, ...],
        ptr_mod: int,
        nbytes: int,
        host_block: Block,
        host_view: torch.Tensor,
        out_event: Event,
    ) -> None:
        self.group = group  # prefetch unit: one checkpoint call, or one saved tensor
        self.dtype = dtype
        # Note [saved layout comes back] in layout.py: the saved tensor's shape and
        # strides, and its data pointer modulo LAYOUT_ALIGN bytes
        self.shape = shape
        self.stride = stride
        self.ptr_mod = ptr_mod
        self.nbytes = nbytes  # span * itemsize: the storage range the saved view covers
        self.host_block = host_block  # host pool block, freed when autograd drops the activation
        self.host_view = host_view  # (span,) dtype, over host_block: the span's bytes
        self.out_event = out_event  # end of the copy to the host
        self.state = ActivationState.MOVING_OUT
        # (shape,) dtype with the saved strides, on the device, over a device pool block; set
        # while MOVING_IN. See Note [device blocks live as long as their storage] in layout.py.
        self.device_tensor: torch.Tensor | None = None
        self.in_event: Event | None = None  # end of the copy back, while MOVING_IN

    def __repr__(self) -> str:
        return (
            f"OffloadedActivation(group={self.group}, shape={self.shape}, stride={self.stride}, "
            f"dtype={self.dtype}, "
            f"nbytes={self.nbytes}, state={self.state.name})"
        )


class SavedActivation:
    """What autograd stores in place of an offloaded tensor; its death frees the host block."""

    __slots__ = ("__weakref__", "record")

    def __init__(self, record: OffloadedActivation) -> None:
        self.record = record
