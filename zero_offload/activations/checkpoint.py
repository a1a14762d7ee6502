"""``checkpoint``: ``torch.utils.checkpoint`` whose saved layer inputs live on the host.

Note [checkpoint inputs through outer hooks]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Non-reentrant ``torch.utils.checkpoint`` saves the tensors passed to it as autograd saved
tensors *before* it installs its own hooks for the function's body; the body's saved
tensors go to those inner hooks (they keep nothing and recompute in backward). So saved
tensor hooks wrapped around the call see exactly the checkpoint's inputs, and see them
unpacked exactly when backward starts recomputing that checkpoint. ``checkpoint`` wraps
each call in ``offload_hooks`` with one prefetch group per call: the inputs leave for the
host as the forward produces them, and while backward recomputes call ``k`` the inputs of
calls ``k-1 .. k-prefetch_depth`` come back. RNG state, autocast and the determinism check
are torch's own, untouched. Tensors nested in tuples, lists or dicts (and in kwargs) are
flattened into direct arguments first, so they are saved (and offloaded) too rather than
captured by the recomputation's closure.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch.utils import _pytree as pytree

from ..accelerator.capture import eager_only
from .default import default_offloader
from .offloader import ActivationOffloader
from .saved_tensors import offload_hooks

__all__ = ["checkpoint"]

#: Keyword arguments that configure ``torch.utils.checkpoint.checkpoint`` instead of ``fn``.
_CHECKPOINT_OPTIONS = (
    "preserve_rng_state",
    "context_fn",
    "determinism_check",
    "debug",
    "early_stop",
)


@eager_only  # Note [no graph capture of library work] in accelerator/capture.py
def checkpoint(
    fn: Callable[..., Any],
    *args: Any,
    offloader: ActivationOffloader | None = None,
    **kwargs: Any,
) -> Any:
    """Drop-in for ``torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False, **kwargs)``.

    The inputs checkpointing keeps are copied to the offloader's host pool as the forward
    produces them and prefetched back ``config.prefetch_depth`` calls ahead of their
    recomputation; see Note [checkpoint inputs through outer hooks]. Inputs smaller than
    ``config.min_bytes``, parameters and leaves requiring grad stay on the device.

    ``preserve_rng_state``, ``context_fn``, ``determinism_check``, ``debug`` and
    ``early_stop`` go to torch's checkpoint; other keyword arguments go to ``fn``.
    ``use_reentrant`` may only be False. ``fn`` must return a tensor or a (nested)
    tuple/list/dict holding at least one tensor. Inside a ``torch.compile``d model it runs
    eagerly (a graph break), ``fn`` included.
    """
    if not callable(fn):
        raise TypeError(f"checkpoint's first argument must be callable, got {type(fn).__name__}")
    if kwargs.pop("use_reentrant", False):
        raise ValueError(
            "zero_offload.activations.checkpoint is non-reentrant only (use_reentrant=True "
            "saves no inputs through autograd, so there is nothing to offload); drop "
            "use_reentrant or pass use_reentrant=False"
        )
    offloader = default_offloader() if offloader is None else offloader
    if not isinstance(offloader, ActivationOffloader):
        raise TypeError(f"offloader must be an ActivationOffloader, got {type(offloader).__name__}")
    options = {key: kwargs.pop(key) for key in _CHECKPOINT_OPTIONS if key in kwargs}
    leaves, spec = pytree.tree_flatten((args, kwargs))
    positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    tensors = [leaves[i] for i in positions]
    for i in positions:
        leaves[i] = None  # the closure below must not keep the inputs alive on the device

    def run(*inputs: torch.Tensor) -> Any:
        filled = list(leaves)
        for i, tensor in zip(positions, inputs, strict=True):
            filled[i] = tensor
        call_args, call_kwargs = pytree.tree_unflatten(filled, spec)
        out = fn(*call_args, **call_kwargs)
        _check_output(fn, out)
        return out

    hooks = offload_hooks(
        offloader, min_bytes=offloader.config.min_bytes, group=offloader.new_group()
    )
    with hooks:
        return torch_checkpoint.checkpoint(run, *tensors, use_reentrant=False, **options)


def _check_output(fn: Callable[..., Any], out: Any) -> None:
    if isinstance(out, torch.Tensor):
        return
    if not any(isinstance(leaf, torch.Tensor) for leaf in pytree.tree_leaves(out)):
        name = getattr(fn, "__qualname__", repr(fn))
        raise TypeError(
            f"the checkpointed function {name} returned {type(out).__name__} {out!r:.80}, "
            f"which holds no tensor, so no gradient can flow through the checkpoint; return "
            f"the tensor(s) computed from the inputs (a tuple, list or dict of them is fine)"
        )
