"""A bucket's parameters under parameter offload: views of the unit's slot while the unit is
on the device, zero-byte placeholders on the device otherwise (Note [a released parameter] in
``released.py``); the pinned home is the only copy of the weights.

``WindowedViews`` is the ``ParamViews`` of an offloaded-parameter bucket. What differs:
``weights_dev`` is a fixed range of the unit's slot (Note [a unit always returns to its
slot] in ``window.py``), not a block of the bucket's own, and the parameters are re-pointed
between it and their placeholders as the unit comes and goes (Note [a unit's lifecycle] in
``unit.py``). The re-pointing goes through here, so ``detached()`` compares each parameter
with where it should point *now* and never takes the window's moves for a replacement behind
the optimizer (Note [parameters replaced behind the optimizer] in ``views/param_views.py``).
The optimizer's fingerprints (Note [weights written outside the optimizer]) are taken of the
home (``bound_to()``): a write reaches it, or is copied there when the unit leaves.

Construction copies the model's initial weights into the slot, exactly as ``ParamViews``
copies them into ``weights_dev``, so the backend's ``reconcile_master`` derives the fp32
master from them unchanged; ``adopt_home`` then releases the parameters onto their
placeholders, and the slot is free for the next unit.

Note [a state dict entry owns a storage of its bytes]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A state dict entry is the parameter's weights in its pinned home (Note [state dict entries
are views of the homes] in ``offloader.py``), but not a view of the home tensor: every home
is a range of one host pool, whose storage also holds the fp32 master and the moments, and
``torch.save`` (like pickling) writes each storage it meets whole. So ``home_view`` gives a
tensor whose storage is exactly the parameter's bytes (``_storage_of_its_own``: no copy,
the same address; a NumPy array over those bytes holds the pool's storage, so the memory
stays valid as long as the entry does). Each parameter's such tensor (its *entry base*) is
made at its first ``home_view`` and kept until ``close``; every entry handed out is a
``detach()`` of it, sharing its version counter. A write through an entry moves that counter
and not the pool's, so ``home_version`` adds the entry bases' counters to the pool's: the
unit whose home was written sees ``homes_written`` (Note [a unit's lifecycle] in
``unit.py``), and no other unit does. A write to any other view of the pool (another unit's
write-back, a loaded optimizer state) still moves the pool's counter and makes every unit
look written. Kept bases never die, so the sum never goes back. Under strict mode an entry
base is host memory wherever its home is (Note [strict: host memory is not device memory]
in ``accelerator/strict.py``).

An entry kept past ``close`` keeps its last values and no longer follows the model; until it
goes it keeps the whole pool's host memory (pinned on a GPU), as a view of the pool did:
``clone()`` what is kept longer.

Note [weights on NVMe are not read back at exit]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
An optimizer still alive at interpreter exit is released by its finalizer, which gives every
parameter a private copy of its weights (``unbind``). For a home on NVMe that copy is a disk
read, and by then it cannot be issued: ``concurrent.futures`` stops its thread pools (the
NVMe engine's, ``memory/io_engine.py``) before any ``atexit`` hook or finalizer runs. The
parameters go with the interpreter, so at exit (``interpreter_exiting``) such views leave
them on their placeholders and read nothing. ``close()``, or dropping the optimizer, before
exit restores them as always.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

import torch

from ..accelerator.strict import MEMORY
from ..caller_warning import warn_caller
from ..errors import StorageError
from ..memory.block import Block
from ..memory.quiet_exit import interpreter_exiting
from ..partition import BucketLayout
from ..views import ParamViews
from ..weights.nvme_home import WeightFile
from ..weights.source import fill_bucket
from .released import Binding, is_bound_to, is_released, placeholder_like, release, restore
from .window import Slot

if TYPE_CHECKING:
    from ..accelerator import Event
    from ..memory.manager import TieredMemoryManager


class SlotHolder(Protocol):
    """What the views ask of their unit (``unit.ParamUnit``; a protocol, so this module
    stays below the unit that builds it)."""

    slot: Slot  # the window slot the unit's weights use while resident
    resident: bool  # the parameters point at the slot now
    content_valid: bool  # the slot holds the unit's current weights

    #: Fetch the unit for user code and wait for it (Note [a released parameter]); holds
    #: the offloader weakly, as every released parameter's binding keeps it.
    materialize: Callable[[], None]

    def release(self) -> None:
        """Leave the slot (a written slot is copied home first)."""

    def views_stepped(self, views: WindowedViews, flags: Sequence[bool]) -> None:
        """A step moved the counters of ``views``' parameters where ``flags``: while bound,
        the unit's write check moves with them."""


