"""What an optimizer is to the rest of the library: ``OptimizerRule``.

The stores, the planners, the checkpoints and the estimator never name an optimizer's
state or hyper-parameters; they ask its rule (Note [the rule is the only place that knows
the optimizer]):

- ``hyper(group)``: one param group's hyper-parameters for a step, an immutable value the
  update carries to the stores and hands back to the rule's own step;
- ``check_group(group, where)``: the group's values checked, with a clear error;
- ``state_fields(moments_dtype, groups)``: the per-element state the rule keeps, the fp32
  ``master`` first; placement, the NVMe record layout and the estimator size it, the stores
  allocate it, checkpoints and ``opt.state`` read it by these names;
- ``checkpoint_fields(group)``: which of those fields torch's own ``state_dict`` holds per
  parameter (besides ``step``), so a saved state loads into torch's optimizer and back;
- ``tile_step``: the CPU kernel over one tile of a host-side store; ``device_tile_step``:
  the update of one tile of a device-resident store, on the device;
- ``elementwise``: whether each element's update reads only that element. Then tile
  boundaries change no bit, a bucket shards by flat range over ranks, and a bucket can step
  as soon as its gradients arrive. A rule that is not (Adafactor's factored second moment)
  steps one whole parameter at a time (``parameter_step`` on the host,
  ``device_parameter_step`` for state resident on the device) and may keep state shaped by
  the parameter (``param_state``), and on several ranks each parameter has one owner: Note
  [rules that read a whole parameter]. What needs tiles, or flat-range shards that cut a
  parameter, refuses such a rule at construction.

A new elementwise optimizer is one rule (a subclass here), one kernel (``kernels/``) and a
thin facade over ``OffloadAdamW``'s machinery.
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from ...memory.align import aligned

__all__ = [
    "Hyper",
    "OptimizerRule",
    "ParamField",
    "StateField",
    "StateFields",
    "WholeParameterRule",
    "scaled_gradient",
]

#: One param group's hyper-parameters for a step, as the rule reads them (an immutable
#: value; only its rule looks inside).
Hyper = Any

# Note [the rule is the only place that knows the optimizer]
# Below the facade, code that needs to know what the optimizer keeps or how it steps asks
# the rule: names of state fields, their dtypes and bytes, which of them a checkpoint
# holds, the step itself. A test (tests/test_layering.py) greps the package for the names
# of Adam's state and hyper-parameters outside rule/, the kernels and the facade's
# torch-style signature, so a planner that hard-codes "two moments" fails there, not when
# the next optimizer's state is sized wrong.

# Note [rules that read a whole parameter]
# An elementwise rule's state is per element: one flat field per name over the bucket,
# tiled with the weights and sharded by flat range over ranks. Adafactor's update reads a
# whole parameter (the RMS of its weights and of its update, the row and column means of
# its squared gradient), and its second moment is shaped by the parameter, not by its
# elements: a (..., m, 1) row factor and a (..., 1, n) column factor for two dims or more.
# The seam takes such a rule in the simplest way that is sound:
# - the rule says ``elementwise = False``, keeps per-element fields as any rule does (the
#   fp32 master at least), and declares its shaped state per parameter (``param_state``:
#   names and shapes, fp32, starting at 0). ``StateFields.param_state`` carries it to the
#   planners, which size the host pool with it (``param_state_numel``);
# - a host store keeps a bucket's shaped state in one fp32 block of its host pool, the
#   slots' fields one after another in slot order (``state/whole.py``), and checkpoints and
#   ``opt.state`` show each field with its own shape, as torch's state holds it;
# - the host tile loop steps such a rule one whole parameter per call
#   (``RuleTiles.step_parameter``, the rule's ``parameter_step``), whatever
#   ``tile_elements``: the state is in RAM, so a parameter larger than a tile is stepped
#   whole and no buffer grows with it but the kernel's float64 partial sums;
# - a streaming checkpoint saves it after the bucket's per-element tiles, one record per
#   parameter, its names and shapes in the bucket's fingerprint (Note [shaped state in a
#   streamed checkpoint] in ``checkpoint/bucket_file.py``);
# - parameter offload on one rank (``offload_parameters``) keeps it too: no bucket spans
#   two units and no parameter spans two buckets, and each unit's host pool is sized per
#   bucket by the same ``_host_bytes`` (``state/placement.py``) that sizes the one pool
#   without it, shaped state included (Note [homes are pinned unit by unit] in
#   ``unit_pools.py``), so the block lands in the unit's pool with the bucket's fields;
# - several ranks (ZeRO-2) keep it too: each bucket is laid out so that the flat-range
#   shards fall on parameter boundaries, each parameter whole in its owner's shard (Note
#   [a whole parameter has one owner] in ``partition.py``); the owner keeps and steps it,
#   the others keep no shaped state for it;
# - NVMe state (``nvme_dir``) on one rank keeps it too: the per-element fields go to
#   records whose tiles follow whole parameters, sized for the largest, and the shaped
#   state stays in host RAM as above (Note [NVMe tiles follow whole parameters] in
#   ``state/nvme_plan.py``, ``state/whole_nvme.py``); with parameter offload beside it the
#   weights' homes stay in host RAM (a budget too small for them is refused there);
# - state resident on the device (``offload_fraction`` below 1, or "auto") keeps it too,
#   in the device pool, and steps each parameter whole there with torch's operations
#   (``device_parameter_step``): Note [whole parameters stepped on the device] in
#   ``state/whole_resident.py``.
# What cuts a parameter (ZeRO-3's flat-range shards of each unit over ranks:
# ``partition_parameters``, and ``offload_parameters`` on several ranks) is refused at
# construction, naming the rule and the feature (``refuse_whole_parameter_features`` in
# ``checks.py``), and so is NVMe state on several ranks (planned per whole bucket). A
# bucket thus never runs a whole-parameter rule over part of a parameter, and no shaped
# state goes unsaved.


@dataclass(frozen=True)
class ParamField:
    """One field of a parameter's shaped state (Note [rules that read a whole parameter]):
    its name (as ``opt.state`` and checkpoints show it) and shape; fp32, starting at 0."""

    name: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        """Its elements."""
        n = 1
        for dim in self.shape:
            n *= dim
        return n


@dataclass(frozen=True)
class StateField:
    """One per-element state field: its name (as ``opt.state`` and checkpoints show it),
    its dtype, and the value every element starts from (before the first step, and where a
    loaded ``state_dict`` has no state for a parameter; Adagrad's ``sum`` starts from
    ``initial_accumulator_value``)."""

    name: str
    dtype: torch.dtype
    initial: float = 0.0


@dataclass(frozen=True)
class StateFields:
    """The per-element state of one bucket, in order; the fp32 ``master`` is first."""

    fields: tuple[StateField, ...]
    #: The shaped state of a parameter of a given shape, for a rule that reads whole
    #: parameters (Note [rules that read a whole parameter]); None: per-element state only.
    param_state: Callable[[tuple[int, ...]], tuple[ParamField, ...]] | None = field(
        default=None, compare=False
    )

    def __post_init__(self) -> None:
        if not self.fields or self.fields[0] != StateField("master", torch.float32):
            raise ValueError(f"the first state field must be the fp32 master, got {self.fields}")

    @property
    def names(self) -> tuple[str, ...]:
        """The fields' names, master first."""
        return tuple(f.name for f in self.fields)

    def initial(self, name: str) -> float:
        """The value field ``name`` starts from (the master's is the model's weights)."""
        for f in self.fields:
            if f.name == name:
                return f.initial
        raise KeyError(f"no state field {name!r} in {self.names}")

    def pairs(self) -> list[tuple[str, torch.dtype]]:
        """``(name, dtype)`` of each field, master first."""
        return [(f.name, f.dtype) for f in self.fields]

    @property
    def bytes_per_element(self) -> int:
        """State bytes per element, every field together."""
        return sum(f.dtype.itemsize for f in self.fields)

    @property
    def bytes_beside_master(self) -> int:
        """State bytes per element besides the fp32 master."""
        return self.bytes_per_element - 4

    def bytes_for(self, numel: int, alignment: int) -> int:
        """Bytes of ``numel`` elements of every field, each field its own block of
        ``alignment``-rounded bytes."""
        return sum(aligned(numel * f.dtype.itemsize, alignment) for f in self.fields)

    def fields_of(self, shape: tuple[int, ...]) -> tuple[ParamField, ...]:
        """The shaped state of a parameter of ``shape`` (none for an elementwise rule)."""
        return () if self.param_state is None else self.param_state(tuple(shape))

    def param_state_numel(self, shapes: Iterable[tuple[int, ...]]) -> int:
        """fp32 elements of the shaped state of parameters of ``shapes``, all together."""
        return sum(f.numel for shape in shapes for f in self.fields_of(shape))

    def param_state_bytes(self, shapes: Iterable[tuple[int, ...]], alignment: int) -> int:
        """Bytes of the one block holding the shaped state of ``shapes`` (0 if none)."""
        numel = self.param_state_numel(shapes)
        return aligned(4 * numel, alignment) if numel else 0


