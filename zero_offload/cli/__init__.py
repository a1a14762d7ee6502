"""The ``zero-offload`` command: ``info``, ``demo``, ``estimate``, ``bench``.

The parser and the small commands are in ``command.py``, ``estimate``'s flags and checks in
``estimate_command.py``, the flags' value types in ``args.py``.

``--help`` and the parser import neither torch nor numba (Note [the package imports torch
lazily] in ``__init__.py``): each command imports what it needs when it runs, and the demo's
flags, whose defaults come from a module that imports torch, are added only when the
command is ``demo``.

Errors (bad flag values, a budget too small, a missing benchmark) print one line and exit
with status 2; ``--debug`` shows the traceback instead.
"""

from __future__ import annotations

from .command import BENCHMARKS, main

__all__ = ["BENCHMARKS", "main"]
