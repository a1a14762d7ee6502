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
package and outside torch: the user's line, or the framework's that made the call.
"""

from __future__ import annotations

import os
import sys
import warnings

__all__ = ["warn_caller"]

_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _passed_over() -> tuple[str, ...]:
    """This package's folder, and torch's (its wrappers and autograd) once it is imported:
    this module does not import torch (``thread_budget`` warns before it may)."""
    torch = sys.modules.get("torch")
    where = getattr(torch, "__file__", None)
    if where is None:
        return (_PACKAGE,)
    return (_PACKAGE, os.path.dirname(os.path.abspath(where)) + os.sep)


def warn_caller(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn(message, category)`` at the first frame outside this package and
    torch (Note [a warning names the caller's line]); at the immediate caller when every
    frame is theirs (a thread the library started)."""
    passed_over = _passed_over()
    frame = sys._getframe(1)
    level = 2  # warnings.warn's level of warn_caller's caller
    while frame is not None and frame.f_code.co_filename.startswith(passed_over):
        frame = frame.f_back
        level += 1
    warnings.warn(message, category, stacklevel=level if frame is not None else 2)
