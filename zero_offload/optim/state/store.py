"""The state store interface: where a bucket's optimizer state lives and how it is updated.

A bucket (``flat_bucket.FlatBucket``) is its parameter views, its gradient lifecycle, one
gradient path (``grads/path.py``) and one state store, chosen at construction by
``placement.plan_placement`` and ``nvme_plan.plan_nvme``:

- ``host.HostState``: fp32 master weights and moments in the host pool, updated tile by
  tile by the CPU Adam kernel (``rule/adamw.py``); gradients come to the host;
- ``nvme.NvmeState``: the same update, the state streamed from files of the storage tier;
- ``whole.WholeParameterHostState`` and ``whole_nvme.WholeParameterNvmeState``: the same
  two, for a rule that reads whole parameters (its shaped state in host RAM beside);
- ``resident.ResidentState``: the state on the device, updated by torch's fused AdamW;
  gradients stay on the device.

Every store walks its state tile by tile (``stream_fields``): checkpoints, the master's
reconciliation with written weights and the republication of a resumed update are written
once, here, over that walk.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ...accelerator import Event
from ...memory.block import Block
from ...memory.manager import TieredMemoryManager
from ...memory.pool import BlockPool
from ...views import ParamViews
from ..grads.path import GradSource
from ..publish import Publication, Publish, WeightCopies
from ..rule.base import Hyper

__all__ = [
    "BucketPools",
    "StateStore",
    "TileFn",
    "WeightsHome",
    "refuse_take_written",
    "republish_from_master",
    "stream_tensors",
    "take_written",
    "weights_into_home",
]

#: ``fn(lo, hi, fields)``: one tile ``[lo, hi)`` of a store's elements and its state views.
TileFn = Callable[[int, int, dict[str, torch.Tensor]], None]


@dataclass(frozen=True)
class BucketPools:
    """Where a segment's buffers come from."""

    device: BlockPool  # weights_dev, gradient buffers, and a resident bucket's fp32 state
    # An offloaded bucket's fp32 state and staging: one pool; with parameter offload one per
    # unit (Note [homes are pinned unit by unit] in optim/unit_pools.py), and the homes on
    # NVMe's weight tile ring.
    host: tuple[BlockPool, ...]


# Note [a publication does not hold its store]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A host-side store owns its publication (``WeightCopies``), which reads the store's weights'
# home at every copy. Handed the store's bound ``weights_home``, the publication pointed back
# at the store: a reference cycle, so a closed or dropped optimizer's stores, and through their
# tensors the host pools' buffers, lived until the cyclic garbage collector happened to run
# (Note [lifetimes without close] in ``optim/lifetime.py``; 100 MiB of a 6M-parameter model
# after close(), GiBs over a sweep). So the home is a ``WeightsHome``, a value both hold: the
# store binds it when its block is allocated or moved and clears it at close, and the
# publication only calls it. A block's ``on_move`` callback may name its store (that cycle
# ends when ``close`` frees the block, which drops the callbacks); nothing a store keeps after
# close may. At close a store also drops its views of the pool (state, staging): a view keeps
# the pool's buffer alive however the pool was closed.


class WeightsHome:
    """Where a host-side store's updated weights live: the pinned training-dtype tensor its
    publication's H2D copies read, ``(shard_numel,)``, and the pool block under it.

    Bound by the store (at allocation, and when the block moves), cleared at its close;
    called by the publication. It holds no reference to the store: Note [a publication does
    not hold its store].
    """

    __slots__ = ("_what", "block", "tensor")

    def __init__(self, what: str) -> None:
        self._what = what  # "bucket 3", for the error of a use after close
        self.tensor: torch.Tensor | None = None  # (shard_numel,) training dtype, host pool
        self.block: Block | None = None  # the block under ``tensor``

    def bind(self, tensor: torch.Tensor, block: Block) -> None:
        """The home is ``tensor``, a view of ``block``."""
        self.tensor = tensor
        self.block = block

    def clear(self) -> None:
        """Forget the view and the block (the store closed; the block was freed)."""
        self.tensor = None
        self.block = None

    def __call__(self) -> tuple[torch.Tensor, Block]:
        if self.tensor is None or self.block is None:
            raise RuntimeError(
                f"{self._what}: its weights' home in host memory was used after the store "
                "closed, or where the home is not in host memory (bug)"
            )
        return self.tensor, self.block


