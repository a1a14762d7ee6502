"""What each field of a loaded optimizer state dict must be: the check phase of
``load_optimizer_state`` (Note [a load checks everything, then copies] in ``state_dict.py``).
Each check names the field, the value and what would work, and changes nothing.
"""

from __future__ import annotations

import math
import numbers
import reprlib
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import torch

from ..rule.base import OptimizerRule, ParamField

#: The layout version ``state_dict()`` writes under ``zero_offload``.
FORMAT_VERSION = 1
_STEP_MAX = 2**63 - 1  # bucket.steps is int64

__all__ = [
    "FORMAT_VERSION",
    "check_empty_entry",
    "check_extra",
    "check_mapping",
    "check_skipped_steps",
    "check_step",
    "check_tensor",
    "saved_groups",
    "without_rebuilt_gaps",
]


def check_mapping(where: str, value: Any, what: str) -> Mapping[Any, Any]:
    if not isinstance(value, Mapping):
        raise TypeError(
            f"{where} must be a dict ({what}), got {type(value).__name__} {reprlib.repr(value)}"
        )
    return value


# Note [a field DCP rebuilt as {}]
# ``torch.distributed.checkpoint.state_dict.set_optimizer_state_dict`` with flattened dicts
# rebuilds each parameter's entry from the loading optimizer's own field names
# (``opt.state[p]``): a field the saved dict lacks (our ``master`` in a dict torch's AdamW
# saved) comes back as an empty dict, not as a missing key. An empty mapping in a field is
# therefore read as the field's absence: an optional one (``master``, whose values then come
# from the weights) loads as if left out, and a required one is named as missing.


def without_rebuilt_gaps(where: str, entry: Any) -> Any:
    """``entry`` without the fields DCP rebuilt as ``{}`` (Note [a field DCP rebuilt as
    {}]); what is not a dict is left for ``check_mapping`` to refuse."""
    if not isinstance(entry, Mapping):
        return entry
    return {k: v for k, v in entry.items() if not (isinstance(v, Mapping) and len(v) == 0)}


