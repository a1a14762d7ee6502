"""``estimate()``: its inputs checked and resolved, then one row per configuration."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..config import parse_bytes_with_unit
from .configs import load_config, shape_from_config
from .result import ConfigEstimate, LeftOutRow, MemoryEstimate
from .rows import Context, Limits, Status, Subject, largest_fitting
from .shape import ModelShape, Shape
from .subjects import CountSubject, ModuleSubject, ShapeSubject
from .tiered import CONFIGURATIONS

if TYPE_CHECKING:
    import torch

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "DEFAULT_MICRO_BATCH",
    "DEFAULT_SEQ_LEN",
    "MOMENTS_DTYPES",
    "OPTIMIZERS",
    "estimate",
    "host_reserve",
    "parse_size",
]

#: The optimizers the estimate sizes, by the names of their rules (``optim.rule.RULES``;
#: named here so that choosing one imports no torch).
OPTIMIZERS = ("adamw", "adam", "lion", "adagrad", "adafactor", "muon")

#: The dtypes of the optimizer's moments the estimate sizes (``OffloadConfig.moments_dtype``).
MOMENTS_DTYPES = ("float32", "bfloat16")

#: Default bucket size of ``OffloadConfig.bucket_bytes`` (32 MiB).
DEFAULT_BUCKET_BYTES = 32 * 2**20
_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}
#: The least ``device_memory`` / ``host_memory`` given as a bare int (bytes): a smaller one is
#: a size whose unit was forgotten.
_LEAST_MEMORY = 2**20
#: ``estimate()``'s default tokens per sequence and sequences per micro-batch, for the shapes
#: it builds from a config (and the command's, for the shape its flags give).
DEFAULT_SEQ_LEN = 1024
DEFAULT_MICRO_BATCH = 1


def parse_size(value: int | str, *, name: str, least: int = 1, ints: bool = True) -> int:
    """A byte size: a string with a unit (``"24GiB"``, ``"24GB"``, ``"512MiB"``, ``"1e9B"``)
    or an int of bytes, at least ``least``. A string without a unit is refused, never read as
    bytes (``config.parse_bytes_with_unit``; ``ints=False`` for a flag, whose value is a
    string). Raises ``ValueError``/``TypeError`` naming ``name``, the value and an example."""
    nbytes = parse_bytes_with_unit(value, name=name, ints=ints)
    if nbytes < least:
        example = f"{value}GiB" if isinstance(value, int) and value else "24GiB"
        raise ValueError(
            f"{name}={value!r} is {nbytes} bytes, less than {least}; give a size with a "
            f"unit, e.g. '{example}'"
        )
    return nbytes


def host_reserve(host_memory: int) -> int:
    """Host bytes a configuration must leave free to fit: max(10% of the RAM, 2 GiB), what
    ``OffloadConfig(host_budget="auto")`` leaves for activations, the data loader, the
    interpreter and the page cache."""
    from ..optim.state.nvme_plan import AUTO_HOST_HEADROOM_FRACTION, AUTO_HOST_HEADROOM_MIN

    return max(int(host_memory * AUTO_HOST_HEADROOM_FRACTION), AUTO_HOST_HEADROOM_MIN)


def _dtype_name(dtype: str | torch.dtype | None) -> str:
    if dtype is None:
        return "bfloat16"
    name = dtype if isinstance(dtype, str) else None
    if _is_torch(dtype):  # a torch.dtype, named without importing torch
        name = str(dtype).removeprefix("torch.")
    if name not in _ITEMSIZE:
        raise ValueError(f"dtype must be one of {', '.join(_ITEMSIZE)}, got {dtype!r}")
    return name


def _is_torch(value: object) -> bool:
    return type(value).__module__.startswith("torch")


@dataclass(frozen=True)
class MixedShapes:
    """A module's parameter shapes in more than one training dtype, and each one's bytes
    per element."""

    shapes: list[Shape]
    itemsizes: list[int]


def _model_source(
    model: Any, dtype: str | torch.dtype | None, *, seq_len: int, micro_batch: int
) -> tuple[str, ModelShape | list[Shape] | MixedShapes | int]:
    """``(dtype name, what the subject is built from)``: a shape, a module's parameter
    shapes (with their dtypes where they differ and ``dtype`` is not given), or a
    count."""
    torch_module = sys.modules.get("torch")  # a module or dtype exists only if torch is loaded
    if torch_module is not None and isinstance(model, torch_module.nn.Module):
        params = [p for p in model.parameters() if p.requires_grad and p.numel()]
        count = sum(p.numel() for p in params)
        if dtype is None and len({p.dtype for p in params}) > 1:
            # Each parameter by its own dtype (bf16 layers with fp32 norms); the rows that
            # size buckets by one dtype take the one of most elements.
            numel: dict[str, int] = {}
            for p in params:
                key = _dtype_name(p.dtype)
                numel[key] = numel.get(key, 0) + p.numel()
            name = max(numel, key=lambda key: numel[key])
            itemsizes = [_ITEMSIZE[_dtype_name(p.dtype)] for p in params]
            return name, MixedShapes([tuple(p.shape) for p in params], itemsizes)
        name = _dtype_name(params[0].dtype if params and dtype is None else dtype)
        config = getattr(model, "config", None)
        if config is not None and hasattr(config, "to_dict"):  # a transformers model
            try:
                shape = shape_from_config(config, seq_len=seq_len, micro_batch=micro_batch)
            except (TypeError, ValueError):
                shape = None
            if shape is not None and shape.params == count:  # nothing frozen, nothing added
                return name, shape
        return name, [tuple(p.shape) for p in params]
    if isinstance(model, ModelShape):
        _check_shape_takes(model, seq_len=seq_len, micro_batch=micro_batch)
        return _dtype_name(dtype), model
    if isinstance(model, (str, Path)):
        model = load_config(model)
    if isinstance(model, Mapping) or (hasattr(model, "to_dict") and hasattr(model, "model_type")):
        return _dtype_name(dtype), shape_from_config(
            model, seq_len=seq_len, micro_batch=micro_batch
        )
    if isinstance(model, bool) or not isinstance(model, int) or model < 1:
        raise TypeError(
            "model must be a parameter count (int >= 1), a ModelShape, an nn.Module, a "
            "transformers config (object, dict, config.json path or a known name such as "
            f"'llama-3-8b'), got {type(model).__name__} {model!r}"
        )
    return _dtype_name(dtype), model


def _check_shape_takes(shape: ModelShape, *, seq_len: int, micro_batch: int) -> None:
    """A ``ModelShape`` carries its own ``seq_len`` and ``micro_batch``: ``estimate``'s are
    for the shapes it builds (from a config or a module's config). Given with a shape, they
    must be the defaults or the shape's own; another value would be silently ignored."""
    differ = [
        f"{name}={given}"
        for name, given, default, own in (
            ("seq_len", seq_len, DEFAULT_SEQ_LEN, shape.seq_len),
            ("micro_batch", micro_batch, DEFAULT_MICRO_BATCH, shape.micro_batch),
        )
        if given not in (default, own)
    ]
    if differ:
        raise ValueError(
            f"estimate(ModelShape, {', '.join(differ)}): a ModelShape's activations are sized "
            f"by its own seq_len={shape.seq_len} and micro_batch={shape.micro_batch}, not by "
            "estimate()'s; pass dataclasses.replace(shape, "
            f"{', '.join(differ)}) instead"
        )


def _machine_memory(
    device_memory: int | None, host_memory: int | None
) -> tuple[int | None, str, int, str]:
    if device_memory is not None:
        device_source = "given"
    else:
        import torch  # only to ask for a GPU

        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(torch.cuda.current_device())
            device_memory, device_source = props.total_memory, f"this machine's {props.name}"
        else:
            device_source = "unknown: no GPU here; pass device_memory / --device-memory"
    if host_memory is not None:
        return device_memory, device_source, host_memory, "given"
    from ..memory.host_ram import host_ram

    ram = host_ram()  # a container's limit where it has one (Note [host RAM in a container])
    source = "this container's memory limit" if ram.limited else "this machine's RAM"
    return device_memory, device_source, ram.total, source


def estimate(
    model: int | ModelShape | torch.nn.Module | Mapping[str, Any] | str | Path | Any,
    *,
    world_size: int = 1,
    ranks_per_node: int | None = None,
    dtype: str | torch.dtype | None = None,
    device_memory: int | str | None = None,
    host_memory: int | str | None = None,
    bucket_bytes: int | str = DEFAULT_BUCKET_BYTES,
    seq_len: int = DEFAULT_SEQ_LEN,
    micro_batch: int = DEFAULT_MICRO_BATCH,
    disk_memory: int | str | None = None,
    optimizer: str = "adamw",
    moments_dtype: str = "float32",
) -> MemoryEstimate:
    """Estimate training memory per tier for each configuration; returns the estimate (its
    ``table()`` is what ``zero-offload estimate`` prints). See ``docs/estimator.md``.

    ``model``: a parameter count; a ``ModelShape`` (activations counted too); an
    ``nn.Module`` (its trainable parameters' exact shapes, or its transformers config's
    shape when that counts the same parameters); a transformers config (a
    ``PretrainedConfig``, its dict, a ``config.json`` path or folder, or a name in
    ``KNOWN_MODELS`` such as ``"llama-3-8b"``), whose shape takes ``seq_len`` and
    ``micro_batch``. A ``ModelShape`` has its own ``seq_len`` and ``micro_batch``: others
    given with it are refused (``ValueError``; use ``dataclasses.replace(shape, seq_len=...,
    micro_batch=...)``). ``dtype``: training dtype (``"bfloat16"`` default, or the module's).
    ``device_memory`` (per rank) and ``host_memory`` (per node): a size with a unit
    (``"80GiB"``, ``"24GB"``) or an int of bytes (at least 1 MiB); default this machine's GPU
    and RAM. ``disk_memory``: NVMe bytes per node for ``nvme_dir`` (default none: rows with
    NVMe then fit only what needs no disk). ``bucket_bytes``: ``OffloadConfig.bucket_bytes``,
    the same forms. ``optimizer``: the rule whose state the rows size, one of ``OPTIMIZERS``
    (``"adamw"`` default): its fields, and for Adafactor and Muon the state shaped by each
    parameter and, on several ranks, each parameter in one rank's shard; rows the library
    refuses for that rule are left out, with the reason (``MemoryEstimate.left_out``).
    ``moments_dtype``: ``OffloadConfig.moments_dtype``, one of ``MOMENTS_DTYPES``
    (``"float32"`` default): the dtype of the rule's moments in the host pools, the NVMe
    records and their I/O buffers, and in the paper rows' ``K`` (``"bfloat16"``: AdamW 8
    bytes per parameter instead of 12, Lion and Adagrad 6 instead of 8; the fp32 master,
    Adafactor's and Muon's shaped state, and a resident bucket's state stay fp32).
    """
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {optimizer!r}")
    if moments_dtype not in MOMENTS_DTYPES:
        raise ValueError(
            f"moments_dtype must be one of {', '.join(MOMENTS_DTYPES)} "
            f"(OffloadConfig.moments_dtype), got {moments_dtype!r}"
        )
    for name, value in (
        ("world_size", world_size),
        ("seq_len", seq_len),
        ("micro_batch", micro_batch),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    ranks_per_node = world_size if ranks_per_node is None else ranks_per_node
    if (
        isinstance(ranks_per_node, bool)
        or not isinstance(ranks_per_node, int)
        or not 1 <= ranks_per_node <= world_size
    ):
        raise ValueError(
            f"ranks_per_node must be in [1, world_size={world_size}], got {ranks_per_node!r}"
        )
    if world_size % ranks_per_node:
        # Host and disk are per node, the node holding ranks_per_node ranks: a partial node
        # is not modelled.
        raise ValueError(
            f"world_size={world_size} is not a multiple of ranks_per_node={ranks_per_node}: "
            "the host and disk bytes are per node of ranks_per_node ranks, and the nodes must "
            f"be full; use world_size={-(-world_size // ranks_per_node) * ranks_per_node} or a "
            "ranks_per_node that divides it"
        )
    bucket = parse_size(bucket_bytes, name="bucket_bytes", least=1024)
    device = (
        None
        if device_memory is None
        else parse_size(device_memory, name="device_memory", least=_LEAST_MEMORY)
    )
    host = (
        None
        if host_memory is None
        else parse_size(host_memory, name="host_memory", least=_LEAST_MEMORY)
    )
    disk = (
        None
        if disk_memory is None
        else parse_size(disk_memory, name="disk_memory", least=_LEAST_MEMORY)
    )
    dtype_name, what = _model_source(model, dtype, seq_len=seq_len, micro_batch=micro_batch)
    device, device_source, host, host_source = _machine_memory(device, host)
    ctx = Context(
        itemsize=_ITEMSIZE[dtype_name],
        world_size=world_size,
        ranks_per_node=ranks_per_node,
        bucket_bytes=bucket,
        rule=optimizer,
        moments_dtype=moments_dtype,
    )
    subject: Subject
    if isinstance(what, ModelShape):
        subject = ShapeSubject(what, ctx)
    elif isinstance(what, MixedShapes):
        subject = ModuleSubject(what.shapes, ctx, itemsizes=what.itemsizes)
    elif isinstance(what, list):
        subject = ModuleSubject(what, ctx)
    else:
        subject = CountSubject(what, ctx)
    limits = Limits(device=device, host=host, host_reserve=host_reserve(host), disk=disk)
    rows, left_out = [], []
    for configuration in CONFIGURATIONS:
        refused = configuration.refusal(ctx)
        if refused is not None:
            left_out.append(LeftOutRow(configuration.name, refused))
            continue
        row = configuration.bytes(subject, limits)
        if row is None:
            continue
        status, reason = configuration.status(ctx)
        largest = None
        if limits.device is not None:
            largest = largest_fitting(configuration, subject, limits)
        rows.append(
            ConfigEstimate(
                name=configuration.name,
                device_model_states=row.model_states,
                device_buffers=row.buffers,
                device_activations=row.activations,
                host=row.host,
                fits=limits.fits(row),
                largest_fitting_params=(
                    None if limits.device is None else largest.params if largest else 0
                ),
                largest_fitting_layers=(
                    largest.shape.layers if largest is not None and largest.shape else None
                ),
                disk=row.disk,
                library=status.value,
                not_run=reason if status is Status.NOT_YET else "",
                conditions=configuration.conditions(),
            )
        )
    return MemoryEstimate(
        params=subject.params,
        dtype=dtype_name,
        world_size=world_size,
        ranks_per_node=ranks_per_node,
        device_memory=device,
        device_memory_source=device_source,
        host_memory=host,
        host_memory_source=host_source,
        host_reserve=limits.host_reserve,
        shape=subject.shape,
        rows=rows,
        disk_memory=disk,
        optimizer=optimizer,
        left_out=left_out,
        moments_dtype=moments_dtype,
        activation_pools=subject.activation_pools(),
    )
