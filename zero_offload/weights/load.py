"""``load_pretrained``: a model built on the meta device, given its safetensors checkpoint.

The trainable parameters stay on meta, tagged with their checkpoint tensor: the optimizer
reads each one straight into its device slot (or window slot, with parameter offload) when
it builds that parameter's bucket (Note [construction reads each weight from its source]).
Everything else the checkpoint names (frozen parameters, persistent buffers) is read now,
onto the accelerator's device. Nothing is materialised whole, anywhere.
"""

from __future__ import annotations

import os
import re
from typing import TypeVar

import torch

from ..accelerator import Accelerator, get_accelerator
from .checkpoint import SafetensorsCheckpoint, TensorInfo, checkpoint_name, original_module
from .source import attach, materialise

__all__ = ["load_pretrained"]

M = TypeVar("M", bound=torch.nn.Module)


def _names_by_tensor(
    model: torch.nn.Module,
) -> tuple[dict[int, list[str]], dict[int, torch.Tensor]]:
    """Every parameter and persistent buffer once, with all its names (tied weights have
    several: GPT-2's ``lm_head.weight`` is ``transformer.wte.weight``), in model order."""
    names: dict[int, list[str]] = {}
    tensors: dict[int, torch.Tensor] = {}
    # Note [a compiled model is its original module]: names as the uncompiled model's.
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(checkpoint_name(name))
        tensors[id(param)] = param
    for module_name, module in model.named_modules(remove_duplicate=False):
        for name, buffer in module._buffers.items():
            if buffer is None or name in module._non_persistent_buffers_set:
                continue
            full = f"{module_name}.{name}" if module_name else name
            names.setdefault(id(buffer), []).append(checkpoint_name(full))
            tensors[id(buffer)] = buffer
    return names, tensors


def _non_persistent_on_meta(model: torch.nn.Module) -> list[str]:
    """Names of the non-persistent buffers on the meta device: no checkpoint holds them
    (BERT's ``position_ids``, Llama's rotary ``inv_freq``), and left there the forward
    fails, or computes NaN without a word."""
    return [
        f"{module_name}.{name}" if module_name else name
        for module_name, module in model.named_modules()
        for name, buffer in module._buffers.items()
        if buffer is not None and buffer.is_meta and name in module._non_persistent_buffers_set
    ]


def _candidates(name: str, prefix: str) -> list[str]:
    """``name`` and, for a model with a ``base_model_prefix``, the name with the prefix
    added or removed (a checkpoint of the base model loads into a model with a head, and
    back, as in ``from_pretrained``)."""
    out = [name]
    if prefix:
        if name.startswith(prefix + "."):
            out.append(name[len(prefix) + 1 :])
        else:
            out.append(f"{prefix}.{name}")
    return out


def _patterns(model: torch.nn.Module, attribute: str) -> list[re.Pattern[str]]:
    return [re.compile(p) for p in (getattr(model, attribute, None) or ())]


