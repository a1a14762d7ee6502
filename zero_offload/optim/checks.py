"""Argument checks for OffloadAdamW: every refusal names the parameter and what would work."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

__all__ = [
    "SUPPORTED_DTYPES",
    "check_hyper",
    "check_new_params",
    "check_params",
    "describe_param",
    "trainer_clipping_we_cannot_see",
]

#: Training dtypes the CPU kernels read and write.
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def describe_param(index: int, param: torch.Tensor) -> str:
    """``"parameter 3 (shape (4, 5), torch.float32)"``, for error messages."""
    return f"parameter {index} (shape {tuple(param.shape)}, {param.dtype})"


def _number(where: str, name: str, value: Any, *, low: float, high: float | None = None) -> None:
    if isinstance(value, torch.Tensor):
        raise TypeError(f"{where}: {name} must be a Python float, got a tensor ({value!r})")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{where}: {name} must be a finite number, got {value!r}")
    if value < low or (high is not None and value >= high):
        allowed = f"in [{low}, {high})" if high is not None else f">= {low}"
        raise ValueError(f"{where}: {name} must be {allowed}, got {value!r}")


def check_hyper(group: dict[str, Any], *, where: str) -> None:
    """Validate one group's (or the defaults') AdamW hyper-parameters, as torch does."""
    _number(where, "lr", group["lr"], low=0.0)
    _number(where, "eps", group["eps"], low=0.0)
    _number(where, "weight_decay", group["weight_decay"], low=0.0)
    betas = group["betas"]
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
        raise ValueError(f"{where}: betas must be a pair (beta1, beta2), got {betas!r}")
    _number(where, "betas[0]", betas[0], low=0.0, high=1.0)
    _number(where, "betas[1]", betas[1], low=0.0, high=1.0)
    for flag in ("amsgrad", "maximize"):
        if not isinstance(group[flag], bool):
            raise TypeError(f"{where}: {flag} must be a bool, got {group[flag]!r}")


def check_new_params(params: Sequence[Any], param_groups: Sequence[dict[str, Any]]) -> None:
    """Refuse non-tensors, non-leaves and parameters already in a group, by position."""
    first = sum(len(group["params"]) for group in param_groups)
    seen = {id(p) for group in param_groups for p in group["params"]}
    for offset, param in enumerate(params):
        index = first + offset
        if not isinstance(param, torch.Tensor):
            raise TypeError(f"parameter {index} must be a torch.Tensor, got {type(param).__name__}")
        what = describe_param(index, param)
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


def check_params(
    param_groups: Sequence[dict[str, Any]],
    group_indices: Sequence[int],
    *,
    first_index: int,
    device: torch.device,
    dtype: torch.dtype | None,
) -> list[tuple[int, list[tuple[int, tuple[int, ...]]]]]:
    """Check the parameters of ``group_indices``; return the trainable ones per group.

    Returns ``[(group_index, [(flat_index, shape), ...]), ...]`` for parameters that require
    grad and have elements (others are skipped, as torch skips them). ``dtype``: the
    training dtype already in use, if any; all trainable parameters must share one.
    """
    families = []
    index = first_index
    for g in group_indices:
        members = []
        for param in param_groups[g]["params"]:
            what = describe_param(index, param)
            if param.is_complex() or not param.is_floating_point():
                raise TypeError(
                    f"{what} is not a real floating-point tensor; OffloadAdamW updates "
                    f"{', '.join(str(d) for d in SUPPORTED_DTYPES)} parameters only"
                )
            if param.layout is not torch.strided:
                raise ValueError(f"{what} is {param.layout}; only dense (strided) parameters work")
            if param.dtype not in SUPPORTED_DTYPES:
                raise TypeError(
                    f"{what}: dtype {param.dtype} is not supported; cast the model to one of "
                    f"{', '.join(str(d) for d in SUPPORTED_DTYPES)}"
                )
            if param.device.type == "meta":
                raise ValueError(
                    f"{what} is on the meta device (no storage yet): materialise the model "
                    f"first, e.g. model.to_empty(device={str(device)!r}) and then initialise "
                    "or load its weights"
                )
            if param.device.type != device.type or (
                device.index is not None and param.device.index != device.index
            ):
                raise ValueError(
                    f"{what} is on {param.device} but the accelerator's device is {device}; "
                    f"move the model there first (model.to({str(device)!r}))"
                )
            if param.requires_grad and param.numel() > 0:
                if dtype is None:
                    dtype = param.dtype
                elif param.dtype != dtype:
                    raise TypeError(
                        f"{what} has dtype {param.dtype} but other parameters are {dtype}; "
                        "OffloadAdamW needs one training dtype: cast the model with "
                        "model.to(dtype), or use one optimizer per dtype"
                    )
                members.append((index, tuple(param.shape)))
            index += 1
        if members:
            families.append((g, members))
    return families


def trainer_clipping_we_cannot_see(frame: Any, *, depth: int = 12) -> Any | None:
    """The Hugging Face ``Trainer`` among the callers of ``frame`` (up to ``depth`` frames)
    whose ``args.max_grad_norm`` asks for clipping, or None.

    Such a Trainer clips with ``torch.nn.utils.clip_grad_norm_(model.parameters())``, which
    finds no ``.grad`` on OffloadAdamW's parameters (the gradients are on the host) and so
    clips nothing and logs a norm of 0. Found by the class's module name: transformers is
    never imported here.
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
        if owner is not None and any(
            cls.__name__ == "Trainer" and cls.__module__.startswith("transformers.")
            for cls in type(owner).__mro__
        ):
            args = getattr(owner, "args", None)
            limit = getattr(args, "max_grad_norm", None)
            return owner if isinstance(limit, (int, float)) and limit > 0 else None
        frame = frame.f_back
    return None
