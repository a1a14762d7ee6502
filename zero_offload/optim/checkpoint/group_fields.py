"""zero-offload's own fields carried in the first param group, for the routes that keep only
an optimizer dict's ``state`` and ``param_groups`` (torch.distributed.checkpoint).

Note [our fields ride in the first param group]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``state_dict()`` keeps the loss scaler, the skip count and whether an ``overlap_step`` update
is pending (with the parameters written since the last step) under a top-level
``zero_offload`` key. torch's DCP recipe (``get_state_dict`` -> ``dcp.save``, then
``get_state_dict`` -> ``dcp.load`` -> ``set_state_dict``) keeps only ``state`` and
``param_groups``, each group with every key it has. So that resume lost a pending update
(the model one update behind, which the first step took for a write: 1e-2 off the
uninterrupted run five steps later) and an fp16 run's loss scaler (131072 saved, the
template's 65536 loaded). So one rank's ``state_dict()`` also writes those fields into its
first group, under the same key, as one JSON string (``carried_fields``): the load template
(a fresh optimizer's ``state_dict()``) names the key, ``dcp.load`` fills it whatever the
fields hold (one value, so no nested key of the checkpoint's can be missing from the
template's: an fp16 scaler's four against a bf16 run's none), and ``set_state_dict`` hands
the group back.

The load reads the group's copy only where the dict has no top-level ``zero_offload``
(``fields_from_groups``), drops it from every group (the live groups hold torch's keys
only), and believes it only about the state it was saved with: it records an xxh3 of the
saved entries (their names, dtypes, shapes, and 64 evenly spaced elements of each: a second
pass over every byte cost as much as the save's own copy of the state, read from disk with
the state on NVMe), and a dict whose entries differ loads as if it had none. That is the template's own copy where the
checkpoint had none (torch's, loaded with ``allow_partial_load``: its fake step may say an
update is pending), and a dict of ours that torch's AdamW loaded (keeping the group's key),
stepped and saved. The parameters written since the last step are recorded by position
across the groups, as DCP names parameters by FQN. A flattened dict
(``flatten_optimizer_state_dict=True``) is rebuilt from the loading optimizer's own group
keys, which do not include this one: docs/checkpoints.md says to flush first.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import xxhash

__all__ = ["GROUP_KEY", "carried_fields", "fields_from_groups"]

#: The key of the first group that carries the fields (as the top-level one is named).
GROUP_KEY = "zero_offload"
_DIGEST = "state_xxh3"  # the fields' record of the entries they describe


#: Elements of each saved tensor the digest reads, evenly spaced (Note [our fields ride in
#: the first param group]): a step changes every moment, so a sample tells a stepped state
#: from the one saved, without a second pass over every byte of a large model's state.
_SAMPLED = 64


def _digest(state: Mapping[Any, Any], ids: Sequence[Any]) -> str | None:
    """xxh3-64 (hex) of the entries of ``state`` in the order of ``ids`` (every group's
    ``params``): each entry's field names, and each value's dtype, shape and ``_SAMPLED``
    evenly spaced elements (all of a small one; a non-tensor by its ``repr``). None where
    an entry is not a mapping (the load refuses it later)."""
    hasher = xxhash.xxh3_64()
    for position, saved_id in enumerate(ids):
        if saved_id not in state:
            continue
        entry = state[saved_id]
        if not isinstance(entry, Mapping):
            return None
        hasher.update(f"#{position}".encode())
        for name in sorted(entry, key=str):
            value = entry[name]
            hasher.update(f"|{name}".encode())
            if isinstance(value, torch.Tensor):
                flat = value.detach().reshape(-1)  # a view of a saved (contiguous) entry
                stride = max(1, flat.numel() // _SAMPLED)
                sample = flat[::stride][:_SAMPLED].to("cpu").contiguous()  # <= 64 elements
                hasher.update(f":{flat.dtype}{tuple(value.shape)}".encode())
                hasher.update(sample.view(torch.uint8).numpy())
            else:
                hasher.update(f"={value!r}".encode())
    return hasher.hexdigest()


def carried_fields(
    extra: Mapping[str, Any], state: Mapping[int, Any], groups: Sequence[Mapping[str, Any]]
) -> str:
    """The value of ``GROUP_KEY`` in the first of ``groups`` of a one-rank ``state_dict()``:
    the top-level ``extra`` and the digest of ``state``, as JSON."""
    fields = dict(extra)
    fields[_DIGEST] = _digest(state, [saved_id for group in groups for saved_id in group["params"]])
    return json.dumps(fields)


def fields_from_groups(
    groups: Sequence[Mapping[str, Any]], state: Mapping[Any, Any]
) -> dict[str, Any]:
    """The fields the first of ``groups`` carries, where they describe ``state`` (Note [our
    fields ride in the first param group]), with ``written_since_step`` as parameter ids;
    else none (``{}``)."""
    carried = groups[0].get(GROUP_KEY) if groups else None
    if not isinstance(carried, str):
        return {}
    try:
        fields = json.loads(carried)
    except ValueError:
        return {}
    ids = [saved_id for group in groups for saved_id in group["params"]]
    if not isinstance(fields, dict) or fields.pop(_DIGEST, None) != _digest(state, ids):
        return {}
    written = fields.get("written_since_step", [])
    if isinstance(written, list) and all(isinstance(k, int) and 0 <= k < len(ids) for k in written):
        fields["written_since_step"] = [ids[k] for k in written]
    return fields
