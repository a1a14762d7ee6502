"""Which hooks parameter offload puts on the model, its outputs and the optimizer, and which
offloader call each one makes.

Every hook holds the offloader weakly (a ``Hook`` of ``hook_ref.py``; Note [lifetimes
without close] in ``optim/lifetime.py``) and does nothing once it is gone. What the calls do
is the offloader's: the uses that move the window (Note [the parameter window] in
``offloader.py``) and the state-dict entries (Note [state dict entries are views of the
homes] in ``state_dict_entries.py``).

- the model's forward pre- and post-hooks: a forward begins and ends (not during a
  backward's recompute);
- each unit module's forward pre-hook: a forward use of the unit; its forward post-hook
  watches the unit's outputs, whose first gradient in each backward is the unit's backward
  use (``Once``), refused in a backward with ``create_graph=True`` (Note [no higher-order
  gradients] in ``offloader.py``); during a recompute, the recomputed outputs are watched
  the same way (Note [a recompute moves nothing]);
- the end of a backward's graph task: every unit is released;
- the optimizer's step and ``load_state_dict`` pre-hooks: the step writes the homes;
- each owning module's state-dict pre- and post-hooks: its entries become views of the
  homes;
- a released parameter read by user code: its unit is brought back (``materializer``).

A hook that raises (a ``KeyboardInterrupt`` included) leaves no unit MOVING behind: the
offloader recovers them on the way out (``_recovering``; Note [an interrupted move] in
``unit.py``), and again at its next entry should a second interrupt land there. It leaves
torch's tensor-subclass dispatch as it found it, too: an interrupt at the exit of a ``with
torch._C.DisableTorchFunctionSubclass()`` block in the window's code skips the exit, and
torch would go on ignoring the released parameters' class on that thread.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from ..memory.quiet_exit import interpreter_exiting
from . import released
from .hook_ref import Hook
from .state_dict_entries import Owned

__all__ = ["Once", "in_backward", "install", "materializer", "queue_end_of_backward", "watch"]


def in_backward() -> bool:
    """Whether autograd is running a backward on this thread (recompute included)."""
    return torch._C._current_graph_task_id() != -1


class Once:
    """One forward use's backward trigger: the first output gradient of each backward
    through the graph fires it (a graph kept with ``retain_graph=True`` is run again with
    the unit released)."""

    __slots__ = ("task",)

    def __init__(self) -> None:
        self.task = -1  # the graph task that fired it last (-1: none)


def install(
    offloader: Any, optimizer: torch.optim.Optimizer, owners: list[tuple[nn.Module, list[Owned]]]
) -> list[Any]:
    """Register every hook of ``offloader`` (its model, its units' modules, ``optimizer``
    and the ``owners`` of offloaded parameters, from ``state_dict_entries.owners``); returns
    the handles, to remove at close."""
    ref = weakref.ref(offloader)
    handles: list[Any] = []
    add = handles.append
    model: nn.Module = offloader.model
    add(model.register_forward_pre_hook(Hook(_root_pre_hook, ref)))
    add(model.register_forward_hook(Hook(_root_post_hook, ref)))
    for unit in offloader.units:
        for module in unit.spec.modules:
            add(module.register_forward_pre_hook(Hook(_pre_hook, ref, unit.index)))
            add(module.register_forward_hook(Hook(_post_hook, ref, unit.index)))
    add(optimizer.register_step_pre_hook(Hook(_step_pre_hook, ref)))
    add(optimizer.register_load_state_dict_pre_hook(Hook(_load_pre_hook, ref)))
    for module, owned in owners:
        add(module.register_state_dict_pre_hook(Hook(_state_dict_pre_hook, ref, owned)))
        add(module.register_state_dict_post_hook(Hook(_state_dict_post_hook, ref, owned)))
    return handles


def watch(offloader: Any, index: int, output: Any) -> None:
    """Hook the gradients of unit ``index``'s forward ``output``: the first to arrive in
    each backward is the unit's backward use."""
    once = Once()
    for leaf in pytree.tree_leaves(output):
        if isinstance(leaf, torch.Tensor) and leaf.requires_grad and leaf.grad_fn is not None:
            leaf.register_hook(functools.partial(_grad_hook, weakref.ref(offloader), index, once))


def queue_end_of_backward(offloader: Any) -> None:
    """Run ``offloader._end_backward`` when this backward's graph task ends (after the
    optimizer's router flushed its buckets)."""
    torch.autograd.Variable._execution_engine.queue_callback(
        functools.partial(_end_of_backward, weakref.ref(offloader))
    )


def materializer(offloader: Any, index: int) -> functools.partial[None]:
    """What a released parameter of unit ``index`` calls when user code reads it (Note [a
    released parameter] in ``released.py``)."""
    return functools.partial(_materialize, weakref.ref(offloader), index)


