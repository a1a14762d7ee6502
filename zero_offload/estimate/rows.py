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
from collections.abc import Callable
from dataclasses import dataclass, field

from ..activation_sizes import checkpoint_pool_bytes
from .buckets import BucketGroups
from .planners import reads_whole, rule_state, shaped_state_bytes
from .shape import ModelShape, Shape

__all__ = [
    "ActivationMode",
    "Configuration",
    "Context",
    "DeviceShards",
    "Limits",
    "RowBytes",
    "Status",
    "Subject",
    "largest_fitting",
    "nvme_refusal",
    "param_offload_refusal",
]

#: The search stops growing a family here (a model this large does not fit anything).
_SEARCH_CAP = 2**50


@dataclass(frozen=True)
class Context:
    """The training setup every row shares."""

    itemsize: int  # training dtype bytes
    world_size: int
    ranks_per_node: int
    bucket_bytes: int
    #: The optimizer rule whose state the rows size (``optim/rule/``, ``by_name``).
    rule: str = "adamw"
    #: The dtype of the rule's moments in an offloaded bucket (``OffloadConfig.moments_dtype``:
    #: ``"float32"`` or ``"bfloat16"``); the master and any shaped state stay fp32.
    moments_dtype: str = "float32"

    @property
    def whole(self) -> bool:
        """Whether the rule reads whole parameters (Adafactor, Muon: Note [rules that read
        a whole parameter] in ``optim/rule/base.py``)."""
        return reads_whole(self.rule)

    @property
    def state_bytes(self) -> int:
        """Optimizer state bytes per parameter (ZeRO paper's ``K``), from the rule: its
        fields, the moments in ``moments_dtype`` (for AdamW the master and two moments, 12
        in fp32, 8 in bf16) in mixed precision; in fp32 less the master, since the weights
        are the master copy (8, or 4). Per element only: Adafactor's shaped state (its
        factors) depends on the shapes, not the count (``pools.rule_state_bytes``)."""
        fields = rule_state(self.rule, self.moments_dtype)
        return fields.bytes_per_element - (4 if self.itemsize == 4 else 0)


