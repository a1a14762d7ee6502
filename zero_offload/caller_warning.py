"""A warning that names the line of the program that led to it.

Note [a warning names the caller's line]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``warnings.warn``'s ``stacklevel`` counts frames, and the frames between a user's call and
the code that warns are not fixed: torch wraps ``step()`` (its profiler hook, ``no_grad``),
the optimizer's public methods mark what they raise (``said_to_caller`` in
``error_marks.py``), a backward reaches the library through autograd's hooks, and a
framework (Trainer, accelerate, Lightning) calls through wrappers of its own. A fixed
``stacklevel`` pointed at one of those wrappers, so the warning named a line of torch or of
this library and Python's default filter ("once per location") merged warnings from
different lines of the user's program. ``warn_caller`` names the first frame outside this
package, torch and the standard library's wrappers (a ``with`` block, a thread's start, a
finalizer, an import): the user's line, or the framework's that made the call. Where there
is none (a thread the library started) it names the library's own line that warned.
"""

from __future__ import annotations

import os
import sys
import warnings
from types import FrameType

__all__ = ["warn_caller"]

_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep
#: The standard library's wrappers a call into this package passes through: a ``with`` block
#: (contextlib), a thread's start (threading), a finalizer (weakref), an executor's worker
#: (concurrent.futures), an import (importlib's frozen frames).
_STDLIB = os.path.dirname(os.path.abspath(os.__file__)) + os.sep
_STDLIB_WRAPPERS = (
    _STDLIB + "contextlib.py",
    _STDLIB + "threading.py",
    _STDLIB + "weakref.py",
    _STDLIB + "concurrent" + os.sep,
    "<frozen importlib",
)


def _passed_over() -> tuple[str, ...]:
    """This package's folder, the standard library's wrappers, and torch's folder (its
    wrappers and autograd) once it is imported: this module does not import torch
    (``thread_budget`` warns before it may)."""
    torch = sys.modules.get("torch")
    where = getattr(torch, "__file__", None)
    if where is None:
        return (_PACKAGE, *_STDLIB_WRAPPERS)
    return (_PACKAGE, *_STDLIB_WRAPPERS, os.path.dirname(os.path.abspath(where)) + os.sep)


def warn_caller(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn(message, category)`` at the first frame outside this package, the
    standard library's wrappers and torch (Note [a warning names the caller's line]); at the
    immediate caller when every frame is theirs (a thread the library started, a
    finalizer). The frame is named explicitly (``warnings.warn_explicit``), as
    ``warnings.warn`` would name it, registry included: ``stacklevel`` counts frames
    differently (it skips importlib's)."""
    passed_over = _passed_over()
    caller = sys._getframe(1)
    frame: FrameType | None = caller
    while frame is not None and frame.f_code.co_filename.startswith(passed_over):
        frame = frame.f_back
    if frame is None:
        frame = caller
    globals_ = frame.f_globals
    warnings.warn_explicit(
        message,
        category,
        frame.f_code.co_filename,
        frame.f_lineno,
        module=globals_.get("__name__", "<unknown>"),
        registry=globals_.setdefault("__warningregistry__", {}),
    )  # no module_globals, as warnings.warn: a ``python -c`` script's loader has no source
