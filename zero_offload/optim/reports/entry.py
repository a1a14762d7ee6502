"""One trained parameter's ``opt.state[p]``: a dict of live views whose writes apply
(Note [writes through opt.state] in ``live.py``), and the checks of what is written."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NoReturn

import torch

from ..flat_bucket import FlatBucket

__all__ = ["StateEntry", "reset_buckets"]

_STEP_MAX = 2**63 - 1  # bucket.steps is int64


def reset_buckets(buckets: Iterable[FlatBucket]) -> None:
    """Every parameter of ``buckets`` as a fresh one: step 0, the rule's fields at their
    start (``field_initial``), its shaped state zero; never the ``master`` (the weights).
    Through ``stream_fields``, so that NVMe state resets too; every shaped view is taken
    first, so a store that cannot hand them out refuses before anything changes."""
    buckets = list(buckets)
    shaped = [bucket.param_state(i) for bucket in buckets for i in range(len(bucket.params))]
    with torch.no_grad():
        for bucket in buckets:
            names = [name for name in bucket.store.state_names() if name != "master"]
            initial = {name: bucket.store.field_initial(name) for name in names}

            def fill(lo: int, hi: int, fields: Mapping[str, torch.Tensor]) -> None:
                for name in names:  # noqa: B023 (called before the loop moves on)
                    fields[name].fill_(initial[name])  # noqa: B023

            bucket.store.stream_fields(fill, read=True, write=True)
            bucket.steps[:] = 0
            bucket.kept_at_zero.clear()
        for views in shaped:
            for view in views.values():
                view.zero_()


def _checked_step(where: str, value: Any) -> int:
    """A step count as torch keeps one (a number or a 1-element tensor), whole, >= 0."""
    wanted = "a whole number >= 0 (an int, a float or a 1-element tensor, as torch keeps it)"
    step = value
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.layout != torch.strided or value.device.type == "meta":
            raise ValueError(
                f"{where}: 'step' must be {wanted}, got a tensor of shape {tuple(value.shape)} "
                f"on {value.device}"
            )
        step = value.item()
    if isinstance(step, bool) or not isinstance(step, numbers.Real):
        raise TypeError(f"{where}: 'step' must be {wanted}, got {type(value).__name__} {value!r}")
    if not (isinstance(step, numbers.Integral) or (math.isfinite(step) and step == int(step))):
        raise ValueError(f"{where}: 'step' must be {wanted}, got {value!r}")
    if not 0 <= step <= _STEP_MAX:
        raise ValueError(f"{where}: 'step' must be {wanted} that fits int64, got {value!r}")
    return int(step)


class StateEntry(dict):
    """``opt.state[p]`` of a trained parameter: a ``dict`` holding ``step`` (a 0-d int64 view
    of the bucket's step counts) and views of the rule's state (``master`` first, then its
    fields, then any shaped state), as ``live.py``'s docstring describes; the writes torch
    code makes to a state dict apply to the optimizer (Note [writes through opt.state]).

    ``piece``: ``(lo, hi)`` of the flattened parameter these views cover (all of it with
    one rank); ``shape``: the parameter's; ``shaped``: the names of the shaped state, each
    view with its own shape; ``writable``: called before every write with what is written
    (raises where no write may happen now, drains queued host work)."""

    def __init__(
        self,
        bucket: FlatBucket,
        index: int,
        views: Mapping[str, torch.Tensor],
        *,
        piece: tuple[int, int],
        shape: tuple[int, ...],
        shaped: Iterable[str],
        writable: Callable[[str], None],
    ) -> None:
        super().__init__(views)
        self._bucket = bucket
        self._index = index
        self._piece = piece
        self._shape = shape
        self._shaped = frozenset(shaped)
        self._writable = writable

    # -- reads are the dict's own; copies and pickles are plain dicts ------------------

    def __reduce_ex__(self, protocol: Any) -> Any:
        return (dict, (dict(self),))

    def __repr__(self) -> str:
        return f"StateEntry({dict.__repr__(self)})"

    # -- writes ----------------------------------------------------------------------

    def __setitem__(self, key: str, value: Any) -> None:
        self._writable(f"opt.state[p][{key!r}] = ...")
        self._apply({key: self._staged(key, value)})

    def update(self, other: Any = (), /, **kwargs: Any) -> None:  # type: ignore[override]
        """Every value checked first, then copied: a refused one writes nothing."""
        items = dict(other, **kwargs)
        self._writable("opt.state[p].update(...)")
        staged = {key: self._staged(key, value) for key, value in items.items()}
        if len(staged) > 1:  # one field's new value may be another's view: read all first
            staged = {k: _unshared(v, self) for k, v in staged.items()}
        self._apply(staged)

    def __ior__(self, other: Any) -> StateEntry:  # type: ignore[override,misc]
        self.update(other)
        return self

    def setdefault(self, key: str, default: Any = None) -> Any:
        if key in self:
            return self[key]
        self._unknown(key)

    def clear(self) -> None:
        """The parameter starts afresh, as torch's does after ``opt.state[p].clear()``: step
        0, the rule's fields at their start, the shaped state zero; the ``master`` (the
        weights) is kept."""
        self._writable("opt.state[p].clear()")
        self.reset()

    def replace(self, value: Mapping[str, Any]) -> None:
        """``opt.state[p] = value``: a fresh parameter (``clear``), then ``value``'s fields
        written as ``update`` writes them, all checked first. Staged as copies, so that
        ``value`` may hold this entry's own views."""
        self._writable("opt.state[p] = {...}")
        staged = {key: self._staged(key, item) for key, item in value.items()}
        staged = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in staged.items()}
        self.reset()
        self._apply(staged)

    def reset(self) -> None:
        """``clear`` without the caller's check (``writable`` already ran)."""
        store = self._bucket.store
        with torch.no_grad():
            for name, view in self.items():
                if name in self._shaped:
                    view.zero_()
                elif name not in ("step", "master"):
                    view.fill_(store.field_initial(name))
        self._bucket.steps[self._index] = 0
        self._bucket.kept_at_zero.discard(self._index)

    def __delitem__(self, key: str) -> NoReturn:
        raise TypeError(
            f"opt.state[p] cannot lose its field {key!r}: its fields ({self._fields()}) are "
            "views of the offloaded state. Write a new value (opt.state[p][name] = tensor), "
            "reset the parameter (opt.state[p].clear()), or load a state with "
            "opt.load_state_dict(...)"
        )

    def pop(self, key: str, *default: Any) -> NoReturn:
        del self[key]

    def popitem(self) -> NoReturn:
        del self[next(iter(self))]

    # -- checks ----------------------------------------------------------------------

    def _fields(self) -> str:
        return ", ".join(repr(name) for name in self)

    def _unknown(self, key: Any) -> NoReturn:
        raise TypeError(
            f"opt.state[p] has no field {key!r} to write: its fields are {self._fields()}, "
            "views of the offloaded state the rule steps with. Write one of those, or load "
            "a whole state with opt.load_state_dict(...)"
        )

    def _staged(self, key: Any, value: Any) -> Any:
        """``value`` as ``_apply`` takes it for field ``key``: checked, detached, of the
        view's shape (a whole-parameter tensor gives this rank's piece)."""
        where = f"opt.state[p][{key!r}]"
        if key == "step":
            return _checked_step(where, value)
        if key not in self:
            self._unknown(key)
        view = dict.__getitem__(self, key)
        if not isinstance(value, torch.Tensor):
            raise TypeError(
                f"{where} must be a tensor (torch.zeros_like(p), a copy of a saved one), got "
                f"{type(value).__name__}; it is copied into the optimizer's fp32 state"
            )
        if type(value).__torch_dispatch__ is not torch.Tensor.__torch_dispatch__:
            raise TypeError(
                f"{where}: a {type(value).__name__} (a tensor subclass with its own dispatch) "
                "cannot be copied into the state; pass a plain tensor (a DTensor's "
                ".full_tensor())"
            )
        if value.layout != torch.strided or value.device.type == "meta":
            raise ValueError(
                f"{where}: a dense tensor with data is needed, got layout {value.layout} on "
                f"{value.device}"
            )
        if not value.is_floating_point():
            raise TypeError(
                f"{where} has dtype {value.dtype}; a floating dtype is needed (it is copied "
                "into fp32 state)"
            )
        shapes = {tuple(view.shape)}
        if key not in self._shaped:
            shapes.add(self._shape)  # a whole parameter: this rank's piece is taken
        if tuple(value.shape) not in shapes:
            raise ValueError(
                f"{where} has shape {tuple(value.shape)}; the state needs "
                f"{' or '.join(str(s) for s in sorted(shapes))}"
            )
        value = value.detach()
        if tuple(value.shape) != tuple(view.shape):
            lo, hi = self._piece
            value = value.reshape(-1)[lo:hi]
        return value

    def _apply(self, staged: Mapping[str, Any]) -> None:
        """Copy what ``_staged`` returned into the views and the step counts; nothing here
        raises on the caller's values."""
        with torch.no_grad():
            for key, value in staged.items():
                if key == "step":
                    self._bucket.steps[self._index] = value
                    if value == 0:  # torch keeps this entry: so do we (FlatBucket)
                        self._bucket.kept_at_zero.add(self._index)
                else:
                    view = dict.__getitem__(self, key)
                    if not _same_memory(view, value):  # Note [a view written onto itself]
                        view.copy_(value)


