"""``zero_grad`` called elsewhere than on the optimizer reaches its window.

Note [zero_grad from elsewhere reaches the window]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
torch clears gradients wherever ``.grad`` is set to None: ``model.zero_grad()``, a
sub-module's (a GAN's ``netD.zero_grad()``), another optimizer object over the same
parameters (SAM's wrapper, whose ``zero_grad`` is torch's). An offload optimizer's
gradients are not in ``.grad`` (they leave during backward), so none of these could see
them: a loop that cleared that way in the middle of a window (an adversarial example's
input-gradient backward, a skipped bad batch, the generator's backward through the
discriminator) kept the gradients it meant to drop, and the next step added them in,
silently. So importing ``zero_offload.optim`` (which every offload optimizer's import does)
wraps ``torch.nn.Module.zero_grad`` and ``torch.optim.Optimizer.zero_grad``: the parameters that a live offload optimizer trains
(``OWNERS``, looked up only while one is alive) are cleared in their optimizer's window.

- A call that covers every parameter an optimizer trains is that optimizer's own
  ``zero_grad(set_to_none)``: the window is forgotten, in flight or not, as torch's ``.grad``
  would be (a step with no backward after it steps nothing).
- A call that covers some of them, while the window holds gradients of a backward not yet
  stepped, is refused before anything is cleared: a window is summed per bucket, and some
  parameters' share of it cannot be taken out. Clear through the optimizer
  (``opt.zero_grad()``), or give the parameters cleared apart an optimizer of their own.
  With nothing pending (after a step, or before any backward) there is nothing to clear
  and the call goes through; a ``step()`` right after it, with no backward between, is
  refused (Note [a partial clear after a step] in ``kept_zero_grads.py``).
- An offload optimizer's own ``zero_grad`` calls torch's unwrapped (``torch_zero_grad``), also
  through the frameworks' wrappers that run it with themselves as ``self`` (Lightning's
  ``LightningOptimizer``, Fabric's): the guard would see that as another object's clear.
- Parameters listed twice (torch warns, and allows it) count once.

What cannot be seen: ``p.grad = None`` written by hand for one parameter, and a reference to
torch's function taken before ``zero_offload`` was imported.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

import torch

from .grads.lifecycle import PENDING
from .lifetime import OWNERS

__all__ = ["install", "torch_zero_grad"]

#: Marks a ``zero_grad`` this module wrapped (so it is wrapped once).
_WRAPPED = "__zero_offload_zero_grad__"


def _owners(params: Iterable[Any]) -> dict[int, tuple[Any, list[Any]]]:
    """Each live offload optimizer that trains one of ``params``: id -> (it, those)."""
    found: dict[int, tuple[Any, list[Any]]] = {}
    seen: set[int] = set()
    for param in params:  # frozen ones too: a layer frozen mid-run is still in a bucket
        if not isinstance(param, torch.Tensor) or id(param) in seen:
            continue
        seen.add(id(param))
        ref = OWNERS.get(param)
        owner = ref() if ref is not None else None
        if owner is None or owner.closed:
            continue
        found.setdefault(id(owner), (owner, []))[1].append(param)
    return found


def _trained(opt: Any) -> int:
    """How many parameters ``opt`` trains (one ``OWNERS`` entry each)."""
    return sum(len(bucket.params) for bucket in opt.buckets)


def _check(found: dict[int, tuple[Any, list[Any]]], what: str) -> tuple[list[Any], list[Any]]:
    """The optimizers whose whole window ``what`` clears, and those it clears some
    parameters of with nothing pending (with the parameters); refuses a partial clear of
    a window with pending gradients (Note [zero_grad from elsewhere reaches the window])."""
    whole, partial = [], []
    for opt, cleared in found.values():
        count, total = len(cleared), _trained(opt)
        if count >= total:
            whole.append(opt)
            continue
        if any(bucket.grads.state in PENDING for bucket in opt.buckets):
            raise ValueError(
                f"{what} clears {count} of the {total} parameters {opt!r} trains, whose "
                "gradients since the last step are summed per bucket on the host and "
                "cannot be dropped for some parameters alone. Nothing was cleared. Clear the "
                "whole window with opt.zero_grad() (or model.zero_grad() on a module that "
                "holds every parameter it trains), or train the parameters cleared apart "
                "with an optimizer of their own (Note [zero_grad from elsewhere reaches the "
                "window])"
            )
        partial.append((opt, cleared))
    return whole, partial


def _clear(fn: Callable[..., Any], owner: Any, params: Iterable[Any], set_to_none: bool) -> None:
    """torch's ``fn`` on ``owner`` (a module or an optimizer), then the windows of the
    offload optimizers whose every parameter ``params`` holds; checked first."""
    found = _owners(params)
    found.pop(id(owner), None)  # an offload optimizer itself clears through torch_zero_grad
    whole, partial = _check(found, f"{type(owner).__name__}.zero_grad()")
    fn(owner, set_to_none)
    for opt in whole:
        opt.zero_grad(set_to_none=set_to_none)
    for opt, cleared in partial:  # Note [a partial clear after a step] in kept_zero_grads.py
        ranks = 1 if opt.comm is None else opt.comm.world_size
        if opt._kept_zeros.cleared_after_step(opt.buckets, cleared, opt.backwards, ranks=ranks):
            opt._policy.window_changed()  # a bucket forgotten: the cached statistics are stale


def _guard_module(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def zero_grad(self: torch.nn.Module, set_to_none: bool = True) -> None:
        if not OWNERS:  # no offload optimizer alive: torch's own, nothing looked up
            return fn(self, set_to_none)
        _clear(fn, self, self.parameters(), set_to_none)

    setattr(zero_grad, _WRAPPED, True)
    return zero_grad


def _guard_optimizer(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def zero_grad(self: torch.optim.Optimizer, set_to_none: bool = True) -> None:
        if not OWNERS:
            return fn(self, set_to_none)
        params = (p for group in self.param_groups for p in group["params"])
        _clear(fn, self, params, set_to_none)

    setattr(zero_grad, _WRAPPED, True)
    return zero_grad


def torch_zero_grad(optimizer: torch.optim.Optimizer, set_to_none: bool) -> None:
    """torch's own ``Optimizer.zero_grad``, unwrapped: for an offload optimizer's
    ``zero_grad``, whatever object runs it (Note [zero_grad from elsewhere reaches the
    window])."""
    fn = torch.optim.Optimizer.zero_grad
    if getattr(fn, _WRAPPED, False):
        fn = fn.__wrapped__  # type: ignore[attr-defined]
    fn(optimizer, set_to_none)


def install() -> None:
    """Wrap ``Module.zero_grad`` and ``Optimizer.zero_grad``; idempotent (Note [zero_grad
    from elsewhere reaches the window])."""
    module_fn = torch.nn.Module.zero_grad
    if not getattr(module_fn, _WRAPPED, False):
        torch.nn.Module.zero_grad = _guard_module(module_fn)  # type: ignore[method-assign]
    optimizer_fn = torch.optim.Optimizer.zero_grad
    if not getattr(optimizer_fn, _WRAPPED, False):
        torch.optim.Optimizer.zero_grad = _guard_optimizer(optimizer_fn)  # type: ignore[method-assign]