#: The thread's tensor-subclass dispatch state, where torch exposes it (recent releases;
#: with an older torch the skipped with-exit of Note [an interrupted move] stays a gap).
_get_dispatch: Callable[[], Any] | None = getattr(torch._C, "_get_torch_function_state", None)


def _recovering(hook: Callable[..., None]) -> Callable[..., None]:
    """``hook(ref, ...)``, recovering the offloader's MOVING units if it raises."""

    @functools.wraps(hook)
    def run(ref: weakref.ref, *args: Any) -> None:
        dispatch = None if _get_dispatch is None else _get_dispatch()
        try:
            hook(ref, *args)
        except BaseException:
            if dispatch is not None:
                # A with-exit the interrupt skipped (the views, released.py): the recovery
                # and every read after it need the released parameters' class dispatched.
                torch._C._set_torch_function_state(dispatch)
            offloader = ref()
            if offloader is not None:
                with contextlib.suppress(Exception):  # the hook's error is the one to raise
                    offloader.recover()
            raise

    return run


@_recovering
def _pre_hook(ref: weakref.ref, index: int, module: nn.Module, args: Any) -> None:
    offloader = ref()
    if offloader is not None:
        offloader._before_forward(offloader.units[index])


def _post_hook(ref: weakref.ref, index: int, module: nn.Module, args: Any, output: Any) -> None:
    offloader = ref()
    if offloader is not None:
        offloader._after_forward(offloader.units[index], output)


@_recovering
def _grad_hook(ref: weakref.ref, index: int, once: Once, grad: torch.Tensor) -> None:
    offloader = ref()
    task = torch._C._current_graph_task_id()
    if offloader is not None and once.task != task:
        if torch.is_grad_enabled():  # the engine's grad mode is create_graph
            offloader.refuse_higher_order(offloader.units[index])  # Note [no higher-order ...]
        once.task = task
        offloader._backward_use(offloader.units[index])


@_recovering
def _end_of_backward(ref: weakref.ref) -> None:
    offloader = ref()
    if offloader is not None:
        offloader._end_backward()


@_recovering
def _root_pre_hook(ref: weakref.ref, module: nn.Module, args: Any) -> None:
    offloader = ref()
    if offloader is not None and not in_backward():
        offloader._begin_forward()


@_recovering
def _root_post_hook(ref: weakref.ref, module: nn.Module, args: Any, output: Any) -> None:
    offloader = ref()
    if offloader is not None and not in_backward():
        offloader._end_forward()


@_recovering
def _materialize(ref: weakref.ref, index: int) -> None:
    offloader = ref()
    if offloader is None:
        if interpreter_exiting():  # Note [weights on NVMe are not read back at exit]
            raise RuntimeError(
                "a parameter whose weights live on NVMe was read at interpreter exit, after "
                "its optimizer was closed or collected: Python has stopped the I/O threads "
                "that read them back. Read or save the model before exit (not in an atexit "
                "hook)"
            )
        raise RuntimeError(
            "a released parameter was read after its optimizer was collected without close() "
            "(a bug in zero-offload: the optimizer's finalizer restores every parameter)"
        )
    offloader.materialize(offloader.units[index])


@_recovering
def _state_dict_pre_hook(
    ref: weakref.ref, owned: list[Owned], module: nn.Module, prefix: str, keep_vars: bool
) -> None:
    offloader = ref()
    if offloader is not None:
        offloader.check_homes_settled("a state dict")
        offloader.recover()  # Note [an interrupted move] in unit.py
        offloader.flush_copies()
        released.begin_saving()
        for unit in sorted({unit for _, unit, _, _ in owned}):
            offloader.units[unit].write_back()


def _state_dict_post_hook(
    ref: weakref.ref,
    owned: list[Owned],
    module: nn.Module,
    state_dict: dict[str, Any],
    prefix: str,
    local_metadata: Any,
) -> None:
    offloader = ref()
    if offloader is not None:
        released.end_saving()
        offloader.entries.to_homes(offloader.units, owned, module, state_dict, prefix)


@_recovering
def _load_pre_hook(ref: weakref.ref, optimizer: Any, state_dict: Any) -> None:
    """Before a load writes the homes, as before a step (torch's load pre-hook signature;
    Note [torch's state-dict hooks] in ``optim/checkpoint/torch_hooks.py``)."""
    offloader = ref()
    if offloader is not None:
        offloader.before_step()


@_recovering
def _step_pre_hook(ref: weakref.ref, optimizer: Any, args: Any, kwargs: Any) -> None:
    offloader = ref()
    if offloader is not None:
        offloader.before_step()
