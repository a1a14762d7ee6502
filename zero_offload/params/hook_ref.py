"""The callable the parameter offloader registers as a hook, holding the offloader weakly,
which a copy of the model replaces with an inert one (``Hook``)."""

from __future__ import annotations

from typing import Any

__all__ = ["Hook", "inert"]


def inert(*args: Any) -> None:
    """What a copy of the model holds in place of the offloader's hooks (``Hook``)."""


class Hook:
    """``fn(*args, *hook_args)``, as ``functools.partial`` would call it, for a hook the
    offloader registers on the model or the optimizer (``args`` hold it weakly). A copy of
    the model (``copy.deepcopy``, ``AveragedModel``, ``torch.save(model)``) is not what the
    optimizer trains: it gets an inert hook, so its forwards leave this window alone, and it
    pickles (a weak reference does not)."""

    def __init__(self, fn: Any, *args: Any) -> None:  # no __slots__: torch marks some hooks
        self.fn = fn
        self.args = args

    def __call__(self, *hook_args: Any) -> None:
        self.fn(*self.args, *hook_args)

    def __deepcopy__(self, memo: dict[int, Any]) -> Hook:
        return Hook(inert)

    def __reduce__(self) -> tuple[Any, ...]:
        return (Hook, (inert,))
