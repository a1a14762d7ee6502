"""Fingerprints of a bucket's weights, to see writes made outside the optimizer (Note
[weights written outside the optimizer] in ``param_views.py``): xxh3-64 of each slot's bytes
where they are host-addressable, streamed over the update's tiles where it can be; on a GPU
a position-mixed 64-bit sum per slot, computed on the device for a whole bucket at a time.
Pure functions of the weights, and the streaming hasher.

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
"""

from __future__ import annotations

import functools
from bisect import bisect_right
from collections.abc import Sequence

import torch
import xxhash

from ..partition import ParamSlot

__all__ = [
    "DEVICE_CHUNK",
    "SAME_SIZE_INT",
    "StreamedHashes",
    "device_fingerprints",
    "host_addressable",
    "mixed_terms",
    "slot_fingerprints",
]

#: The integer dtype of each element size, to read a weight's bit pattern.
SAME_SIZE_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

#: Elements the device fingerprint mixes at a time (bounds its int64 temporaries).
DEVICE_CHUNK = 1 << 22
#: Up to this many parameters in a chunk are summed one by one; more take the running sum
#: (Note [one fingerprint pass per bucket]).
_FEW_PIECES = 2
#: The odd 64-bit golden-ratio constant (2**64 / phi), as a signed int64, to spread positions.
_MIX = 0x9E3779B97F4A7C15 - (1 << 64)
_LOW32 = (1 << 32) - 1


def host_addressable(flat: torch.Tensor) -> bool:
    """Whether ``flat``'s bytes can be hashed on the host without a copy."""
    return flat.device.type == "cpu"


def mixed_terms(bits: torch.Tensor, first: int) -> torch.Tensor:
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


def device_fingerprints(flat: torch.Tensor, ranges: list[tuple[int, int]]) -> torch.Tensor:
    """One position-mixed int64 fingerprint per ``(start, end)`` range of ``flat`` (sorted,
    not overlapping), as an int64 tensor on ``flat``'s device; see Note [weights written
    outside the optimizer] and Note [one fingerprint pass per bucket]."""
    ints = flat.detach().view(SAME_SIZE_INT[flat.element_size()])
    device = flat.device
    out = torch.zeros(len(ranges), dtype=torch.int64, device=device)
    if not ranges:
        return out
    for lo, hi, pieces, index in _chunk_plan(tuple(ranges), DEVICE_CHUNK, device):
        if index is None:  # a large parameter's chunk: sum it directly
            for i, a, b in pieces:
                out[i : i + 1].add_(mixed_terms(ints[lo + a : lo + b], lo + a).sum())
            continue
        running = torch.zeros(hi - lo + 1, dtype=torch.int64, device=device)
        torch.cumsum(mixed_terms(ints[lo:hi], lo), 0, out=running[1:])
        sums = running.index_select(0, index[:, 2]).sub_(running.index_select(0, index[:, 1]))
        out.index_add_(0, index[:, 0], sums)
    return out


class StreamedHashes:
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


def slot_fingerprints(
    flat: torch.Tensor, slots: Sequence[ParamSlot], streamed: StreamedHashes | None = None
) -> list[int] | torch.Tensor:
    """One fingerprint per slot of ``flat``: the xxh3-64 of its bytes where they are
    host-addressable (a list), else the device's position-mixed sums (an int64 tensor on
    ``flat``'s device; Note [weights written outside the optimizer] in ``param_views.py``).
    ``streamed``: the slots it covers take its fingerprints (Note [one cold hash per step])."""
    if host_addressable(flat):
        raw = flat.detach().view(torch.uint8).numpy()
        size = flat.element_size()
        out = []
        for i, s in enumerate(slots):
            known = None if streamed is None else streamed.digest(i)
            if known is None:
                known = xxhash.xxh3_64_intdigest(raw[s.offset * size : s.end * size])
            out.append(known)
        return out
    return device_fingerprints(flat, [(s.offset, s.end) for s in slots])
