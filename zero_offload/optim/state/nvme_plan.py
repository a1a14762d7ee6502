"""Which offloaded buckets keep their state on NVMe, and the bytes of each place: pure
arithmetic, before anything is allocated (``plan_nvme``); and how a tile's state sits in
its record of the bucket's file (``RecordLayout``). See Note [the step streams the state]
in ``nvme.py``.

Host bytes per NVMe bucket, with ``k`` the shard's elements and ``s`` the training dtype's
bytes (``a(x)`` = ``x`` rounded up to the pool alignment): gradient staging ``a(s*k)`` and
weight staging ``a(s*k)`` (fp32 weights too: the H2D copies' source, so that the I/O buffer
is free as soon as its write is issued); with one micro-batch per step that is all (Adam
reads the gradient from staging, Note [no accumulator for one backward] in
``grads/to_host.py``). With several micro-batches (or ``overlap_step``) the fp32 accumulator
``a(4k)`` joins, in its own pool, created at the first accumulating step. Plus, once per
segment of buckets, the tier's I/O buffers: ``B * record_bytes + 4096``.

Note [homes on NVMe]
~~~~~~~~~~~~~~~~~~~~
With parameter offload the weight staging of a bucket is its unit's *home*, the only copy
of its training-dtype weights (Note [a unit's lifecycle] in ``params/unit.py``), and
``host_budget`` bounds the homes and the master and moments kept in RAM together. The homes
come first: kept in RAM in bucket order while they fit the budget, that bucket's home and
every later one in a weight file (``weights/nvme_home.py``); the state then takes what is
left, placed as above (a bucket whose home is on disk has its state on disk too). Why the
homes first: a byte of state moved to disk costs two bytes of traffic per step (read,
written), a byte of a home three or more (read for the forward and again for the backward,
written by the step). ``host_budget="auto"`` is then the RAM beside the gradient staging,
the I/O buffers and the two rings (the bounce ring taken as large as the device window).
A bucket with its home on disk has only its gradient staging in host RAM; its disk bytes
add the weight file (``weight_file_bytes``), and the segment adds one ring of
``HOME_TILE_BUFFERS`` aligned weight tiles (``home_ring_bytes``: the step reads and writes
the weights tile by tile through it). The window's bounce buffers
(``params/home_store.py``) are the offloader's.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from ...config import OffloadConfig
from ...memory.align import aligned
from ...memory.host_ram import HostShare, host_ram
from ...memory.storage import IO_ALIGNMENT, IO_BUFFERS
from ...partition import BucketLayout
from ...weights.nvme_home import home_ring_bytes, weight_file_bytes
from ..rule.base import StateFields
from .placement import Placement, _host_bytes

__all__ = [
    "AUTO_HOST_HEADROOM_MIN",
    "NvmePlan",
    "RecordLayout",
    "plan_nvme",
    "resolve_host_budget",
    "tile_sizes",
    "whole_parameter_tiles",
]

#: ``host_budget="auto"`` leaves max(10% of total RAM, this) free, for activations, the data
#: loader, the interpreter and the page cache.
AUTO_HOST_HEADROOM_MIN = 2 << 30
AUTO_HOST_HEADROOM_FRACTION = 0.10


@dataclass(frozen=True)
class RecordLayout:
    """Where each state field of one tile sits in its record: ``fields`` is ``(name, dtype,
    byte offset)`` for a record of ``capacity`` elements; each field starts 4 KiB-aligned.
    A shorter tile (the last of a shard; any tile of a rule that reads whole parameters)
    packs its fields the same way at its own length (``offsets``), so its record is only
    its own bytes, aligned.

    ``tile_elements``: the tile the shard is cut into (``OffloadConfig.tile_elements``);
    ``whole``: tiles follow parameters instead (Note [NVMe tiles follow whole parameters]);
    ``capacity``: the elements of the largest record, ``tile_elements`` unless ``whole``
    made a tile larger (the I/O buffers are ``record_bytes``, that record's bytes)."""

    tile_elements: int
    fields: tuple[tuple[str, torch.dtype, int], ...]
    record_bytes: int
    #: ``(name, value)`` each field starts from (``StateField.initial``), in field order.
    initials: tuple[tuple[str, float], ...] = ()
    whole: bool = False
    capacity: int = 0  # 0: tile_elements

    @classmethod
    def make(cls, tile_elements: int, state: StateFields, *, capacity: int = 0) -> RecordLayout:
        """The record of the rule's ``state`` fields, in their order, ``capacity`` elements
        at most (``tile_elements`` when 0)."""
        capacity = max(capacity, tile_elements)
        fields, offset = [], 0
        for name, dtype in state.pairs():
            fields.append((name, dtype, offset))
            offset += aligned(capacity * dtype.itemsize, IO_ALIGNMENT)
        initials = tuple((f.name, f.initial) for f in state.fields)
        whole = state.param_state is not None
        return cls(tile_elements, tuple(fields), offset, initials, whole, capacity)

    @classmethod
    def for_buckets(
        cls, layouts: Iterable[BucketLayout], tile_elements: int, state: StateFields
    ) -> RecordLayout:
        """The record that holds every tile of ``layouts``' buckets: of ``tile_elements``,
        or for a rule that reads whole parameters of the largest of their tiles (Note
        [NVMe tiles follow whole parameters])."""
        if state.param_state is None:
            return cls.make(tile_elements, state)
        largest = max(
            (n for b in layouts for n in whole_parameter_tiles(b, tile_elements)), default=0
        )
        return cls.make(tile_elements, state, capacity=largest)

    def initial(self, name: str) -> float:
        """The value field ``name`` starts from."""
        return dict(self.initials)[name]

    def offsets(self, count: int) -> list[int]:
        """Byte offset of each field in the record of a tile of ``count`` elements."""
        out, offset = [], 0
        for _, dtype, _ in self.fields:
            out.append(offset)
            offset += aligned(count * dtype.itemsize, IO_ALIGNMENT)
        return out

    def bytes_for(self, count: int) -> int:
        """Bytes of the record of a tile of ``count`` elements (a multiple of 4 KiB)."""
        return sum(aligned(count * dtype.itemsize, IO_ALIGNMENT) for _, dtype, _ in self.fields)

    def views(self, data: torch.Tensor, count: int) -> dict[str, torch.Tensor]:
        """The fields of the record in ``data`` (uint8), each ``(count,)`` long."""
        return {
            name: data[offset : offset + count * dtype.itemsize].view(dtype)
            for (name, dtype, _), offset in zip(self.fields, self.offsets(count), strict=True)
        }


@dataclass(frozen=True)
class NvmePlan:
    """Which offloaded buckets keep their state on NVMe, and the bytes of each place.

    ``host_pool``: the host pool's capacity (host-resident buckets in full, NVMe buckets'
    gradients and staging, the weight tile ring); ``host_state``: of that, the master and
    moments in host RAM (what ``host_budget`` bounds); ``disk``: bytes of the files;
    ``record``: the layout; ``homes``: the buckets whose home is a weight file (Note
    [homes on NVMe]); ``home_disk``: of ``disk``, the weight files; ``home_ring``: of
    ``host_pool``, the weight tile ring (0 without homes on NVMe); ``bucket_host``: per
    offloaded bucket index, its own bytes of ``host_pool`` (every term above but the ring;
    with parameter offload each unit's pool is the sum over its buckets, Note [homes are
    pinned unit by unit] in ``optim/unit_pools.py``).
    """

    nvme: frozenset[int]
    host_pool: int
    host_state: int
    disk: int
    record: RecordLayout
    host_budget: int | None
    homes: frozenset[int] = frozenset()
    home_disk: int = 0
    home_ring: int = 0
    bucket_host: Mapping[int, int] = field(default_factory=dict)


def _state_bytes(bucket: BucketLayout, *, state: StateFields, alignment: int) -> int:
    """The state fields (master and the rule's) of this rank's shard in the host pool."""
    return state.bytes_for(bucket.shard_numel, alignment)


def _shaped_bytes(bucket: BucketLayout, state: StateFields, alignment: int) -> int:
    """A whole-parameter rule's shaped state of the bucket, in host RAM wherever its
    per-element state is (Note [NVMe tiles follow whole parameters]); 0 for the others."""
    return state.param_state_bytes((slot.shape for slot in bucket.slots), alignment)


def _nvme_host_bytes(
    bucket: BucketLayout, *, itemsize: int, state: StateFields, alignment: int
) -> int:
    """An NVMe bucket's bytes in the host pool: gradient staging and weight staging, and a
    whole-parameter rule's shaped state."""
    shaped = _shaped_bytes(bucket, state, alignment)
    return 2 * aligned(itemsize * bucket.shard_numel, alignment) + shaped


def _refuse_homes_on_nvme(
    config: OffloadConfig,
    budget: int | None,
    on_disk: int,
    offloaded: Sequence[tuple[BucketLayout, int]],
    alignment: int,
) -> None:
    """A rule that reads whole parameters keeps every home in host RAM (Note [NVMe tiles
    follow whole parameters]): refuse a budget that would put some on NVMe."""
    homes = sum(aligned(s * b.shard_numel, alignment) for b, s in offloaded)
    raise ValueError(
        f"OffloadConfig.host_budget={config.host_budget!r} leaves {budget} bytes of host RAM "
        f"for the weights' homes and the optimizer state, which hold the homes of only "
        f"{len(offloaded) - on_disk} of {len(offloaded)} buckets; this optimizer's rule "
        "reads whole parameters, so with offload_parameters=True every home stays in host "
        "RAM (a home on NVMe streams in tiles of tile_elements, which cut parameters; Note "
        f"[NVMe tiles follow whole parameters]). Give host_budget at least {homes} bytes "
        "(the homes; the state goes to NVMe where it does not fit beside them), or leave "
        "nvme_dir=None"
    )


# Note [NVMe tiles follow whole parameters]
# A rule that reads whole parameters (Note [rules that read a whole parameter] in
# rule/base.py) steps one whole parameter per call, so the tile that holds a parameter's
# per-element state (the fp32 master) in an I/O buffer must hold all of it. Its buckets'
# tiles therefore follow parameters (``whole_parameter_tiles``): a tile is a run of whole
# slots, a new one starting at a slot that would take the tile past ``tile_elements``; a
# slot larger than that is a tile of its own, as large as the slot (with the alignment gap
# after it). The record (``RecordLayout.for_buckets``) and so each of the tier's I/O
# buffers is sized for the largest tile of the segment's buckets: ``B`` buffers of the
# largest parameter, at least of ``tile_elements``, are the host RAM this costs (the
# planner counts them, ``plan_nvme``'s ``other_host_bytes``; the records are packed, so the
# file is no larger). The step streams these tiles as any other (Note [the step streams
# the state] in nvme.py), and each parameter in a tile is stepped whole, reading and
# writing its state where the record lies in the buffer: no scratch copy, and the same
# kernel on the same bytes as the host-RAM store, so the bits are the same. The shaped
# state (Adafactor's factors, Muon's momentum buffer and AdamW moments) stays in host RAM,
# one block per bucket as ``WholeParameterHostState`` keeps it (``state/shaped.py``), in
# the host pool beside the staging (``_nvme_host_bytes``): ``opt.state``, checkpoints and
# the step find it where they find the host store's. It is small for Adafactor; for Muon it
# is as large as the master (NVMe then holds 4 of its 8 bytes per parameter). Like the
# staging it is RAM whatever the placement: ``host_budget`` bounds the per-element state,
# and ``"auto"`` sets the shaped state aside before placing (here and in
# ``segment_plan._nvme_config``). One rank
# only, so a bucket's shard is all of it. With parameter offload (``offload_parameters``)
# the weights' homes stay in host RAM: a home on NVMe is a weight file of tiles of
# ``tile_elements`` (``weights/nvme_home.py``), which would cut parameters, so a
# ``host_budget`` too small for every home is refused (``_refuse_homes_on_nvme``); the
# state takes what the homes leave, as Note [homes on NVMe] places it.


def whole_parameter_tiles(bucket: BucketLayout, tile_elements: int) -> list[int]:
    """Elements of each tile of a bucket of a rule that reads whole parameters, with one
    rank (its shard is the bucket): runs of whole slots, Note [NVMe tiles follow whole
    parameters] (one tile at least)."""
    real = bucket.real_in(0, bucket.padded_numel)
    starts = [0]
    for slot in bucket.slots:
        if slot.offset > starts[-1] and slot.end - starts[-1] > tile_elements:
            starts.append(slot.offset)
    sizes = [hi - lo for lo, hi in itertools.pairwise([*starts, real]) if hi > lo]
    return sizes or [1]


def tile_sizes(bucket: BucketLayout, shard: tuple[int, int], record: RecordLayout) -> list[int]:
    """Elements of each tile of a bucket's shard: its real elements in ``tile_elements``
    pieces, or for a rule that reads whole parameters runs of whole slots (Note [NVMe tiles
    follow whole parameters]); one tile at least."""
    if record.whole:
        return whole_parameter_tiles(bucket, record.tile_elements)
    real = bucket.real_in(*shard)
    step = record.tile_elements
    sizes = [min(step, real - lo) for lo in range(0, real, step)]
    return sizes or [1]


def resolve_host_budget(
    config: OffloadConfig, *, other_host_bytes: int, share: HostShare | None = None
) -> int | None:
    """``config.host_budget`` in bytes for the master and moments; ``"auto"`` is this
    rank's part of the RAM available less max(10% of total, 2 GiB), less
    ``other_host_bytes`` (gradients, staging, I/O buffers: they are in host RAM whatever the
    placement). In a container, available and total are its limit's (Note [host RAM in a
    container] in ``memory/host_ram.py``); ``share``: the ranks that draw on the same RAM
    (Note [what "auto" leaves each rank])."""
    budget = config.host_budget
    if budget is None or isinstance(budget, int):
        return budget
    ram = host_ram()
    headroom = max(int(ram.total * AUTO_HOST_HEADROOM_FRACTION), AUTO_HOST_HEADROOM_MIN)
    if share is None:
        return max(0, ram.available - headroom - other_host_bytes)
    return max(0, (share.available - headroom) // share.ranks - other_host_bytes)


# Note [what "auto" leaves each rank]
# With several ranks on one host's RAM, the reserve is kept once for the host, and what is
# left after it is split evenly between the ranks; each rank's own buffers (gradient
# staging, I/O buffers, rings) come out of its part. The available figure is the largest
# any of those ranks read at the build's exchange (Note [ranks that share a host's RAM] in
# memory/host_ram.py), taken before any of them allocated, so a rank that builds a little
# later does not count its neighbours' new pools twice. estimate's rows make the same
# split with ``ranks_per_node``.


def plan_nvme(
    layouts: Sequence[BucketLayout],
    placement: Placement,
    *,
    config: OffloadConfig,
    itemsize: int | Sequence[int],
    state: StateFields,
    rank: int,
    alignment: int,
    homes_movable: bool = False,
    window_bytes: int = 0,
    share: HostShare | None = None,
) -> NvmePlan:
    """Place offloaded buckets whole: in bucket order, on the host while their master and
    moments fit ``host_budget``; that bucket and every later one on NVMe. With
    ``homes_movable`` (parameter offload: the staging is the unit's home) the budget holds
    the homes first, then the state (Note [homes on NVMe]); ``window_bytes``, the device
    window's, bounds the bounce ring that "auto" leaves room for; ``share``, the ranks on
    this host's RAM, splits "auto" (Note [what "auto" leaves each rank]).

    Without ``nvme_dir`` every offloaded bucket stays on the host (``host_pool`` is then
    ``placement.host_state``, unchanged)."""
    sizes = [itemsize] * len(layouts) if isinstance(itemsize, int) else list(itemsize)
    offloaded = [
        (b, s) for b, s in zip(layouts, sizes, strict=True) if b.index not in placement.resident
    ]
    record = RecordLayout.for_buckets((b for b, _ in offloaded), config.tile_elements, state)
    if config.nvme_dir is None:
        in_ram = sum(_state_bytes(b, state=state, alignment=alignment) for b, _ in offloaded)
        each = {
            b.index: _host_bytes(b, itemsize=s, state=state, alignment=alignment)
            for b, s in offloaded
        }
        return NvmePlan(
            frozenset(), placement.host_state, in_ram, 0, record, None, bucket_host=each
        )
    minimum = sum(
        _nvme_host_bytes(b, itemsize=s, state=state, alignment=alignment) for b, s in offloaded
    )
    budget = resolve_host_budget(
        config,
        other_host_bytes=minimum + IO_BUFFERS * record.record_bytes + IO_ALIGNMENT,
        share=share,
    )
    homes: set[int] = set()
    home_disk = home_ring = 0
    if homes_movable:  # Note [homes on NVMe]: the homes first, the state in what is left
        if config.host_budget == "auto":  # the RAM beside the gradient staging and rings
            grads = sum(aligned(s * b.shard_numel, alignment) for b, s in offloaded)
            rings = home_ring_bytes(config.tile_elements, max(sizes, default=1)) + window_bytes
            other = grads + IO_BUFFERS * record.record_bytes + IO_ALIGNMENT + rings
            other += sum(_shaped_bytes(b, state, alignment) for b, _ in offloaded)
            budget = resolve_host_budget(config, other_host_bytes=other, share=share)
        kept = 0  # homes in host RAM, bucket order
        for b, s in offloaded:
            home = aligned(s * b.shard_numel, alignment)
            if budget is None or (not homes and kept + home <= budget):
                kept += home
                continue
            homes.add(b.index)
            real = b.real_in(*b.shard_range(rank))
            home_disk += weight_file_bytes(real, config.tile_elements, s)
        if homes and state.param_state is not None:
            _refuse_homes_on_nvme(config, budget, len(homes), offloaded, alignment)
        if budget is not None:
            budget -= kept
    nvme: set[int] = set()
    host_state = disk = 0
    each: dict[int, int] = {}  # NvmePlan.bucket_host
    for b, s in offloaded:
        own = _state_bytes(b, state=state, alignment=alignment)
        fits = budget is None or host_state + own <= budget
        if not nvme and fits and b.index not in homes:
            host_state += own
            each[b.index] = _host_bytes(b, itemsize=s, state=state, alignment=alignment)
            continue
        nvme.add(b.index)
        each[b.index] = _nvme_host_bytes(b, itemsize=s, state=state, alignment=alignment)
        if b.index in homes:
            each[b.index] -= aligned(s * b.shard_numel, alignment)  # no weight staging
        tiles = tile_sizes(b, b.shard_range(rank), record)
        disk += sum(record.bytes_for(n) for n in tiles)
    host_pool = sum(each.values())
    if homes:
        widest = max(s for b, s in offloaded if b.index in homes)
        home_ring = home_ring_bytes(config.tile_elements, widest)
        host_pool += home_ring
        disk += home_disk
    return NvmePlan(
        frozenset(nvme),
        host_pool,
        host_state,
        disk,
        record,
        budget,
        frozenset(homes),
        home_disk,
        home_ring,
        each,
    )