@dataclass(frozen=True)
class RowBytes:
    """One configuration's bytes: device per rank, host and disk per node."""

    model_states: int  # weights, gradients, optimizer state on the device
    buffers: int  # device pools beside the weights: gradient buffers, accumulators, shadows
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
        """``(device weights, device gradient buffers, host per rank)`` of the optimizer of
        ``ctx.rule``."""

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

    def shaped_state(self) -> int:
        """fp32 bytes of the rule's shaped state over every parameter (Adafactor's factors,
        Muon's momentum and its AdamW moments), alignment aside: what the paper's rows add
        to ``K P``; 0 for an elementwise rule."""
        if not self.ctx.whole:
            return 0
        return shaped_state_bytes(self.ctx.rule, self._shape_counts())

    def _shape_counts(self) -> list[tuple[Shape, int]]:
        """``(shape, how many parameters of it)`` over the subject's parameters."""
        bucket_numel = max(1, self.ctx.bucket_bytes // self.ctx.itemsize)
        full, rest = divmod(self.params, bucket_numel)  # a count: 1-D, bucket by bucket
        return [((bucket_numel,), full), ((rest,), 1 if rest else 0)]

    @abstractmethod
    def _plan_groups(self) -> BucketGroups:
        """The optimizer's buckets in bucket order (``buckets.BucketGroups``)."""

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
        host_pool, device_pool = checkpoint_pool_bytes(ckpt, shape.layers)
        return device_pool + layer + logits, host_pool * self.ctx.ranks_per_node

    def activation_pools(self) -> tuple[int, int] | None:
        """``(host_pool_bytes, device_pool_bytes)`` of each rank's ``ActivationOffloadConfig``
        in the activation-offload rows, prefetch depth 1 (Note [pools sized for checkpointed
        layers] in activation_sizes.py); ``None`` without a shape."""
        shape = self.shape
        if shape is None:
            return None
        return checkpoint_pool_bytes(shape.checkpoint_bytes(self.ctx.itemsize), shape.layers)

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

    RUNS = "yes"  # the optimizer runs it; its pools are the library's exact sizes
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

    def refusal(self, ctx: Context) -> str | None:
        """Why the optimizer's construction refuses this configuration for ``ctx``'s rule and
        ranks (``optim/checks.py``, ``refuse_whole_parameter_features``), so that it is no
        row but a ``MemoryEstimate.left_out`` line; None: a row, sized for the rule."""
        return None

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
        states = model_state_bytes(self.stage, p, ctx, shaped=subject.shaped_state())
        return RowBytes(states, 0, device, host)

    def status(self, ctx: Context) -> tuple[Status, str]:
        return Status.PAPER, "the ZeRO paper's accounting (model states on the device)"


def model_state_bytes(stage: int, params: int, ctx: Context, *, shaped: int = 0) -> int:
    """Device bytes of weights, gradients and optimizer state per rank at ZeRO ``stage``
    (0: DDP): ``(2s + K) P``, ``2sP + KP/N``, ``sP + (s + K)P/N``, ``(2s + K)P/N``, each
    partitioned part rounded up to whole bytes; ``shaped``: the rule's shaped state
    (``Subject.shaped_state``), with ``KP`` wherever it is."""
    s, k, n, p = ctx.itemsize, ctx.state_bytes, ctx.world_size, params
    state = k * p + shaped
    return {
        0: 2 * s * p + state,
        1: 2 * s * p + -(-state // n),
        2: s * p + -(-(s * p + state) // n),
        3: -(-(2 * s * p + state) // n),
    }[stage]


@dataclass(frozen=True)
class Offloaded(Configuration):
    """ZeRO-Offload with this library: the optimizer's exact pools, everything offloaded;
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

    def refusal(self, ctx: Context) -> str | None:
        return param_offload_refusal(ctx)

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

    def refusal(self, ctx: Context) -> str | None:
        if ctx.whole and ctx.world_size > 1:
            return (
                f"partition_parameters=True: ZeRO-3's flat-range shards cut the parameters "
                f"that {ctx.rule} reads whole"
            )
        return None

    def bytes(self, subject: Subject, limits: Limits) -> RowBytes | None:
        pools, shards = subject.param_offload_pools(), subject.device_shards()
        if subject.ctx.world_size == 1 or pools is None or shards is None:
            return None
        window, grad_buffers, host = pools
        device, act_host = subject.activations(self.activations)
        rpn = subject.ctx.ranks_per_node
        return RowBytes(window + shards, grad_buffers, device, host * rpn + act_host)


def param_offload_refusal(ctx: Context) -> str | None:
    """``offload_parameters=True`` on several ranks (ZeRO-3 with offload) for a rule that
    reads whole parameters: refused, as construction refuses it."""
    if ctx.whole and ctx.world_size > 1:
        return (
            f"offload_parameters=True on {ctx.world_size} ranks: ZeRO-3 with offload shards "
            f"each unit by flat range, which cuts the parameters that {ctx.rule} reads whole"
        )
    return None


def nvme_refusal(ctx: Context) -> str | None:
    """NVMe state (``nvme_dir``) for a rule that reads whole parameters: refused on several
    ranks, as construction refuses it (on one rank its records follow whole parameters,
    Note [NVMe tiles follow whole parameters] in ``optim/state/nvme_plan.py``, and the
    tiers plan them so: ``nvme.whole_bucket_tiers``)."""
    if ctx.whole and ctx.world_size > 1:
        return (
            f"nvme_dir on {ctx.world_size} ranks: {ctx.rule}'s records are planned over one "
            "rank's whole bucket"
        )
    return None


def largest_fitting(
    configuration: Configuration, subject: Subject, limits: Limits
) -> Subject | None:
    """The largest member of ``subject``'s family that ``configuration`` fits into
    ``limits``; see Note [largest that fits grows the row's own family]."""

    def fits(member: Subject) -> bool:
        row = configuration.bytes(member, limits)
        return row is not None and limits.fits(row) is not False

    return subject.largest(fits)
