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
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from ...collectives import Comm
from ..flat_bucket import FlatBucket
from ..rule.base import OptimizerRule
from ..update.loss_scaler import LossScaler

__all__ = ["LoadedState", "group_entries", "load_optimizer_state", "optimizer_state"]


class LoadedState(NamedTuple):
    """What a loaded state says beyond the buckets and groups (the caller applies it)."""

    scaler_state: dict[str, Any]  # for LossScaler.load_state_dict (checked already)
    skipped_steps: int | None  # None: the state has no count
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


def _check_tensor(where: str, name: str, value: Any, shape: tuple[int, ...]) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{where}: {name!r} must be a tensor, got {type(value).__name__}")
    if tuple(value.shape) != shape:
        raise ValueError(
            f"{where}: {name!r} has shape {tuple(value.shape)} but the parameter has {shape}"
        )
    if not value.is_floating_point():
        raise TypeError(f"{where}: {name!r} has dtype {value.dtype}; a floating dtype is needed")
    return value


def _check_step(where: str, value: Any) -> int:
    """A parameter's step count: a whole number >= 0. 0 is a parameter not stepped yet with
    its state at hand, as torch's Adagrad saves every parameter from its construction on
    (``step`` 0, ``sum`` at its start)."""
    step = value.item() if isinstance(value, torch.Tensor) else value
    if (
        isinstance(step, bool)
        or not isinstance(step, (int, float))
        or step < 0
        or step != int(step)
    ):
        raise ValueError(f"{where}: 'step' must be a whole number >= 0, got {value!r}")
    return int(step)


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
    ``param_groups``; see ``OffloadAdamW.load_state_dict``. Returns what the caller
    applies: the scaler's state, the skip count, whether an update was pending."""
    if not isinstance(state_dict, dict) or not {"state", "param_groups"} <= set(state_dict):
        raise ValueError("state_dict must be a dict with 'state' and 'param_groups' keys")
    saved_groups = state_dict["param_groups"]
    if len(saved_groups) != len(param_groups):
        raise ValueError(
            f"state_dict has {len(saved_groups)} param groups but this optimizer has "
            f"{len(param_groups)}"
        )
    for g, (saved, group) in enumerate(zip(saved_groups, param_groups, strict=True)):
        if len(saved["params"]) != len(group["params"]):
            raise ValueError(
                f"param group {g}: state_dict has {len(saved['params'])} parameters but this "
                f"optimizer has {len(group['params'])}"
            )
    extra = state_dict.get("zero_offload", {})
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
    positions = [p for saved in saved_groups for p in saved["params"]]
    to_local = {saved_id: local for local, saved_id in enumerate(positions)}
    slots = _slots(buckets)
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
        bucket, i = slots[index]
        shape = bucket.layout.slots[i].shape
        missing = ({"step", *kept[index]}) - set(entry)
        if missing:
            raise ValueError(f"{where}: missing {sorted(missing)}")
        lo, hi, _ = bucket.state_views(i)
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
        shaped = {name: tuple(view.shape) for name, view in bucket.param_state(i).items()}
        lacking = sorted(set(shaped) - set(entry))
        if lacking:
            raise ValueError(f"{where}: missing {lacking}")
        for name, field_shape in shaped.items():
            checked[name] = _check_tensor(where, name, entry[name], field_shape)
        checked["step"] = _check_step(where, entry["step"])
        staged[index] = checked
    scaler_state = extra.get("loss_scaler") or {}
    scaler.check_state(scaler_state)
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

    written_ids = list(extra.get("written_since_step", ()))
    unknown = [i for i in written_ids if i not in to_local or to_local[i] not in slots]
    if unknown:
        raise ValueError(
            f"{rank_prefix}state_dict names parameters written before the save that this "
            f"optimizer does not train: {unknown}"
        )
    written = {to_local[saved_id] for saved_id in written_ids}

    # Everything is checked: from here on nothing raises on the caller's data.
    for bucket in buckets:
        # Master weights the checkpoint lacks (a torch.optim.AdamW state dict, parameters
        # never stepped) come from the model's weights (Note [weights written outside the
        # optimizer] in views/param_views.py).
        bucket.store.reconcile_master()
    # Slots whose loaded weights win: no master in the state, or written before the save.
    weights_win: dict[int, set[int]] = {bucket.layout.index: set() for bucket in buckets}
    for index, (bucket, i) in slots.items():
        _, _, views = bucket.state_views(i)
        entry = staged.get(index)
        if entry is None or "master" not in entry:
            weights_win[bucket.layout.index].add(i)
        shaped = bucket.param_state(i)  # starts at 0 (ParamField)
        if entry is None:
            for name, view in views.items():
                if name != "master":
                    view.fill_(bucket.store.field_initial(name))
            for view in shaped.values():
                view.zero_()
            bucket.steps[i] = 0
            continue
        for name, view in views.items():
            if name in entry:
                view.copy_(entry[name])
        for name, view in shaped.items():
            view.copy_(entry[name])
        bucket.steps[i] = entry["step"]
    for index in written:
        bucket, i = slots[index]
        weights_win[bucket.layout.index].add(i)
    for bucket in buckets:
        # Note [a loaded state claims no weights]
        bucket.views.forget()
        bucket.views.masters_from_weights = frozenset(weights_win[bucket.layout.index])
    for saved, group in zip(saved_groups, param_groups, strict=True):
        for key, value in saved.items():
            if key != "params":
                # A copy, as torch takes: a tensor lr is stepped in place by LR schedulers,
                # which must not write into the caller's state dict.
                group[key] = copy.deepcopy(value)
    skipped = extra.get("skipped_steps")
    return LoadedState(
        scaler_state, None if skipped is None else int(skipped), bool(extra.get("pending_update"))
    )
