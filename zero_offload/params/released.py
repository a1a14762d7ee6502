"""A released parameter: a zero-byte tensor on the device that brings its unit back when read.

Note [a released parameter]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
Between uses a unit's parameters stay what user code expects (FSDP2's way): tensors of their
shape and dtype on the accelerator's device, so ``param.device``, HF ``model.device`` and
``generate()`` see the device. Their storage holds 0 bytes (one storage per parameter, the
*placeholder*); the unit's homes are the only copy of the weights (Note [a unit's
lifecycle] in ``unit.py``).

Torch does not refuse to read a tensor whose storage is too small: most kernels read address
0 (a segfault on a CPU, an illegal access that poisons the CUDA context on a GPU). So while
released a parameter's class is switched to a subclass of its own class (as torch's
``UninitializedParameter`` switches its class when materialised), whose
``__torch_function__`` lets metadata through (shape, dtype, device, ``requires_grad``,
``grad``, hooks, the version counter, ``param.data = ...``) and, before anything that reads
or writes values (any op, ``.data``, ``.detach()``, ``copy_``, ``print``, ``stride()``),
brings the unit onto the device (``ParamOffloader.materialize``: a fetch into a buffer of the
unit's own, waited for: Note [a read outside the window lands privately] in
``private_reads.py``), which switches the class back; then the op runs on the real weights. A
call taking several released parameters brings every one back before it runs, and none of
them leaves for another (``current_call``). User code between steps gets
torch's semantics: a read sees the live weights, a write lands in the slot and reaches the
home when the unit leaves (Note [a write to a resident unit reaches its home] in
``slot_writes.py``), and ``model.half()`` converts the fetched weights and replaces ``.data``, which
the next fetch or step refuses (Note [parameters replaced behind the optimizer] in
``views/param_views.py``). Compute never pays for the check: a unit's parameters have their
plain class while it is on the device, and the window's hooks fetch every unit before its
forward and backward.

Pickling (``torch.save`` of parameters or of the model) does not fetch either: a released
parameter pickles as a plain parameter holding a private copy of its home's weights
(``torch.save`` writes a storage's bytes after pickling everything, when a fetched unit's
slot may hold another unit); ``copy.deepcopy`` fetches and clones.

``model.state_dict()`` does not fetch: while a state dict is being taken (``begin_saving``,
set by the offloader's state-dict hooks) ``detach()`` of a released parameter returns its
weights in its home (Note [state dict entries are views of the homes] in
``state_dict_entries.py``), in a storage of exactly their bytes (Note [a state dict entry owns a storage of its bytes]
in ``windowed_views.py``).

A placeholder has all-zero strides (it is made from one element whose storage is then
resized to 0, so making it allocates nothing worth counting and the storage never holds the
weights); ``stride()`` and ``is_contiguous()`` are therefore not metadata here and fetch.
"""

from __future__ import annotations

import copy
import functools
import itertools
import threading
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch.utils.weak import WeakIdKeyDictionary

from ..views.value_reads import intercepted

__all__ = [
    "Binding",
    "begin_saving",
    "bring_back",
    "current_call",
    "end_saving",
    "is_bound_to",
    "is_released",
    "placeholder_like",
    "release",
    "restore",
]


class Binding(NamedTuple):
    """How a released parameter reaches its weights (both hold the offloader weakly)."""

    materialize: Callable[[], None]  # fetch the parameter's unit and wait for it
    home_view: Callable[[], torch.Tensor]  # its weights in its home (pinned host), or a copy


#: Released parameters and their bindings (weak keys: a parameter dropped with its model goes).
_BINDINGS: WeakIdKeyDictionary = WeakIdKeyDictionary()
_local = threading.local()  # .saving: depth of state-dict calls on this thread; .call below
_calls = itertools.count()  # tokens of intercepted torch calls


def current_call() -> int | None:
    """The token of the intercepted torch call on this thread whose arguments are being
    brought back (None: none). The units brought back for one call must stay together: Note
    [a read outside the window lands privately] in ``private_reads.py``."""
    return getattr(_local, "call", None)


