"""Argument checks for the offload optimizers: every refusal names the parameter and what
would work."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.nn.modules.module import register_module_parameter_registration_hook
from torch.utils.weak import WeakIdKeyDictionary

from ..views.family import Family
from ..weights.source import has_source
from .rule.base import OptimizerRule
from .shared_memory import refuse_shared_memory

if TYPE_CHECKING:
    from .flat_bucket import FlatBucket

__all__ = [
    "SUPPORTED_DTYPES",
    "check_new_params",
    "check_param_group",
    "check_params",
    "check_untouched",
    "describe_param",
    "param_name",
    "plain_trainer_calling",
    "refuse_torch_switches",
    "refuse_whole_parameter_features",
    "split_names",
    "watch_replacement",
]

#: Training dtypes the CPU kernels read and write.
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def describe_param(index: int, param: torch.Tensor, name: str | None = None) -> str:
    """``"parameter 3 (shape (4, 5), torch.float32)"``, for error messages; with the name
    that ``named_parameters()`` gave it, ``"parameter 3 ('fc.weight', shape ...)"``."""
    named = f"{name!r}, " if name is not None else ""
    return f"parameter {index} ({named}shape {tuple(param.shape)}, {param.dtype})"


def param_name(param_groups: Sequence[dict[str, Any]], index: int) -> str | None:
    """The name of the parameter at flat position ``index`` across ``param_groups``, when
    the groups were given ``named_parameters()`` (their ``param_names``), else None."""
    for group in param_groups:
        count = len(group["params"])
        if index < count:
            names = group.get("param_names")
            return names[index] if names is not None else None
        index -= count
    return None


def split_names(params: Sequence[Any], *, where: str) -> tuple[list[Any], list[str] | None]:
    """``(tensors, names)`` of a group's ``params``: ``model.named_parameters()`` gives
    ``(name, tensor)`` pairs, which torch accepts and keeps as the group's ``param_names``
    (``names`` is None when no entry is a pair). Names for some entries only are refused,
    as torch refuses them."""
    pairs = [isinstance(p, tuple) for p in params]
    if not any(pairs):
        return list(params), None
    if not all(pairs):
        missing = pairs.index(False)
        raise ValueError(
            f"{where}: entry {missing} of 'params' has no name but others are (name, "
            "parameter) pairs; pass all of them with names (model.named_parameters()) or "
            "none (model.parameters())"
        )
    for i, pair in enumerate(params):
        if len(pair) != 2 or not isinstance(pair[0], str):
            raise TypeError(
                f"{where}: entry {i} of 'params' must be a (name: str, parameter) pair, as "
                f"model.named_parameters() yields, got {pair!r}"
            )
    return [pair[1] for pair in params], [pair[0] for pair in params]


def check_param_group(
    param_group: Any, param_groups: Sequence[dict[str, Any]], *, where: str
) -> tuple[dict[str, Any], list[Any], list[str] | None]:
    """``(group, params, names)`` for ``add_param_group(param_group)``: a copy of the group
    whose ``params`` is a list (one tensor is one entry), and the names when they came as
    ``model.named_parameters()`` pairs (then kept as the group's ``param_names``, as torch
    keeps them). Refuses what torch refuses, with what would work; changes nothing."""
    if not isinstance(param_group, dict):
        raise TypeError(
            f"param_group must be a dict, as torch requires, such as {{'params': "
            f"[tensors], 'lr': 1e-4}}; got {type(param_group).__name__}"
        )
    if "params" not in param_group:
        raise ValueError(
            f"{where} has no 'params' entry (its keys: {sorted(map(str, param_group))}); "
            "pass the group's parameters as {'params': [tensors], ...}"
        )
    group = dict(param_group)
    params = group["params"]
    if isinstance(params, torch.Tensor):
        params = [params]
    elif isinstance(params, set) or not isinstance(params, Iterable):
        raise TypeError(
            f"{where}: 'params' must be a tensor or an ordered iterable of tensors (not a "
            f"set), got {type(params).__name__}"
        )
    params, names = split_names(list(params), where=where)
    group["params"] = params
    if names is not None:
        group["param_names"] = names
    if param_groups and ("param_names" in group) != ("param_names" in param_groups[0]):
        raise ValueError(
            f"{where} is {'with' if names is not None else 'without'} parameter names but "
            "the optimizer's first group is not; pass every group as named_parameters() "
            "pairs or none of them (as torch requires)"
        )
    return group, params, names


def check_new_params(
    params: Sequence[Any],
    param_groups: Sequence[dict[str, Any]],
    *,
    names: Sequence[str] | None = None,
) -> None:
    """Refuse non-tensors, non-leaves, parameters already in a group, by position (and
    by name, given ``names``), and parameters whose memory overlaps another's (Note
    [parameters that share memory] in shared_memory.py)."""
    first = sum(len(group["params"]) for group in param_groups)
    seen = {id(p) for group in param_groups for p in group["params"]}
    for offset, param in enumerate(params):
        index = first + offset
        if not isinstance(param, torch.Tensor):
            raise TypeError(f"parameter {index} must be a torch.Tensor, got {type(param).__name__}")
        what = describe_param(index, param, names[offset] if names is not None else None)
        if not param.is_leaf:
            raise ValueError(
                f"{what} is not a leaf tensor (it was computed from others); pass the "
                "model's parameters (model.parameters()), not tensors derived from them"
            )
        if id(param) in seen:
            raise ValueError(
                f"{what} appears in more than one parameter group (or twice in one); "
                "list each parameter once"
            )
        seen.add(id(param))
    every = [*(p for group in param_groups for p in group["params"]), *params]
    refuse_shared_memory(  # Note [parameters that share memory] in shared_memory.py
        every,
        first=first,
        describe=lambda i: _describe(every, i, first, names, param_groups),
    )


def _describe(
    every: Sequence[torch.Tensor],
    index: int,
    first: int,
    names: Sequence[str] | None,
    param_groups: Sequence[dict[str, Any]],
) -> str:
    """``describe_param`` for flat ``index``: a new parameter (``first`` on) named by
    ``names``, an existing one by its group's ``param_names``."""
    if index >= first:
        name = names[index - first] if names is not None else None
    else:
        name = param_name(param_groups, index)
    return describe_param(index, every[index], name)