def _plan(
    model: torch.nn.Module, checkpoint: SafetensorsCheckpoint
) -> list[tuple[torch.Tensor, list[str], TensorInfo]]:
    """Each tensor of ``model`` with a checkpoint key, its names and that key's entry;
    raises ``ValueError`` (changing nothing) for what ``load_pretrained`` refuses."""
    prefix = getattr(model, "base_model_prefix", "") or ""
    names, tensors = _names_by_tensor(model)
    ignore_missing = _patterns(model, "_keys_to_ignore_on_load_missing")
    ignore_unexpected = _patterns(model, "_keys_to_ignore_on_load_unexpected")

    plan: list[tuple[torch.Tensor, list[str], TensorInfo]] = []
    used: set[str] = set()
    missing: list[str] = []
    for key_id, tensor in tensors.items():
        found = next(
            (
                checkpoint.tensors[c]
                for n in names[key_id]
                for c in _candidates(n, prefix)
                if c in checkpoint.tensors
            ),
            None,
        )
        if found is None:
            if tensor.is_meta and not any(
                p.search(n) for p in ignore_missing for n in names[key_id]
            ):
                missing.append(f"{names[key_id][0]!r} (shape {tuple(tensor.shape)})")
            continue
        if tuple(tensor.shape) != found.shape:
            raise ValueError(
                f"checkpoint tensor {found.key!r} in {found.file} has shape {found.shape}, "
                f"but the model's {names[key_id][0]!r} has shape {tuple(tensor.shape)}; build "
                "the model from the checkpoint's config (config.json). Nothing was loaded"
            )
        # A tied weight saved under several of its names: each is this tensor's.
        used.update(
            c for n in names[key_id] for c in _candidates(n, prefix) if c in checkpoint.tensors
        )
        plan.append((tensor, names[key_id], found))
    if missing:
        raise ValueError(
            f"{len(missing)} tensor(s) of the model on the meta device have no key in the "
            f"checkpoint {checkpoint.path} ({len(checkpoint.files)} file(s)): "
            f"{', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}. Build the model "
            "from the config the checkpoint was saved with. Nothing was loaded"
        )
    unexpected = [
        info
        for key, info in checkpoint.tensors.items()
        if key not in used and not any(p.search(key) for p in ignore_unexpected)
    ]
    if unexpected:
        shown = ", ".join(f"{i.key!r} (shape {i.shape}, in {i.file.name})" for i in unexpected[:8])
        raise ValueError(
            f"{len(unexpected)} checkpoint tensor(s) in {checkpoint.path} match no parameter or "
            f"buffer of {type(model).__name__}: {shown}{' ...' if len(unexpected) > 8 else ''}. "
            "Build the model class the checkpoint was saved from. Nothing was loaded"
        )
    return plan


