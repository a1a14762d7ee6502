"""Errors raised inside autograd's hooks, kept for the library's backward entry points.

Note [errors raised inside autograd hooks]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A library hook that autograd calls (activation offload's saved-tensor hooks, under
``torch.utils.checkpoint`` too; the optimizer's gradient hooks) raises into autograd's C++
engine, which hands the error back to ``loss.backward()``. On CPU it arrives whole. On CUDA
under ``TORCH_CUDA_SANITIZER=1`` it can be lost on the way: the sanitizer's trace hooks are
Python callbacks run at each CUDA free, and one that runs while the error is pending fails
("cuda trace hook execution failed: SystemError: <built-in function __import__> returned a
result with an exception set") and clears it, so backward raises ``SystemError:
run_backward returned NULL without setting an exception`` instead of the sanitizer's report
(the H200 run of issue 36). So the library's hooks run under ``reported``, which keeps the
error a hook raises while one of the library's backward entry points (``backward`` below:
``OffloadAdamW.backward``) runs, and that entry point raises the first kept error in place
of whatever autograd reported. A plain ``loss.backward()`` has no entry point of ours; there
the error is still sticky on its stream (Note [stream errors are sticky] in
accelerator/base.py), so the next library call on that stream raises it.

Errors are kept only while an entry point runs, and dropped when the last one returns: a kept
error holds its traceback's frames, and their device tensors.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

if TYPE_CHECKING:
    import torch

__all__ = ["backward", "reported"]

P = ParamSpec("P")
R = TypeVar("R")

_lock = threading.Lock()  # guards the two below; hooks run on autograd's worker threads too
_watching = 0  # backward entry points running now, on any thread
_kept: list[BaseException] = []  # errors hooks raised while one ran, oldest first


def reported(hook: Callable[P, R]) -> Callable[P, R]:
    """``hook``, keeping the error it raises for a running backward entry point (Note
    [errors raised inside autograd hooks]); the error is raised on as before."""

    @functools.wraps(hook)
    def run(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return hook(*args, **kwargs)
        except BaseException as exc:
            with _lock:
                if _watching and all(kept is not exc for kept in _kept):
                    _kept.append(exc)
            raise

    return run


def backward(loss: torch.Tensor, **kwargs: Any) -> None:
    """``loss.backward(**kwargs)``; if a library hook raised during it, that error is
    raised in place of the one autograd reports (Note [errors raised inside autograd
    hooks])."""
    global _watching
    with _lock:
        _watching += 1
        start = len(_kept)
    try:
        loss.backward(**kwargs)
    except BaseException as exc:
        with _lock:
            original = _kept[start] if len(_kept) > start else None
        if original is None or original is exc:
            raise
        raise original  # noqa: B904 -- its context is what autograd made of it
    finally:
        with _lock:
            _watching -= 1
            if _watching == 0:
                _kept.clear()