__all__ = ["WindowedViews"]


def _storage_of_its_own(view: torch.Tensor) -> torch.Tensor:
    """``view`` (contiguous, host) as a tensor whose storage covers exactly its bytes, at the
    same address, keeping ``view``'s storage alive: Note [a state dict entry owns a storage
    of its bytes]."""
    if view.numel() == 0:
        return torch.empty(view.shape, dtype=view.dtype)
    # No copy: the array views the bytes and holds ``view`` (so the pool's storage).
    raw = view.detach().reshape(-1).view(torch.uint8).numpy()
    out = torch.from_numpy(raw).view(view.dtype).view(view.shape)
    kind = MEMORY.lookup(view)
    # Strict mode: the same memory as the home. At the pool's own address the pool's entry
    # already answers (registering ours would replace it, and drop it with our storage).
    if kind is not None and out.data_ptr() != view.untyped_storage().data_ptr():
        MEMORY.register(out, *kind)
    return out


def _home_view_of(ref: weakref.ref, index: int) -> torch.Tensor:
    views = ref()
    if views is None:
        raise RuntimeError("a released parameter outlived its optimizer's buffers (bug)")
    return views.home_view(index)


class WindowedViews(ParamViews):
    """Fields (beyond ``ParamViews``'):
    weights_dev: (padded_numel,) training dtype, where the bucket's weights are while the
        unit is resident: ``slot_range``, or the same range of the unit's private buffer
        while user code reads it outside the window (Note [a read outside the window lands
        privately] in ``private_reads.py``).
    slot_range: (padded_numel,) training dtype, the unit's slot at this bucket's offset
        (fixed for good: Note [a unit always returns to its slot]).
    block: the slot's block (copies record their events on it).
    home: training dtype, pinned host; the authoritative weights of ``home_span`` (None
        until ``adopt_home``); ``home_block`` its block.
    home_span: ``[lo, hi)`` of the bucket the home holds: all of it on one rank; this
        rank's shard with several (``sharded_homes.py``; Note [a sharded unit] in
        ``sharded_fetch.py``).
    placeholders: per parameter, its shape and dtype on the device, 0 bytes of storage
        (empty until ``adopt_home``); what a released parameter holds.
    entry_bases: parameter index -> its weights in the home, ``(shape)``, pinned host, with a
        storage of exactly its bytes; made by the first ``home_view``, kept until
        ``close`` (Note [a state dict entry owns a storage of its bytes]).
    """

    weights_cross_the_link = False  # the step writes the home; the next fetch brings it

    def __init__(
        self,
        layout: BucketLayout,
        params: Sequence[torch.nn.Parameter],
        unit: SlotHolder,
        region: torch.Tensor,
    ) -> None:
        # Not ParamViews.__init__: the device bytes are the slot's, not a block of our own.
        self.layout = layout
        self.params = list(params)
        self.dtype = self.params[0].dtype
        self.unit = unit
        self.block: Block = unit.slot.block
        self.weights_dev = region
        self.slot_range = region
        self.home: torch.Tensor | None = None
        self.home_block: Block | None = None
        self.home_span = (0, layout.padded_numel)
        fill_bucket(layout, self.params, region)  # the window keeps the slot on failure
        self._point_at(region)  # releases the original storage (one copy of the model)
        self.versions: tuple[int, ...] | None = None
        self.placeholders: list[torch.Tensor] = []
        self._bindings: list[Binding] = []  # per parameter, how it reaches its weights
        self.entry_bases: dict[int, torch.Tensor] = {}
        # The home on NVMe instead (Note [homes on NVMe are fetched through a bounce ring]
        # in home_store.py): the weight file, this bucket's offset in its slot's bounce,
        # the manager its reads go through, the file's ``written`` at ``remember()``.
        self.nvme_home: WeightFile | None = None
        self.bounce_offset = 0
        self._manager: TieredMemoryManager | None = None
        self._disk_seen = 0

    def _point_at(self, flat: torch.Tensor) -> None:
        for slot, param in zip(self.layout.slots, self.params, strict=True):
            param.data = flat[slot.offset : slot.end].view(slot.shape)

    def slot_span(self) -> tuple[int, int]:
        """``[start, end)`` in bytes of ``slot_range`` within the unit's slot."""
        base = self.block.view(torch.uint8).data_ptr()
        start = self.slot_range.data_ptr() - base
        return start, start + self.slot_range.numel() * self.slot_range.element_size()

    def land_in(self, buffer: torch.Tensor | None) -> None:
        """Where the bucket's weights go while the unit is resident: ``buffer`` (the unit's
        private ``(nbytes,) uint8`` buffer, this bucket at its slot offset), or its slot
        range again (None). Only while the unit is released (Note [a read outside the
        window lands privately] in ``private_reads.py``)."""
        if self.unit.resident:
            raise RuntimeError(f"{self.unit!r}: moved while resident (bug)")
        if buffer is None:
            self.weights_dev = self.slot_range
            return
        start, end = self.slot_span()
        self.weights_dev = buffer[start:end].view(self.dtype)

    def _bind(self, block: Block) -> None:
        raise RuntimeError("a window slot never moves (its pool does not defragment) (bug)")

    def adopt_home(self, home: torch.Tensor, home_block: Block) -> None:
        """The backend is built and its home holds the weights: the parameters are released
        onto their placeholders (Note [a released parameter])."""
        lo, hi = self.home_span
        if home.numel() != hi - lo or home.dtype != self.dtype:
            raise RuntimeError(
                f"bucket {self.layout.index}: home {tuple(home.shape)} {home.dtype} does not "
                f"match ({hi - lo},) {self.dtype} (bug)"
            )
        self.home, self.home_block = home, home_block
        self._release_onto_placeholders()

    def adopt_nvme_home(self, home: WeightFile, manager: TieredMemoryManager) -> None:
        """As ``adopt_home``, for a home in a weight file (Note [homes on NVMe])."""
        if home.real > self.layout.padded_numel or home.dtype != self.dtype:
            raise RuntimeError(f"bucket {self.layout.index}: weight file mismatch (bug)")
        self.nvme_home, self._manager = home, manager
        self._release_onto_placeholders()

    def _release_onto_placeholders(self) -> None:
        device = self.weights_dev.device
        self.placeholders = [placeholder_like(param, device) for param in self.params]
        ref = weakref.ref(self)
        self._bindings = [
            Binding(self.unit.materialize, functools.partial(_home_view_of, ref, i))
            for i in range(len(self.params))
        ]
        self.bind_placeholders()

    def home_pair(self) -> tuple[torch.Tensor, Block]:
        """``(home, home_block)``, the source of every fetch."""
        if self.home is None or self.home_block is None:
            raise RuntimeError(f"bucket {self.layout.index}: no home yet (bug)")
        return self.home, self.home_block

    def home_slot(self) -> torch.Tensor:
        """The range of the slot the home is copied into (and written back from)."""
        lo, hi = self.home_span
        return self.weights_dev[lo:hi]

    def home_view(self, index: int) -> torch.Tensor:
        """Parameter ``index``'s weights in the home: ``(shape)``, pinned host, detached,
        with a storage of exactly its bytes (Note [a state dict entry owns a storage of its
        bytes]); a private copy read from disk for a home on NVMe (Note [state dict entries
        are views of the homes] in ``offloader.py``)."""
        slot = self.layout.slots[index]
        if self.nvme_home is not None and self._manager is not None:
            copy = self.nvme_home.read_range(self._manager, slot.offset, slot.end)
            return copy.view(slot.shape)
        base = self.entry_bases.get(index)
        if base is None:
            home = self.home_pair()[0][slot.offset : slot.end].view(slot.shape)
            base = self.entry_bases[index] = _storage_of_its_own(home)
        return base.detach()  # shares the base's version counter

    def write_home(self, index: int, values: torch.Tensor) -> None:
        """Parameter ``index``'s weights in an NVMe home take ``values`` (a state dict's
        copy written by user code)."""
        slot = self.layout.slots[index]
        if self.nvme_home is None or self._manager is None:
            raise RuntimeError(f"bucket {self.layout.index}: home not on NVMe (bug)")
        self.nvme_home.write_range(self._manager, slot.offset, slot.end, values)

    def home_version(self) -> int:
        """Moves when the home is written outside the optimizer's step: its version
        counter (the pool's) plus its entry bases' (Note [a state dict entry owns a storage
        of its bytes]), or the weight file's ``written``."""
        if self.nvme_home is not None:
            return self.nvme_home.written
        own = sum(base._version for base in self.entry_bases.values())
        return self.home_pair()[0]._version + own

    def stepped(self, flags: Sequence[bool]) -> None:
        """As ``ParamViews.stepped``, and the unit's own write check moves with the
        counters while the unit is bound to the device (an announced step hands a bucket
        over while its unit is still there: ``SlotHolder.views_stepped``)."""
        super().stepped(flags)
        self.unit.views_stepped(self, flags)

    def home_rewritten(self) -> None:
        """The step wrote the home: the unit's slot no longer holds its weights."""
        if self.unit.resident:
            raise RuntimeError(f"{self.unit!r}: stepped while on the device (bug)")
        self.unit.content_valid = False

    def remember(self) -> None:
        if self.nvme_home is None:
            super().remember()
            return
        self.versions = self.current_versions()
        self._disk_seen = self.nvme_home.written

    def device_written(self) -> torch.Tensor | None:
        """None for a home on NVMe (``changed_params`` decides by the file's writes)."""
        return None if self.nvme_home is not None else super().device_written()

    def changed_params(self) -> list[torch.nn.Parameter]:
        """For a home on NVMe: every parameter when the file was written outside the step
        since ``remember()`` (the reconciliation compares by value, tile by tile)."""
        if self.nvme_home is None:
            return super().changed_params()
        if self.versions is None or self.nvme_home.written != self._disk_seen:
            return list(self.params)
        return []

    def replaced(self) -> list[int]:
        """Indices of the parameters whose ``.data`` was replaced since the unit last
        bound them (Note [parameters replaced behind the optimizer])."""
        return [i for i, _ in self.detached()]

    def bind_device(self) -> None:
        """The unit is fetched: every parameter becomes a view of the slot (plain class)."""
        for slot, param in zip(self.layout.slots, self.params, strict=True):
            restore(param, self.weights_dev[slot.offset : slot.end].view(slot.shape))

    def bind_placeholders(self) -> None:
        """The unit is released: every parameter bound to the slot (or the private buffer),
        to its placeholder, or half-way between (Note [an interrupted move] in ``unit.py``)
        holds its placeholder again; idempotent. A replaced one is left as it is, for the
        next fetch or step to refuse."""
        for i, (param, holder) in enumerate(zip(self.params, self.placeholders, strict=True)):
            if self._ours(i, param, holder):
                release(param, holder, self._bindings[i])

    def _ours(self, index: int, param: torch.Tensor, holder: torch.Tensor) -> bool:
        """Whether ``param`` points where this bucket put it: its placeholder's storage
        (whatever its class), or its range of the slot or of the private buffer."""
        slot = self.layout.slots[index]
        with torch._C.DisableTorchFunctionSubclass():
            if param.untyped_storage()._cdata == holder.untyped_storage()._cdata:
                return True
            if param.dtype != self.dtype or tuple(param.shape) != slot.shape:
                return False
            at = param.data_ptr()
            size = self.dtype.itemsize
            return any(
                at == flat.data_ptr() + slot.offset * size
                for flat in (self.weights_dev, self.slot_range)
            )

    def unbind(self) -> None:
        """Give every parameter a private copy of its weights on the device (the home's,
        once adopted) and its plain class (close, or a construction that failed). A
        parameter whose ``.data`` was replaced keeps what it was given. At interpreter exit,
        a home on NVMe is not read: Note [weights on NVMe are not read back at exit]."""
        if self.nvme_home is not None and interpreter_exiting():
            return
        for i, param in enumerate(self.params):
            if self.home is None and self.nvme_home is None:
                param.data = param.data.clone()
            elif is_bound_to(param, self.placeholders[i]):
                source = self._home_or_nan(i)
                device = self.weights_dev.device
                restore(param, torch.empty(source.shape, dtype=source.dtype, device=device))
                param.data.copy_(source)
            elif is_released(param):  # replaced while released: only the class is ours
                with torch._C.DisableTorchFunctionSubclass():
                    data = param.data
                restore(param, data)

    def _home_or_nan(self, index: int) -> torch.Tensor:
        """``home_view(index)``; for an NVMe home whose record is unreadable (a bad
        checksum, an I/O error), NaN, with a warning naming the parameter and the file:
        ``close`` still releases everything else."""
        try:
            return self.home_view(index)
        except StorageError as exc:
            slot = self.layout.slots[index]
            warn_caller(
                f"zero-offload: closing the optimizer, parameter {index} of bucket "
                f"{self.layout.index} {slot.shape} could not be read from its weight file; "
                f"it is NaN now. {exc}"
            )
            return torch.full(slot.shape, float("nan"), dtype=self.dtype)

    def detached(self) -> list[tuple[int, torch.nn.Parameter]]:
        """``(slot_index, param)`` of parameters bound neither to the slot (resident) nor to
        their placeholder (released): Note [parameters replaced behind the optimizer]."""
        if not self.placeholders:
            return super().detached()
        out = []
        with torch._C.DisableTorchFunctionSubclass():
            for i, (slot, param) in enumerate(zip(self.layout.slots, self.params, strict=True)):
                if self.unit.bound:  # FETCHING: placeholders still (Note [a fetching unit's ...])
                    view = self.weights_dev[slot.offset : slot.end]
                    ok = (
                        not is_released(param)
                        and param.dtype == self.dtype
                        and tuple(param.shape) == slot.shape
                        and param.data_ptr() == view.data_ptr()
                    )
                else:
                    ok = is_bound_to(param, self.placeholders[i])
                if not ok:
                    out.append((i, param))
        return out

    def slot_fingerprint(self) -> list[int] | torch.Tensor:
        """Per parameter, the fingerprint of its slot range now (Note [a write to a resident
        unit reaches its home] in ``slot_writes.py``)."""
        return self._fingerprint(self.weights_dev)

    def bound_to(self) -> torch.Tensor:
        """The home once adopted (the truth the optimizer fingerprints), the slot before."""
        return self.weights_dev if self.home is None else self.home

    def bound_start(self) -> int:
        """Where ``bound_to()`` starts in the bucket: the home's span (this rank's shard
        under ZeRO-3), the slot's 0 before."""
        return 0 if self.home is None else self.home_span[0]

    def copy_in(
        self,
        manager: TieredMemoryManager,
        lo: int,
        hi: int,
        source: torch.Tensor,
        source_block: Block,
        *,
        after: list[Event],
        label: str,
    ) -> Event | None:
        # The step wrote the home itself; the unit's next fetch brings it. A resident unit
        # would now hold stale weights: ParamOffloader.before_step released every unit.
        if self.unit.resident:
            raise RuntimeError(f"{self.unit!r}: stepped while on the device (bug)")
        if source_block is not self.home_block:
            raise RuntimeError(f"bucket {self.layout.index}: update outside the home (bug)")
        self.unit.content_valid = False
        return None

    def copy_out(
        self,
        manager: TieredMemoryManager,
        lo: int,
        hi: int,
        target: torch.Tensor,
        target_block: Block,
        *,
        label: str,
    ) -> Event | None:
        if self.home is None and self.nvme_home is None:  # construction: in the slot
            return super().copy_out(manager, lo, hi, target, target_block, label=label)
        if target_block is not self.home_block:
            raise RuntimeError(f"bucket {self.layout.index}: weights read off-home (bug)")
        if self.unit.resident:
            # Read outside a step (``load_state_dict``, whose caller waited for every copy):
            # the unit leaves first, so a write to its slot reaches the home (Note [a write
            # to a resident unit reaches its home]) and no slot outlives what is loaded.
            self.unit.release()
        return None  # the parameters are views of the home: writes landed there

    def close(self) -> None:
        """Nothing of its own to free: the slot is the window's, the home the backend's."""
        self.home = self.home_block = None
        self.nvme_home = self._manager = None
        self.placeholders = []
        self._bindings = []
        self.entry_bases = {}  # entries handed out keep their memory alive themselves
