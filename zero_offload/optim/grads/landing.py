"""A gradient's way into host memory in tiles, and what follows each tile as it lands.

Note [Adam follows the gradient in]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A flush copies its gradient into staging in tiles of ``tile_elements``, one copy and one
end event each (a ``Landing``), and the host worker's pass (statistics, or accumulation
with statistics) follows tile by tile as each lands (``Landing.follow``), so it ends one
tile after the copy does. A window summed on the device lands in the host accumulator the
same way (Note [micro-batches add up on the device] in ``device_acc.py``). When the step's
decision needs no statistics (Note [a step that needs no statistics] in
``update/policy.py``), ``step()`` does not wait for the host worker at all: the CPU Adam
tile loop waits for the copy of each tile just before it reads it (``await_grad`` in
``to_host.py``, ``Landing.covering``), so CPU Adam starts on the first tile while the rest
is still on the way. Events of one stream complete in order, so a tile's event covers
every tile before it. A gradient the host worker accumulated waits for its last pass over
the bucket instead, which follows every tile of the window's last flush.
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Callable, Iterator, Sequence

import torch

from ...accelerator import Event
from ...memory.block import Block
from ...memory.host_worker import HostWorker
from ...memory.manager import TieredMemoryManager
from ...memory.traffic import Category, Direction

__all__ = ["Landing"]


class Landing(Sequence[tuple[int, Event]]):
    """The tile copies of one transfer into host memory, in order: ``(end offset, end
    event)`` of each. Empty before any."""

    def __init__(self, tiles: list[tuple[int, Event]] | None = None) -> None:
        self._tiles = tiles or []
        self._ends = [end for end, _ in self._tiles]  # for bisect

    @classmethod
    def queue(
        cls,
        manager: TieredMemoryManager,
        src: torch.Tensor,
        dst: torch.Tensor,
        *,
        tile_elements: int,
        label: str,
        after: Sequence[Event],
        blocks: Sequence[Block],
    ) -> Landing:
        """Queue ``dst[:n] = src`` (device to host) in tiles of ``tile_elements``. The first
        copy waits for ``after``; the last one's end (every copy's end: the stream is in
        order) is recorded on ``blocks``, also when queueing fails half-way."""
        tiles: list[tuple[int, Event]] = []
        n = src.numel()
        try:
            for lo in range(0, n, tile_elements):
                hi = min(lo + tile_elements, n)
                event = manager.copy(
                    dst[lo:hi],
                    src[lo:hi],
                    direction=Direction.D2H,
                    category=Category.GRADIENTS,
                    after=after if lo == 0 else (),
                    blocks=blocks if hi == n else (),
                    label=label if n <= tile_elements else f"{label}[{lo}:{hi}]",
                )
                tiles.append((hi, event))
        except BaseException:
            for block in blocks if tiles else ():  # what was queued still uses them
                block.record_event(tiles[-1][1])
            raise
        return cls(tiles)

    def __len__(self) -> int:
        return len(self._tiles)

    def __getitem__(self, index: int) -> tuple[int, Event]:  # type: ignore[override]
        return self._tiles[index]

    def __iter__(self) -> Iterator[tuple[int, Event]]:
        return iter(self._tiles)

    @property
    def last(self) -> Event:
        """The end of the last copy (of every copy)."""
        return self._tiles[-1][1]

    def covering(self, hi: int) -> Event:
        """The end of the first copy ending at or past ``hi`` (the last one past the copied
        part): once it completed, ``dst[:hi]`` has landed."""
        ends = self._ends
        return self._tiles[min(bisect.bisect_left(ends, hi), len(ends) - 1)][1]

    def landed_through(self, lo: int, limit: int) -> int:
        """How far past ``lo`` (up to ``limit``) the copies have landed now, without waiting:
        the end of the last tile whose copy is done, in order (``lo`` when the tile holding
        ``lo`` is still on its way)."""
        end = lo
        tiles = self._tiles
        k = bisect.bisect_right(self._ends, lo)
        while k < len(tiles) and end < limit:
            tile_end, event = tiles[k]
            if not event.query():
                break
            end = tile_end
            k += 1
        return min(end, limit) if end > lo else lo

    def follow(self, worker: HostWorker, real: int, task: Callable[[int, int], None]) -> None:
        """Queue ``task(lo, hi)`` on the host worker behind each tile's copy, over the
        first ``real`` elements (a tile of padding only has nothing to pass over)."""
        lo = 0
        for hi, event in self._tiles:
            worker.wait_event(event)
            if min(hi, real) > lo:
                worker.submit(functools.partial(task, lo, min(hi, real)))
            lo = hi