def load_pretrained(
    model: M,
    path: str | os.PathLike[str],
    *,
    accelerator: Accelerator | None = None,
) -> M:
    """Point ``model`` (built on the meta device) at the safetensors checkpoint ``path``;
    returns ``model``.

    ``path``: the directory ``save_pretrained`` wrote (``model.safetensors``, or
    ``model.safetensors.index.json`` with its shards), or a ``.safetensors`` file.

    Every parameter and persistent buffer is matched with its checkpoint tensor by the
    names ``named_parameters()`` / ``named_buffers()`` give it (any of a tied weight's
    names; with or without the model's ``base_model_prefix``). Then:

    - trainable parameters on meta stay there, tagged: build ``OffloadAdamW`` over them and
      it reads each tensor into its device slot, bucket by bucket (with parameter offload,
      unit by unit), so the host holds one checkpoint tensor at a time;
    - frozen (or empty) parameters and buffers on meta are read now onto the accelerator's
      device;
    - until the optimizer has read them, a forward of a module whose parameters wait on
      meta raises ``ValueError`` naming them (one left out of the optimizer, or frozen
      after this call);
    - tensors that are already real get the checkpoint's values in place (as
      ``from_pretrained`` does).

    A Hugging Face model's weights are tied first (``model.tie_weights()``), as
    ``from_pretrained`` does: built under ``accelerate.init_empty_weights()`` a tied
    ``lm_head`` comes out untied, and its checkpoint holds it once.

    Raises ``ValueError`` before changing anything (the tying undone) when a non-persistent
    buffer is on meta (no checkpoint holds one: build the model under
    ``accelerate.init_empty_weights()``, which keeps buffers real), when a tensor on meta
    has no key in the checkpoint, when a key matches no tensor of the model (unless the
    model's ``_keys_to_ignore_on_load_unexpected`` says so), or when shapes differ; each
    names the key, its file and the shapes.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    compiled, model = model, original_module(model)  # Note [a compiled model is its
    # original module] in checkpoint.py
    acc = accelerator if accelerator is not None else get_accelerator()
    checkpoint = SafetensorsCheckpoint(path)
    non_persistent = _non_persistent_on_meta(model)
    if non_persistent:
        raise ValueError(
            f"{len(non_persistent)} non-persistent buffer(s) of {type(model).__name__} are on "
            f"the meta device: {', '.join(repr(n) for n in non_persistent[:8])}"
            f"{' ...' if len(non_persistent) > 8 else ''}. No checkpoint holds them (the "
            "model computes them at construction); build the model under "
            "accelerate.init_empty_weights(), which keeps buffers real, instead of "
            "torch.device('meta'). Nothing was loaded"
        )
    # A Hugging Face model ties its weights in post_init, but under init_empty_weights each
    # parameter is re-created as it is registered, so a tied lm_head comes out a separate
    # meta parameter, and the checkpoint saves it once, under the other name. Tie as
    # from_pretrained does (the model's own config says which: a no-op when already tied),
    # and untie if the checks refuse, so a refusal leaves the model as it was.
    registered = [(module, dict(module._parameters)) for module in model.modules()]
    tie = getattr(model, "tie_weights", None)
    try:
        if callable(tie):
            tie()
        plan = _plan(model, checkpoint)
    except BaseException:
        for module, params in registered:
            module._parameters.clear()
            module._parameters.update(params)
        raise

    # Checked: now change the model.
    waiting: dict[str, torch.Tensor] = {}  # trainable parameters left for the optimizer
    for tensor, tensor_names, info in plan:
        is_param = isinstance(tensor, torch.nn.Parameter)
        # An optimizer skips a parameter without elements (as torch does): read it now.
        if is_param and tensor.is_meta and tensor.requires_grad and tensor.numel() > 0:
            attach(tensor, checkpoint, info.key)  # type: ignore[arg-type]
            waiting.update((name, tensor) for name in tensor_names)
            continue
        if not tensor.is_meta:
            checkpoint.read_into(info.key, tensor.detach())
            continue
        data = torch.empty(tensor.shape, dtype=tensor.dtype, device=acc.device)
        checkpoint.read_into(info.key, data)
        if is_param:
            materialise(tensor, data)  # type: ignore[arg-type]
        else:
            for name in tensor_names:
                owner, _, leaf = name.rpartition(".")
                model.get_submodule(owner)._buffers[leaf] = data
    checkpoint.close()
    _refuse_forward_while_waiting(model, waiting)
    return compiled  # what the caller passed (the compiled wrapper, if it was one)


def _refuse_forward_while_waiting(model: torch.nn.Module, waiting: dict[str, torch.Tensor]) -> None:
    """Until the optimizer has read them, a forward of a module whose parameters wait on
    meta raises naming them (left alone, torch's error names no parameter, or none comes:
    "Tensor on device cpu is not on the expected device meta"). Each hook removes itself at
    the first forward that finds its parameters read."""
    by_module: dict[str, list[tuple[str, torch.Tensor]]] = {}
    for name, param in waiting.items():
        by_module.setdefault(name.rpartition(".")[0], []).append((name, param))
    for owner, params in by_module.items():
        module = model.get_submodule(owner)
        handle: list[torch.utils.hooks.RemovableHandle] = []

        def check(
            module: torch.nn.Module,
            args: object,
            params: list[tuple[str, torch.Tensor]] = params,
            handle: list[torch.utils.hooks.RemovableHandle] = handle,
        ) -> None:
            left = [name for name, param in params if param.is_meta]
            if left:
                raise ValueError(
                    f"{', '.join(repr(n) for n in left[:8])} still wait on the meta device: "
                    "load_pretrained left them for the optimizer to read, and no OffloadAdamW "
                    "was built over them. Build it over every trainable parameter "
                    "(model.parameters()); a parameter frozen after load_pretrained is "
                    "never read: freeze before calling it"
                )
            handle[0].remove()

        handle.append(module.register_forward_pre_hook(check))
