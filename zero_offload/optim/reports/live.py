"""``Optimizer.state`` as live views of the offloaded state.

``opt.state[p]`` of a trained parameter is a dict (``entry.StateEntry``) built on access
from its bucket: ``step`` (a 0-d int64 view of the bucket's step counts), and the rule's
state fields (``master`` and, for Adam, its moments) as views of the host (or resident
device) state, shaped like the parameter with one rank and flat pieces of this rank's
shard with several (Note [sharded state dicts] in ``checkpoint/state_dict.py``). Parameters
the optimizer does not train get ordinary dict entries, as torch's ``defaultdict(dict)``
gives them.

Note [opt.state is torch's before the first step]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
torch's optimizers create a parameter's state at its first step, and code reads the
mapping's emptiness as "never stepped": ``torch.distributed.checkpoint.state_dict``'s
``_init_optim_state`` runs a fake step (``lr`` 0, zero gradients) only where
``optim.state`` is empty, so that the load template names every state key; without it
``dcp.load`` fills nothing and the resume silently starts from zero moments. So as a
mapping (``bool``, ``len``, iteration, ``in``, ``keys``/``items``) ``opt.state`` holds the
trained parameters with a step count above 0 (what torch's would hold) and the entries of
parameters it does not train, while ``opt.state[p]`` hands out the live views of any
trained parameter, stepped or not (torch's ``defaultdict`` would give ``{}`` there). The
fake step is an ordinary step of ours: zero gradients and ``lr`` 0 leave every weight
bitwise unchanged and every step count at 1, as torch's do.

Note [writes through opt.state]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Code written for torch resets state by writing the dicts, and each write applies to what
the next step reads:

- ``opt.state[p][name] = tensor`` (and ``update``) copies into the view: a floating tensor
  of the view's shape or, with several ranks, of the parameter's (this rank's piece is
  taken); ``opt.state[p]['step'] = n`` sets the step count (a whole number >= 0, or a
  1-element tensor holding one).
- A step count written 0 with the state kept (torch's "restart the bias correction")
  keeps the entry, in the mapping and in ``state_dict()``, as torch's does
  (``FlatBucket.kept_at_zero``), until a reset.
- ``opt.state[p].clear()``, ``del opt.state[p]`` and ``opt.state[p] = {...}`` reset the
  parameter as fresh (step 0, the rule's fields at their start, shaped state zero) and then
  write what the new dict holds; the ``master`` is the weights and is never reset.
- ``opt.state = {}`` (``defaultdict(dict)``: torch's "reset the optimizer") resets every
  parameter so; assigning anything else is refused (``load_state_dict`` loads a state).

Deleting a single field, or writing one the rule does not keep, is a ``TypeError`` naming
the fields. Every value is checked before anything is written. With several ranks each
rank writes its own shard: every rank must make the same writes, as it makes the same
steps. A write is refused between an announced step and ``step()`` (the step ran with the
state as it was) and after ``close``; it waits for queued host work first.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, MutableMapping
from typing import Any

import torch

from ..flat_bucket import FlatBucket
from ..grads.lifecycle import GradState
from .entry import StateEntry, reset_buckets

__all__ = ["OptimizerState", "StateEntry"]


class OptimizerState(MutableMapping):
    """The mapping behind ``OffloadAdamW.state``; see the module docstring.

    ``drain`` waits for queued host work (a delayed or announced update); ``busy`` says
    why the state cannot be written now (a step announced and not taken), or None."""

    def __init__(
        self, *, drain: Callable[[], None], busy: Callable[[], str | None] = lambda: None
    ) -> None:
        self._drain = drain
        self._busy = busy
        self._closed = False
        self._slots: dict[int, tuple[torch.Tensor, FlatBucket, int]] = {}  # id(param) ->
        self._other: dict[torch.Tensor, Any] = {}

    def add(self, buckets: list[FlatBucket]) -> None:
        """Expose the parameters of ``buckets``."""
        for bucket in buckets:
            for i, param in enumerate(bucket.params):
                self._slots[id(param)] = (param, bucket, i)

    def clear_slots(self) -> None:
        """Forget every trained parameter (``close``); writes are refused from now on."""
        self._slots.clear()
        self._closed = True

    def _slot(self, param: object) -> tuple[torch.Tensor, FlatBucket, int] | None:
        entry = self._slots.get(id(param))
        return entry if entry is not None and entry[0] is param else None

    def _buckets(self) -> list[FlatBucket]:
        """The buckets of the trained parameters, each once."""
        return list({id(b): b for _, b, _ in self._slots.values()}.values())

    def _stepped(self, param: object) -> bool:
        slot = self._slot(param)
        return slot is not None and slot[1].has_state(slot[2])

    def writable(self, what: str) -> None:
        """Raise where ``what`` (a write through ``opt.state``) cannot happen now; else wait
        for queued host work (Note [writes through opt.state])."""
        if self._closed:
            raise RuntimeError(
                f"{what} after close(): the optimizer's state is gone; build a new optimizer"
            )
        why = self._busy()
        if why is not None:
            raise RuntimeError(f"{what}: {why}")
        self._drain()  # Synchronisation point: a queued update must not write over it

    def __getitem__(self, param: torch.Tensor) -> Any:
        slot = self._slot(param)
        if slot is None:
            return self._other.setdefault(param, {})
        _, bucket, i = slot
        self._drain()  # Synchronisation point: what is read is final, not mid-update
        lo, hi, views = bucket.state_views(i)
        shape = bucket.layout.slots[i].shape
        whole = (lo, hi) == (0, bucket.layout.slots[i].numel)
        out: dict[str, torch.Tensor] = {"step": torch.from_numpy(bucket.steps)[i]}
        for name, view in views.items():
            out[name] = view.view(shape) if whole else view
        # writable: the next write check must not take the weights over it
        bucket.expose_master(out["master"])
        shaped = bucket.param_state(i)  # shaped state, as torch's (Adafactor's factors)
        out.update(shaped)
        return StateEntry(
            bucket, i, out, piece=(lo, hi), shape=tuple(shape), shaped=shaped,
            writable=self.writable,
        )  # fmt: skip

    def __setitem__(self, param: torch.Tensor, value: Any) -> None:
        if self._slot(param) is None:
            self._other[param] = value
            return
        if not isinstance(value, Mapping):
            raise TypeError(
                "opt.state[p] of a trained parameter takes a dict of its fields (as torch's "
                f"state holds them; {{}} resets it), got {type(value).__name__}; to load a "
                "whole state use opt.load_state_dict(...)"
            )
        self[param].replace(value)

    def __delitem__(self, param: torch.Tensor) -> None:
        if self._slot(param) is None:
            del self._other[param]
            return
        self[param].clear()  # torch's next step starts it afresh

    def assign(self, value: Any, *, where: str) -> None:
        """``opt.state = value`` (``where`` names it): an empty mapping resets every entry,
        this mapping itself changes nothing, anything else is refused (Note [writes through
        opt.state])."""
        if value is self:
            return
        if not isinstance(value, Mapping) or len(value) != 0:
            size = f" with {len(value)} entries" if isinstance(value, Mapping) else ""
            raise TypeError(
                f"{where} can only be reset (= {{}} or defaultdict(dict), torch's reset), got "
                f"{type(value).__name__}{size}; load a state with opt.load_state_dict(...), "
                "or write single entries (opt.state[p][name] = tensor)"
            )
        self.reset(f"{where} = {{}}")

    def reset(self, what: str) -> None:
        """Every trained parameter starts afresh (``opt.state = {}``), the others' entries
        go; Note [writes through opt.state]."""
        self.writable(what)
        reset_buckets(self._buckets())
        self._other.clear()

    def __iter__(self) -> Iterator[torch.Tensor]:
        # Note [opt.state is torch's before the first step]
        for param, bucket, i in list(self._slots.values()):
            if bucket.has_state(i):
                yield param
        yield from list(self._other)

    def __len__(self) -> int:
        stepped = sum(1 for _, bucket, i in self._slots.values() if bucket.has_state(i))
        return stepped + len(self._other)

    def __contains__(self, param: object) -> bool:
        return self._stepped(param) or param in self._other

    def __bool__(self) -> bool:
        """Stepped entries, or gradients in the window: torch's ``_init_optim_state`` skips
        its fake step where a ``.grad`` exists, and ours are in the buckets, not ``.grad``
        (a fake step there would step the window's gradients with ``lr`` 0, and leave it 0
        when refused). Note [opt.state is torch's before the first step]."""
        if len(self):
            return True
        return any(
            b.grads.state not in (GradState.EMPTY, GradState.CONSUMED) for b in self._buckets()
        )

    def pop(self, param: torch.Tensor, *default: Any) -> Any:
        """torch's ``opt.state.pop(p)``: the entry as it was (a copy: the live views are
        reset by the removal), and the parameter starts afresh."""
        if self._slot(param) is None:
            return self._other.pop(param, *default)
        if param not in self:
            if default:
                return default[0]
            raise KeyError(param)
        entry = self[param]
        kept = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in entry.items()}
        entry.clear()
        return kept

    def popitem(self) -> tuple[torch.Tensor, Any]:
        for param in self:
            return param, self.pop(param)
        raise KeyError("popitem(): opt.state is empty")