def take_written(master: torch.Tensor, weights: torch.Tensor) -> None:
    """Where ``weights`` is not the training-dtype rounding of ``master``, the master takes
    the weight; elsewhere it keeps its extra bits (Note [weights written outside the
    optimizer] in ``views/param_views.py``). Both are one tile's views."""
    if weights.dtype == torch.float32:
        if weights.data_ptr() != master.data_ptr():  # an fp32 home is the master itself
            master.copy_(weights)
        return
    written = weights != master.to(weights.dtype)
    master.copy_(torch.where(written, weights.float(), master))


def weights_into_home(
    views: ParamViews,
    manager: TieredMemoryManager,
    shard: tuple[int, int],
    home: tuple[torch.Tensor, Block],
    *,
    bucket: int,
) -> torch.Tensor:
    """The shard's current weights in ``home`` (a host store's ``weights_home()``), waited:
    the D2H copy from the device, or nothing where the parameters are views of the home
    already (parameter offload, ``views.copy_out`` says which)."""
    # Synchronisation point (rare: construction, loading, weights written outside the
    # optimizer): the weights' bytes must be final and the home idle.
    manager.synchronize()
    target, target_block = home
    done = views.copy_out(
        manager, *shard, target, target_block, label=f"bucket{bucket} master refresh"
    )
    if done is not None:
        done.synchronize()  # Synchronisation point: the caller reads it
    return target