def check_params(
    param_groups: Sequence[dict[str, Any]],
    group_indices: Sequence[int],
    *,
    first_index: int,
    device: torch.device,
) -> list[Family]:
    """Check the parameters of ``group_indices``; return the trainable ones per group and
    training dtype.

    Parameters that require grad and have elements are returned (others are skipped, as
    torch skips them), one ``Family`` per (group, dtype), groups in order and, within a
    group, dtypes in the order they first appear. Training dtypes may differ (bf16 weights
    with fp32 norms, fp32 adapters on a bf16 base): each bucket holds one.
    """
    families = []
    index = first_index
    for g in group_indices:
        by_dtype: dict[torch.dtype, list[tuple[int, tuple[int, ...]]]] = {}
        names = param_groups[g].get("param_names")
        for i, param in enumerate(param_groups[g]["params"]):
            what = describe_param(index, param, names[i] if names is not None else None)
            if param.is_complex() or not param.is_floating_point():
                raise TypeError(
                    f"{what} is not a real floating-point tensor; the offload optimizers update "
                    f"{', '.join(str(d) for d in SUPPORTED_DTYPES)} parameters only"
                )
            if param.layout is not torch.strided:
                raise ValueError(f"{what} is {param.layout}; only dense (strided) parameters work")
            if param.dtype not in SUPPORTED_DTYPES:
                raise TypeError(
                    f"{what}: dtype {param.dtype} is not supported; cast the model to one of "
                    f"{', '.join(str(d) for d in SUPPORTED_DTYPES)}"
                )
            if param.device.type == "meta" and not has_source(param):
                raise ValueError(
                    f"{what} is on the meta device (no storage yet) and has no source of "
                    "weights: load its checkpoint first, zero_offload.load_pretrained(model, "
                    f"path), or materialise the model, model.to_empty(device={str(device)!r}), "
                    "and initialise it"
                )
            # Note [construction reads each weight from its source] in weights/source.py:
            # the device, the host (pinned or not) and meta plus a checkpoint are all read
            # bucket by bucket into the slots.
            if param.device.type not in ("cpu", "meta") and (
                param.device.type != device.type
                or (device.index is not None and param.device.index != device.index)
            ):
                raise ValueError(
                    f"{what} is on {param.device} but the accelerator's device is {device}; "
                    f"move the model there (model.to({str(device)!r})) or to the CPU first"
                )
            if param.requires_grad and param.numel() > 0:
                by_dtype.setdefault(param.dtype, []).append((index, tuple(param.shape)))
            index += 1
        families.extend(Family(g, dtype, members) for dtype, members in by_dtype.items())
    return families


