"""A bucket's parameters as views of one flat device buffer, and what changed behind us.

The model's parameters keep working unchanged as views into ``weights_dev`` (one buffer per
bucket), so the optimizer's weight copies and all-gathers move one contiguous range per
tile and every parameter sees them at once.

Note [weights written outside the optimizer]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Code other than the optimizer may write the weights in place between steps
(``model.load_state_dict``, an EMA swap, re-initialisation, user code under ``no_grad``,
through the parameter or through ``param.data``). At the next step the bucket reconciles
its fp32 master with the weights (``StateStore.reconcile_master`` in
``optim/state/store.py``): elements whose weight is no longer the training-dtype rounding of
the master take the weight, the others keep the master's extra precision. So a step starts
from what the model holds, and restoring a checkpoint gives the same bits whichever of
``model.load_state_dict`` and ``opt.load_state_dict`` runs first.

What was written is decided by *value*, not by version counter: a write through
``param.data`` (``p.data.copy_``, ``p.data.mul_``) moves no counter the optimizer can see
(``.data`` is a tensor with a counter of its own), and ``load_state_dict`` of the weights
the model already holds moves the counter without writing anything new. ``remember()``
takes a fingerprint of each parameter's slot after the optimizer's own writes landed
(ordered after them on the compute stream), and ``changed()`` / ``changed_params()``
compare a fresh fingerprint with it. The fingerprint (``slot_fingerprints`` in ``fingerprints.py``) is the xxh3-64 of
the slot's bytes where the weights are in host-addressable memory (the host accelerator,
pinned homes), and on a GPU a position-mixed 64-bit sum computed with integer ops on the
device (``device_fingerprints``: each element's bit pattern times an odd multiplier drawn
from its position, folded by an xor-shift, summed modulo 2**64; kept on the device until
the comparison, whose ``.tolist()`` is the one synchronisation point). Mixing in the
position makes a permutation of a parameter's elements (two weights swapped) change the
sum, which a plain sum of bit patterns would not; both hashes miss only collisions. The
device path works through ``DEVICE_CHUNK`` elements at a time, so its transient device
memory is three int64 vectors of that length (96 MiB) whatever the parameter's size. Under
parameter offload the fingerprints are of the pinned homes, the only copy between steps; a
write to a unit on the device reaches its home when the unit leaves (Note [a write to a
resident unit reaches its home] in ``params/slot_writes.py``). Cost: docs/optimizer.md.

Note [parameters replaced behind the optimizer]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``param.data = ...`` (``model.half()``, ``load_state_dict(assign=True)``, PEFT's
``merge_and_unload``, ``resize_token_embeddings``) detaches a parameter from its slot: the
optimizer would go on updating memory nobody reads. ``detached()`` compares each
parameter's data pointer, shape and dtype with its slot, and the next ``step()`` refuses
with the parameter's name before anything changes. The version counter alone cannot see it:
a fresh tensor may have the same version.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from ..memory.block import Block
from ..memory.pool import BlockPool
from ..memory.traffic import Category, Direction
from ..partition import BucketLayout
from ..weights.source import fill_bucket
from . import fingerprints
from .fingerprints import StreamedHashes, slot_fingerprints
from .in_flight import InFlight, Landing

if TYPE_CHECKING:
    from ..accelerator import Accelerator, Event
    from ..memory.manager import TieredMemoryManager

__all__ = ["ParamViews", "changed_params_of"]


#: Whether ``increment_version`` takes a list (torch >= 2.5): one C call per bucket.
_INCREMENTS_MANY = tuple(int(part) for part in torch.__version__.split(".")[:2]) >= (2, 5)


def moved_versions(versions: Sequence[int], flags: Sequence[bool]) -> tuple[int, ...]:
    """``versions`` as they are once a step moved the counters where ``flags`` (Note [a step
    moves the version counters])."""
    return tuple(v + 1 if flag else v for v, flag in zip(versions, flags, strict=True))


class ParamViews:
    """The bucket's parameters bound to slots of ``weights_dev``.

    Fields:
        weights_dev: (padded_numel,) training dtype, device pool; the params are views of it.
        block: the pool block under ``weights_dev`` (copies record their events on it).
        versions: each parameter's version when the optimizer last wrote or read it; None
            means unknown (compare as changed). See Note [weights written outside the
            optimizer].
        masters_from_weights: slot indices whose fp32 master the last loaded optimizer state
            lacked (taken from the weights then); weights written to them before the next
            step are theirs even when a resumed delayed update trusts the rest (Note
            [delayed parameter update] in ``optim/update/modes.py``).
        _stamp: ``(data_ptr, fingerprints)`` of ``bound_to()`` at ``remember()``, one
            fingerprint per slot (a list of ints, or an int64 device tensor); None until
            then or after ``forget()``.
        _streamed: the published tiles' fingerprints, streamed (Note [one cold hash per
            step]); None when none are being taken.
    """

    _stamp: tuple[int, list[int] | torch.Tensor] | None = None
    _streamed: StreamedHashes | None = None
    masters_from_weights: frozenset[int] = frozenset()
    #: Whether an update's weights reach ``weights_dev`` by a copy from the host (so a
    #: device shadow can take them early: Note [the delayed update lands in a shadow] in
    #: ``optim/shadow.py``); not where the host home is where they live between uses.
    weights_cross_the_link = True
    #: Set while a delayed update's weights cross the link unwaited (Note [weights landed at
    #: their first use] in views/in_flight.py): nothing can have written them.
    in_flight: InFlight | None = None

    def __init__(
        self, layout: BucketLayout, params: Sequence[torch.nn.Parameter], pool: BlockPool
    ) -> None:
        self.layout = layout
        self.params = list(params)
        self.dtype = self.params[0].dtype
        nbytes = layout.padded_numel * self.params[0].element_size()
        self.block: Block = pool.alloc(nbytes, owner=f"bucket{layout.index}.weights")
        self.block.on_move(self._bind)
        flat = self.block.view(self.dtype, (layout.padded_numel,))
        try:
            # Device, host or meta plus a checkpoint: Note [construction reads each weight
            # from its source] in weights/source.py.
            fill_bucket(layout, self.params, flat)
        except BaseException:
            self.block.free()
            raise
        self._bind(self.block)
        self.versions: tuple[int, ...] | None = None

    def _bind(self, block: Block) -> None:
        """(Re-)point every parameter at its slot of ``weights_dev`` (also after a move).

        Releases each parameter's previous storage (at construction: the original weights,
        so the model is never held twice; Note [construction holds one copy] in
        ``construction.py``)."""
        self.weights_dev = block.view(self.dtype, (self.layout.padded_numel,))
        for slot, param in zip(self.layout.slots, self.params, strict=True):
            param.data = self.weights_dev[slot.offset : slot.end].view(slot.shape)
        if self._stamp is not None:  # a move keeps the values: the fingerprints hold
            self._stamp = (self.weights_dev.data_ptr(), self._stamp[1])

    def unbind(self) -> None:
        """Give every parameter a private copy of its weights (before the pool goes away
        on a construction that failed, so the model keeps its values)."""
        for param in self.params:
            param.data = param.data.clone()

    def detached(self) -> list[tuple[int, torch.nn.Parameter]]:
        """``(slot_index, param)`` of parameters no longer bound to their slot; see Note
        [parameters replaced behind the optimizer]."""
        out = []
        bound = self.bound_to()
        # Where each slot's view starts, by arithmetic: slicing ``bound`` per parameter made
        # a tensor per parameter, on every step (a few µs each, a large share of step() for
        # a model of many small parameters). An empty slot is sliced: an empty view's
        # ``data_ptr()`` is 0, not its offset.
        base, size = bound.data_ptr(), bound.element_size()
        for i, (slot, param) in enumerate(zip(self.layout.slots, self.params, strict=True)):
            if slot.end > slot.offset:
                where = base + slot.offset * size
            else:
                where = bound[slot.offset : slot.end].data_ptr()
            if (
                param.dtype != self.dtype
                or tuple(param.shape) != slot.shape
                or param.data_ptr() != where
            ):
                out.append((i, param))
        return out

    def bound_to(self) -> torch.Tensor:
        """The flat tensor the parameters are views of now: ``weights_dev``."""
        return self.weights_dev

    def bound_start(self) -> int:
        """The bucket element ``bound_to()`` starts at: 0, the whole bucket."""
        return 0

    def current_versions(self) -> tuple[int, ...]:
        """Each parameter's version counter now."""
        return tuple(param._version for param in self.params)

    # Note [a step moves the version counters]
    # torch's step writes every parameter it updates in place, so each one's version
    # counter moves, and autograd refuses a backward that would read a value saved before
    # the step (a GAN stepping D, then G's loss backward through D's retained graph: "one
    # of the variables needed for gradient computation has been modified by an inplace
    # operation"). Ours write the flat buffer the parameters are views of (``.data`` was
    # set: each parameter keeps a counter of its own), or a home they are fetched from, and
    # moved none: that backward ran, on old activations and new weights, without a word. So
    # each parameter a step updates (a gradient reached it) gets its counter moved, one C
    # call per bucket (per parameter on torch < 2.5, which takes one tensor a call): in
    # ``step()`` once the update is applied or queued, and, for a step announced before
    # backward, when the bucket is handed to the host worker, while
    # backward goes on (a value of the weight still to be read after its gradient was
    # complete, through ``.detach()`` or a function that saves it but returns no gradient
    # for it, then raises there, as it would in torch, instead of reading the stepped
    # weight). The versions the write check keeps move with them (Note [weights written
    # outside the optimizer]): a counter moved by the step is not a write.
    def stepped(self, flags: Sequence[bool]) -> None:
        """The step updates the parameters where ``flags`` (one per slot) is set: move their
        version counters (Note [a step moves the version counters])."""
        moved = [param for param, flag in zip(self.params, flags, strict=True) if flag]
        if not moved:
            return
        if _INCREMENTS_MANY:
            torch.autograd.graph.increment_version(moved)
        else:
            for param in moved:
                torch.autograd.graph.increment_version(param)
        if self.versions is not None:
            self.versions = moved_versions(self.versions, flags)

    def _fingerprint(
        self, flat: torch.Tensor, streamed: StreamedHashes | None = None
    ) -> list[int] | torch.Tensor:
        """One fingerprint per slot of ``flat`` (``fingerprints.slot_fingerprints``)."""
        return slot_fingerprints(flat, self.layout.slots, streamed)

    def begin_published(self) -> None:
        """An update starts publishing tiles: stream their fingerprints where the weights
        are host-addressable (Note [one cold hash per step])."""
        flat = self.bound_to()
        self._streamed = (
            StreamedHashes(self.layout.slots) if fingerprints.host_addressable(flat) else None
        )

    def published_tile(self, lo: int, hi: int, values: torch.Tensor) -> None:
        """Elements ``[lo, hi)`` of the bucket receive ``values`` (host memory, what their
        copy reads): fold them into the streamed fingerprints."""
        streamed = self._streamed  # once: another thread may drop it meanwhile
        if streamed is not None:
            streamed.feed(lo, hi, values)

    def finish_published(self) -> None:
        """Every tile the update published was fed: ``remember()`` may use them."""
        streamed = self._streamed
        if streamed is not None:
            streamed.final = True

    def drop_published(self) -> None:
        """Something other than a fed tile reaches the weights: hash afresh."""
        self._streamed = None

    def _written_slots(self) -> list[int] | None:
        """Indices of the slots whose values differ from ``remember()``'s fingerprints; None
        when they cannot be compared (never taken, forgotten, or the parameters now view
        another tensor)."""
        written = self.device_written()
        if written is not None:
            # Synchronisation point (GPU): the comparison's result is read on the host
            # (``changed_params_of`` reads every bucket's at once).
            return torch.nonzero(written).flatten().tolist()
        stamped = self._stamped()
        if stamped is None:
            return None
        flat, before = stamped
        now = self._fingerprint(flat)
        return [i for i, (a, b) in enumerate(zip(now, before, strict=True)) if a != b]  # type: ignore[arg-type]

    def _stamped(self) -> tuple[torch.Tensor, list[int] | torch.Tensor] | None:
        """``(bound_to(), remember()'s fingerprints)`` when they can be compared: taken, not
        forgotten, and the parameters still view the tensor they were taken of."""
        if self._stamp is None or self.versions is None:
            return None
        flat = self.bound_to()
        ptr, before = self._stamp
        return None if flat.data_ptr() != ptr else (flat, before)

    def device_written(self) -> torch.Tensor | None:
        """``changed_params()`` as a comparison still on the device, one bool per slot, or
        None where the check is not one (host-addressable weights, nothing remembered): then
        ``changed_params()`` decides. Starts a new check like ``changed_params()``."""
        if self._unlanded():
            return None  # changed_params(): nothing written (Note [weights landed at their
            # first use])
        stamped = self._stamped()
        if stamped is None or not isinstance(stamped[1], torch.Tensor):
            return None
        self._streamed = None  # a new check (Note [one cold hash per step])
        now = self._fingerprint(stamped[0])
        return now != stamped[1] if isinstance(now, torch.Tensor) else None

    def _unlanded(self) -> bool:
        return self.in_flight is not None and self.in_flight.state is Landing.IN_FLIGHT

    def changed(self) -> bool:
        """Whether something wrote new values into a parameter since ``remember()``."""
        return bool(self.changed_params())

    def changed_params(self) -> list[torch.nn.Parameter]:
        """The parameters written since ``remember()`` (all of them when unknown), by value
        where it can be compared (Note [weights written outside the optimizer])."""
        if self._unlanded():
            return []  # Note [weights landed at their first use]: published, unread since
        self._streamed = None  # a new check: streamed hashes are stale (Note [one cold hash
        # per step])
        if self.versions is None:
            return list(self.params)
        written = self._written_slots()
        if written is not None:
            return [self.params[i] for i in written]
        now = self.current_versions()
        return [p for p, a, b in zip(self.params, now, self.versions, strict=True) if a != b]

    def remember(self) -> None:
        """Record the versions and the values after the optimizer's own writes or reads
        (issued on the compute stream after them)."""
        self.versions = self.current_versions()
        flat = self.bound_to()
        streamed, self._streamed = self._streamed, None
        if streamed is not None and not streamed.final:
            streamed = None
        self._stamp = (flat.data_ptr(), self._fingerprint(flat, streamed))

    def forget(self) -> None:
        """Treat the weights as written (reconcile at the next step)."""
        self.versions = None
        self._stamp = None
        self._streamed = None

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
        """Queue the copy of updated training-dtype weights ``source`` (pinned host) into
        ``weights_dev[lo:hi]``; its end event, or None when nothing had to move (the source
        is the weights' home, ``zero_offload.params.windowed_views.WindowedViews``)."""
        return manager.copy(
            self.weights_dev[lo:hi],
            source,
            direction=Direction.H2D,
            category=Category.WEIGHTS,
            after=after,
            # The end event on both ends: neither the device block nor the pinned source
            # is reused while the copy is pending.
            blocks=[self.block, source_block],
            label=label,
        )

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
        """Queue the copy of ``weights_dev[lo:hi]`` into pinned ``target`` (re-deriving the
        master); its end event, or None when ``target`` already holds the weights."""
        return manager.copy(
            target,
            self.weights_dev[lo:hi],
            direction=Direction.D2H,
            category=Category.OPTIMIZER_STATE,  # reads the weights to re-derive the master
            after=[manager.compute_ready()],
            blocks=[self.block, target_block],
            label=label,
        )

    def close(self) -> None:
        """Return ``weights_dev`` to its pool (the parameters keep pointing at it: only for
        an optimizer whose model is going away or was unbound)."""
        self.block.free()


def changed_params_of(
    all_views: Sequence[ParamViews], accelerator: Accelerator
) -> list[list[torch.nn.Parameter]]:
    """``changed_params()`` of each of ``all_views``, reading every device comparison on the
    host at once, through ``accelerator`` (Note [one fingerprint pass per bucket])."""
    masks = [views.device_written() for views in all_views]
    on_device = [mask for mask in masks if mask is not None]
    flags: list[bool] = []
    if on_device:
        # Synchronisation point (GPU): the one read of every bucket's comparison, counted
        # (Note [host syncs are counted where they can block] in accelerator/host_syncs.py).
        flags = accelerator.read_to_host(torch.cat(on_device)).tolist()
    out: list[list[torch.nn.Parameter]] = []
    at = 0
    for views, mask in zip(all_views, masks, strict=True):
        if mask is None:
            out.append(views.changed_params())
            continue
        written = flags[at : at + mask.numel()]
        at += mask.numel()
        out.append([p for p, flag in zip(views.params, written, strict=True) if flag])
    return out
