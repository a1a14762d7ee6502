"""OffloadAdamW's ``state_dict`` and ``load_state_dict``: torch's layout, checked first.

The layout is torch's (``state`` keyed by the parameter's position across groups,
``param_groups`` with ``params`` as positions, and ``param_names`` where the optimizer
was given ``named_parameters()``, which loading carries over as torch does), with each
parameter's fp32 ``master`` weights added, and the loss scaler and skip count under
``zero_offload``. A ``torch.optim.AdamW`` state dict loads too: missing master weights come
from the parameters.

Note [sharded state dicts]
~~~~~~~~~~~~~~~~~~~~~~~~~~
With several ranks, ``state_dict()`` on each rank holds only the state that rank owns
(Note [who owns which shard] in ``partition.py``): per parameter, the flat piece
``[lo, hi)`` of the flattened parameter in this rank's shards, under the same names, and
``zero_offload["shard"]`` = ``{"rank", "world_size", "pieces": {index: (lo, hi)},
"shapes": {index: shape}, "shaped": {index: names}}`` to place it. A rule that reads whole
parameters keeps each parameter's state on its owner (Note [a whole parameter has one
owner] in ``partition.py``): its piece there is the whole parameter, its shaped state is
whole too and listed under ``"shaped"`` (merged as it is), and the other ranks hold an
empty piece and no shaped state. Such a dict loads back only on the same rank of
the same world size. ``zero_offload.checkpoint_io`` merges the ranks' dicts into the
one-rank layout (``consolidated_state_dict``), and any world size loads that layout: each
rank copies its own pieces out of the full tensors, which is how a checkpoint saved with N
ranks resumes with M.

Note [a loaded state claims no weights]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
After a load the optimizer's master is the checkpoint's, and the model's weights are
whatever the model holds: the checkpoint's own weights (the model loaded first), the model's
initialisation (loaded after, or never), or a write made between the last step and the save,
which the model's checkpoint carries and the optimizer's master does not. So the load does
not stamp the weights it finds as the optimizer's own (``ParamViews.remember``): it forgets
its fingerprints (``forget``), and the next step reconciles every bucket by value (Note
[weights written outside the optimizer] in ``views/param_views.py``). Elements whose weight
is the training-dtype rounding of the loaded master keep the master's extra bits; the others
take the weight, as the uninterrupted run and torch's AdamW (whose parameter is its master)
would. Stamping instead lost such a write whenever the model loaded first (issue 38). The
cost is one pass over the weights and the master at the first step after a load. A
checkpoint saved with an ``overlap_step`` update pending is the one case where the weights
are stale by design: there the update is published from the master, except into the
parameters it names in ``written_since_step`` and those without a master, which keep their
weights (Note [delayed parameter update] in ``update/modes.py``).

Note [a load checks everything, then copies]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``load_optimizer_state`` has two phases, so that a refused dict leaves the optimizer as it
was. The first reads the caller's dict and raises on anything the second could not take:
each container's type; each state tensor's type (a tensor, not a subclass with its own
dispatch such as a DTensor), layout (dense), device (one with data: a meta tensor has none),
shape and dtype; each step count (a whole number that fits ``bucket.steps``);
``skipped_steps`` (an int >= 0) and the other ``zero_offload`` fields; the loss scaler's
state; the groups, which it also deep-copies (an object that cannot be copied refuses here);
and every slot's state views (an NVMe store, which cannot hand them out, refuses here). It
stages what it read: ints, and detached tensors (a tensor that requires grad loads by value,
as torch's ``Optimizer.load_state_dict`` takes it). The second phase reads only the staged
values: it fills, copies (``copy_`` from a dense tensor with data into a view of the same
shape converts the dtype and crosses devices) and assigns, none of which raises on the
caller's data. A check that the second phase relies on belongs in the first: one made while
copying is a refusal after part of the state was overwritten.
"""

from __future__ import annotations

import copy
import math
import numbers
import reprlib
from collections.abc import Hashable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from ...collectives import Comm
from ..flat_bucket import FlatBucket
from ..rule.base import OptimizerRule
from ..update.loss_scaler import LossScaler

__all__ = [
    "LoadedState",
    "check_skipped_steps",
    "group_entries",
    "load_optimizer_state",
    "optimizer_state",
]


