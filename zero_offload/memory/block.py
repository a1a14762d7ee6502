"""``Block``: a handle on a range of a ``BlockPool``'s buffer, and its lifecycle state.

A block is a handle, not a tensor: the pool may move its bytes (``BlockPool.defragment``),
so owners take views through ``Block.view`` and re-take them in an ``on_move`` callback.
See Note [views pin unregistered blocks] in ``pool.py`` and Note [block reuse waits on
events] in ``pending_blocks.py``.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from typing import Protocol

import torch

from ..accelerator import Event

__all__ = ["Block", "BlockOwner", "BlockState", "MoveCallback", "view_shape"]

#: Called as ``callback(block)`` after ``block`` moved; the owner re-takes its views there.
MoveCallback = Callable[["Block"], None]


class BlockOwner(Protocol):
    """What a block asks of the pool that made it (``BlockPool`` in ``pool.py`` is the one
    implementation; the protocol keeps this module below it)."""

    name: str

    def free(self, block: Block) -> None: ...

    def _view(
        self, block: Block, dtype: torch.dtype, shape: tuple[int, ...] | None
    ) -> torch.Tensor: ...

    def _register_callback(self, block: Block, callback: MoveCallback) -> None: ...

    def _record_event(self, block: Block, event: Event) -> None: ...


class BlockState(enum.Enum):
    """What a block handle means for the pool's memory.

    Transitions (checked in ``BlockPool``): ``IN_USE -> FREE`` when freed with no pending
    copy; ``IN_USE -> IN_FLIGHT -> FREE`` when freed while a recorded event is pending.
    """

    #: The bytes belong to the owner; its views are valid. Defragmentation may move the bytes
    #: (and then calls the owner's ``on_move`` callbacks) unless the block is pinned in place.
    IN_USE = "in_use"
    #: The owner freed the block but a copy recorded on it may still read or write the
    #: bytes: they are not reusable until its events complete. The handle is dead to the owner.
    IN_FLIGHT = "in_flight"
    #: The bytes are back on the pool's free list and may belong to another block now. The
    #: handle is dead; its views must not be used.
    FREE = "free"


class Block:
    """``nbytes`` of a pool's buffer at ``offset``; create with ``BlockPool.alloc``.

    Attributes (all guarded by the pool's lock, read-only to owners):
        offset: start of the block in the pool's buffer, bytes; a multiple of ``align``.
        size: bytes reserved, ``nbytes`` rounded up to the pool's alignment.
        nbytes: bytes requested; views may cover at most this many.
        align: alignment of ``offset`` in bytes (a power of two).
        owner: free-form label for error messages and ``BlockPool.live_blocks``.
        state: a ``BlockState``.
    """

    __slots__ = (
        "_callbacks",
        "_events",
        "_pinned_in_place",
        "align",
        "nbytes",
        "offset",
        "owner",
        "pool",
        "size",
        "state",
    )

    def __init__(
        self, pool: BlockOwner, offset: int, size: int, nbytes: int, align: int, owner: str
    ) -> None:
        self.pool = pool
        self.offset = offset
        self.size = size
        self.nbytes = nbytes
        self.align = align
        self.owner = owner
        self.state = BlockState.IN_USE
        self._events: list[Event] = []  # copies touching the bytes, see the pool's Note
        self._callbacks: list[MoveCallback] = []
        # A view was handed out with no callback to re-point it: never move this block.
        # See Note [views pin unregistered blocks] in pool.py.
        self._pinned_in_place = False

    def __repr__(self) -> str:
        return (
            f"Block(pool={self.pool.name!r}, offset={self.offset}, size={self.size}, "
            f"nbytes={self.nbytes}, owner={self.owner!r}, state={self.state.name})"
        )

    @property
    def end(self) -> int:
        """One past the last reserved byte (``offset + size``)."""
        return self.offset + self.size

    @property
    def pinned_in_place(self) -> bool:
        """Whether defragmentation leaves this block where it is (a view has no callback)."""
        return self._pinned_in_place

    def view(self, dtype: torch.dtype, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        """A ``dtype`` tensor of ``shape`` over the block's first bytes (1-D over all when None).

        The view aliases the pool's buffer. If no ``on_move`` callback is registered yet,
        the block becomes pinned in place for good (Note [views pin unregistered blocks]).
        """
        return self.pool._view(self, dtype, shape)

    def on_move(self, callback: MoveCallback) -> None:
        """Register ``callback(block)``, called after defragmentation moved this block."""
        if not callable(callback):
            raise TypeError(f"on_move callback must be callable, got {callback!r}")
        self.pool._register_callback(self, callback)

    def record_event(self, event: Event) -> None:
        """Record a pending copy touching this block; reuse waits for it.

        See Note [block reuse waits on events] in pending_blocks.py.
        """
        self.pool._record_event(self, event)

    def free(self) -> None:
        """Same as ``self.pool.free(self)``."""
        self.pool.free(self)

    # -- the pool's side: called by the pool (and its compaction and in-flight set) with its
    # lock held. Owners use view, on_move, record_event and free above.

    @property
    def events(self) -> tuple[Event, ...]:
        """The copies recorded on the block that may still touch its bytes."""
        return tuple(self._events)

    def keep_events(self, keep: Callable[[list[Event]], list[Event]]) -> bool:
        """Keep only ``keep(events)`` (those still pending, as a rule); whether any remain."""
        if self._events:
            self._events = keep(self._events)
        return bool(self._events)

    def add_event(self, event: Event, keep: Callable[[list[Event]], list[Event]]) -> None:
        """Record ``event``, keeping only ``keep(events)`` of those recorded before."""
        self._events = [*keep(self._events), event]

    def inherit_events(self, other: Block) -> None:
        """Take ``other``'s events: these bytes were ``other``'s, and reuse waits for its
        copies (Note [block reuse waits on events] in pending_blocks.py)."""
        self._events = list(other._events)

    @property
    def move_callbacks(self) -> tuple[MoveCallback, ...]:
        """The owner's ``on_move`` callbacks, in registration order."""
        return tuple(self._callbacks)

    def add_move_callback(self, callback: MoveCallback) -> None:
        """Register an ``on_move`` callback (checked by the pool)."""
        self._callbacks.append(callback)

    def drop_move_callbacks(self) -> None:
        """Forget the owner's callbacks (the block was freed: nobody re-points views)."""
        self._callbacks.clear()

    def pin_in_place(self) -> None:
        """A view was handed out with no callback: the block never moves again (Note
        [views pin unregistered blocks] in pool.py)."""
        self._pinned_in_place = True


def view_shape(
    block: Block, dtype: torch.dtype, shape: tuple[int, ...] | None
) -> tuple[tuple[int, ...], int]:
    """The shape and element count of a ``dtype`` view of ``block``, checked against its
    bytes: the whole block as 1-D when ``shape`` is None."""
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, got {dtype!r}")
    itemsize = dtype.itemsize
    if shape is None:
        numel = block.nbytes // itemsize
        return (numel,), numel
    shape = tuple(shape)
    if any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in shape):
        raise ValueError(f"shape must be a tuple of ints >= 0, got {shape!r}")
    numel = math.prod(shape)
    if numel * itemsize > block.nbytes:
        raise ValueError(
            f"a {dtype} view of shape {shape} needs {numel * itemsize} bytes but {block!r} "
            f"holds {block.nbytes}; allocate a larger block"
        )
    return shape, numel