def check_tensor(where: str, name: str, value: Any, shape: tuple[int, ...]) -> torch.Tensor:
    """``value`` as the copy phase takes it: detached, dense, with data (Note [a load
    checks everything, then copies])."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{where}: {name!r} must be a tensor, got {type(value).__name__}")
    if type(value).__torch_dispatch__ is not torch.Tensor.__torch_dispatch__:
        raise TypeError(
            f"{where}: {name!r} is a {type(value).__name__}, a tensor subclass with its own "
            "dispatch, whose values a copy into a plain tensor cannot read; pass a plain "
            "torch.Tensor (for a DTensor, its .full_tensor())"
        )
    if value.layout != torch.strided:
        raise TypeError(
            f"{where}: {name!r} has layout {value.layout}; a dense (torch.strided) tensor is "
            "needed: pass value.to_dense()"
        )
    if value.device.type == "meta":
        raise ValueError(
            f"{where}: {name!r} is on the meta device, which holds no values to load; pass a "
            "tensor with data, on the CPU or on the accelerator's device"
        )
    if tuple(value.shape) != shape:
        raise ValueError(
            f"{where}: {name!r} has shape {tuple(value.shape)} but the parameter has {shape}"
        )
    if not value.is_floating_point():
        raise TypeError(f"{where}: {name!r} has dtype {value.dtype}; a floating dtype is needed")
    # torch's Optimizer.load_state_dict takes a tensor that requires grad too: its values,
    # never a graph into the optimizer's state.
    return value.detach()


def check_empty_entry(
    where: str,
    entry: Any,
    *,
    fields: Sequence[str],
    param_fields: Sequence[ParamField],
    shape: tuple[int, ...],
) -> None:
    """The state of a parameter with no elements, which the optimizer holds in its groups
    but keeps no state for (torch's optimizers keep some: ``step`` and empty moments),
    checked as a trained parameter's is (``fields`` torch's per-element fields, of the
    parameter's ``shape``; ``param_fields`` its shaped state) and then dropped by the
    caller: Note [an empty parameter's state is checked, then dropped] in ``state_dict.py``."""
    check_mapping(where, entry, "field name -> value, as state_dict() saves")
    missing = {"step", *fields, *(f.name for f in param_fields)} - set(entry)
    if missing:
        raise ValueError(f"{where}: missing {sorted(missing)}")
    for name in (*fields, "master"):
        if name in entry:
            check_tensor(where, name, entry[name], shape)
    for field in param_fields:
        check_tensor(where, field.name, entry[field.name], field.shape)
    check_step(where, entry["step"])


def check_step(where: str, value: Any) -> int:
    """A parameter's step count: a whole number >= 0. 0 is a parameter not stepped yet with
    its state at hand, as torch's Adagrad saves every parameter from its construction on
    (``step`` 0, ``sum`` at its start)."""
    wanted = "a whole number >= 0 (an int, a float or a 1-element tensor, as torch saves it)"
    step = value
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.layout != torch.strided or value.device.type == "meta":
            shown = f"tensor of shape {tuple(value.shape)} ({value.layout}, on {value.device})"
            raise ValueError(f"{where}: 'step' must be {wanted}, got a {shown}")
        step = value.item()
    if isinstance(step, bool) or not isinstance(step, numbers.Real):
        raise TypeError(f"{where}: 'step' must be {wanted}, got {type(value).__name__} {value!r}")
    whole = isinstance(step, numbers.Integral) or (math.isfinite(step) and float(step).is_integer())
    if not whole or step < 0:
        raise ValueError(f"{where}: 'step' must be {wanted}, got {value!r}")
    if step > _STEP_MAX:
        raise ValueError(
            f"{where}: 'step' {value!r} is past the largest step count kept ({_STEP_MAX}, "
            "int64); pass the parameter's real count"
        )
    return int(step)


def check_skipped_steps(where: str, value: Any) -> int | None:
    """``skipped_steps`` as a state records it: an int >= 0, or None where it has none
    (torch's dicts); ``where`` names the state."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(
            f"{where}: 'skipped_steps' must be an int >= 0 (the steps skipped for overflow), "
            f"got {type(value).__name__} {value!r}"
        )
    if value < 0:
        raise ValueError(
            f"{where}: 'skipped_steps' must be an int >= 0 (the steps skipped for overflow), "
            f"got {value!r}"
        )
    return int(value)


def saved_groups(
    state_dict: Any, param_groups: Sequence[dict[str, Any]]
) -> list[Mapping[str, Any]]:
    """The dict's ``param_groups``, checked against ours: a dict per group, as many, each
    with as many distinct parameter ids."""
    if not isinstance(state_dict, Mapping) or not {"state", "param_groups"} <= set(state_dict):
        got = sorted(map(repr, state_dict)) if isinstance(state_dict, Mapping) else None
        raise ValueError(
            "state_dict must be a dict with 'state' and 'param_groups' keys (an optimizer's "
            f"state_dict()), got {type(state_dict).__name__}"
            + (f" with keys {got}" if got is not None else "")
        )
    check_mapping("state_dict['state']", state_dict["state"], "parameter id -> state")
    saved_groups = state_dict["param_groups"]
    if not isinstance(saved_groups, (list, tuple)):
        raise TypeError(
            "state_dict['param_groups'] must be a list of dicts, one per param group, got "
            f"{type(saved_groups).__name__}"
        )
    if len(saved_groups) != len(param_groups):
        raise ValueError(
            f"state_dict has {len(saved_groups)} param groups but this optimizer has "
            f"{len(param_groups)}"
        )
    seen: set[Any] = set()
    for g, (saved, group) in enumerate(zip(saved_groups, param_groups, strict=True)):
        where = f"state_dict param group {g}"
        check_mapping(where, saved, "its hyper-parameters and 'params'")
        if "params" not in saved:
            raise ValueError(
                f"{where} has no 'params' (keys {sorted(map(str, saved))}); each group needs "
                "the list of its parameter ids (positions, as state_dict() saves them)"
            )
        params = saved["params"]
        if not isinstance(params, (list, tuple)):
            raise TypeError(
                f"{where}: 'params' must be a list of parameter ids (positions, as "
                f"state_dict() saves them), got {type(params).__name__} {reprlib.repr(params)}"
            )
        if len(params) != len(group["params"]):
            raise ValueError(
                f"param group {g}: state_dict has {len(params)} parameters but this "
                f"optimizer has {len(group['params'])}"
            )
        for saved_id in params:
            if not isinstance(saved_id, Hashable):
                raise TypeError(
                    f"{where}: parameter id {reprlib.repr(saved_id)} is not hashable; ids "
                    "are the parameters' positions (ints), as state_dict() saves them"
                )
            if saved_id in seen:
                raise ValueError(
                    f"{where}: parameter id {saved_id!r} appears twice; each parameter "
                    "needs its own id (its position, as state_dict() saves them)"
                )
            seen.add(saved_id)
    return list(saved_groups)


def check_extra(extra: Mapping[str, Any], rule: OptimizerRule) -> None:
    """``zero_offload``'s own fields that do not depend on the ranks."""
    if extra and extra.get("version") != FORMAT_VERSION:
        raise ValueError(
            f"state_dict format version {extra.get('version')!r} is not {FORMAT_VERSION}"
        )
    # Saved before the rule was recorded, or by torch: no check (the fields still must be
    # there). As the streaming checkpoints check it.
    if "rule" in extra and extra.get("family", extra["rule"]) != rule.state_family:
        raise ValueError(
            f"state_dict was saved by an optimizer with the {extra['rule']!r} rule, this one "
            f"steps with the {rule.name!r} rule: its state means something else here (the "
            f"{extra['rule']!r} rule's fields are not the {rule.name!r} rule's); load it into "
            "an optimizer of the rule that saved it. Nothing was loaded"
        )
    pending = extra.get("pending_update", False)
    if not isinstance(pending, bool):
        raise TypeError(
            "state_dict['zero_offload']['pending_update'] must be a bool (whether an "
            f"overlap_step update was pending at the save), got {pending!r}"
        )
    written = extra.get("written_since_step", [])
    if not isinstance(written, (list, tuple)) or not all(isinstance(i, Hashable) for i in written):
        raise TypeError(
            "state_dict['zero_offload']['written_since_step'] must be a list of parameter "
            f"ids (those written since the last step), got {written!r}"
        )
    scaler_state = extra.get("loss_scaler", {})
    if scaler_state is not None:
        check_mapping("state_dict['zero_offload']['loss_scaler']", scaler_state, "the scaler's")