# Note [a view written onto itself]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Frameworks move optimizer state between devices by rewriting every entry: Lightning's
# ``_optimizer_to_device`` runs ``state[p][k] = move_data_to_device(state[p][k], device)`` at
# every strategy's teardown (to the CPU) and at a checkpoint's restore. A host view moved to
# the CPU is the view itself, and copying it onto itself would pass over the whole state
# once more (about 12 bytes a parameter of host bandwidth, seconds for a billion parameters)
# to change nothing. So a value with the view's memory, dtype, shape and strides is not
# copied; anything else is copied as before.
def _same_memory(view: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether ``value`` is ``view``'s own memory, read the same way."""
    return (
        value.device == view.device
        and value.dtype == view.dtype
        and value.data_ptr() == view.data_ptr()
        and value.shape == view.shape
        and value.stride() == view.stride()
        and not value.is_neg()  # torch._neg_view and .conj() share the memory, lazily
        and not value.is_conj()
    )


def _unshared(value: Any, entry: Mapping[str, Any]) -> Any:
    """``value``, cloned where it is one of ``entry``'s views (``update`` swapping two fields
    would otherwise copy the first into the second's source before reading it)."""
    if not isinstance(value, torch.Tensor):
        return value
    views = [v for v in entry.values() if isinstance(v, torch.Tensor)]
    shared = any(
        v.untyped_storage().data_ptr() == value.untyped_storage().data_ptr() for v in views
    )
    return value.clone() if shared else value
