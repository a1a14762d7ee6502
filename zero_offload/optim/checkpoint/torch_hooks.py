"""torch's optimizer state-dict hooks, run around our ``state_dict`` and ``load_state_dict``
where ``torch.optim.Optimizer`` runs them: Note [torch's state-dict hooks].

Note [torch's state-dict hooks]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``torch.optim.Optimizer`` lets code register four hooks around its checkpoints
(``register_state_dict_pre_hook``, ``..._post_hook``, ``register_load_state_dict_pre_hook``,
``..._post_hook``); libraries use them to add keys to a saved dict, to adapt an old one
before it loads, or to act after a load. Our optimizers replace both methods, so they run
the hooks themselves, in torch's order and with torch's contract (torch 2.4 to 2.13): the
save's pre-hooks get the optimizer, its post-hooks the optimizer and the dict and may
return a new one; the load works on a shallow copy of the caller's dict, its pre-hooks may
return a new dict, and its post-hooks run after a load that succeeded. Before, the hooks
were kept and never called: the keys a post-hook added were silently missing from the
checkpoint. A load a hook changed is checked like any other (Note [a load checks
everything, then copies] in ``state_dict.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

__all__ = ["load_with_hooks", "save_with_hooks"]


def _hooks(optimizer: torch.optim.Optimizer, name: str) -> list[Callable[..., Any]]:
    return list(getattr(optimizer, f"_optimizer_{name}", {}).values())


def save_with_hooks(
    optimizer: torch.optim.Optimizer, make: Callable[[], dict[str, Any]]
) -> dict[str, Any]:
    """``make()``'s state dict, with ``optimizer``'s state-dict hooks run around it."""
    for hook in _hooks(optimizer, "state_dict_pre_hooks"):
        hook(optimizer)
    state_dict = make()
    for hook in _hooks(optimizer, "state_dict_post_hooks"):
        result = hook(optimizer, state_dict)
        if result is not None:
            state_dict = result
    return state_dict


def load_with_hooks(
    optimizer: torch.optim.Optimizer,
    state_dict: Mapping[str, Any],
    load: Callable[[dict[str, Any]], None],
) -> None:
    """``load(state_dict)`` with ``optimizer``'s load-state-dict hooks run around it."""
    # torch's shallow copy: a hook may change its keys (what is not a dict is refused by
    # the load, naming it)
    current: Any = dict(state_dict) if isinstance(state_dict, Mapping) else state_dict
    for hook in _hooks(optimizer, "load_state_dict_pre_hooks"):
        result = hook(optimizer, current)
        if result is not None:
            current = result
    load(current)
    for hook in _hooks(optimizer, "load_state_dict_post_hooks"):
        hook(optimizer)
