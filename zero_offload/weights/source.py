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
copy] in ``optim/construction.py``. Originals on the device leave it before any pool is
allocated (Note [originals on the device leave first]), so ``fill`` reads those from the
host.
"""

from __future__ import annotations

import contextvars
import weakref
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, NamedTuple

import torch

from ..accelerator.strict import MEMORY, MemoryKind
from ..caller_warning import warn_caller

if TYPE_CHECKING:
    from ..memory.manager import TieredMemoryManager
    from ..partition import BucketLayout
    from .checkpoint import SafetensorsCheckpoint

__all__ = [
    "ConstructionPeaks",
    "DeviceOriginals",
    "PeakTracker",
    "attach",
    "fill",
    "fill_bucket",
    "has_source",
    "on_device",
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
# CPU original counts as host memory, as it would beside a GPU, unless it was registered as
# device memory (``on_device``: the strict accelerator's memory, a test's model "on the
# GPU"). Samples are taken after every allocation and every weight read; memory only falls
# between them, so the sampled maximum is the peak. An original counts until the bucket
# that holds it has re-pointed its parameters (the user may hold other references; then it
# lives on, outside our count), and one on the device moves to the host count when it
# leaves the device (Note [originals on the device leave first]); one whose device memory
# something else still holds then stays in the device count to the end.


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
            on_gpu = on_device(param)
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

    def pending_host(self, params: Iterable[torch.Tensor]) -> int:
        """Host bytes of ``params``' originals not yet released."""
        entries = (self._pending.get(id(param)) for param in params)
        return sum(e[0] for e in entries if e is not None and not e[1])

    def left_device(self, param: torch.Tensor) -> None:
        """``param``'s device original was copied to the host and ``param`` re-pointed
        there: its bytes count as host memory from now on."""
        entry = self._pending.get(id(param))
        if entry is None or not entry[1]:
            return
        self._pending[id(param)] = (entry[0], False)
        self._device_pending -= entry[0]
        self._host_pending += entry[0]
        self.sample()

    def held_on_device(self, nbytes: int) -> None:
        """``nbytes`` of device originals live on (something else references them): they
        count as device memory to the end of the construction."""
        self._device_pending += nbytes
        self.sample()

    def peaks(self) -> ConstructionPeaks:
        """The peaks so far."""
        return ConstructionPeaks(device=self.device, host=self.host)


def on_device(param: torch.Tensor) -> bool:
    """Whether ``param``'s weights are in device memory: a GPU tensor, or on the host
    accelerator memory registered as device memory (Note [strict: host memory is not device
    memory] in ``accelerator/strict.py``)."""
    if param.is_meta:
        return False
    if param.device.type != "cpu":
        return True
    entry = MEMORY.lookup(param)
    return entry is not None and entry[0] is MemoryKind.DEVICE


# Note [originals on the device leave first]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The device pool is allocated whole before any weight moves (Note [construction holds one
# copy] in optim/construction.py). Originals already on the device would sit beside it until
# their bucket moved: device peak = final footprint + the model. So before anything is
# allocated, ``DeviceOriginals`` copies each trainable original on the device to a host
# tensor of its own (pageable CPU memory, one parameter at a time; the copy is synchronous,
# so it is complete when it returns) and re-points the parameter there (``.data``: the same
# object, its version counter untouched), which frees the device original. The build then
# runs as from CPU weights, bitwise the same values. Device peak = max(the model on the
# device at the call, the final footprint); construction adds nothing above what the caller
# had. Host peak = what the CPU-weights build holds: max(the model, the final host
# footprint) without parameter offload (the final footprint whenever every bucket's fp32
# master is in RAM, which is at least the model); with it, max(the model + the segment-wide
# buffers, the final footprint), the final footprint whenever every home is in RAM (Note
# [homes are pinned unit by unit] in optim/unit_pools.py).
#
# A device original is freed only if nothing else holds its storage: a tensor or view the
# caller kept, or a parameter viewing a shared buffer (freed once all its views moved). Each
# storage is watched by weak reference; those still alive after every parameter moved are
# reported (a warning with their size) and stay in the device count (Note [construction
# peaks]). If the build fails, ``restore`` gives every parameter not in device memory a
# device tensor with its current values again, so the model is where it was; if that
# copy fails, the error says how many parameters stay in host memory.


class _Moved(NamedTuple):
    param: torch.Tensor
    device: torch.device  # where the original was
    simulated: str | None  # its registered device memory's name (host accelerator), or None


class DeviceOriginals:
    """Moves trainable device originals to the host before construction allocates; see
    Note [originals on the device leave first].

    Fields: ``moved``: each parameter moved, where it was; ``held_bytes``: device bytes
    that stayed alive (referenced elsewhere) after the move.
    """

    def __init__(self, params: Iterable[torch.Tensor], tracker: PeakTracker) -> None:
        self.moved: list[_Moved] = []
        self.held_bytes = 0
        storages: dict[int, tuple[weakref.ref[torch.UntypedStorage], int]] = {}
        seen: set[int] = set()
        try:
            for param in params:
                if id(param) in seen or not on_device(param):
                    continue
                seen.add(id(param))
                storage = param.untyped_storage()
                storages[storage.data_ptr()] = (weakref.ref(storage), storage.nbytes())
                del storage
                self._to_host(param, tracker)
        except BaseException as exc:
            self.restore(exc)
            raise
        held = [nbytes for ref, nbytes in storages.values() if ref() is not None]
        self.held_bytes = sum(held)
        if held:
            tracker.held_on_device(self.held_bytes)
            warn_caller(
                f"{len(held)} device storages of the parameters ({self.held_bytes} bytes) are "
                "still referenced elsewhere (a tensor or view of the weights kept by the "
                "caller), so building the optimizer could not free them: the device holds "
                "them beside the optimizer's pools. Drop those references before building "
                "it (Note [originals on the device leave first])"
            )

    def _to_host(self, param: torch.Tensor, tracker: PeakTracker) -> None:
        entry = MEMORY.lookup(param)
        host = torch.empty(param.shape, dtype=param.dtype, device="cpu")  # pageable
        with torch.no_grad():
            host.copy_(param.detach())  # synchronous D2H: done when it returns
        self.moved.append(_Moved(param, param.device, None if entry is None else entry[1]))
        param.data = host  # drops the parameter's hold on its device original
        tracker.left_device(param)

    def restore(self, error: BaseException | None) -> None:
        """A build failed (``error``): every moved parameter not in device memory gets a
        device tensor with its values again. Raises ``RuntimeError`` (from ``error``)
        saying how many stay in host memory if that fails."""
        stuck = 0
        for moved in self.moved:
            param = moved.param
            if on_device(param):  # bound, then given a device copy back (unbind)
                continue
            try:
                back = torch.empty(param.shape, dtype=param.dtype, device=moved.device)
                if moved.simulated is not None:
                    MEMORY.register(back, MemoryKind.DEVICE, moved.simulated)
                with torch.no_grad():
                    back.copy_(param.detach())
                param.data = back
            except Exception:  # counted and reported below
                stuck += 1
        self.moved = []
        if stuck:
            raise RuntimeError(
                f"building the optimizer failed ({error!r}), and {stuck} parameters that "
                "had left the device for it could not go back: they keep their values in "
                "host memory (CPU tensors). Move the model back (model.to(device)) or free "
                "device memory and build again"
            ) from error


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
