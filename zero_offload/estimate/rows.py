"""What is estimated (a ``Subject``: a shape, a module's parameters, or a bare count), each
configuration's bytes for it (a ``Configuration``, one per table row), and the largest
member of the subject's family that a configuration fits.

Note [largest that fits grows the row's own family]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
"Largest that fits" must never contradict "fits": a row that fits reports a largest model at
least as large as the model, and a row that does not, a smaller one. So the search evaluates
the very function that sized the row (``Configuration.bytes``, tested by ``Limits.fits``),
on members of one family that contains the model itself, ordered by size; and it starts from
the model: upward from it if the row fits, below it if not. That makes the rule hold by
construction. The bytes grow with the size (up to alignment gaps, a few bytes per
parameter against a whole layer's), so the binary search finds the largest member exactly.
The families:

- a ``ModelShape``: the same widths with more or fewer layers (``ModelShape.with_layers``);
  the embeddings, the head, their gradient buffers and the activations per layer are the
  row's own;
- a bare count: that many parameters in full buckets (``offload_bytes_of_count``);
- a module's parameter shapes: if it fits, the module plus whole buckets of extra
  parameters; if not, a bare count below the module's (which is smaller, so it cannot
  contradict the row either).
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from .pools import (
    BucketGroups,
    device_shard_bytes,
    offload_adamw_bytes,
    offload_bytes_of_count,
    param_offload_bytes,
    rule_state,
    shape_bucket_groups,
    shape_offload_bytes,
    unit_bucket_groups,
)
from .shape import ModelShape, Shape, shapes_numel

__all__ = [
    "ActivationMode",
    "Configuration",
    "Context",
    "CountSubject",
    "DeviceShards",
    "Limits",
    "ModuleSubject",
    "RowBytes",
    "ShapeSubject",
    "Status",
    "Subject",
    "largest_fitting",
]

#: Activation checkpoints held on the device by activation offload (prefetch depth 1 + 1).
OFFLOAD_CHECKPOINTS_ON_DEVICE = 2
#: The search stops growing a family here (a model this large does not fit anything).
_SEARCH_CAP = 2**50


@dataclass(frozen=True)
class Context:
    """The training setup every row shares."""

    itemsize: int  # training dtype bytes
    world_size: int
    ranks_per_node: int
    bucket_bytes: int
    #: The optimizer rule whose state the rows size (``optim/rule/``).
    rule: str = "adamw"

    @property
    def state_bytes(self) -> int:
        """Optimizer state bytes per parameter (ZeRO paper's ``K``), from the rule: its
        fields in fp32 (for AdamW the master and two moments, 12) in mixed precision; in
        fp32 less the master, since the weights are the master copy (8). Per element only:
        Adafactor's shaped state (its factors) depends on the shapes, not the count
        (``pools.rule_state_bytes``)."""
        fields = rule_state(self.rule)
        return fields.bytes_per_element - (4 if self.itemsize == 4 else 0)


@dataclass(frozen=True)
class RowBytes:
    """One configuration's bytes: device per rank, host and disk per node."""

    model_states: int  # weights, gradients, optimizer state on the device
    buffers: int  # the library's gradient buffers (ZeRO-Offload rows only)
    activations: int
    host: int
    disk: int = 0  # NVMe: optimizer state records, and weights with parameters on NVMe

    @property
    def device(self) -> int:
        """Device bytes per rank."""
        return self.model_states + self.buffers + self.activations


@dataclass(frozen=True)
class Limits:
    """Memory per rank (device), per node (host) and NVMe per node (disk); ``None``: unknown
    (a disk not given holds nothing). A configuration fits when its device bytes fit
    ``device``, its host bytes fit ``host`` less ``host_reserve``, and its disk bytes fit
    ``disk``."""

    device: int | None
    host: int | None
    host_reserve: int
    disk: int | None = None

    def fits(self, row: RowBytes) -> bool | None:
        """``False`` if a known limit is exceeded, ``True`` if both are known and kept,
        else ``None``."""
        if self.device is not None and row.device > self.device:
            return False
        if self.host is not None and row.host > self.host - self.host_reserve:
            return False
        if row.disk > (self.disk or 0):
            return False
        return None if self.device is None or self.host is None else True

    def state_budget(self, fixed: int, other: int, ranks: int) -> int | None:
        """Each rank's host budget for optimizer state: the host less the reserve, less
        ``other`` (per node), shared by ``ranks``, less ``fixed`` (per rank); ``None``
        (unbounded) when the host is unknown. See Note [the host budget decides the
        split] in ``nvme.py``."""
        if self.host is None:
            return None
        return max(0, (self.host - self.host_reserve - other) // ranks - fixed)


class ActivationMode(enum.Enum):
    """What stays of the forward's activations until backward."""

    FULL = "every layer's activations on the device"
    CHECKPOINTED = "each layer's input on the device, one layer recomputed at a time"
    OFFLOADED = "each layer's input on the host, two on the device, one layer recomputed"


class Subject(ABC):
    """What the estimate is of, and its family for the largest-model search."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self._pools: tuple[int, int, int] | None = None
        self._groups: BucketGroups | None = None  # bucket_groups(), planned once

    @property
    @abstractmethod
    def params(self) -> int:
        """Trainable parameters."""

    @property
    def shape(self) -> ModelShape | None:
        """The model's shape, when known (activations and parameter offload need it)."""
        return None

    @abstractmethod
    def _plan_offload(self) -> tuple[int, int, int]:
        """``(device weights, device gradient buffers, host per rank)`` of OffloadAdamW."""

    def offload_pools(self) -> tuple[int, int, int]:
        """``_plan_offload``, planned once."""
        if self._pools is None:
            self._pools = self._plan_offload()
        return self._pools

    def param_offload_pools(self) -> tuple[int, int, int] | None:
        """``param_offload_bytes``, or ``None`` where parameter offload is not estimated."""
        return None

    def device_shards(self) -> int | None:
        """``device_shard_bytes``, or ``None`` where parameter offload is not estimated."""
        return None

    @abstractmethod
    def _plan_groups(self) -> BucketGroups:
        """OffloadAdamW's buckets in bucket order (``pools.BucketGroups``)."""

    def bucket_groups(self) -> BucketGroups:
        """``_plan_groups``, planned once."""
        if self._groups is None:
            self._groups = self._plan_groups()
        return self._groups

    def unit_groups(self) -> BucketGroups | None:
        """The buckets under parameter offload (each unit's own), or ``None`` where
        parameter offload is not estimated."""
        return None

    def activations(self, mode: ActivationMode) -> tuple[int, int]:
        """``(device, host per node)`` activation bytes; ``(0, 0)`` without a shape."""
        shape, s = self.shape, self.ctx.itemsize
        if shape is None:
            return 0, 0
        layer, ckpt = shape.layer_activation_bytes(s), shape.checkpoint_bytes(s)
        logits = shape.logits_bytes(s)
        if mode is ActivationMode.FULL:
            return shape.layers * layer + logits, 0
        if mode is ActivationMode.CHECKPOINTED:
            return shape.layers * ckpt + layer + logits, 0
        on_device = min(shape.layers, OFFLOAD_CHECKPOINTS_ON_DEVICE) * ckpt + layer + logits
        return on_device, shape.layers * ckpt * self.ctx.ranks_per_node

    @property
    @abstractmethod
    def size(self) -> int:
        """This subject's place in its family (``member(size)`` is itself)."""

    @abstractmethod
    def member(self, size: int) -> Subject:
        """The family's member of ``size`` (>= 1)."""

    def largest(self, fits: Callable[[Subject], bool]) -> Subject | None:
        """The largest member of this subject's family that ``fits``, ``None`` if none
        does: not below this subject if it fits, below it if not; see Note [largest that
        fits grows the row's own family]."""
        if fits(self):
            size = _largest_int(lambda n: fits(self.member(n)), low=self.size)
        else:
            size = _largest_int(lambda n: fits(self.member(n)), low=1, high=self.size - 1)
        return None if size is None else self.member(size)


class ShapeSubject(Subject):
    """A ``ModelShape``; its family: the same widths, any number of layers."""

    def __init__(self, shape: ModelShape, ctx: Context) -> None:
        super().__init__(ctx)
        self._shape = shape
        self._members: dict[int, ShapeSubject] = {shape.layers: self}
        self._param_pools: tuple[int, int, int] | None = None
        self._shards: int | None = None  # device_shards(), planned once

    @property
    def params(self) -> int:
        return self._shape.params

    @property
    def shape(self) -> ModelShape:
        return self._shape

    def _plan_offload(self) -> tuple[int, int, int]:
        ctx = self.ctx
        return shape_offload_bytes(
            self._shape,
            itemsize=ctx.itemsize,
            bucket_bytes=ctx.bucket_bytes,
            world_size=ctx.world_size,
        )

    def param_offload_pools(self) -> tuple[int, int, int] | None:
        if self._param_pools is None:  # several ranks: ZeRO-3 with offload
            self._param_pools = param_offload_bytes(
                self._shape,
                itemsize=self.ctx.itemsize,
                bucket_bytes=self.ctx.bucket_bytes,
                world_size=self.ctx.world_size,
            )
        return self._param_pools

    def device_shards(self) -> int | None:
        if self._shards is None:
            ctx = self.ctx
            self._shards = device_shard_bytes(
                self._shape,
                itemsize=ctx.itemsize,
                bucket_bytes=ctx.bucket_bytes,
                world_size=ctx.world_size,
            )
        return self._shards

    def _plan_groups(self) -> BucketGroups:
        numel = max(1, self.ctx.bucket_bytes // self.ctx.itemsize)
        return shape_bucket_groups(self._shape, bucket_numel=numel)

    def unit_groups(self) -> BucketGroups | None:
        ctx = self.ctx
        return unit_bucket_groups(self._shape, itemsize=ctx.itemsize, bucket_bytes=ctx.bucket_bytes)

    @property
    def size(self) -> int:
        return self._shape.layers

    def member(self, size: int) -> ShapeSubject:
        """The same widths with ``size`` layers (members are shared: each planned once)."""
        if size not in self._members:
            member = ShapeSubject(self._shape.with_layers(size), self.ctx)
            member._members = self._members
            self._members[size] = member
        return self._members[size]


class CountSubject(Subject):
    """A bare parameter count, in full buckets; its family: every count."""

    def __init__(self, params: int, ctx: Context) -> None:
        super().__init__(ctx)
        self._params = params

    @property
    def params(self) -> int:
        return self._params

    def _plan_offload(self) -> tuple[int, int, int]:
        ctx = self.ctx
        return offload_bytes_of_count(
            self._params,
            itemsize=ctx.itemsize,
            bucket_bytes=ctx.bucket_bytes,
            world_size=ctx.world_size,
        )

    def _plan_groups(self) -> BucketGroups:
        bucket_numel = max(1, self.ctx.bucket_bytes // self.ctx.itemsize)
        full, rest = divmod(self._params, bucket_numel)
        groups = [((bucket_numel,), full), ((rest,), 1)]
        return [(numels, repeats) for numels, repeats in groups if repeats and numels[0]]

    @property
    def size(self) -> int:
        return self._params

    def member(self, size: int) -> CountSubject:
        return CountSubject(size, self.ctx)


class ModuleSubject(Subject):
    """A module's trainable parameters by shape; its family: the module plus whole buckets
    of extra parameters, and below it, bare counts."""

    def __init__(
        self,
        shapes: Sequence[Shape],
        ctx: Context,
        *,
        base: ModuleSubject | None = None,
        extra_buckets: int = 0,
    ) -> None:
        super().__init__(ctx)
        self._shapes = list(shapes)
        self._base = base  # the module itself, when this is it plus extra buckets
        self._extra = extra_buckets  # whole buckets of parameters added after the module
        self._bucket_numel = max(1, ctx.bucket_bytes // ctx.itemsize)

    @property
    def params(self) -> int:
        return shapes_numel(self._shapes) + self._extra * self._bucket_numel

    def _plan_offload(self) -> tuple[int, int, int]:
        # The extra parameters, registered last, are packed first, a full bucket each, and
        # leave the module's own buckets as they were: the pools add up.
        ctx, extra = self.ctx, self._extra
        if self._base is not None:
            weights, grad_buffers, host = self._base.offload_pools()
            full = offload_bytes_of_count(
                self._bucket_numel,
                itemsize=ctx.itemsize,
                bucket_bytes=ctx.bucket_bytes,
                world_size=ctx.world_size,
            )
            return weights + extra * full[0], max(grad_buffers, full[1]), host + extra * full[2]
        return offload_adamw_bytes(
            self._shapes,
            itemsize=ctx.itemsize,
            bucket_bytes=ctx.bucket_bytes,
            world_size=ctx.world_size,
        )

    def _plan_groups(self) -> BucketGroups:
        # The extra parameters, registered last, fill the first buckets.
        from .pools import module_bucket_numels

        own = module_bucket_numels(tuple(self._shapes), self.ctx.itemsize, self.ctx.bucket_bytes)
        return [((self._bucket_numel,), self._extra)] * bool(self._extra) + [(own, 1)]

    @property
    def size(self) -> int:
        return self.params

    def member(self, size: int) -> Subject:
        """Below the module: a bare count; from it up: the module plus whole buckets (a
        size between two of those is the smaller)."""
        module = self if self._base is None else self._base
        if size < module.params:
            return CountSubject(size, self.ctx)
        extra = (size - module.params) // self._bucket_numel
        if not extra:
            return module
        return ModuleSubject(module._shapes, self.ctx, base=module, extra_buckets=extra)


def _largest_int(fits: Callable[[int], bool], *, low: int, high: int | None = None) -> int | None:
    """The largest ``n`` in ``[low, high]`` (``high`` unbounded: up to ``_SEARCH_CAP``) with
    ``fits(n)``, for ``fits`` true up to some ``n`` and false beyond; ``None`` if
    ``fits(low)`` is false."""
    cap = _SEARCH_CAP if high is None else high
    if cap < low or not fits(low):
        return None
    good, bad = low, None
    step = max(1, low)
    while bad is None:  # grow until a size does not fit (or the cap)
        probe = min(good + step, cap)
        if probe == good:
            return good
        if fits(probe):
            good, step = probe, step * 2
        else:
            bad = probe
    while bad - good > 1:
        middle = (good + bad) // 2
        good, bad = (middle, bad) if fits(middle) else (good, middle)
    return good


class Status(enum.Enum):
    """Whether this library trains a configuration today."""

    RUNS = "yes"  # OffloadAdamW runs it; its pools are the library's exact sizes
    PAPER = "paper"  # the ZeRO paper's accounting of another system (DDP, ZeRO-1/2/3)
    NOT_YET = "not yet"  # an estimate of what the library does not run yet (reason given)


@dataclass(frozen=True)
class Configuration(ABC):
    """One way of training: a table row. ``bytes`` is ``None`` where it does not apply."""

    name: str
    activations: ActivationMode = field(default=ActivationMode.FULL)

    @abstractmethod
    def bytes(self, subject: Subject, limits: Limits) -> RowBytes | None:
        """This configuration's bytes for ``subject`` (``limits`` set the host budget of
        rows with NVMe, Note [the host budget decides the split] in ``nvme.py``)."""

    def status(self, ctx: Context) -> tuple[Status, str]:
        """Whether the library runs it with ``ctx``'s ranks, and if not yet, why."""
        return Status.RUNS, ""

    def conditions(self) -> str:
        """What a training loop must keep to for the row to hold (empty: nothing)."""
        return ""


@dataclass(frozen=True)
class Replicated(Configuration):
    """Model states on the device (ZeRO paper, sections 3.1 and 5): weights ``sP``, gradients
    ``sP``, Adam ``KP``; ``stage`` 0 (DDP) replicates all, 1 partitions the Adam state over
    ``N`` ranks (``P_os``), 2 the gradients too (``P_os+g``), 3 the weights too
    (``P_os+g+p``). The paper's Table 1 is these with ``s = 2``, ``K = 12``."""

    stage: int = 0

    def bytes(self, subject: Subject, limits: Limits) -> RowBytes | None:
        ctx, p = subject.ctx, subject.params
        device, host = subject.activations(self.activations)
        return RowBytes(model_state_bytes(self.stage, p, ctx), 0, device, host)

    def status(self, ctx: Context) -> tuple[Status, str]:
        return Status.PAPER, "the ZeRO paper's accounting (model states on the device)"


def model_state_bytes(stage: int, params: int, ctx: Context) -> int:
    """Device bytes of weights, gradients and Adam state per rank at ZeRO ``stage`` (0:
    DDP): ``(2s + K) P``, ``2sP + KP/N``, ``sP + (s + K)P/N``, ``(2s + K)P/N``, each
    partitioned part rounded up to whole bytes."""
    s, k, n, p = ctx.itemsize, ctx.state_bytes, ctx.world_size, params
    return {
        0: (2 * s + k) * p,
        1: 2 * s * p + -(-k * p // n),
        2: s * p + -(-(s + k) * p // n),
        3: -(-(2 * s + k) * p // n),
    }[stage]


@dataclass(frozen=True)
class Offloaded(Configuration):
    """ZeRO-Offload with this library: ``OffloadAdamW``'s exact pools, everything offloaded;
    the host part per node (each rank's shards, times the ranks on a node)."""

    def bytes(self, subject: Subject, limits: Limits) -> RowBytes | None:
        weights, grad_buffers, host = subject.offload_pools()
        device, act_host = subject.activations(self.activations)
        return RowBytes(weights, grad_buffers, device, host * subject.ctx.ranks_per_node + act_host)


@dataclass(frozen=True)
class ParamOffloaded(Configuration):
    """``OffloadConfig(offload_parameters=True)``: the window's slots instead of the weights
    on the device; a shape needed. With several ranks it is ZeRO-3 with offload (each rank
    holds its shard of the host state; the slots hold gathered units), which runs
    (``params/sharded_fetch.py``; tests/test_zero3.py checks these pools on two ranks)."""

    def bytes(self, subject: Subject, limits: Limits) -> RowBytes | None:
        pools = subject.param_offload_pools()
        if pools is None:
            return None
        window, grad_buffers, host = pools
        device, act_host = subject.activations(self.activations)
        return RowBytes(window, grad_buffers, device, host * subject.ctx.ranks_per_node + act_host)


@dataclass(frozen=True)
class DeviceShards(Configuration):
    """``OffloadConfig(partition_parameters=True)`` on several ranks: ZeRO-3 with each
    rank's shards on the device (``params/device_shards.py``; tests/test_zero3_device.py
    checks these pools on two ranks): the shards and the window's slots on the device, the
    host state as ZeRO-3 with offload's. Not a row on one rank, where a shard is the whole
    model and the optimizer is built as without partitioning (the ``Offloaded`` rows)."""

    def bytes(self, subject: Subject, limits: Limits) -> RowBytes | None:
        pools, shards = subject.param_offload_pools(), subject.device_shards()
        if subject.ctx.world_size == 1 or pools is None or shards is None:
            return None
        window, grad_buffers, host = pools
        device, act_host = subject.activations(self.activations)
        rpn = subject.ctx.ranks_per_node
        return RowBytes(window + shards, grad_buffers, device, host * rpn + act_host)


def largest_fitting(
    configuration: Configuration, subject: Subject, limits: Limits
) -> Subject | None:
    """The largest member of ``subject``'s family that ``configuration`` fits into
    ``limits``; see Note [largest that fits grows the row's own family]."""

    def fits(member: Subject) -> bool:
        row = configuration.bytes(member, limits)
        return row is not None and limits.fits(row) is not False

    return subject.largest(fits)