class OptimizerRule(ABC):
    """An optimizer's update, its state and its hyper-parameters; see the module docstring."""

    #: The name users choose it by (``zero-offload estimate --optimizer``).
    name: ClassVar[str]
    #: Whether each element's update reads only that element (the module docstring).
    elementwise: ClassVar[bool]
    #: For a rule that is not elementwise: what its update reads of a whole parameter, as
    #: the refusals of Note [rules that read a whole parameter] say it.
    reads_whole: ClassVar[str] = ""
    #: Whether ``tile_step`` can take weights written since the last step into the master
    #: in its own pass (``take_written``; Note [the update takes the written weights] in
    #: kernels/convert.py). A whole-parameter rule reads the master before it writes (the
    #: weights' norm), so it keeps the write check.
    takes_written: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        step = cls.__dict__.get("tile_step")
        if (
            step is not None
            and cls.takes_written
            and "take_written" not in inspect.signature(step).parameters
        ):
            # a subclass of a rule that takes, whose tile_step cannot: it keeps the check
            cls.takes_written = False

    @property
    def state_family(self) -> str:
        """What its saved state means: rules of one family (Adam and AdamW: the same moments)
        load each other's checkpoints, as torch's do; the name by default."""
        return self.name

    @abstractmethod
    def hyper(self, group: Mapping[str, Any]) -> Hyper:
        """One param group's hyper-parameters for a step."""

    @abstractmethod
    def check_group(self, group: Mapping[str, Any], *, where: str) -> None:
        """Raise ``ValueError``/``TypeError`` naming ``where``, the key and the value when
        ``group``'s hyper-parameters are not ones this rule can step with."""

    def complete_group(self, group: dict[str, Any]) -> None:
        """Add the keys a new group (checked, with the defaults filled in) takes from its
        own values; none by default (Muon's ``adamw_lr_reference``)."""
        return None

    @abstractmethod
    def state_fields(
        self, moments_dtype: torch.dtype, groups: Sequence[Mapping[str, Any]]
    ) -> StateFields:
        """The state of a bucket holding parameters of ``groups``: its fp32 master and the
        rule's own fields, the rule's floating state in ``moments_dtype``."""

    @abstractmethod
    def checkpoint_fields(self, group: Mapping[str, Any]) -> tuple[str, ...]:
        """The fields torch's optimizer keeps per parameter of ``group`` besides ``step``
        (what a ``state_dict`` must hold to resume)."""

    def missing_state(self, group: Mapping[str, Any], names: Sequence[str]) -> str | None:
        """Why a bucket built with fields ``names`` cannot step ``group`` (its options ask
        for state it does not have), or None when it can."""
        lacking = [n for n in self.checkpoint_fields(group) if n not in names]
        if not lacking:
            return None
        return f"it needs the state {lacking}, which the optimizer was built without"

    def missing_step(self, where: str) -> str:
        """The refusal of a loaded state entry (``where``) that holds the rule's fields but
        no ``step`` (Note [a loaded entry needs its step] in checkpoint/state_dict.py). By
        default the update reads the count (bias corrections, a decaying rate or decay), so
        none can be made up; a rule whose update does not read it says how to load the
        stepless dicts of its reference optimizer."""
        return (
            f"{where}: missing ['step'], the parameter's step count, which the {self.name} "
            "update reads, so it cannot be made up: torch's optimizers of this rule save it "
            "in every entry, and a state without it was written or edited by other code. Load "
            "a state_dict() that kept its counts (ours or torch's). Nothing was loaded"
        )

    @abstractmethod
    def tile_step(
        self,
        fields: Mapping[str, torch.Tensor],
        grad: torch.Tensor,
        *,
        step: int,
        hyper: Hyper,
        grad_scale: float,
        out: torch.Tensor | None,
        take_written: bool = False,
    ) -> None:
        """One step over one host tile: ``fields`` are the tile's views of the state,
        ``grad`` its gradient (training dtype or fp32), ``out`` receives the training-dtype
        weights (None where the master is the weights' home). ``take_written`` (only where
        ``takes_written``): an element whose ``out`` is not its master's rounding first
        takes it (a weight written since the last step)."""

    @abstractmethod
    def device_tile_step(
        self,
        fields: Mapping[str, torch.Tensor],
        grad: torch.Tensor,
        *,
        step: int,
        hyper: Hyper,
        grad_scale: float,
        step_tensor: torch.Tensor,
    ) -> None:
        """One step over one tile of device-resident state (fp32 fields), on the device.
        ``grad`` must not be changed (a second ``step()`` reads it again); ``step_tensor``
        is a 0-d fp32 device tensor the rule may use as its step count."""

    def param_state(self, shape: tuple[int, ...]) -> tuple[ParamField, ...]:
        """The shaped state of one parameter of ``shape`` (Note [rules that read a whole
        parameter]); none for an elementwise rule."""
        return ()

    def parameter_step(
        self,
        fields: Mapping[str, torch.Tensor],
        param_state: Mapping[str, torch.Tensor],
        grad: torch.Tensor,
        *,
        shape: tuple[int, ...],
        step: int,
        hyper: Hyper,
        grad_scale: float,
        out: torch.Tensor | None,
    ) -> None:
        """One step of one whole parameter of ``shape`` on the host, for a rule that is not
        elementwise: ``fields`` its flat per-element state, ``param_state`` its shaped
        state (``param_state``'s fields, shaped), ``grad`` and ``out`` as in
        ``tile_step``."""
        raise RuntimeError(
            f"the {self.name} rule is elementwise and is stepped by tiles (tile_step); "
            "parameter_step was called on it (a bug)"
        )

    def device_parameter_step(
        self,
        fields: Mapping[str, torch.Tensor],
        param_state: Mapping[str, torch.Tensor],
        grad: torch.Tensor,
        *,
        shape: tuple[int, ...],
        step: int,
        hyper: Hyper,
        grad_scale: float,
        step_tensor: torch.Tensor,
    ) -> None:
        """One step of one whole parameter of ``shape`` whose state is resident on the
        device, on the device, for a rule that is not elementwise (Note [whole parameters
        stepped on the device] in ``state/whole_resident.py``): ``fields`` its flat fp32
        per-element state, ``param_state`` its shaped state, ``grad`` its fp32 gradient
        (not to be changed), ``step_tensor`` as in ``device_tile_step``."""
        raise RuntimeError(
            f"the {self.name} rule is elementwise and is stepped on the device by tiles "
            "(device_tile_step); device_parameter_step was called on it (a bug)"
        )

    def device_parameter_temporary_bytes(
        self, shape: tuple[int, ...], hyper: Hyper, grad_scale: float
    ) -> int:
        """Device bytes ``device_parameter_step`` allocates beyond the state, at most, for
        a parameter of ``shape`` (Note [resident temporaries are counted] in
        ``state/resident.py``)."""
        return 0

    def device_temporary_bytes(self, hyper: Hyper, grad_scale: float, tile_elements: int) -> int:
        """Device bytes ``device_tile_step`` allocates beyond the state, at most, for a tile
        of ``tile_elements`` (Note [resident temporaries are counted] in
        ``state/resident.py``)."""
        return 0


