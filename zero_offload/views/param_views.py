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
compare a fresh fingerprint with it. The fingerprint (``_fingerprint``) is the xxh3-64 of
the slot's bytes where the weights are in host-addressable memory (the host accelerator,
pinned homes), and on a GPU a position-mixed 64-bit sum computed with integer ops on the
device (``_device_fingerprints``: each element's bit pattern times an odd multiplier drawn
from its position, folded by an xor-shift, summed modulo 2**64; kept on the device until
the comparison, whose ``.tolist()`` is the one synchronisation point). Mixing in the
position makes a permutation of a parameter's elements (two weights swapped) change the
sum, which a plain sum of bit patterns would not; both hashes miss only collisions. The
device path works through ``_DEVICE_CHUNK`` elements at a time, so its transient device
memory is three int64 vectors of that length (96 MiB) whatever the parameter's size. Under
parameter offload the fingerprints are of the pinned homes, the only copy between steps; a
write to a unit on the device reaches its home when the unit leaves (Note [a write to a
resident unit reaches its home] in ``params/unit.py``). Cost: docs/optimizer.md.

Note [one cold hash per step]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Hashing the weights twice per step (``changed()`` at the start, ``remember()`` after the
update landed) read every weight byte twice from memory, cold: 3.5 ms of CPU time per step
for 17M bf16 weights on the host accelerator. ``remember()`` needs the fingerprint of the bytes the
update published, and those bytes pass through the CPU's caches once already: CPU Adam
writes each tile into the pinned home, and that tile's H2D copy reads it. So where the
weights are host-addressable, ``WeightCopies`` feeds each tile to ``published_tile()`` as
its copy is issued, while the tile is still in cache, and each slot's xxh3 streams over its
tiles in order (xxh3 streamed over the pieces equals xxh3 of the whole, so the fingerprint is
the same number ``_fingerprint`` gives). ``remember()`` takes the streamed fingerprint of
every slot the tiles covered completely and hashes only the others (a slot crossing the
rank's shard, one the update did not touch), from ``bound_to()`` as before. Measured
(``benchmarks/bench_write_check.py``, docs/benchmarks.md): the weights are read cold once a
step instead of twice, but a default 2M-element tile has mostly left the cache by the time
it is hashed (CPU Adam streams 28-32 bytes per element through it), so the check's CPU time
fell by about 12% only; xxh3 itself is near memory speed, so one pass over the weights at
the step's start is the check's floor.

Streamed fingerprints are of the bytes copied, so they are used only where nothing else can
have written the weights between the tile and ``remember()``: ``begin_published()`` (the
update's ``prepare``) starts them, ``finish_published()`` (``publish()`` with every copy
issued from a fed tile) makes them usable, and anything else drops them: a tile published
later from the home (``mark_unpublished``, a delayed update), dropped copies, ``forget()``,
``changed()`` (a new step's check), or ``remember()`` itself (they are used once). What a
write between steps looks like is unchanged: ``changed()`` still hashes the weights as they
are at the step's start, so a write through ``param.data`` is seen as before.

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

import functools
from bisect import bisect_right
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import xxhash

from ..memory.block import Block
from ..memory.pool import BlockPool
from ..memory.traffic import Category, Direction
from ..partition import BucketLayout, ParamSlot
from ..weights.source import fill_bucket
from .in_flight import InFlight, Landing

if TYPE_CHECKING:
    from ..accelerator import Accelerator, Event
    from ..memory.manager import TieredMemoryManager

__all__ = ["ParamViews", "changed_params_of"]

#: The integer dtype of each element size, to read a weight's bit pattern.
_SAME_SIZE_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

#: Elements the device fingerprint mixes at a time (bounds its int64 temporaries).
_DEVICE_CHUNK = 1 << 22
#: Up to this many parameters in a chunk are summed one by one; more take the running sum
#: (Note [one fingerprint pass per bucket]).
_FEW_PIECES = 2
#: The odd 64-bit golden-ratio constant (2**64 / phi), as a signed int64, to spread positions.
_MIX = 0x9E3779B97F4A7C15 - (1 << 64)
_LOW32 = (1 << 32) - 1


def _host_addressable(flat: torch.Tensor) -> bool:
    """Whether ``flat``'s bytes can be hashed on the host without a copy."""
    return flat.device.type == "cpu"


def _mixed_terms(bits: torch.Tensor, first: int) -> torch.Tensor:
    """The position-mixed term of each element of ``bits`` (an integer view of weights whose
    first element sits at position ``first`` of the bucket), int64 on their device; the
    fingerprint of a range is the sum of its terms. Integer products and sums wrap modulo
    2**64, on the CPU and on CUDA alike."""
    size = bits.element_size()
    mixed = bits.to(torch.int64, copy=True)  # a copy even for 8-byte weights: mixed in place
    if size < 8:
        mixed.bitwise_and_((1 << (8 * size)) - 1)  # the bit pattern, not its sign extension
    # An odd multiplier per position: a bijection of the element's bits, different at
    # every position, so moving a value changes its term.
    factor = torch.arange(first, first + bits.numel(), dtype=torch.int64, device=bits.device)
    mixed.mul_(factor.mul_(_MIX).bitwise_or_(1))
    # Fold the high half into the low (a logical shift: the arithmetic one is masked), so
    # that the terms are not linear in the values (a linear sum cancels some swaps).
    mixed.bitwise_xor_(factor.copy_(mixed).bitwise_right_shift_(32).bitwise_and_(_LOW32))
    return mixed


# Note [one fingerprint pass per bucket]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# On a GPU the fingerprints were taken slot by slot: about 9 kernels per 4M-element chunk of
# every parameter, twice per step, so a bucket of 400 small parameters launched thousands
# of kernels (the H200 run: ~35 ms of a 90 ms step at 27M parameters). Now the terms of a
# whole chunk of the bucket are computed at once and summed by a running sum (``cumsum``,
# wrapping modulo 2**64 like the sums it replaces); each slot's piece of the chunk is the
# difference of the running sum at its two ends, and ``index_add_`` adds the pieces into
# the slots' fingerprints: a dozen kernels per chunk of the bucket, whatever its number of
# parameters, and the same numbers as the slot-by-slot sums. A chunk of one or two
# parameters (a large weight's) is summed directly, as before: the running sum would only
# add a pass over the chunk there. The gaps between slots (Note
# [slots are aligned] in partition.py) are mixed too but fall between the ends, so they
# count nowhere. The comparison is read on the host once per step for every bucket
# together (``changed_params_of``), not once per bucket.


@functools.lru_cache(maxsize=1024)
def _chunk_plan(
    ranges: tuple[tuple[int, int], ...], chunk: int, device: torch.device
) -> tuple[tuple[int, int, tuple[tuple[int, int, int], ...], torch.Tensor | None], ...]:
    """Per chunk of ``ranges``: ``(lo, hi, pieces, index)``, each piece ``(range, start,
    end)`` chunk-local, and ``index`` the pieces on ``device`` where the chunk takes the
    running sum (None where it sums them directly). A bucket's slots never change, so the
    index is copied to the device once, not at every check: a copy from pageable memory
    waits for the stream, which would be a synchronisation per chunk per check."""
    plan = []
    first, last = ranges[0][0], max(end for _, end in ranges)
    for lo in range(first, last, chunk):
        hi = min(last, lo + chunk)
        pieces = tuple(
            (i, max(start, lo) - lo, min(end, hi) - lo)
            for i, (start, end) in enumerate(ranges)
            if start < hi and end > lo
        )
        if pieces:
            index = None
            if len(pieces) > _FEW_PIECES:
                index = torch.tensor(pieces, dtype=torch.int64).to(device)
            plan.append((lo, hi, pieces, index))
    return tuple(plan)


def _device_fingerprints(flat: torch.Tensor, ranges: list[tuple[int, int]]) -> torch.Tensor:
    """One position-mixed int64 fingerprint per ``(start, end)`` range of ``flat`` (sorted,
    not overlapping), as an int64 tensor on ``flat``'s device; see Note [weights written
    outside the optimizer] and Note [one fingerprint pass per bucket]."""
    ints = flat.detach().view(_SAME_SIZE_INT[flat.element_size()])
    device = flat.device
    out = torch.zeros(len(ranges), dtype=torch.int64, device=device)
    if not ranges:
        return out
    for lo, hi, pieces, index in _chunk_plan(tuple(ranges), _DEVICE_CHUNK, device):
        if index is None:  # a large parameter's chunk: sum it directly
            for i, a, b in pieces:
                out[i : i + 1].add_(_mixed_terms(ints[lo + a : lo + b], lo + a).sum())
            continue
        running = torch.zeros(hi - lo + 1, dtype=torch.int64, device=device)
        torch.cumsum(_mixed_terms(ints[lo:hi], lo), 0, out=running[1:])
        sums = running.index_select(0, index[:, 2]).sub_(running.index_select(0, index[:, 1]))
        out.index_add_(0, index[:, 0], sums)
    return out


class _StreamedHashes:
    """Each slot's xxh3, streamed over the tiles the update publishes, in order; see Note
    [one cold hash per step].

    Fields:
        hashers: slot index -> (next element expected, xxh3 state so far).
        broken: slots fed out of order (hashed afresh at ``remember()``).
        final: every tile published was fed (``finish_published()``).
    """

    def __init__(self, slots: Sequence[ParamSlot]) -> None:
        self.slots = slots
        self.order = sorted(range(len(slots)), key=lambda i: slots[i].offset)
        self.starts = [slots[i].offset for i in self.order]
        self.hashers: dict[int, tuple[int, xxhash.xxh3_64]] = {}
        self.broken: set[int] = set()
        self.final = False

    def feed(self, lo: int, hi: int, values: torch.Tensor) -> None:
        """Elements ``[lo, hi)`` of the bucket now hold ``values`` (host memory)."""
        raw = values.detach().view(torch.uint8).numpy()
        size = values.element_size()
        k = max(bisect_right(self.starts, lo) - 1, 0)
        while k < len(self.order) and self.starts[k] < hi:
            i = self.order[k]
            k += 1
            slot = self.slots[i]
            a, b = max(lo, slot.offset), min(hi, slot.end)
            if a >= b or i in self.broken:
                continue
            at, hasher = self.hashers.get(i, (slot.offset, None))
            if at != a:  # a gap or a repeat: not the bytes in order
                self.broken.add(i)
                self.hashers.pop(i, None)
                continue
            if hasher is None:
                hasher = xxhash.xxh3_64()
            hasher.update(raw[(a - lo) * size : (b - lo) * size])
            self.hashers[i] = (b, hasher)

    def digest(self, i: int) -> int | None:
        """Slot ``i``'s fingerprint when every byte of it was fed, in order; else None."""
        entry = self.hashers.get(i)
        if entry is None or entry[0] != self.slots[i].end:
            return None
        return entry[1].intdigest()


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
    _streamed: _StreamedHashes | None = None
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

    def _fingerprint(
        self, flat: torch.Tensor, streamed: _StreamedHashes | None = None
    ) -> list[int] | torch.Tensor:
        """One fingerprint per slot of ``flat``; see Note [weights written outside the
        optimizer]. ``streamed``: the slots it covers take its fingerprints (Note [one cold
        hash per step])."""
        slots = self.layout.slots
        if _host_addressable(flat):
            raw = flat.detach().view(torch.uint8).numpy()
            size = flat.element_size()
            out = []
            for i, s in enumerate(slots):
                known = None if streamed is None else streamed.digest(i)
                if known is None:
                    known = xxhash.xxh3_64_intdigest(raw[s.offset * size : s.end * size])
                out.append(known)
            return out
        return _device_fingerprints(flat, [(s.offset, s.end) for s in slots])

    def begin_published(self) -> None:
        """An update starts publishing tiles: stream their fingerprints where the weights
        are host-addressable (Note [one cold hash per step])."""
        flat = self.bound_to()
        self._streamed = _StreamedHashes(self.layout.slots) if _host_addressable(flat) else None

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
