"""Which torch calls on a tensor read or write its values, and which only its metadata.

A parameter whose class is switched to intercept every call (``__torch_function__``) must let
metadata through without acting: shape, dtype, device, ``requires_grad``, ``.grad``, hooks,
the version counter, ``param.data = ...``. Everything else (any op, ``.data``, ``.detach()``,
``copy_``, ``print``, ``stride()``) reads or writes values. Two such classes share this
list: a released parameter (``params/released.py``, Note [a released parameter]) and a
parameter whose weights are still crossing the link (``views/in_flight.py``, Note [weights
landed at their first use]).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["intercepted", "reads_no_values"]

#: Property getters and setters that read no values (by descriptor name).
_META_GET = frozenset(
    {
        "shape", "dtype", "device", "requires_grad", "grad", "_version", "is_leaf", "ndim",
        "layout", "is_cuda", "is_cpu", "is_meta", "is_sparse", "is_quantized", "is_mkldnn",
        "is_nested", "is_xpu", "is_mps", "names", "grad_fn", "_grad_fn", "_backward_hooks",
        "_post_accumulate_grad_hooks", "retains_grad", "name", "output_nr", "itemsize",
        "is_sparse_csr", "_cdata",
    }
)  # fmt: skip
_META_SET = frozenset(
    {"data", "grad", "requires_grad", "_backward_hooks", "_post_accumulate_grad_hooks"}
)
#: Methods that read no values.
_META_CALLS = frozenset(
    {
        torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.nelement,
        torch.Tensor.element_size, torch.Tensor.is_floating_point, torch.Tensor.is_complex,
        torch.Tensor.is_signed, torch.Tensor.get_device, torch.Tensor.requires_grad_,
        torch.Tensor.register_hook, torch.Tensor.register_post_accumulate_grad_hook,
        torch.Tensor.__hash__, torch.is_floating_point, torch.is_complex, torch.numel,
        torch._has_compatible_shallow_copy_type,
    }
)  # fmt: skip


def reads_no_values(func: Any) -> bool:
    """Whether ``func`` (as ``__torch_function__`` receives it) touches only metadata."""
    if func in _META_CALLS or getattr(func, "__wrapped__", None) in _META_CALLS:
        return True  # or a method this package wrapped (Note [the optimizer's hook runs last])
    name = getattr(func, "__name__", None)
    if name in ("__get__", "__set__"):
        names = _META_GET if name == "__get__" else _META_SET
        return getattr(getattr(func, "__self__", None), "__name__", None) in names
    return False


def _args_of(cls: type, args: Any, kwargs: dict[str, Any]) -> Iterator[torch.Tensor]:
    """The arguments of class ``cls`` of a call, one level into lists and tuples."""
    for group in (args, kwargs.values()):
        for arg in group:
            if isinstance(arg, cls):
                yield arg  # type: ignore[misc]
            elif isinstance(arg, (list, tuple)):
                yield from (a for a in arg if isinstance(a, cls))


def intercepted(
    cls: type,
    func: Any,
    args: Any,
    kwargs: dict[str, Any] | None,
    before: Callable[[torch.Tensor], None],
) -> Any:
    """Run a call that ``cls.__torch_function__`` intercepted: metadata as it is; anything
    that reads or writes values after ``before(tensor)`` for each argument of class ``cls``
    (which gives it its plain class back, or returns early inside its own work). Every
    argument is brought back first; one whose class was switched again meanwhile gets
    ``before`` once more (a ``before`` that cannot keep them together raises), so the call
    never runs on a switched argument except from ``before``'s own work."""
    kwargs = kwargs or {}
    if reads_no_values(func):
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)
    tensors = list(_args_of(cls, args, kwargs))
    for tensor in tensors:
        before(tensor)
    for tensor in tensors:  # every argument first, then check none was switched again
        if isinstance(tensor, cls):
            before(tensor)
    if any(isinstance(tensor, cls) for tensor in tensors):
        # ``before`` returned with the class still switched: the call comes from the work
        # ``before`` is doing on this thread (a landing's own reads). Run it as it is.
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)
    return func(*args, **kwargs)
