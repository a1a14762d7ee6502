"""Refusing graph capture: ``torch.compile`` tracing and CUDA graph capture.

Note [no graph capture of library work]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Library work is Python bookkeeping around streams, events, pool blocks and pinned host
copies: what a copy touches, which block it lands in and which event frees it are decided
each time it is issued. A CUDA graph would replay one capture's pointers and events
forever, and ``torch.compile`` (dynamo) would trace the bookkeeping into a graph or bake a
pool offset in as a constant. Neither can be right, so every copy refuses while either is
under way (``CaptureRefused``), and the library's hooks that run inside a model's forward
(activation offload's saved-tensor hooks, ``checkpoint``) are wrapped in
``torch.compiler.disable``: a compiled model graph-breaks around them, and they run
eagerly, between the compiled pieces, exactly as without compilation.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

from ..errors import CaptureRefused

__all__ = ["capturing", "check_not_capturing", "eager_only"]

F = TypeVar("F", bound=Callable[..., object])


def capturing() -> str | None:
    """What is capturing the calling thread's work now, or None: Note [no graph capture of
    library work]."""
    if torch.compiler.is_compiling():
        return "torch.compile is tracing"
    # Every copy asks: ``is_initialized`` is a flag read, where ``is_available`` costs a
    # microsecond or more; a capture can only be under way once CUDA is initialized.
    if torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing():
        return "a CUDA graph is capturing the current stream"
    return None


def check_not_capturing(what: str, *, label: str = "") -> None:
    """Raise ``CaptureRefused`` naming ``what`` (and ``label``, when given) when work is
    being captured. Called at every copy: the message is built only when it raises."""
    who = capturing()
    if who is not None:
        if label:
            what = f"{what} {label!r}"
        raise CaptureRefused(
            f"{what} was issued while {who}: zero-offload's copies, streams and pool blocks "
            f"cannot be captured into a graph (Note [no graph capture of library work] in "
            f"accelerator/capture.py). Keep the backward whose gradients the optimizer "
            f"takes, its step and offload calls out of a captured CUDA graph; under "
            f"torch.compile they run eagerly by themselves (a graph break), so this names a "
            f"path that does not: please report it."
        )


#: Why dynamo breaks the graph at the library's eager functions: what
#: ``torch.compile(fullgraph=True)`` reports when it cannot (torch >= 2.8 takes a reason).
EAGER_REASON = (
    "zero-offload runs this eagerly: its copies, streams and pool blocks cannot be traced "
    "into a graph (Note [no graph capture of library work] in zero_offload/accelerator/"
    "capture.py); torch.compile(fullgraph=True) cannot contain it: use fullgraph=False, "
    "whose graph breaks here"
)


def eager_only(fn: F) -> F:
    """``fn`` run eagerly even inside a compiled model (``torch.compiler.disable``)."""
    try:
        return torch.compiler.disable(fn, recursive=True, reason=EAGER_REASON)  # type: ignore[return-value,call-arg]
    except TypeError:  # a torch without reason=
        return torch.compiler.disable(fn, recursive=True)  # type: ignore[return-value]