def plain_trainer_calling(frame: Any, *, depth: int = 12) -> Any | None:
    """The Hugging Face ``Trainer`` among the callers of ``frame`` (up to ``depth`` frames)
    that is not zero-offload's ``OffloadTrainer``, or None.

    Such a Trainer clips (``max_grad_norm > 0``) and computes the ``grad_norm`` it logs
    (always) with ``torch.nn.utils.clip_grad_norm_(model.parameters())``, which finds no
    ``.grad`` on OffloadAdamW's parameters (the gradients are on the host): it clips nothing
    and logs 0. Found by class and module names: transformers is never imported here.
    """
    for _ in range(depth):
        if frame is None:
            return None
        if "transformers" not in frame.f_code.co_filename:
            # Reading f_locals materialises a dict on the frame that keeps its locals alive
            # (an optimizer the caller has just dropped, say): only transformers' own frames.
            frame = frame.f_back
            continue
        owner = frame.f_locals.get("self")
        mro = type(owner).__mro__ if owner is not None else ()
        if any(c.__name__ == "Trainer" and c.__module__.startswith("transformers.") for c in mro):
            ours = any(c.__module__.startswith("zero_offload.integrations") for c in mro)
            return None if ours else owner
        frame = frame.f_back
    return None


# Note [parameters replaced in their module]
# ``model.load_state_dict(sd, assign=True)`` (and ``module.weight = nn.Parameter(...)``)
# does not write the old parameter: it puts a new Parameter object in the module. The
# optimizer holds the old object, whose storage is still its slot (``detached()`` sees
# nothing), and no gradient reaches it again: training would silently stop, as it does with
# torch's own optimizers. The optimizer does not know the model, but every such replacement
# goes through ``Module.register_parameter``, whose process-wide registration hooks see the
# module's old parameter before it is replaced: one hook, installed with the first
# optimizer, records the replaced parameters the optimizers train, and the next step
# refuses, naming the parameter and where it was. (With torch's swap_tensors conversion
# the old object takes the new data instead, which ``detached()`` refuses.)

#: Parameters an optimizer trains (keys only; set at construction).
WATCHED: WeakIdKeyDictionary = WeakIdKeyDictionary()
#: Watched parameters replaced in their module, and where: ``"Linear.weight"``.
REPLACED: WeakIdKeyDictionary = WeakIdKeyDictionary()
_hook: list[object] = []  # the registration hook's handle, once installed


def _on_register(module: torch.nn.Module, name: str, param: object) -> None:
    old = module._parameters.get(name)
    if old is not None and old is not param and old in WATCHED:
        REPLACED[old] = f"{type(module).__name__}.{name}"


def watch_replacement(params: Sequence[torch.Tensor]) -> None:
    """Record it if one of ``params`` is replaced in its module: Note [parameters replaced
    in their module]."""
    if not _hook:
        _hook.append(register_module_parameter_registration_hook(_on_register))
    for param in params:
        WATCHED[param] = True
        REPLACED.pop(param, None)


