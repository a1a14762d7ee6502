"""The estimate as data (``MemoryEstimate``, one ``ConfigEstimate`` per row) and as text."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from ..activation_sizes import DEFAULT_DEVICE_POOL_BYTES, DEFAULT_HOST_POOL_BYTES
from ..config import format_bytes
from .shape import ModelShape

__all__ = ["ConfigEstimate", "LeftOutRow", "MemoryEstimate", "format_count"]


@dataclass(frozen=True)
class ConfigEstimate:
    """One configuration's bytes per rank (device) and per node (host, disk), whether it
    fits, and whether the library runs it."""

    name: str
    device_model_states: int  # weights, gradients, optimizer state on the device
    # The library's device pools beside the weights (ZeRO-Offload rows only): the gradient
    # buffers, and in the rows with several micro-batches or overlap_step the fp32 device
    # accumulators and weight shadows.
    device_buffers: int
    device_activations: int
    host: int  # per node
    fits: bool | None  # None: a memory size is unknown
    # The largest model of the same family that fits (Note [largest that fits grows the
    # row's own family] in rows.py): its parameters, 0 if none fits, None if unknown; and
    # its layers when the family is a shape.
    largest_fitting_params: int | None
    largest_fitting_layers: int | None = None
    disk: int = 0  # NVMe per node
    # "yes": the library runs it; "paper": the ZeRO paper's accounting of another system;
    # "not yet": an estimate of what the library does not run yet, ``not_run`` saying why.
    library: str = "yes"
    not_run: str = ""
    # What the training loop must keep to for the row to hold (empty: nothing), e.g. no
    # gradient clipping for in-flight gradient staging (estimate/in_flight.py).
    conditions: str = ""

    @property
    def device_total(self) -> int:
        """Device bytes per rank."""
        return self.device_model_states + self.device_buffers + self.device_activations


@dataclass(frozen=True)
class LeftOutRow:
    """A configuration the library refuses for the estimate's optimizer and ranks, and so
    no row (``Configuration.refusal``): its name and why."""

    name: str
    reason: str


@dataclass(frozen=True)
class MemoryEstimate:
    """The estimate: inputs and one row per configuration. ``table()`` is the text that
    ``zero-offload estimate`` prints; ``to_dict()`` the JSON."""

    params: int
    dtype: str
    world_size: int
    ranks_per_node: int
    device_memory: int | None
    device_memory_source: str
    host_memory: int | None
    host_memory_source: str
    host_reserve: int  # host bytes a fitting configuration leaves free, per node
    shape: ModelShape | None
    rows: list[ConfigEstimate] = field(default_factory=list)
    disk_memory: int | None = None  # NVMe per node; None: not given (holds nothing)
    optimizer: str = "adamw"  # the rule whose state the rows size (``estimate.OPTIMIZERS``)
    left_out: list[LeftOutRow] = field(default_factory=list)  # no rows for this optimizer
    moments_dtype: str = "float32"  # the optimizer's moments (``OffloadConfig.moments_dtype``)
    # Each rank's ActivationOffloadConfig (host_pool_bytes, device_pool_bytes) that the
    # activation-offload rows count; None without a shape.
    activation_pools: tuple[int, int] | None = None

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-friendly data, with each row's ``device_total``."""
        out = asdict(self)
        out["rows"] = [dict(asdict(row), device_total=row.device_total) for row in self.rows]
        return out

    def table(self) -> str:
        """The estimate as text: a header, one line per configuration, what the columns
        mean."""
        head = f"zero-offload memory estimate: {format_count(self.params)} parameters"
        head += f" ({self.dtype}), world size {self.world_size}, optimizer {self.optimizer}"
        if self.moments_dtype != "float32":
            head += f" with {self.moments_dtype} moments"
        if self.world_size != self.ranks_per_node:
            head += f", {self.ranks_per_node} ranks per node"
        if self.shape is not None:
            head += f"\nmodel: {self.shape.describe()}"
        else:
            head += "\nactivations not counted (give a model shape to count them)"
        head += (
            f"\ndevice memory {_size(self.device_memory)} per rank ({self.device_memory_source});"
            f" host memory {_size(self.host_memory)} per node ({self.host_memory_source});"
            f" NVMe {_size(self.disk_memory) if self.disk_memory else 'none'} per node"
        )
        # One mark per distinct condition: *, **, ...
        conditions = dict.fromkeys(row.conditions for row in self.rows if row.conditions)
        marks = {text: "*" * (i + 1) for i, text in enumerate(conditions)}
        rows = [
            [
                row.name,
                _size(row.device_model_states),
                _size(row.device_buffers),
                _size(row.device_activations),
                _size(row.device_total),
                _size(row.host),
                _size(row.disk),
                {True: "yes", False: "no", None: "?"}[row.fits],
                _largest_text(row),
                row.library + marks.get(row.conditions, ""),
            ]
            for row in self.rows
        ]
        header = ["configuration", "model states", "buffers", "activations", "device total"]
        header += ["host", "disk", "fits", "largest that fits", "library runs it"]
        reasons = dict.fromkeys(
            reason for row in self.rows if row.not_run for reason in row.not_run.split("; ")
        )
        grows = (
            "the same widths with more or fewer layers"
            if self.shape is not None
            else "more or fewer parameters in full buckets"
        )
        note = (
            "\n\nmodel states: weights, gradients and optimizer state on the device (ZeRO "
            "paper, 2 + 2 + 12 bytes per parameter for AdamW in mixed precision; the rule's "
            "per-element state for the others); buffers: the library's device pools beside the "
            "weights: the gradient buffers, and where a row's condition says so, the fp32 "
            "gradient accumulators and weight shadows; "
            f"host: the {self.optimizer} optimizer's pools per node (with NVMe: the staging, "
            "I/O buffers and the state that fits the host budget); disk: NVMe per node, the "
            "state beyond the host budget (and the weights, with params on NVMe)."
            f"\nfits: device total <= device memory, and host <= host memory less "
            f"{_size(self.host_reserve)} kept free (max(10% of RAM, 2 GiB), the reserve of "
            f'OffloadConfig(host_budget="auto")), and disk <= NVMe.'
            f"\nlargest that fits: the most parameters each configuration holds, with {grows}."
            "\nlibrary runs it: yes (the optimizer's exact pools); paper (the ZeRO paper's "
            "accounting of other systems); not yet (an estimate: "
            + ("; ".join(reasons) or "none here")
            + ")."
        )
        for conditions, mark in marks.items():
            note += f"\n{mark}: only where {conditions}."
        note += self._activation_pools_note()
        by_reason: dict[str, list[str]] = {}
        for left in self.left_out:
            by_reason.setdefault(left.reason, []).append(left.name)
        for reason, names in by_reason.items():
            note += f"\nrefused for {self.optimizer} ({reason}): {'; '.join(names)}."

        from ..profiling.report import format_table  # profiling imports torch; so did planning

        return head + "\n\n" + format_table(header, rows) + note

    def _activation_pools_note(self) -> str:
        """The activation offloader's pools the activation-offload rows count, and whether
        ``ActivationOffloadConfig``'s defaults would do (Note [pools sized for checkpointed
        layers] in activation_sizes.py)."""
        if self.activation_pools is None or not any(
            "activation offload" in row.name for row in self.rows
        ):
            return ""
        host, device = self.activation_pools
        short = [
            f"{name}'s default {format_bytes(default)} is too small"
            for name, default, need in (
                ("host_pool_bytes", DEFAULT_HOST_POOL_BYTES, host),
                ("device_pool_bytes", DEFAULT_DEVICE_POOL_BYTES, device),
            )
            if default < need
        ]
        verdict = (
            "; ".join(short) + ": set the sizes"
            if short
            else "the defaults hold them, but allocate their own sizes"
        )
        return (
            f"\nactivation offload rows: each rank's ActivationOffloadConfig("
            f"host_pool_bytes={host}, device_pool_bytes={device}) ({format_bytes(host)} and "
            f"{format_bytes(device)}: every layer's saved input, and "
            f"{min(self.shape.layers, 2) if self.shape else 2} reloaded at once; "
            f"ActivationOffloadConfig.for_checkpoints builds it); {verdict}."
        )


def _largest_text(row: ConfigEstimate) -> str:
    if row.largest_fitting_params is None:
        return "-"
    if not row.largest_fitting_params:
        return "none"
    text = format_count(row.largest_fitting_params)
    return (
        text
        if row.largest_fitting_layers is None
        else f"{text} ({row.largest_fitting_layers} layers)"
    )


def _size(nbytes: int | None) -> str:
    return "unknown" if nbytes is None else format_bytes(nbytes)


def format_count(params: int) -> str:
    """``8030261248`` as ``8.03 B``."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if params >= scale:
            return f"{params / scale:.2f} {unit}"
    return str(params)
