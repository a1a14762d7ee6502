"""Where a parameter's initial weights come from when the optimizer builds its slots, and
how much memory construction held on the way.

Note [construction reads each weight from its source]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Construction copies each trainable parameter's initial weights into its slot of a device
block (``ParamViews.__init__``) or of a window slot (``WindowedViews.__init__``), and then
re-points the parameter there, which releases the original. ``fill(param, out)`` is that one
copy, for every kind of original:

- on the accelerator's device (as before): a device-to-device copy;
- on the CPU, pinned or not, while the accelerator is a GPU: a plain host-to-device copy
  (construction time, synchronous; user data entering the library, as the user's own
  ``model.to(device)`` would, so it is not a tier move of the manager's);
- on the meta device, tagged by ``load_pretrained`` with its checkpoint tensor: that tensor
  is read (one at a time, ``SafetensorsCheckpoint.read_into``) straight into ``out``, and the
  parameter object becomes a real tensor over ``out`` (``torch.utils.swap_tensors``: the
  same object, so the module, the optimizer's groups and any user reference stay valid; its
  ``__dict__`` attributes are kept).

So the model is never whole anywhere but in its final slots: Note [construction holds one
copy] in ``optim/construction.py``.
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, NamedTuple

import torch

if TYPE_CHECKING:
    from ..memory.manager import TieredMemoryManager
    from ..partition import BucketLayout
    from .checkpoint import SafetensorsCheckpoint

__all__ = [
    "ConstructionPeaks",
    "PeakTracker",
    "attach",
    "fill",
    "fill_bucket",
    "has_source",
    "tracking",
]

#: The attribute ``load_pretrained`` sets on a meta parameter: its ``_Pending`` source.
_ATTR = "_zero_offload_weights"


class _Pending(NamedTuple):
    checkpoint: SafetensorsCheckpoint
    key: str  # the tensor's key in the checkpoint


def attach(param: torch.nn.Parameter, checkpoint: SafetensorsCheckpoint, key: str) -> None:
    """Tag meta ``param`` to be read from ``checkpoint[key]`` when an optimizer builds it."""
    setattr(param, _ATTR, _Pending(checkpoint, key))


def has_source(param: torch.Tensor) -> bool:
    """Whether meta ``param`` knows where its weights are (``load_pretrained`` tagged it)."""
    return param.is_meta and isinstance(getattr(param, _ATTR, None), _Pending)


def materialise(param: torch.nn.Parameter, data: torch.Tensor) -> None:
    """Make meta ``param`` a real parameter over ``data`` (same object, same attributes but
    the source tag); see Note [construction reads each weight from its source]."""
    # A fresh tensor of its own, then ``.data``: the parameter keeps a version counter of
    # its own, as a parameter re-pointed with ``.data`` does (a Parameter made over ``data``
    # would share the pool buffer's, and every write into the pool, gradients included,
    # would look like a write to the weight saved for backward).
    empty = torch.empty(0, dtype=data.dtype, device=data.device)
    new = torch.nn.Parameter(empty, requires_grad=param.requires_grad)
    new.__dict__.update({k: v for k, v in param.__dict__.items() if k != _ATTR})
    try:
        torch.utils.swap_tensors(param, new)
        param.data = data
    except RuntimeError as exc:
        raise RuntimeError(
            f"cannot materialise the meta parameter of shape {tuple(param.shape)} in place: "
            f"{exc}. Something holds a weak reference to it (another optimizer, a hook); "
            "build the optimizer before anything else refers to the parameters"
        ) from exc


def fill(param: torch.Tensor, out: torch.Tensor) -> None:
    """Copy ``param``'s initial weights into ``out`` (its flat slot); a meta parameter is
    read from its checkpoint and then viewed over ``out``. See Note [construction reads
    each weight from its source]."""
    transient = 0
    with torch.no_grad():
        if param.is_meta:
            pending = getattr(param, _ATTR, None)
            if not isinstance(pending, _Pending):
                raise RuntimeError(
                    f"meta parameter of shape {tuple(param.shape)} has no weight source "
                    "(check_params refuses these) (bug)"
                )
            transient = pending.checkpoint.read_into(pending.key, out)
            materialise(param, out.view(param.shape))  # type: ignore[arg-type]
        else:
            out.copy_(param.detach().reshape(-1))
    tracker = _TRACKER.get()
    if tracker is not None:
        tracker.sample(transient_host=transient)


def fill_bucket(layout: BucketLayout, params: Sequence[torch.Tensor], flat: torch.Tensor) -> None:
    """Zero ``flat`` (a bucket's padded training-dtype weights) and ``fill`` each parameter
    into its slot. If a read fails, the meta parameters read so far (now views of ``flat``)
    get private copies before the error propagates, so they keep their values when the
    caller frees ``flat``."""
    filled: list[torch.Tensor] = []
    try:
        with torch.no_grad():
            flat.zero_()  # see Note [padding stays at the end] in partition.py
            for slot, param in zip(layout.slots, params, strict=True):
                was_meta = param.is_meta  # read from its checkpoint, then a view of flat
                fill(param, flat[slot.offset : slot.end])
                if was_meta:
                    filled.append(param)
    except BaseException:
        for param in filled:
            param.data = param.data.clone()
        raise


# Note [construction peaks]
# ~~~~~~~~~~~~~~~~~~~~~~~~~
# What one construction (one ``SegmentBuilder.build``) held, in bytes, at its worst moment:
# - device: the library's device bytes (the ledger's ``in_use``: the pools, allocated whole)
#   plus the originals still on a GPU that construction has not yet released;
# - host: the library's host bytes (every host pool of the manager and the NVMe tier's I/O
#   buffers) plus the originals still on the host that construction has not yet released,
#   plus the one checkpoint tensor being read.
# On the host accelerator the device *is* the CPU: there "device" is the ledger only, and a
# CPU original counts as host memory, as it would beside a GPU. Samples are taken after
# every allocation and every weight read; memory only falls between them, so the sampled
# maximum is the peak. An original counts until the bucket that holds it has re-pointed its
# parameters (the user may hold other references; then it lives on, outside our count).


class ConstructionPeaks(NamedTuple):
    """The peaks of Note [construction peaks], in bytes."""

    device: int
    host: int


class PeakTracker:
    """Samples Note [construction peaks] during one construction.

    Fields: ``_pending``: id -> (bytes, on a GPU) of each original not yet released;
    ``_device_pending`` / ``_host_pending``: their sums; ``device`` / ``host``: the peaks.
    """

    def __init__(self, manager: TieredMemoryManager, params: Iterable[torch.Tensor]) -> None:
        self.manager = manager
        self._pending: dict[int, tuple[int, bool]] = {}
        self._device_pending = self._host_pending = 0
        for param in params:
            if param.is_meta or id(param) in self._pending:
                continue
            nbytes = param.numel() * param.element_size()
            on_gpu = param.device.type != "cpu"
            self._pending[id(param)] = (nbytes, on_gpu)
            if on_gpu:
                self._device_pending += nbytes
            else:
                self._host_pending += nbytes
        self.device = self.host = 0
        self.sample()

    def library_host_bytes(self) -> int:
        """The manager's host pools and NVMe I/O buffers, in bytes."""
        pools = sum(p.capacity for p in self.manager.pools if p.kind != "device")
        io = sum(len(tier.buffers) * tier.buffer_bytes for tier in self.manager.storage)
        return pools + io

    def sample(self, *, transient_host: int = 0) -> None:
        """Take one sample; ``transient_host``: bytes read from a checkpoint held now."""
        device = self.manager.accelerator.memory_stats()["in_use"] + self._device_pending
        host = self.library_host_bytes() + self._host_pending + transient_host
        self.device = max(self.device, device)
        self.host = max(self.host, host)

    def released(self, params: Iterable[torch.Tensor]) -> None:
        """``params`` now point at their slots: their originals are gone."""
        for param in params:
            entry = self._pending.pop(id(param), None)
            if entry is None:
                continue
            if entry[1]:
                self._device_pending -= entry[0]
            else:
                self._host_pending -= entry[0]

    def peaks(self) -> ConstructionPeaks:
        """The peaks so far."""
        return ConstructionPeaks(device=self.device, host=self.host)


_TRACKER: contextvars.ContextVar[PeakTracker | None] = contextvars.ContextVar(
    "zero_offload_construction_tracker", default=None
)


@contextmanager
def tracking(tracker: PeakTracker) -> Iterator[PeakTracker]:
    """``fill`` samples ``tracker`` inside this block."""
    token = _TRACKER.set(tracker)
    try:
        yield tracker
    finally:
        _TRACKER.reset(token)