def _check_groups_kept(
    owner: Any, param_groups: Sequence[dict[str, Any]], buckets: Sequence[FlatBucket]
) -> None:
    """Refuse a step after a group, or a trained parameter, was taken out of
    ``param_groups`` by hand: torch would stop stepping it, while its state and bucket
    here would step on. Python's identity tests, O(parameters), no tensor ops."""
    groups = {bucket.layout.group for bucket in buckets}
    if groups and max(groups) >= len(param_groups):
        raise ValueError(
            f"param group {max(groups)} of {owner!r} was removed from param_groups after it "
            f"was built (there are {len(param_groups)} now); its parameters keep their "
            "state and buckets, so torch's way of dropping them cannot work here. Rebuild "
            "the optimizer over the groups that should train, or freeze those that should "
            "not (requires_grad_(False)): nothing was stepped"
        )
    members = [{id(p) for p in group["params"]} for group in param_groups]
    for bucket in buckets:
        kept = members[bucket.layout.group]
        for slot, param in zip(bucket.layout.slots, bucket.params, strict=True):
            if id(param) not in kept:
                raise ValueError(
                    f"{describe_param(slot.index, param)} is no longer in param group "
                    f"{bucket.layout.group}'s 'params' (it was taken out of param_groups "
                    f"by hand after {owner!r} was built): torch would stop stepping it, but "
                    "its state and bucket here would step on. Rebuild the optimizer over "
                    "the parameters that should train, or freeze it (requires_grad_(False)) "
                    "to keep it out of the steps: nothing was stepped"
                )


def check_untouched(
    owner: Any,
    param_groups: Sequence[dict[str, Any]],
    buckets: Sequence[FlatBucket],
    *,
    rule: OptimizerRule,
) -> None:
    """Refuse, before anything changes, what happened behind ``owner``'s (the optimizer's)
    back: Notes [parameters replaced behind the optimizer] and [a step is all or nothing]."""
    _check_groups_kept(owner, param_groups, buckets)
    trained = {id(p) for bucket in buckets for p in bucket.params}
    index = 0
    for g, group in enumerate(param_groups):
        for param in group["params"]:
            # An empty parameter has no state to step and nothing to step (torch skips
            # its step too); only its gradient is left over, as torch leaves it.
            if id(param) not in trained and param.grad is not None and param.numel() > 0:
                raise ValueError(
                    f"{describe_param(index, param)} in param group {g} has a gradient, "
                    f"but it was frozen (requires_grad=False) or empty when {owner!r} was "
                    "built, or put in param_groups by hand since, so it has no optimizer "
                    "state: nothing was stepped. To train it now, rebuild: sd = "
                    "opt.state_dict(); opt.close(); build the optimizer again over the same "
                    "param groups; opt.load_state_dict(sd). To unfreeze layers later in a "
                    "run (gradual unfreezing), build the optimizer while they are trainable "
                    "and freeze them after it: a parameter frozen after the build keeps its "
                    "state and steps again once unfrozen. A parameter put in param_groups by "
                    "hand goes in with add_param_group instead"
                )
            index += 1
    for bucket in buckets:
        for slot, param in zip(bucket.layout.slots, bucket.params, strict=True):
            where = REPLACED.get(param)
            if where is not None:
                raise ValueError(
                    f"{describe_param(slot.index, param, param_name(param_groups, slot.index))} "
                    f"was replaced in its module ({where} is a new nn.Parameter: "
                    "model.load_state_dict(..., assign=True), or an assignment of a new "
                    f"Parameter). {owner!r} holds the old object, which no longer trains. "
                    "Rebuild the optimizer over the model's parameters after such changes "
                    "(load_state_dict carries the state over): nothing was stepped"
                )
    for bucket in buckets:
        detached = bucket.views.detached()
        if detached:
            slot_index, param = detached[0]
            slot = bucket.layout.slots[slot_index]
            raise ValueError(
                f"{describe_param(slot.index, param)} no longer uses the storage "
                f"{owner!r} gave it (its .data was replaced after construction: "
                "model.half()/.to(dtype), load_state_dict(assign=True), PEFT "
                "merge_and_unload, resize_token_embeddings..., or a plain "
                "accelerate.Accelerator's prepare(model) on several processes). The "
                "optimizer would update memory the model does not read. Rebuild the "
                "optimizer after such changes (load_state_dict carries the state over). "
                "With accelerate use zero_offload.integrations.accelerate.OffloadAccelerator, "
                "and do not wrap the model in DistributedDataParallel: the optimizer averages "
                "the gradients across ranks itself. Nothing was stepped"
            )
    for g, group in enumerate(param_groups):
        rule.check_group(group, where=f"param group {g}")
    for bucket in buckets:
        why = rule.missing_state(param_groups[bucket.layout.group], bucket.store.state_names())
        if why is not None:
            raise ValueError(
                f"param group {bucket.layout.group} of {owner!r} cannot step: {why}. "
                "Nothing was stepped"
            )