class LoadedState(NamedTuple):
    """What a loaded state says beyond the buckets and groups (the caller applies it)."""

    scaler_state: dict[str, Any]  # for LossScaler.load_state_dict (checked already)
    skipped_steps: int | None  # >= 0 (checked already); None: the state has no count
    pending_update: bool  # saved with an overlap_step update pending


_FORMAT_VERSION = 1


def _slots(buckets: Sequence[FlatBucket]) -> dict[int, tuple[FlatBucket, int]]:
    return {
        slot.index: (bucket, i) for bucket in buckets for i, slot in enumerate(bucket.layout.slots)
    }


def group_entries(param_groups: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """``param_groups`` as a state dict holds them: ``params`` as positions across groups."""
    groups, position = [], 0
    for group in param_groups:
        entry = {key: value for key, value in group.items() if key != "params"}
        entry["params"] = list(range(position, position + len(group["params"])))
        position += len(group["params"])
        groups.append(entry)
    return groups


def optimizer_state(
    buckets: Sequence[FlatBucket],
    param_groups: Sequence[dict[str, Any]],
    *,
    comm: Comm | None,
    scaler: LossScaler,
    skipped_steps: int,
    pending_update: bool = False,
    written: Sequence[int] = (),
    rule: OptimizerRule | None = None,
) -> dict[str, Any]:
    """The state dict; tensors are CPU copies, shaped like their parameters; ``rule``, the
    optimizer's, is recorded for ``load_optimizer_state`` to check.

    ``pending_update``: an ``overlap_step`` update is computed but its weights are not on
    the device yet (Note [delayed parameter update] in ``update/modes.py``); loading the
    dict makes the next step publish them from the master, except into ``written``, the
    parameters (by position) written since the last step, which keep their weights."""
    groups = group_entries(param_groups)
    state: dict[int, dict[str, torch.Tensor]] = {}
    pieces: dict[int, tuple[int, int]] = {}
    shapes: dict[int, tuple[int, ...]] = {}
    whole_names: dict[int, list[str]] = {}  # shaped state, by parameter
    for index, (bucket, i) in sorted(_slots(buckets).items()):
        if bucket.steps[i] == 0:
            continue  # never stepped: torch has no entry either
        lo, hi, views = bucket.state_views(i)
        shape = bucket.layout.slots[i].shape
        whole = comm is None
        entry = {
            name: (view.view(shape) if whole else view).detach().to("cpu", copy=True)
            for name, view in views.items()
        }
        # Shaped state (Note [rules that read a whole parameter] in rule/base.py), as torch
        # keeps it: whole, on the parameter's owner only (Note [sharded state dicts]).
        for name, view in bucket.param_state(i).items():
            entry[name] = view.detach().to("cpu", copy=True)
            whole_names.setdefault(index, []).append(name)
        entry["step"] = torch.tensor(float(bucket.steps[i]))
        state[index] = entry
        pieces[index], shapes[index] = (lo, hi), shape
    extra: dict[str, Any] = {
        "version": _FORMAT_VERSION,
        "loss_scaler": scaler.state_dict(),
        "skipped_steps": skipped_steps,
        "pending_update": bool(pending_update),
        "written_since_step": [int(index) for index in written],
    }
    if rule is not None:  # what the state means: Adam and AdamW load each other's
        extra["rule"], extra["family"] = rule.name, rule.state_family
    if comm is not None:  # Note [sharded state dicts]
        extra["shard"] = {
            "rank": comm.rank,
            "world_size": comm.world_size,
            "pieces": pieces,
            "shapes": shapes,
            "shaped": whole_names,
        }
    return {"state": state, "param_groups": groups, "zero_offload": extra}


_STEP_MAX = int(np.iinfo(np.int64).max)  # bucket.steps is int64


def _check_mapping(where: str, value: Any, what: str) -> Mapping[Any, Any]:
    if not isinstance(value, Mapping):
        raise TypeError(
            f"{where} must be a dict ({what}), got {type(value).__name__} {reprlib.repr(value)}"
        )
    return value


def _check_tensor(where: str, name: str, value: Any, shape: tuple[int, ...]) -> torch.Tensor:
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


def _check_step(where: str, value: Any) -> int:
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


def _saved_groups(
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
    _check_mapping("state_dict['state']", state_dict["state"], "parameter id -> state")
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
        _check_mapping(where, saved, "its hyper-parameters and 'params'")
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


def _check_extra(extra: Mapping[str, Any], rule: OptimizerRule) -> None:
    """``zero_offload``'s own fields that do not depend on the ranks."""
    if extra and extra.get("version") != _FORMAT_VERSION:
        raise ValueError(
            f"state_dict format version {extra.get('version')!r} is not {_FORMAT_VERSION}"
        )
    # Saved before the rule was recorded, or by torch: no check (the fields still must be
    # there). As the streaming checkpoints check it.
    if "rule" in extra and extra.get("family", extra["rule"]) != rule.state_family:
        raise ValueError(
            f"state_dict was saved by an optimizer with the {extra['rule']!r} rule, this one "
            f"steps with the {rule.name!r} rule: its state means something else here (Adam's "
            "moments are not Lion's momentum); load it into an optimizer of the rule that "
            "saved it. Nothing was loaded"
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
        _check_mapping("state_dict['zero_offload']['loss_scaler']", scaler_state, "the scaler's")


def load_optimizer_state(
    buckets: Sequence[FlatBucket],
    param_groups: list[dict[str, Any]],
    state_dict: dict[str, Any],
    *,
    comm: Comm | None,
    scaler: LossScaler,
    rule: OptimizerRule,
) -> LoadedState:
    """Check everything (the loss scaler's state too), then copy into ``buckets`` and
    ``param_groups``; see ``OffloadAdamW.load_state_dict`` and Note [a load checks
    everything, then copies]. Returns what the caller applies: the scaler's state, the skip
    count, whether an update was pending."""
    saved_groups = _saved_groups(state_dict, param_groups)
    extra = _check_mapping(
        "state_dict['zero_offload']", state_dict.get("zero_offload", {}), "zero-offload's fields"
    )
    _check_extra(extra, rule)
    shard = extra.get("shard")
    here = (comm.rank, comm.world_size) if comm is not None else (0, 1)
    if shard is not None and (shard["rank"], shard["world_size"]) != here:
        raise ValueError(
            f"rank {here[0]}/{here[1]}: this state_dict is the shard of rank "
            f"{shard['rank']} of {shard['world_size']} ranks; load a consolidated one "
            "instead (zero_offload.checkpoint_io.save_consolidated / load_consolidated, "
            "Note [sharded state dicts])"
        )
    # Multi-rank: say which rank refused, since each checks its own pieces.
    rank_prefix = f"rank {here[0]}/{here[1]}: " if comm is not None else ""
    skipped = check_skipped_steps(
        f"{rank_prefix}state_dict['zero_offload']", extra.get("skipped_steps")
    )
    positions = [p for saved in saved_groups for p in saved["params"]]
    to_local = {saved_id: local for local, saved_id in enumerate(positions)}
    slots = _slots(buckets)
    # Every slot's views, taken here: a store that cannot hand them out (NVMe) refuses
    # before anything changes.
    flat_views = {index: bucket.state_views(i) for index, (bucket, i) in slots.items()}
    shaped_views = {index: bucket.param_state(i) for index, (bucket, i) in slots.items()}
    # The fields torch's optimizer keeps for each parameter (Note [the rule is the only
    # place that knows the optimizer] in rule/base.py), by its group.
    kept = {
        index: rule.checkpoint_fields(param_groups[bucket.layout.group])
        for index, (bucket, _) in slots.items()
    }
    staged: dict[int, dict[str, Any]] = {}
    for saved_id, entry in state_dict["state"].items():
        if saved_id not in to_local:
            raise ValueError(f"state_dict has state for unknown parameter id {saved_id!r}")
        index = to_local[saved_id]
        where = f"{rank_prefix}state of parameter {index}"
        if index not in slots:
            raise ValueError(f"{where}: this optimizer does not train that parameter")
        _check_mapping(where, entry, "field name -> value, as state_dict() saves")
        bucket, i = slots[index]
        shape = bucket.layout.slots[i].shape
        missing = ({"step", *kept[index]}) - set(entry)
        if missing:
            raise ValueError(f"{where}: missing {sorted(missing)}")
        lo, hi, _ = flat_views[index]
        if shard is not None and tuple(shard["pieces"].get(saved_id, (lo, hi))) != (lo, hi):
            raise ValueError(
                f"{where}: the shard holds elements {tuple(shard['pieces'][saved_id])} but "
                f"this rank owns {(lo, hi)} (different bucket_bytes?); load a consolidated "
                "state_dict instead"
            )
        checked = {
            name: _check_tensor(where, name, entry[name], shape if shard is None else (hi - lo,))
            for name in (*kept[index], "master")
            if name in entry
        }
        if shard is None:  # a whole-parameter layout: keep this rank's piece of it
            checked = {name: value.reshape(-1)[lo:hi] for name, value in checked.items()}
        # Shaped state, each field with its own shape: whole, on the parameter's owner only.
        shaped = {name: tuple(view.shape) for name, view in shaped_views[index].items()}
        lacking = sorted(set(shaped) - set(entry))
        if lacking:
            raise ValueError(f"{where}: missing {lacking}")
        for name, field_shape in shaped.items():
            checked[name] = _check_tensor(where, name, entry[name], field_shape)
        checked["step"] = _check_step(where, entry["step"])
        staged[index] = checked
    scaler_state = extra.get("loss_scaler") or {}
    scaler.check_state(scaler_state)
    new_groups: list[dict[str, Any]] = []
    for g, (saved, group) in enumerate(zip(saved_groups, param_groups, strict=True)):
        merged = {**group, **{key: value for key, value in saved.items() if key != "params"}}
        rule.check_group(merged, where=f"state_dict param group {g}")
        for bucket in buckets:
            why = (
                None
                if bucket.layout.group != g
                else rule.missing_state(merged, bucket.store.state_names())
            )
            if why is not None:
                raise ValueError(f"state_dict param group {g} cannot be loaded: {why}")
        # A copy, as torch takes: a tensor lr is stepped in place by LR schedulers, which
        # must not write into the caller's state dict. Taken here: a value that cannot be
        # copied refuses before anything changes.
        try:
            new_groups.append(
                {key: copy.deepcopy(value) for key, value in saved.items() if key != "params"}
            )
        except (TypeError, copy.Error) as exc:
            raise TypeError(
                f"state_dict param group {g}: a value cannot be copied ({exc}); a group "
                "holds numbers, tuples, strings, bools and tensors"
            ) from exc

    written_ids = list(extra.get("written_since_step", ()))
    unknown = [i for i in written_ids if i not in to_local or to_local[i] not in slots]
    if unknown:
        raise ValueError(
            f"{rank_prefix}state_dict names parameters written before the save that this "
            f"optimizer does not train: {unknown}"
        )
    written = {to_local[saved_id] for saved_id in written_ids}

    # Note [a load checks everything, then copies]: from here on nothing reads the caller's
    # dict, only what was staged from it, and nothing raises on its data.
    for bucket in buckets:
        # Master weights the checkpoint lacks (a torch.optim.AdamW state dict, parameters
        # never stepped) come from the model's weights (Note [weights written outside the
        # optimizer] in views/param_views.py).
        bucket.store.reconcile_master()
    # Slots whose loaded weights win: no master in the state, or written before the save.
    weights_win: dict[int, set[int]] = {bucket.layout.index: set() for bucket in buckets}
    with torch.no_grad():
        for index, (bucket, i) in slots.items():
            _, _, views = flat_views[index]
            shaped_state = shaped_views[index]  # starts at 0 (ParamField)
            entry = staged.get(index)
            if entry is None or "master" not in entry:
                weights_win[bucket.layout.index].add(i)
            if entry is None:
                for name, view in views.items():
                    if name != "master":
                        view.fill_(bucket.store.field_initial(name))
                for view in shaped_state.values():
                    view.zero_()
                bucket.steps[i] = 0
                continue
            for name, view in views.items():
                if name in entry:
                    view.copy_(entry[name])
            for name, view in shaped_state.items():
                view.copy_(entry[name])
            bucket.steps[i] = entry["step"]
    for index in written:
        bucket, i = slots[index]
        weights_win[bucket.layout.index].add(i)
    for bucket in buckets:
        # Note [a loaded state claims no weights]
        bucket.views.forget()
        bucket.views.masters_from_weights = frozenset(weights_win[bucket.layout.index])
    for new, group in zip(new_groups, param_groups, strict=True):
        group.update(new)
    return LoadedState(scaler_state, skipped, extra.get("pending_update", False))
