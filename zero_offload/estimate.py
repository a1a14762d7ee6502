"""Memory estimator: bytes per tier for each way of training a model, and what fits.

Accounting (per rank, ``P`` parameters, ``s`` bytes per element of the training dtype,
``N`` ranks), after the ZeRO paper (Rajbhandari et al., SC'20, section 3.1): weights ``sP``,
gradients ``sP``, and Adam state ``KP`` with ``K = 12`` in mixed precision (fp32 master,
exp_avg, exp_avg_sq) and ``K = 8`` in fp32 (the weights are the master copy):

- no offload (DDP): device ``(2s + K) P``;
- ZeRO-1: device ``2sP + KP/N`` (optimizer state partitioned);
- ZeRO-2: device ``sP + (s + K) P/N`` (gradients partitioned too);
- ZeRO-Offload (this library): the exact pool sizes of ``OffloadAdamW`` from
  ``optim.placement.plan_placement`` with everything offloaded: device weights plus the
  gradient buffers, host fp32 master, gradient accumulator, moments and staging; the host
  part is partitioned over ``N`` (each rank updates its own shard). Given the parameters'
  shapes (a ``ModelShape`` or a model), the buckets are planned as the optimizer plans them,
  each slot aligned to ``SLOT_ALIGN_NUMEL`` elements (Note [slots are aligned] in
  ``partition.py``: fewer than 16 elements per parameter); from a bare parameter count,
  buckets are taken as full and gap-free, a lower bound by at most that much per parameter.

Activations (``L`` layers, hidden ``h``, heads ``a``, sequence ``S``, micro-batch ``b``,
after Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models",
2022, section 4.1): a layer keeps ``S b h (34 + 5 a S / h)`` bytes in 16-bit training (the
``5 a S / h`` term is the attention matrix, which memory-efficient attention does not keep,
so this is an upper bound), scaled by ``s / 2`` for other dtypes; the logits add
``S b V (s + 4)`` (training dtype plus the fp32 loss). Activation checkpointing keeps each
layer's input (``S b h s``) plus one layer's full activations while it is recomputed;
activation offload moves those inputs to the host and keeps ``prefetch_depth + 1`` of them on
the device.

Parameter offload (one rank, a ``ModelShape`` given; ``param_offload_bytes``): the device
holds the window of ``OffloadConfig(offload_parameters=True)`` instead of the weights, its
exact slots (``prefetch_layers + 2`` ring slots of the largest units, Note [a unit always
returns to its slot] in ``params/window.py``) planned from the same per-unit buckets as the
optimizer's, plus the gradient buffers; the host is as for ZeRO-Offload (the pinned weights
are the staging it already counts). The largest model that fits keeps the layer width and
grows the rest, so host memory bounds it.

Host memory is per node: ``ranks_per_node`` ranks (default: all of ``world_size``) share it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import psutil
import torch

from .config import OffloadConfig, format_bytes
from .optim.state.placement import POOL_ALIGNMENT, Placement, plan_placement
from .partition import BucketLayout, plan_buckets

__all__ = [
    "ConfigEstimate",
    "MemoryEstimate",
    "ModelShape",
    "estimate",
    "offload_adamw_bytes",
    "param_offload_bytes",
]

#: Default bucket size of ``OffloadConfig.bucket_bytes``.
DEFAULT_BUCKET_BYTES = int(OffloadConfig().bucket_bytes)
#: Activation checkpoints held on the device by activation offload (prefetch depth 1 + 1).
OFFLOAD_CHECKPOINTS_ON_DEVICE = 2
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ModelShape:
    """A GPT-style decoder (the demo's ``TinyGPT``): untied embeddings, pre-norm blocks."""

    layers: int
    hidden: int
    heads: int
    vocab: int
    seq_len: int
    micro_batch: int = 1

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ModelShape.{name} must be an int >= 1, got {value!r}")
        if self.hidden % self.heads:
            raise ValueError(f"ModelShape.heads={self.heads} must divide hidden={self.hidden}")

    def parameter_shapes(self) -> list[tuple[int, ...]]:
        """Every parameter's shape, in registration order."""
        h, v = self.hidden, self.vocab
        block = [(h,), (h,), (3 * h, h), (3 * h,), (h, h), (h,), (h,), (h,)]
        block += [(4 * h, h), (4 * h,), (h, 4 * h), (h,)]
        return [(v, h), (self.seq_len, h), *block * self.layers, (h,), (h,), (v, h)]

    def layer_activation_bytes(self, itemsize: int) -> int:
        """Bytes one layer keeps for backward without checkpointing (Korthikanti et al.)."""
        s, b, h, a = self.seq_len, self.micro_batch, self.hidden, self.heads
        return math.ceil(s * b * h * (34 + 5 * a * s / h) * itemsize / 2)

    def checkpoint_bytes(self, itemsize: int) -> int:
        """Bytes of one layer's input, what checkpointing keeps per layer."""
        return self.seq_len * self.micro_batch * self.hidden * itemsize

    def logits_bytes(self, itemsize: int) -> int:
        """Logits in the training dtype plus their fp32 copy for the loss."""
        return self.seq_len * self.micro_batch * self.vocab * (itemsize + 4)


@dataclass(frozen=True)
class ConfigEstimate:
    """One configuration's bytes per rank (device) and per node (host), and whether it fits."""

    name: str
    device_model_states: int  # weights, gradients, optimizer state on the device
    device_buffers: int  # the library's gradient buffers (ZeRO-Offload rows only)
    device_activations: int
    host: int  # per node
    fits: bool | None  # None: a memory size is unknown
    largest_fitting_params: int | None  # same activations; None: unknown

    @property
    def device_total(self) -> int:
        """Device bytes per rank."""
        return self.device_model_states + self.device_buffers + self.device_activations


@dataclass(frozen=True)
class MemoryEstimate:
    """The estimate: inputs and one row per configuration; ``table()`` prints it."""

    params: int
    dtype: str
    world_size: int
    ranks_per_node: int
    device_memory: int | None
    device_memory_source: str
    host_memory: int | None
    host_memory_source: str
    shape: ModelShape | None
    rows: list[ConfigEstimate] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-friendly data, with each row's ``device_total``."""
        out = asdict(self)
        out["rows"] = [dict(asdict(row), device_total=row.device_total) for row in self.rows]
        return out

    def table(self) -> str:
        """The estimate as text: a header, then one line per configuration."""
        from .profiling.report import format_table

        shape = self.shape
        head = f"zero-offload memory estimate: {_count(self.params)} parameters ({self.dtype})"
        head += f", world size {self.world_size}"
        if shape is not None:
            head += (
                f"; {shape.layers} layers x {shape.hidden} hidden, {shape.heads} heads, vocab "
                f"{shape.vocab}, micro-batch {shape.micro_batch} x {shape.seq_len} tokens"
            )
        else:
            head += "; activations not counted (give a model shape to count them)"
        head += (
            f"\ndevice memory {_size(self.device_memory)} per rank ({self.device_memory_source});"
            f" host memory {_size(self.host_memory)} per node ({self.host_memory_source})"
        )
        rows = [
            [
                row.name,
                _size(row.device_model_states),
                _size(row.device_buffers),
                _size(row.device_activations),
                _size(row.device_total),
                _size(row.host),
                {True: "yes", False: "no", None: "?"}[row.fits],
                _largest_text(row.largest_fitting_params),
            ]
            for row in self.rows
        ]
        header = ["configuration", "model states", "buffers", "activations", "device total"]
        header += ["host", "fits", "largest that fits"]
        note = (
            "\n\nmodel states: weights, gradients and Adam state on the device (ZeRO paper, "
            "2 + 2 + 12 bytes per parameter in mixed precision); buffers: OffloadAdamW's "
            "gradient buffers; host: OffloadAdamW's pools per node.\nlargest that fits: the "
            "most parameters each configuration holds with the same activations."
        )
        return head + "\n\n" + format_table(header, rows) + note


def _largest_text(params: int | None) -> str:
    if params is None:
        return "-"
    return _count(params) if params else "none"


def _size(nbytes: int | None) -> str:
    return "unknown" if nbytes is None else format_bytes(nbytes)


def _count(params: int) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if params >= scale:
            return f"{params / scale:.2f} {unit}"
    return str(params)


def offload_adamw_bytes(
    shapes: Sequence[tuple[int, ...]], *, itemsize: int, bucket_bytes: int, world_size: int = 1
) -> tuple[int, int, int]:
    """``(device weights, device gradient buffers, host per rank)`` of a fully offloaded
    ``OffloadAdamW`` over parameters of ``shapes``: its exact pool sizes, in bytes."""
    layouts = plan_buckets(
        [[(i, shape) for i, shape in enumerate(shapes)]],
        bucket_numel=max(1, bucket_bytes // itemsize),
        world_size=world_size,
        align_numel=POOL_ALIGNMENT // 2,
    )
    placement = _full_offload(layouts, itemsize=itemsize)
    # plan_placement sizes the host pool for this rank's shards already.
    return placement.device_weights, placement.device_grad_buffers, placement.host_state


def _full_offload(
    layouts: Sequence[BucketLayout],
    *,
    itemsize: int,
    weights_elsewhere: frozenset[int] = frozenset(),
) -> Placement:
    """``plan_placement`` of ``layouts`` with everything offloaded, fp32 moments, no
    budget."""
    return plan_placement(
        layouts,
        itemsize=itemsize,
        moment_size=4,
        amsgrad=False,
        offload_fraction=1.0,
        device_free=2**62,
        auto_headroom=0.0,
        alignment=POOL_ALIGNMENT,
        weights_elsewhere=weights_elsewhere,
    )


def param_offload_bytes(
    shape: ModelShape, *, itemsize: int, bucket_bytes: int, prefetch_layers: int = 1
) -> tuple[int, int, int]:
    """``(device window, device gradient buffers, host)`` of ``OffloadAdamW`` with
    ``OffloadConfig(offload_parameters=True)`` over a model of ``shape`` (its units: token
    and position embeddings, each block, the final norm, the head), one rank: the exact
    pool sizes, from buckets planned per unit as the optimizer plans them."""
    from .memory.align import aligned
    from .params.window import plan_slots  # params sits above the estimator's inputs

    shapes = shape.parameter_shapes()
    per_block = (len(shapes) - 5) // shape.layers
    units = [[0], [1]]
    units += [list(range(2 + i * per_block, 2 + (i + 1) * per_block)) for i in range(shape.layers)]
    units += [[len(shapes) - 3, len(shapes) - 2], [len(shapes) - 1]]
    layouts = []
    unit_bytes = []
    for unit in units:
        nbytes = 0
        for layout in plan_buckets(
            [[(i, shapes[i]) for i in unit]],
            bucket_numel=max(1, bucket_bytes // itemsize),
            align_numel=POOL_ALIGNMENT // 2,
        ):
            layouts.append(dataclasses.replace(layout, index=len(layouts)))
            nbytes += aligned(layout.padded_numel * itemsize, POOL_ALIGNMENT)
        unit_bytes.append(nbytes)
    _, slot_bytes = plan_slots(unit_bytes, [False] * len(units), prefetch_layers=prefetch_layers)
    placement = _full_offload(
        layouts, itemsize=itemsize, weights_elsewhere=frozenset(b.index for b in layouts)
    )
    return sum(slot_bytes), placement.device_grad_buffers, placement.host_state


def _offload_bytes_of_count(
    params: int, *, itemsize: int, bucket_bytes: int, world_size: int
) -> tuple[int, int, int]:
    """``offload_adamw_bytes`` of ``params`` elements in full buckets plus one partial bucket.

    Full buckets are identical, so one is planned and multiplied: exact, and O(1) in
    ``params`` (the search for the largest model calls this dozens of times).
    """
    bucket_numel = max(1, bucket_bytes // itemsize)
    full, rest = divmod(params, bucket_numel)
    weights = grad_buffers = host = 0
    for count, numel in ((full, bucket_numel), (1, rest)):
        if count and numel:
            w, g, h = offload_adamw_bytes(
                [(numel,)], itemsize=itemsize, bucket_bytes=bucket_bytes, world_size=world_size
            )
            weights, grad_buffers, host = (
                weights + count * w,
                max(grad_buffers, g),
                host + count * h,
            )
    return weights, grad_buffers, host


class _Accountant:
    """Bytes of each configuration as a function of the parameter count."""

    def __init__(
        self,
        *,
        itemsize: int,
        world_size: int,
        ranks_per_node: int,
        bucket_bytes: int,
        shape: ModelShape | None,
    ) -> None:
        self.s = itemsize
        self.k = 8 if itemsize == 4 else 12
        self.n = world_size
        self.ranks_per_node = ranks_per_node
        self.bucket_bytes = bucket_bytes
        self.shape = shape
        # Parameter offload: one rank, the layer shapes known (the window is per layer).
        self.param_offload = (
            param_offload_bytes(shape, itemsize=itemsize, bucket_bytes=bucket_bytes)
            if shape is not None and world_size == 1
            else None
        )

    def activations(self) -> tuple[int, int, int]:
        """``(full, checkpointed, offloaded-on-device)`` activation bytes; host part of offload."""
        shape, s = self.shape, self.s
        if shape is None:
            return 0, 0, 0
        layer, ckpt = shape.layer_activation_bytes(s), shape.checkpoint_bytes(s)
        logits = shape.logits_bytes(s)
        full = shape.layers * layer + logits
        checkpointed = shape.layers * ckpt + layer + logits
        offloaded = min(shape.layers, OFFLOAD_CHECKPOINTS_ON_DEVICE) * ckpt + layer + logits
        return full, checkpointed, offloaded

    def rows(
        self, params: int, shapes: Sequence[tuple[int, ...]] | None = None
    ) -> list[tuple[str, int, int, int, int]]:
        """``(name, model states, buffers, activations, host)`` for each configuration."""
        s, k, n, p = self.s, self.k, self.n, params
        if shapes is None:
            weights, grad_buffers, host = _offload_bytes_of_count(
                p, itemsize=s, bucket_bytes=self.bucket_bytes, world_size=n
            )
        else:
            weights, grad_buffers, host = offload_adamw_bytes(
                shapes, itemsize=s, bucket_bytes=self.bucket_bytes, world_size=n
            )
        host_node = host * self.ranks_per_node
        full, checkpointed, offloaded = self.activations()
        ckpt_host = 0
        if self.shape is not None:
            ckpt_host = self.shape.layers * self.shape.checkpoint_bytes(s) * self.ranks_per_node
        return [
            ("no offload (DDP)", (2 * s + k) * p, 0, full, 0),
            ("ZeRO-1", 2 * s * p + -(-k * p // n), 0, full, 0),
            ("ZeRO-2", s * p + -(-(s + k) * p // n), 0, full, 0),
            ("ZeRO-Offload", weights, grad_buffers, full, host_node),
            ("ZeRO-Offload + checkpointing", weights, grad_buffers, checkpointed, host_node),
            (
                "ZeRO-Offload + activation offload",
                weights,
                grad_buffers,
                offloaded,
                host_node + ckpt_host,
            ),
            *self._param_offload_rows(host_node, full, checkpointed, exact=shapes is not None),
        ]

    def _param_offload_rows(
        self, host_node: int, full: int, checkpointed: int, *, exact: bool
    ) -> list[tuple[str, int, int, int, int]]:
        """The parameter-offload rows (none without a shape or with several ranks); the
        window stays that of the shape's layers while the largest-model search grows the
        parameter count."""
        if self.param_offload is None:
            return []
        window, grad_buffers, host = self.param_offload
        host = host * self.ranks_per_node if exact else host_node
        return [
            ("ZeRO-Offload + parameter offload", window, grad_buffers, full, host),
            (
                "ZeRO-Offload + param offload + checkpointing",
                window,
                grad_buffers,
                checkpointed,
                host,
            ),
        ]


def _fits(
    device: int, host: int, device_memory: int | None, host_memory: int | None
) -> bool | None:
    if device_memory is not None and device > device_memory:
        return False
    if host_memory is not None and host > host_memory:
        return False
    return None if device_memory is None or host_memory is None else True


def _largest(
    accountant: _Accountant, row: int, device_memory: int | None, host_memory: int | None
) -> int | None:
    """Largest parameter count whose row ``row`` fits (binary search, monotone in params)."""
    if device_memory is None:
        return None

    def fits(params: int) -> bool:
        _, states, buffers, acts, host = accountant.rows(params)[row]
        return _fits(states + buffers + acts, host, device_memory, host_memory) is not False

    low, high = 0, 1
    while fits(high) and high < 10**15:
        low, high = high, high * 2
    while high - low > max(1, low // 1000):  # 0.1% is precise enough for a table
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def _model_inputs(
    model: int | ModelShape | torch.nn.Module, dtype: str | torch.dtype | None
) -> tuple[int, list[tuple[int, ...]] | None, ModelShape | None, torch.dtype]:
    if isinstance(model, torch.nn.Module):
        params = [p for p in model.parameters() if p.requires_grad and p.numel()]
        chosen = params[0].dtype if params and dtype is None else dtype
        shapes = [tuple(p.shape) for p in params]
        return sum(p.numel() for p in params), shapes, None, _dtype(chosen)
    if isinstance(model, ModelShape):
        shapes = model.parameter_shapes()
        return sum(math.prod(s) for s in shapes), shapes, model, _dtype(dtype)
    if isinstance(model, bool) or not isinstance(model, int) or model < 1:
        raise TypeError(
            f"model must be a parameter count (int >= 1), a ModelShape or an nn.Module, "
            f"got {type(model).__name__} {model!r}"
        )
    return model, None, None, _dtype(dtype)


def _dtype(dtype: str | torch.dtype | None) -> torch.dtype:
    if dtype is None:
        return torch.bfloat16
    if isinstance(dtype, torch.dtype) and dtype in _DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype in _DTYPES:
        return _DTYPES[dtype]
    raise ValueError(f"dtype must be one of {', '.join(_DTYPES)}, got {dtype!r}")


def _machine_memory(
    device_memory: int | None, host_memory: int | None
) -> tuple[int | None, str, int, str]:
    if device_memory is not None:
        device_source = "given"
    elif torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        device_memory, device_source = props.total_memory, f"this machine's {props.name}"
    else:
        device_source = "unknown: no GPU here; pass device_memory / --device-memory"
    if host_memory is not None:
        return device_memory, device_source, host_memory, "given"
    return device_memory, device_source, psutil.virtual_memory().total, "this machine's RAM"


def estimate(
    model: int | ModelShape | torch.nn.Module,
    *,
    world_size: int = 1,
    ranks_per_node: int | None = None,
    dtype: str | torch.dtype | None = None,
    device_memory: int | None = None,
    host_memory: int | None = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> MemoryEstimate:
    """Estimate training memory per tier for each configuration; see the module docstring.

    ``model``: a parameter count, a ``ModelShape`` (activations counted too), or an
    ``nn.Module`` (its trainable parameters' exact shapes). ``dtype``: training dtype
    (``"bfloat16"`` default, or the module's). ``device_memory`` (bytes per rank) defaults to
    this machine's GPU; ``host_memory`` (bytes per node) to this machine's RAM.
    """
    for name, value in (("world_size", world_size), ("bucket_bytes", bucket_bytes)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    ranks_per_node = world_size if ranks_per_node is None else ranks_per_node
    if not isinstance(ranks_per_node, int) or not 1 <= ranks_per_node <= world_size:
        raise ValueError(
            f"ranks_per_node must be in [1, world_size={world_size}], got {ranks_per_node!r}"
        )
    params, shapes, shape, chosen = _model_inputs(model, dtype)
    device_memory, device_source, host_memory, host_source = _machine_memory(
        device_memory, host_memory
    )
    accountant = _Accountant(
        itemsize=chosen.itemsize,
        world_size=world_size,
        ranks_per_node=ranks_per_node,
        bucket_bytes=bucket_bytes,
        shape=shape,
    )
    rows = []
    for index, (name, states, buffers, acts, host) in enumerate(accountant.rows(params, shapes)):
        rows.append(
            ConfigEstimate(
                name=name,
                device_model_states=states,
                device_buffers=buffers,
                device_activations=acts,
                host=host,
                fits=_fits(states + buffers + acts, host, device_memory, host_memory),
                largest_fitting_params=_largest(accountant, index, device_memory, host_memory),
            )
        )
    return MemoryEstimate(
        params=params,
        dtype=str(chosen).removeprefix("torch."),
        world_size=world_size,
        ranks_per_node=ranks_per_node,
        device_memory=device_memory,
        device_memory_source=device_source,
        host_memory=host_memory,
        host_memory_source=host_source,
        shape=shape,
        rows=rows,
    )
