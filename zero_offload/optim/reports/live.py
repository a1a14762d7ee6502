"""``Optimizer.state`` as live views of the offloaded state.

torch code reads ``opt.state[p]`` (``torch.distributed.checkpoint.state_dict`` checks it is
non-empty before deciding to run a fake zero-gradient step to create state; user code
inspects moments). Every trained parameter therefore has an entry from construction on,
built on access from its bucket: ``step`` (a 0-d int64 view of the bucket's step counts),
and the rule's state fields (``master`` and, for Adam, its moments) as views of
the host (or resident device) state, shaped like the parameter with one rank and flat
pieces of this rank's shard with several (Note [sharded state dicts] in ``state_dict.py``).
Writing through a view writes the optimizer state; replacing an entry is refused (use
``load_state_dict``). Parameters the optimizer does not train get ordinary dict entries,
as torch's ``defaultdict(dict)`` gives them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, MutableMapping
from typing import Any

import torch

from ..flat_bucket import FlatBucket

__all__ = ["OptimizerState"]


class OptimizerState(MutableMapping):
    """The mapping behind ``OffloadAdamW.state``; see the module docstring."""

    def __init__(self, *, drain: Callable[[], None]) -> None:
        self._drain = drain  # waits for queued host work (a delayed or announced update)
        self._slots: dict[int, tuple[torch.Tensor, FlatBucket, int]] = {}  # id(param) ->
        self._other: dict[torch.Tensor, Any] = {}

    def add(self, buckets: list[FlatBucket]) -> None:
        """Expose the parameters of ``buckets``."""
        for bucket in buckets:
            for i, param in enumerate(bucket.params):
                self._slots[id(param)] = (param, bucket, i)

    def clear_slots(self) -> None:
        """Forget every trained parameter (``close``)."""
        self._slots.clear()

    def __getitem__(self, param: torch.Tensor) -> Any:
        entry = self._slots.get(id(param))
        if entry is None or entry[0] is not param:
            return self._other.setdefault(param, {})
        _, bucket, i = entry
        self._drain()  # Synchronisation point: what is read is final, not mid-update
        lo, hi, views = bucket.state_views(i)
        shape = bucket.layout.slots[i].shape
        whole = (lo, hi) == (0, bucket.layout.slots[i].numel)
        out: dict[str, torch.Tensor] = {"step": torch.from_numpy(bucket.steps)[i]}
        for name, view in views.items():
            out[name] = view.view(shape) if whole else view
        # writable: the next write check must not take the weights over it
        bucket.expose_master(out["master"])
        out.update(bucket.param_state(i))  # shaped state, as torch's (Adafactor's factors)
        return out

    def __setitem__(self, param: torch.Tensor, value: Any) -> None:
        if id(param) in self._slots:
            raise TypeError(
                "OffloadAdamW.state entries of trained parameters are views of the offloaded "
                "state and cannot be replaced; write into them in place, or use "
                "opt.load_state_dict(...)"
            )
        self._other[param] = value

    def __delitem__(self, param: torch.Tensor) -> None:
        if id(param) in self._slots:
            raise TypeError(
                "OffloadAdamW.state entries of trained parameters cannot be deleted; use "
                "opt.load_state_dict(...) to reset the state"
            )
        del self._other[param]

    def __iter__(self) -> Iterator[torch.Tensor]:
        for param, _, _ in self._slots.values():
            yield param
        yield from self._other

    def __len__(self) -> int:
        return len(self._slots) + len(self._other)

    def __contains__(self, param: object) -> bool:
        entry = self._slots.get(id(param))
        return (entry is not None and entry[0] is param) or param in self._other
