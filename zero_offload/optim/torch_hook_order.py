"""Post-accumulate-grad hooks registered after the optimizer run before it.

Note [the optimizer's hook runs last]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
An offload optimizer takes each parameter's gradient in a post-accumulate-grad hook, which
sets ``.grad`` to None (the gradient leaves during backward). torch runs a tensor's hooks in
the order they were registered, so a hook a user registers after building the optimizer (a
per-element clamp, noise, a gradient statistic) ran after ours and saw None: its edit was
lost and nothing said so. With torch's optimizers such a hook runs before the step reads
``.grad``, wherever it was registered. So importing ``zero_offload.optim`` wraps
``torch.Tensor.register_post_accumulate_grad_hook``: on a parameter a live offload optimizer
trains, the new hook is registered as torch does and the optimizer's hook is then moved
behind it (the hooks are an ordered dict keyed by handle id; ``BackwardRouter.keep_last``).
The user's hook sees the gradient and may change it in place or replace it, and the
optimizer takes what it leaves, as torch's step would read it. Hooks registered before the
optimizer ran before it already. Not for a hook registered on a parameter while autograd
runs that parameter's hooks (from inside another of its hooks, or another thread during
its backward): the reordering rewrites the dict autograd is walking.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from .lifetime import OWNERS

__all__ = ["install"]

#: Marks the registration this module wrapped (so it is wrapped once).
_WRAPPED = "__zero_offload_hook_order__"


def _guard(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def register_post_accumulate_grad_hook(self: torch.Tensor, hook: Callable[..., Any]) -> Any:
        handle = fn(self, hook)
        if OWNERS:
            ref = OWNERS.get(self)
            owner = ref() if ref is not None else None
            if owner is not None and not owner.closed:
                owner._router.keep_last(self)
        return handle

    setattr(register_post_accumulate_grad_hook, _WRAPPED, True)
    return register_post_accumulate_grad_hook


def install() -> None:
    """Wrap ``Tensor.register_post_accumulate_grad_hook``; idempotent (Note [the
    optimizer's hook runs last])."""
    original = torch.Tensor.register_post_accumulate_grad_hook
    if not getattr(original, _WRAPPED, False):
        torch.Tensor.register_post_accumulate_grad_hook = _guard(original)  # type: ignore[method-assign]
