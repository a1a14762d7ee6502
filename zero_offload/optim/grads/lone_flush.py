"""A window's lone flush, kept in staging (``LoneFlush``, one per ``HostGradients`` in
``to_host.py``): which stream takes its statistics, which copies bring each staging
buffer's in, and whether the update that reads it last is recorded.

With one flush in a window the step reads the gradient where it landed (Note [no
accumulator for one backward] in ``to_host.py``). With ``overlap_step`` its statistics are
taken on the device, on the compute stream with one rank or on the comm stream behind the
reduce-scatter with several (``ShardNorms``), and nothing follows the copies on the host
worker (Note [a lone window's statistics are taken on the device] in ``lone_stats.py``); a
delayed update follows its own window's copies, not the next window's (Note [the delayed
update reads one buffer, the next backward fills the other] in ``staging.py``).
"""

from __future__ import annotations

import torch

from ...accelerator import Event, Stream
from ...memory.block import Block
from ...memory.host_worker import HostWorker
from ...memory.manager import TieredMemoryManager
from ...partition import BucketLayout
from .landing import Landing
from .lone_stats import ShardNorms, piece_norms
from .staging import Staging

__all__ = ["LoneFlush"]


class LoneFlush:
    """One bucket's lone flushes; see the module docstring.

    Fields:
        delayed_update: overlap_step (``HostGradients.delayed_update``): the lone flush's
            statistics are taken on the device, and its reader is the delayed update.
        staged: the landing of the lone flush each staging buffer holds, by buffer.
        reader_unrecorded: delayed_update: a lone flush stayed in staging and the end of its
            window has not yet recorded the update that reads it (``record_reader``).
        shard_norms: a lone flush's norms with several ranks, on the comm stream.
    """

    def __init__(
        self,
        manager: TieredMemoryManager,
        layout: BucketLayout,
        shard: tuple[int, int],
        *,
        delayed_update: bool,
    ) -> None:
        self.manager = manager
        self.layout = layout
        self.shard = shard
        self.delayed_update = delayed_update
        self.staged: dict[int, Landing] = {}
        self.reader_unrecorded = False
        self.shard_norms = ShardNorms(manager, layout, shard)

    def norms(
        self,
        src: torch.Tensor,
        *,
        lone: bool,
        scattered_on: Stream | None = None,
        block: Block | None = None,
    ) -> tuple[torch.Tensor, Event | None] | None:
        """A lone flush's statistics on the device and the event after which they are
        there: on the compute stream (None: in order), or, where ``src`` was
        reduce-scattered on the stream ``scattered_on``, on that stream behind it (compute
        would wait for it), ``block`` (under ``src``) reused after them. None leaves them to
        the host pass (``lone`` false: the flush is not a window's lone one): Note [a lone
        window's statistics are taken on the device] (``lone_stats.py``)."""
        if not self.delayed_update or not lone:
            return None
        if scattered_on is None:
            norms = piece_norms(self.manager, self.layout, self.shard, src)
            return None if norms is None else (norms, None)
        if block is None:
            raise RuntimeError(f"bucket {self.layout.index}: a scattered flush's block (bug)")
        return self.shard_norms.take(src, stream=scattered_on, block=block)

    def stage(self, buffer: int, landing: Landing) -> None:
        """The window's lone flush stays in staging ``buffer``, brought in by ``landing``."""
        self.staged[buffer] = landing
        self.reader_unrecorded = self.delayed_update

    def landing(self, buffer: int) -> Landing | None:
        """The copies that brought in the lone flush ``buffer`` holds (None: none)."""
        return self.staged.get(buffer)

    def order_fold(self, worker: HostWorker, buffer: int) -> None:
        """The fold of ``buffer``'s lone flush reads it on ``worker``, where no pass
        followed its copies (its statistics were taken on the device): the worker waits for
        the last copy first."""
        worker.wait_event(self.staged[buffer].last)

    def record_reader(self, staging: Staging, worker: HostWorker) -> None:
        """The window's gradient is in staging and the update step() just queued reads it
        on ``worker``: record that reader, once a window."""
        if not self.reader_unrecorded:
            return
        # No flush lands there before it is done (Note [the delayed update reads one
        # buffer, the next backward fills the other]); first, so drop_spare sees it.
        # Once per window: this also runs at zero_grad and at the next window's first
        # flush, whose later events would make a flush wait for that window's passes.
        staging.read_by(worker.record_event())
        self.reader_unrecorded = False

    def close(self) -> None:
        self.shard_norms.close()