class WholeParameterRule(OptimizerRule):
    """A rule that is not elementwise (Note [rules that read a whole parameter]): it keeps
    its state shaped (``param_state``) and is stepped one whole parameter at a time, by
    ``parameter_step`` on the host and ``device_parameter_step`` on the device, so it has
    no per-element checkpoint fields and no tile steps."""

    elementwise = False

    def checkpoint_fields(self, group: Mapping[str, Any]) -> tuple[str, ...]:
        """None per element: torch's per-parameter state is shaped (``param_state``)."""
        return ()

    def tile_step(
        self,
        fields: Mapping[str, torch.Tensor],
        grad: torch.Tensor,
        *,
        step: int,
        hyper: Hyper,
        grad_scale: float,
        out: torch.Tensor | None,
        take_written: bool = False,
    ) -> None:
        raise RuntimeError(
            f"the {self.name} rule reads whole parameters and is stepped by parameter_step; "
            "a tile loop reached it (a bug: Note [rules that read a whole parameter])"
        )

    def device_tile_step(
        self,
        fields: Mapping[str, torch.Tensor],
        grad: torch.Tensor,
        *,
        step: int,
        hyper: Hyper,
        grad_scale: float,
        step_tensor: torch.Tensor,
    ) -> None:
        raise RuntimeError(
            f"the {self.name} rule reads whole parameters and is stepped on the device by "
            "device_parameter_step; a device tile loop reached it (a bug: Note [whole "
            "parameters stepped on the device] in state/whole_resident.py)"
        )


def scaled_gradient(grad: torch.Tensor, multiplier: float) -> torch.Tensor:
    """``grad * multiplier`` for a device step (``grad_scale``, negated for maximize): a new
    tensor, a tile temporary, since the accumulated gradient must stay as it is (a second
    ``step()`` on the same gradients, like torch, reads it unscaled); ``grad`` itself when
    ``multiplier`` is 1."""
    return grad if multiplier == 1.0 else grad * multiplier
