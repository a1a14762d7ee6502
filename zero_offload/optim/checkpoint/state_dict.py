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
would. Stamping instead lost such a write whenever the model loaded first (issue 38). A
read of ``opt.state`` before that step does not make the check early (Note [a master read
after a load] in ``flat_bucket.py``). The cost is one pass over the weights and the master at
the first step after a load. A checkpoint saved with an ``overlap_step`` update pending is
the one case where the weights are stale by design: there the update is published from the
master, except into the parameters it names in ``written_since_step`` and those without a
master, which keep their weights (Note [delayed parameter update] in ``update/modes.py``).

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

Note [an empty parameter's state is checked, then dropped]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A parameter with no elements has no slot: nothing to keep and nothing to step (a step
leaves it as torch's does: ``check_untouched`` in ``checks.py``). torch's optimizers still keep
state for it once it has had a gradient (``step`` and empty moments), so their state dicts
name it. Such an entry, for a parameter that this optimizer holds in its groups, is checked
in the first phase as any other is (its fields, their shapes and dtypes, its step:
``check_empty_entry``) and then dropped: a malformed one is still refused, a well-formed
one loads as the rest of the dict does, and ``state_dict()`` names the parameter no more
(torch's, loaded back, starts it afresh: an empty moment holds nothing). An entry for a
parameter that has elements but no slot (frozen when the optimizer was built) is refused.

Note [a loaded entry needs its step]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Every entry of a parameter with a slot must hold ``step``, whatever the rule: the count is
state we keep, save and report (``opt.state[p]["step"]``, ``state_dict()``), and most
updates read it (Adam's bias corrections, Adagrad's ``lr_decay``, Adafactor's decay
schedule), so a missing one is refused rather than made up. The refusal is the rule's
(``OptimizerRule.missing_step``): the rules whose update does not read the count (Lion;
Muon's update of a matrix) name the reference optimizers whose dicts keep none
(lion-pytorch's Lion, ``torch.optim.Muon``) and the one line that loads such a dict (give
each entry a count); the others say that their reference saves one in every entry. Lion
could take a missing count as 1 without changing a step, but the count it reported would
be one the run never had, and a dict of another optimizer that happens to hold Lion's
one field would load silently; so it stays strict, with the way in named.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from ...collectives import Comm
from ..flat_bucket import FlatBucket
from ..rule.base import OptimizerRule
from ..rule.values import loaded_torch_switches
from ..update.loss_scaler import LossScaler
from ..update.resume import LoadGuard
from .group_fields import GROUP_KEY, carried_fields, fields_from_groups
from .loaded_fields import (
    FORMAT_VERSION,
    check_empty_entry,
    check_extra,
    check_mapping,
    check_skipped_steps,
    check_step,
    check_tensor,
    saved_groups,
    without_rebuilt_gaps,
)

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
    # Our state (it has masters) with none of our fields: a route dropped them (Note [our
    # fields ride in the first param group] in group_fields.py)
    fields_dropped: bool = False


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
        if not bucket.has_state(i):
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
        "version": FORMAT_VERSION,
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
    elif groups:  # Note [our fields ride in the first param group]
        groups[0][GROUP_KEY] = carried_fields(extra, state, groups)
    return {"state": state, "param_groups": groups, "zero_offload": extra}


def load_optimizer_state(
    buckets: Sequence[FlatBucket],
    param_groups: list[dict[str, Any]],
    state_dict: dict[str, Any],
    *,
    comm: Comm | None,
    scaler: LossScaler,
    rule: OptimizerRule,
    guard: LoadGuard,
    call: str,
) -> LoadedState:
    """Check everything (the loss scaler's state too), then copy into ``buckets`` and
    ``param_groups``; see ``OffloadAdamW.load_state_dict`` and Note [a load checks
    everything, then copies]. ``guard`` records the copy bucket by bucket, ``call`` being
    the call that redoes it (Note [a load cut short] in ``update/resume.py``). Returns what
    the caller applies: the scaler's state, the skip count, whether an update was pending."""
    loaded_groups = saved_groups(state_dict, param_groups)
    if "zero_offload" in state_dict:
        extra = check_mapping(
            "state_dict['zero_offload']", state_dict["zero_offload"], "zero-offload's fields"
        )
    else:  # Note [our fields ride in the first param group]
        extra = fields_from_groups(loaded_groups, state_dict["state"])
    check_extra(extra, rule)
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
    positions = [p for saved in loaded_groups for p in saved["params"]]
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
    held = [(group, param) for group in param_groups for param in group["params"]]
    staged: dict[int, dict[str, Any]] = {}
    for saved_id, entry in state_dict["state"].items():
        if saved_id not in to_local:
            raise ValueError(f"state_dict has state for unknown parameter id {saved_id!r}")
        index = to_local[saved_id]
        where = f"{rank_prefix}state of parameter {index}"
        entry = without_rebuilt_gaps(where, entry)  # Note [a field DCP rebuilt as {}]
        if index not in slots:
            group, param = held[index]
            if param.numel() != 0:
                raise ValueError(f"{where}: this optimizer does not train that parameter")
            # Note [an empty parameter's state is checked, then dropped]
            check_empty_entry(
                where,
                entry,
                fields=rule.checkpoint_fields(group),
                param_fields=rule.param_state(tuple(param.shape)),
                shape=tuple(param.shape),
            )
            continue
        check_mapping(where, entry, "field name -> value, as state_dict() saves")
        bucket, i = slots[index]
        shape = bucket.layout.slots[i].shape
        missing = ({"step", *kept[index]}) - set(entry)
        if missing - {"step"}:
            raise ValueError(f"{where}: missing {sorted(missing)}")
        lo, hi, _ = flat_views[index]
        if shard is not None and tuple(shard["pieces"].get(saved_id, (lo, hi))) != (lo, hi):
            raise ValueError(
                f"{where}: the shard holds elements {tuple(shard['pieces'][saved_id])} but "
                f"this rank owns {(lo, hi)} (different bucket_bytes?); load a consolidated "
                "state_dict instead"
            )
        checked = {
            name: check_tensor(where, name, entry[name], shape if shard is None else (hi - lo,))
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
            checked[name] = check_tensor(where, name, entry[name], field_shape)
        if "step" not in entry:  # the state is all there but for its count
            # Note [a loaded entry needs its step]: the rule says why, and what loads
            raise ValueError(rule.missing_step(where))
        checked["step"] = check_step(where, entry["step"])
        staged[index] = checked
    scaler_state = extra.get("loss_scaler") or {}
    scaler.check_state(scaler_state)
    new_groups: list[dict[str, Any]] = []
    for g, (saved_group, group) in enumerate(zip(loaded_groups, param_groups, strict=True)):
        # the live groups hold torch's keys (Note [our fields ride in the first param group])
        saved = {key: value for key, value in saved_group.items() if key != GROUP_KEY}
        merged = {**group, **{key: value for key, value in saved.items() if key != "params"}}
        # Note [torch's implementation switches in a group] in rule/values.py
        switches = loaded_torch_switches(f"state_dict param group {g}", saved)
        merged.update(switches)
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
            loaded = {key: copy.deepcopy(value) for key, value in saved.items() if key != "params"}
        except (TypeError, copy.Error) as exc:
            raise TypeError(
                f"state_dict param group {g}: a value cannot be copied ({exc}); a group "
                "holds numbers, tuples, strings, bools and tensors"
            ) from exc
        # Completed by the rule as a new group is, over the group it replaces: what torch's
        # optimizers make of a loaded group in their __setstate__ (Note [the decay's form
        # is the group's] in rule/adamw.py: AdamW's groups stay decoupled).
        completed = {**group, **loaded, **switches}
        rule.complete_group(completed)
        new_groups.append({key: value for key, value in completed.items() if key != "params"})

    written_ids = list(extra.get("written_since_step", ()))
    unknown = [i for i in written_ids if i not in to_local or to_local[i] not in slots]
    if unknown:
        raise ValueError(
            f"{rank_prefix}state_dict names parameters written before the save that this "
            f"optimizer does not train: {unknown}"
        )
    written = {to_local[saved_id] for saved_id in written_ids}

    # Note [a load checks everything, then copies]: from here on nothing reads the caller's
    # dict, only what was staged from it, and nothing raises on its data. A copy cut short
    # (Ctrl-C) is recorded bucket by bucket: Note [a load cut short] in update/resume.py.
    guard.start(call, [bucket.layout.index for bucket in buckets])
    for position, bucket in enumerate(buckets):
        guard.begin(position)
        # Master weights the checkpoint lacks (a torch.optim.AdamW state dict, parameters
        # never stepped) come from the model's weights (Note [weights written outside the
        # optimizer] in views/param_views.py).
        bucket.store.reconcile_master()
        # Slots whose loaded weights win: no master in the state, or written before the save.
        weights_win: set[int] = set()
        with torch.no_grad():
            for i, slot in enumerate(bucket.layout.slots):
                _, _, views = flat_views[slot.index]
                shaped_state = shaped_views[slot.index]  # starts at 0 (ParamField)
                entry = staged.get(slot.index)
                if entry is None or "master" not in entry or slot.index in written:
                    weights_win.add(i)
                if entry is None:
                    for name, view in views.items():
                        if name != "master":
                            view.fill_(bucket.store.field_initial(name))
                    for view in shaped_state.values():
                        view.zero_()
                    bucket.steps[i] = 0
                    bucket.kept_at_zero.discard(i)
                    continue
                for name, view in views.items():
                    if name in entry:
                        view.copy_(entry[name])
                for name, view in shaped_state.items():
                    view.copy_(entry[name])
                bucket.steps[i] = entry["step"]
                if bucket.steps[i] == 0:  # an entry saved with step 0 stays one (as torch's)
                    bucket.kept_at_zero.add(i)
                else:
                    bucket.kept_at_zero.discard(i)
        bucket.loaded(weights_win)  # Note [a loaded state claims no weights]
        guard.done(position)
    for new, group in zip(new_groups, param_groups, strict=True):
        group.update(new)
    dropped = not extra and any("master" in entry for entry in staged.values())
    return LoadedState(scaler_state, skipped, extra.get("pending_update", False), dropped)
