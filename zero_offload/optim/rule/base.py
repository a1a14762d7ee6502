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
  as soon as its gradients arrive. Every rule the stores run today is elementwise; one that
  is not (a factored second moment, an orthogonalized update) must be refused by the
  optimizer that would shard or tile it (``require_elementwise``).

A new elementwise optimizer is one rule (a subclass here), one kernel (``kernels/``) and a
thin facade over ``OffloadAdamW``'s machinery.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ...memory.align import aligned

__all__ = [
    "Hyper",
    "OptimizerRule",
    "StateField",
    "StateFields",
    "require_elementwise",
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


class OptimizerRule(ABC):
    """An optimizer's update, its state and its hyper-parameters; see the module docstring."""

    #: The name users choose it by (``zero-offload estimate --optimizer``).
    name: ClassVar[str]
    #: Whether each element's update reads only that element (the module docstring).
    elementwise: ClassVar[bool]

    @abstractmethod
    def hyper(self, group: Mapping[str, Any]) -> Hyper:
        """One param group's hyper-parameters for a step."""

    @abstractmethod
    def check_group(self, group: Mapping[str, Any], *, where: str) -> None:
        """Raise ``ValueError``/``TypeError`` naming ``where``, the key and the value when
        ``group``'s hyper-parameters are not ones this rule can step with."""

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
    ) -> None:
        """One step over one host tile: ``fields`` are the tile's views of the state,
        ``grad`` its gradient (training dtype or fp32), ``out`` receives the training-dtype
        weights (None where the master is the weights' home)."""

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

    def device_temporary_bytes(self, hyper: Hyper, grad_scale: float, tile_elements: int) -> int:
        """Device bytes ``device_tile_step`` allocates beyond the state, at most, for a tile
        of ``tile_elements`` (Note [resident temporaries are counted] in
        ``state/resident.py``)."""
        return 0


def require_elementwise(rule: OptimizerRule, feature: str) -> None:
    """Refuse ``feature`` (tiles, flat-range shards, stepping as gradients arrive) for a rule
    whose update reads more than its own element."""
    if not rule.elementwise:
        raise ValueError(
            f"the {rule.name} rule is not elementwise, so {feature} would change its "
            "result; this combination is not supported"
        )


def scaled_gradient(grad: torch.Tensor, multiplier: float) -> torch.Tensor:
    """``grad * multiplier`` for a device step (``grad_scale``, negated for maximize): a new
    tensor, a tile temporary, since the accumulated gradient must stay as it is (a second
    ``step()`` on the same gradients, like torch, reads it unscaled); ``grad`` itself when
    ``multiplier`` is 1."""
    return grad if multiplier == 1.0 else grad * multiplier