class _Released:
    """Mixed into a parameter's class while it is released: Note [a released parameter]."""

    _plain: type  # the class the parameter has while resident

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.Tensor.detach and getattr(_local, "saving", 0):
            binding = _BINDINGS.get(args[0])
            if binding is not None:
                return binding.home_view()
        if getattr(_local, "call", None) is not None:
            return intercepted(_Released, func, args, kwargs, bring_back)
        _local.call = next(_calls)  # Note [a read outside the window lands privately]
        try:
            return intercepted(_Released, func, args, kwargs, bring_back)
        finally:
            _local.call = None

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        bring_back(self)  # type: ignore[arg-type]
        return copy.deepcopy(self, memo)

    def __reduce_ex__(self, protocol: Any) -> Any:
        twin = _private_twin(self)  # type: ignore[arg-type]
        return twin.__reduce_ex__(protocol)


def _private_twin(param: torch.Tensor) -> torch.Tensor:
    """A parameter of ``param``'s plain class holding a private device copy of its weights,
    read from its home without a fetch: ``torch.save`` records a tensor's storage and writes
    its bytes after pickling everything, when a fetched unit's slot may hold another unit."""
    binding = _BINDINGS.get(param)
    if binding is None:
        bring_back(param)  # not ours: only the class is
        return param
    source = binding.home_view()
    plain = type(param)._plain  # type: ignore[attr-defined]
    with torch._C.DisableTorchFunctionSubclass():
        data = torch.empty(source.shape, dtype=source.dtype, device=param.device)
        data.copy_(source)
        twin = torch.Tensor._make_subclass(plain, data, param.requires_grad)
    twin.__dict__.update(param.__dict__)
    return twin


def bring_back(param: torch.Tensor) -> None:
    """Fetch ``param``'s unit (its class becomes the plain one again); nothing for a
    parameter brought back already (by another argument of the same unit, in one call)."""
    if not isinstance(param, _Released):
        return
    binding = _BINDINGS.get(param)
    if binding is None:  # not ours (a copy made by torch of a released parameter's class)
        param.__class__ = type(param)._plain  # type: ignore[attr-defined]
        return
    binding.materialize()
    if isinstance(param, _Released):
        raise RuntimeError(
            f"a released {tuple(param.shape)} {param.dtype} parameter is still released after "
            "its unit was fetched (a bug in zero-offload; please report it)"
        )


@functools.cache
def _released_class(plain: type) -> type:
    return type(f"Released{plain.__name__}", (_Released, plain), {"_plain": plain})


def is_released(param: torch.Tensor) -> bool:
    """Whether ``param`` is a released parameter (its class is switched)."""
    return isinstance(param, _Released)


def placeholder_like(param: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A tensor of ``param``'s shape and dtype on ``device`` whose storage holds 0 bytes
    (all-zero strides: Note [a released parameter])."""
    out = torch.empty_strided(
        tuple(param.shape), (0,) * param.dim(), dtype=param.dtype, device=device
    )
    out.untyped_storage().resize_(0)
    return out


def release(param: torch.nn.Parameter, placeholder: torch.Tensor, binding: Binding) -> None:
    """Point ``param`` at ``placeholder`` and switch its class (Note [a released parameter])."""
    with torch._C.DisableTorchFunctionSubclass():
        param.data = placeholder
    if not isinstance(param, _Released):
        param.__class__ = _released_class(type(param))
    _BINDINGS[param] = binding


def restore(param: torch.nn.Parameter, data: torch.Tensor) -> None:
    """Switch ``param``'s class back and point it at ``data`` (its slot, or a copy)."""
    if isinstance(param, _Released):
        param.__class__ = type(param)._plain
    _BINDINGS.pop(param, None)
    param.data = data


def is_bound_to(param: torch.Tensor, placeholder: torch.Tensor) -> bool:
    """Whether released ``param`` still holds ``placeholder``'s storage (not replaced)."""
    with torch._C.DisableTorchFunctionSubclass():
        return (
            isinstance(param, _Released)
            and param.dtype == placeholder.dtype
            and param.shape == placeholder.shape
            and param.untyped_storage()._cdata == placeholder.untyped_storage()._cdata
        )


def begin_saving() -> None:
    """Until ``end_saving``, ``detach()`` of a released parameter on this thread gives its home
    view (a state dict is being taken; calls nest)."""
    _local.saving = getattr(_local, "saving", 0) + 1


def end_saving() -> None:
    """The state dict call that ``begin_saving`` announced is done."""
    _local.saving = max(0, getattr(_local, "saving", 0) - 1)