def refuse_whole_parameter_features(
    name: str, rule: OptimizerRule, config: Any, *, ranks: int
) -> None:
    """Refuse, for a rule that reads whole parameters (Note [rules that read a whole
    parameter] in ``rule/base.py``), each feature that would step part of a parameter or
    keep its state where the rule's shaped state has no place; nothing for an elementwise
    rule. Parameter offload on one rank passes: each unit's host pool holds its buckets'
    shaped state. So does ``offload_fraction`` below 1 or ``"auto"``: resident buckets keep
    it in the device pool and step each parameter whole there (Note [whole parameters
    stepped on the device] in ``state/whole_resident.py``). Several ranks pass (each
    parameter is stepped whole by one rank: Note [a whole parameter has one owner] in
    ``partition.py``), but not with parameter offload, which is ZeRO-3 there, nor with NVMe
    state, planned for one rank. ``name``: the optimizer's class; ``ranks``: the process group's
    size (1 alone)."""
    if rule.elementwise:
        return
    refused = []
    if ranks > 1 and config.offload_parameters and not config.partition_parameters:
        refused.append(
            f"offload_parameters=True on {ranks} ranks (that is ZeRO-3 with offload, whose "
            "units' homes are sharded by flat range, which cuts parameters that the rule "
            "reads whole); leave offload_parameters=False on several ranks (each parameter "
            "is then stepped whole by one rank), or use one rank"
        )
    if ranks > 1 and config.nvme_dir is not None:
        refused.append(
            f"nvme_dir={str(config.nvme_dir)!r} on {ranks} ranks (the records of a rule that "
            "reads whole parameters are planned over one rank's whole bucket, Note [NVMe "
            "tiles follow whole parameters]); leave nvme_dir=None on several ranks (each "
            "parameter is then stepped whole by one rank, its state in host RAM), or use "
            "one rank"
        )
    if config.partition_parameters:
        refused.append(
            "partition_parameters=True (ZeRO-3 shards each unit's buckets by flat range over "
            "ranks, which cuts parameters that the rule reads whole); leave "
            "partition_parameters=False (offload_parameters=True on one rank keeps the "
            "weights off the device, each parameter whole)"
        )
    if refused:
        raise ValueError(
            f"{name}: the {rule.name} rule reads whole parameters ({rule.reads_whole}), so "
            "it does not support " + "; nor ".join(refused)
        )


def refuse_torch_switches(name: str, **switches: bool | None) -> None:
    """Refuse torch's implementation switches that mean nothing here: ``capturable`` and
    ``differentiable`` (True is refused: the update runs on the CPU outside autograd and
    CUDA graphs), ``foreach`` and ``fused`` (anything but None: our own kernel always
    runs). A facade passes those its torch signature takes."""
    for flag, value in switches.items():
        if flag in ("capturable", "differentiable"):
            if value:
                raise ValueError(
                    f"{name} does not support {flag}=True: the update runs on the CPU "
                    f"outside autograd and CUDA graphs; leave {flag}=False"
                )
        elif value is not None:
            raise ValueError(
                f"{name} ignores torch's {flag}= implementation switch (it always "
                f"runs its own fused CPU kernel); leave {flag}=None, got {value!r}"
            )
