"""The free ranges of one ``BlockPool``: best fit by size, coalescing by address.

``FreeList`` is pure bookkeeping over byte offsets; it touches no memory and takes no lock
(the pool's lock guards it, see ``BlockPool``). Two indexes describe the same ranges:

- by size: a ``SortedInts`` of keys ``size << OFFSET_BITS | offset``, so the smallest key
  ``>= size << OFFSET_BITS`` is the best fit, ties broken by the lowest address (which keeps
  live data toward the start of the pool and the large free range at its end);
- by address: ``_size_at_start`` (start -> size) and ``_start_at_end`` (end -> start), so
  the neighbours of a freed range are found in O(1) and merged with it.

Every range in the list is maximal: no two free ranges touch (they are merged on insert).
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Iterator

__all__ = ["OFFSET_BITS", "FreeList", "SortedInts", "check_align", "check_pool_args"]

#: Offsets and sizes must stay below 2**OFFSET_BITS bytes (256 TiB) to share one sort key.
OFFSET_BITS = 48
_OFFSET_MASK = (1 << OFFSET_BITS) - 1


class SortedInts:
    """A sorted multiset-free collection of ints, split into buckets of bounded length.

    Cost: every operation bisects the list of bucket maxima and then one bucket, so it makes
    O(log n) comparisons; the element shifts of an insert or delete are bounded by the
    bucket length (at most ``2 * load``, a constant), plus an O(n / load) shift of the maxima
    list when a bucket splits or empties (rare). A plain sorted list would shift O(n) elements
    on every insert.
    """

    def __init__(self, *, load: int = 256) -> None:
        self._load = load
        self._buckets: list[list[int]] = []
        self._maxes: list[int] = []  # _maxes[i] == _buckets[i][-1]
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[int]:
        for bucket in self._buckets:
            yield from bucket

    def add(self, key: int) -> None:
        """Insert ``key`` (not already present)."""
        self._len += 1
        if not self._maxes:
            self._buckets.append([key])
            self._maxes.append(key)
            return
        i = bisect_left(self._maxes, key)
        if i == len(self._maxes):
            i -= 1
            self._buckets[i].append(key)
            self._maxes[i] = key
        else:
            insort(self._buckets[i], key)
        bucket = self._buckets[i]
        if len(bucket) > 2 * self._load:
            half = len(bucket) // 2
            self._buckets[i : i + 1] = [bucket[:half], bucket[half:]]
            self._maxes.insert(i, bucket[half - 1])

    def remove(self, key: int) -> None:
        """Delete ``key``; ``KeyError`` if it is absent."""
        i = bisect_left(self._maxes, key)
        bucket = self._buckets[i] if i < len(self._maxes) else []
        j = bisect_left(bucket, key)
        if j == len(bucket) or bucket[j] != key:
            raise KeyError(key)
        del bucket[j]
        self._len -= 1
        if not bucket:
            del self._buckets[i]
            del self._maxes[i]
        elif j == len(bucket):
            self._maxes[i] = bucket[-1]

    def ceiling(self, key: int) -> int | None:
        """The smallest element ``>= key``, or ``None``."""
        i = bisect_left(self._maxes, key)
        if i == len(self._maxes):
            return None
        bucket = self._buckets[i]
        return bucket[bisect_left(bucket, key)]

    def max(self) -> int | None:
        """The largest element, or ``None`` when empty."""
        return self._maxes[-1] if self._maxes else None

    def clear(self) -> None:
        """Remove every element."""
        self._buckets.clear()
        self._maxes.clear()
        self._len = 0


class FreeList:
    """Free byte ranges of a pool; see the module docstring. Sizes and offsets in bytes."""

    def __init__(self) -> None:
        self._by_size = SortedInts()
        self._size_at_start: dict[int, int] = {}  # start offset -> size of the free range
        self._start_at_end: dict[int, int] = {}  # end offset (exclusive) -> start offset
        self.free_bytes = 0  # sum of the sizes of all free ranges

    def __len__(self) -> int:
        return len(self._size_at_start)

    def ranges(self) -> list[tuple[int, int]]:
        """Every free range as ``(offset, size)``, in address order."""
        return sorted(self._size_at_start.items())

    def largest(self) -> int:
        """Size of the largest free range in bytes (0 when none is free)."""
        key = self._by_size.max()
        return 0 if key is None else key >> OFFSET_BITS

    def clear(self) -> None:
        """Forget every range (the caller re-inserts the ones that stay free)."""
        self._by_size.clear()
        self._size_at_start.clear()
        self._start_at_end.clear()
        self.free_bytes = 0

    def insert(self, offset: int, size: int) -> None:
        """Return ``[offset, offset + size)`` to the list, merged with free neighbours."""
        end = offset + size
        before = self._start_at_end.get(offset)
        if before is not None:
            self._remove(before, offset - before)
            offset = before
        after = self._size_at_start.get(end)
        if after is not None:
            self._remove(end, after)
            end += after
        self._add(offset, end - offset)

    def take(self, size: int, align: int, base_align: int) -> int | None:
        """Remove a best-fit range for ``size`` bytes at an ``align``-aligned offset.

        Every free offset is a multiple of ``base_align``, so at most ``align - base_align``
        bytes of padding precede an aligned start: if the best fit for ``size`` cannot take
        the padding, the best fit for ``size + align - base_align`` always can. Returns the
        aligned offset (the padding and the tail go back to the list) or ``None``.
        """
        found = self._fit(size, size, align)
        if found is None and align > base_align:
            found = self._fit(size + align - base_align, size, align)
        if found is None:
            return None
        start, length, aligned = found
        self._remove(start, length)
        if aligned > start:
            self._add(start, aligned - start)
        end = start + length
        if aligned + size < end:
            self._add(aligned + size, end - aligned - size)
        return aligned

    def _fit(self, search: int, size: int, align: int) -> tuple[int, int, int] | None:
        # The best-fit range of at least ``search`` bytes, if ``size`` fits in it aligned.
        key = self._by_size.ceiling(search << OFFSET_BITS)
        if key is None:
            return None
        start, length = key & _OFFSET_MASK, key >> OFFSET_BITS
        aligned = start if start % align == 0 else start - start % align + align
        if aligned + size > start + length:
            return None
        return start, length, aligned

    def _add(self, offset: int, size: int) -> None:
        self._by_size.add(size << OFFSET_BITS | offset)
        self._size_at_start[offset] = size
        self._start_at_end[offset + size] = offset
        self.free_bytes += size

    def _remove(self, offset: int, size: int) -> None:
        self._by_size.remove(size << OFFSET_BITS | offset)
        del self._size_at_start[offset]
        del self._start_at_end[offset + size]
        self.free_bytes -= size


def check_align(value: int, name: str) -> int:
    """``value``, checked to be an int power of two (an alignment in bytes)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int power of two, got {type(value).__name__} {value!r}")
    if value <= 0 or value & (value - 1):
        raise ValueError(f"{name} must be a power of two (1, 2, ..., 512, ...), got {value}")
    return value


def check_pool_args(capacity_bytes: int, alignment: int) -> tuple[int, int]:
    """A pool's size and alignment, checked: the alignment a power of two, the size at
    least one alignment and addressable by the free list's packed offsets."""
    alignment = check_align(alignment, "alignment")
    if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int):
        raise TypeError(
            f"capacity_bytes must be an int, got {type(capacity_bytes).__name__} {capacity_bytes!r}"
        )
    if capacity_bytes < alignment or capacity_bytes >= 1 << OFFSET_BITS:
        raise ValueError(
            f"capacity_bytes must be at least the alignment ({alignment}) and below "
            f"2**{OFFSET_BITS}, got {capacity_bytes}"
        )
    return capacity_bytes, alignment