class StateStore(ABC):
    """A bucket's optimizer state, for one placement.

    Fields every store has: ``publication`` (how its updated weights reach the device),
    ``tile_elements`` (the tile of ``stream_fields``).
    """

    #: Whether the state lives on the device (no tier crossing).
    resident: bool
    #: Where the state lives, for reports: "device", "host" or "nvme".
    location: str
    publication: Publication
    tile_elements: int

    #: Whether ``state_tensors()`` can be copied aside and restored (a speculative step,
    #: Note [speculative steps] in ``update/eager.py``); False where it is not in memory.
    supports_speculation = True

    #: Whether the state lives in files of the storage tier (NVMe): it is reloaded with
    #: ``load_streaming`` after a failed step (Note [a step is all or nothing]).
    on_storage_tier = False

    def check_usable(self) -> None:  # noqa: B027 (stores in memory have nothing to check)
        """Raise (changing nothing) when this store cannot take a step: a step refuses up
        front rather than stepping the buckets before it and failing here (Note [a step is
        all or nothing] in ``update/modes.py``). Stores in memory always can."""

    @abstractmethod
    def update(
        self,
        hyper: Hyper,
        grad_scale: float,
        runs: list[tuple[int, int, int]],
        *,
        publish: Publish,
        source: GradSource | None = None,
        after: list[Event] | None = None,
        take_written: bool = False,
    ) -> None:
        """One step of the rule over ``runs`` (``(start, stop, step)`` bucket ranges), reading
        the gradient from ``source`` (``window_source()`` when the step was planned; now
        when None). With ``Publish.NOW`` each updated tile's copy to ``weights_dev`` is
        issued as soon as the tile is done, after ``after`` (default: the compute issued so
        far); with ``Publish.LATER`` ``publication.publish()`` issues them later.
        ``take_written`` (only where ``reconciles_in_update()``): the update is the write
        check, its master taking the weights written since the last step (Note [the write
        check in the update] in ``update/reconcile.py``)."""

    def reconciles_in_update(self) -> bool:
        """Whether ``update(take_written=True)`` can replace the write check and
        ``reconcile_master`` over the runs it steps: the parameters are views of the home
        the update writes (Note [the write check in the update] in
        ``update/reconcile.py``). Not by default."""
        return False

    def weights_are_master(self) -> bool:
        """Whether the parameters' bytes are the fp32 master itself, so that a write into
        the weights (``model.load_state_dict``) writes the master too (Note [a resumed
        update is published at the step, not at the load] in ``update/resume.py``). Not by
        default."""
        return False

    @abstractmethod
    def span(self) -> tuple[int, int]:
        """The bucket elements ``[start, stop)`` the state fields cover (this rank's
        shard, or the whole padded bucket on the device)."""

    @abstractmethod
    def field_dtypes(self) -> list[tuple[str, torch.dtype]]:
        """The state fields this bucket keeps and their dtypes, without touching them:
        the rule's ``state_fields``, the fp32 master first."""

    @abstractmethod
    def field_initial(self, name: str) -> float:
        """The value state field ``name`` starts from (the rule's ``StateField.initial``)."""

    def state_names(self) -> tuple[str, ...]:
        """The names of ``field_dtypes()``."""
        return tuple(name for name, _ in self.field_dtypes())

    @abstractmethod
    def state_tensors(self) -> dict[str, torch.Tensor]:
        """The flat state fields by name, each over ``span()`` from its start."""

    def param_state(self, slot_index: int) -> dict[str, torch.Tensor]:
        """Slot ``slot_index``'s shaped state by name, each view shaped as the rule's
        ``param_state`` says (Note [rules that read a whole parameter] in
        ``rule/base.py``); none for an elementwise rule."""
        return {}

    def param_state_bytes(self) -> int:
        """Bytes of the shaped state where the store keeps it, host RAM or the device pool
        (0 for an elementwise rule)."""
        return 0

    @abstractmethod
    def stream_fields(self, fn: TileFn, *, read: bool = True, write: bool = False) -> None:
        """``fn(lo, hi, fields)`` over the real elements of ``span()`` in tiles of
        ``tile_elements``, in order (span-local ``[lo, hi)``; ``fields`` are that tile's
        views): the state read first (``read``; else ``fn`` must fill every field) and
        written back after (``write``) where it does not live in memory."""

    @abstractmethod
    def final_weights(self) -> torch.Tensor:
        """The training-dtype weights over ``span()``, final (every write to them landed),
        where the master can be compared with them."""

    @abstractmethod
    def weights_out(self) -> torch.Tensor:
        """Where the update writes the training-dtype weights over ``span()``."""

    def reconcile_master(self) -> None:
        """Where a weight is not the rounding of the master, take the weight into the
        master; see Note [weights written outside the optimizer] in
        ``views/param_views.py``. Updated tiles not yet copied are forgotten."""
        weights = self.final_weights()
        self.stream_fields(
            lambda lo, hi, fields: take_written(fields["master"], weights[lo:hi]),
            read=True,
            write=True,
        )
        self.publication.drop_unpublished()

    @abstractmethod
    def publish_all_from_master(self) -> None:
        """Mark every tile as updated but unpublished: the next ``publish`` writes the
        training-dtype rounding of the master (resuming a delayed update)."""

    @abstractmethod
    def close(self) -> None:
        """Return every block to its pool."""


def refuse_take_written(store: StateStore, take_written: bool) -> None:
    """``update(take_written=True)`` of a store that does not ``reconciles_in_update()``:
    a bug, raised before anything changes."""
    if take_written:
        raise RuntimeError(
            f"{type(store).__name__} cannot take written weights in its update (a bug: Note "
            "[the write check in the update] in optim/update/reconcile.py)"
        )


def republish_from_master(store: StateStore, copies: WeightCopies) -> None:
    """``publish_all_from_master`` of a host-side store: every tile's weights from the
    master (rounded to nearest even), each tile marked for the next ``publish``."""
    out = store.weights_out()

    def take(lo: int, hi: int, fields: dict[str, torch.Tensor]) -> None:
        if out[lo:hi].data_ptr() != fields["master"].data_ptr():  # fp32: out is the master
            out[lo:hi].copy_(fields["master"])
        copies.mark_unpublished(lo, hi)

    store.stream_fields(take, read=True, write=False)


def stream_tensors(tensors: dict[str, torch.Tensor], real: int, tile: int, fn: TileFn) -> None:
    """``stream_fields`` of a store whose state is in memory: views of ``tensors``, tile by
    tile over their first ``real`` elements."""
    for lo in range(0, real, tile):
        hi = min(lo + tile, real)
        fn(lo, hi, {name: tensor[lo:hi] for name, tensor in tensors.items()})
