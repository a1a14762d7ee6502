"""Which aligned host buffer carries a record to or from the disk, and what it is doing now.

An ``IOBuffer`` is one aligned slice of host memory with the event of the I/O that keeps it
busy, and a lifecycle (``IOBufferState``) checked at every transition. The NVMe tier holds a
small ring of them (``StorageTier.buffers`` in ``storage.py``); the parameter homes on NVMe
carve their own (``weights/nvme_home.py``).
"""

from __future__ import annotations

import enum

import torch

from .io_engine import IOEvent, RecordFile

__all__ = ["IO_BUFFERS", "IOBuffer", "IOBufferState"]

#: I/O buffers per tier: two reads in flight ahead of the tile computed on, that tile, and
#: the previous tile being written (Note [the step streams the state] in optim/state/nvme.py).
IO_BUFFERS = 4


class IOBufferState(enum.Enum):
    """An I/O buffer's lifecycle; what each state means for its bytes."""

    #: Idle: no I/O touches it; its bytes are garbage. May be handed out.
    FREE = "free"
    #: A read into it is pending (its ``event``): the bytes are not valid yet.
    READING = "reading"
    #: Holds a verified record; its owner reads and writes it on the CPU.
    HELD = "held"
    #: A write from it is pending (its ``event``): it must not change until that completes.
    WRITING = "writing"


class IOBuffer:
    """One aligned host buffer of ``nbytes`` (a multiple of ``IO_ALIGNMENT``), with the
    event of the I/O that keeps it busy; see ``IOBufferState``.

    Fields: ``data``: ``(nbytes,)`` uint8, host, pinned where available, 4 KiB-aligned
    address. ``event``: the pending (or last) read or write touching ``data``.
    """

    def __init__(self, index: int, data: torch.Tensor) -> None:
        self.index = index
        self.data = data
        self.state = IOBufferState.FREE
        self.event: IOEvent | None = None
        # (file, record) of the I/O it carries or last carried; None when FREE.
        self.tag: tuple[RecordFile, int] | None = None

    def settle(self) -> None:
        """Wait for the pending I/O (raising its error) and become FREE.

        Synchronisation point: the caller blocks until the disk is done with the buffer;
        Note [the step streams the state] in ``optim/state/nvme.py`` keeps this off the critical
        path in steady state."""
        event, self.event = self.event, None
        busy = self.state in (IOBufferState.READING, IOBufferState.WRITING)
        try:
            if busy and event is not None:
                event.synchronize()
        finally:
            self.state = IOBufferState.FREE
            self.tag = None

    def transition(self, old: IOBufferState, new: IOBufferState) -> None:
        """Move ``old -> new``; any other current state is a bug."""
        if self.state is not old:
            raise RuntimeError(
                f"I/O buffer {self.index} is {self.state.value}, expected {old.value} before "
                f"becoming {new.value} (bug)"
            )
        self.state = new
