"""Run a function on a module once it is imported, whether that happened before or after.

Note [a hook on import, in either order]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Some guards must change a class of another library (``accelerate.Accelerator``, say: Note
[clipping guarded at each framework's entry point] in ``optim/framework_clipping.py``), and
``zero_offload`` may be imported before or after that library, or the library never at all.
Importing every framework up front would cost seconds and import what the user does not use.
So ``when_imported(name, hook)`` runs ``hook(module)`` at once when ``name`` is already in
``sys.modules``; otherwise a finder at the front of ``sys.meta_path`` answers for ``name``
alone: it asks the finders behind it for the module's spec, wraps the loader so that
``exec_module`` runs the hooks when the module's body has finished, and puts the original
loader back on the module and its spec right after, so the wrapper is seen by no one
(``inspect``, ``importlib.resources`` and ``reload`` find the library's own loader). Every
other import passes through with one dictionary lookup. A hook that fails is reported as a
warning, never as the user's import failing; hooks are idempotent, since ``reload`` runs the
module's body again and the module may already be patched.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading
import warnings
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

__all__ = ["when_imported"]

Hook = Callable[[ModuleType], None]

_lock = threading.RLock()
_hooks: dict[str, list[Hook]] = {}  # module name -> hooks, in registration order


def _run(name: str, module: ModuleType, hooks: Sequence[Hook] | None = None) -> None:
    """Each of ``hooks`` (default: every hook of ``name``) on ``module``."""
    if hooks is None:
        with _lock:
            hooks = list(_hooks.get(name, ()))
    for hook in hooks:
        try:
            hook(module)
        except Exception as exc:  # a broken guard must not break the user's import
            warnings.warn(
                f"zero_offload could not install its hook on {name} "
                f"({getattr(hook, '__qualname__', hook)}): {exc!r}. Nothing else changed; "
                "please report it with the versions `zero-offload info` prints",
                RuntimeWarning,
                stacklevel=2,
            )


class _HookedLoader(importlib.abc.Loader):
    """``inner``, whose ``exec_module`` then runs the hooks for ``name``."""

    def __init__(self, inner: Any, name: str) -> None:
        self._inner = inner
        self._name = name

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        create = getattr(self._inner, "create_module", None)
        return create(spec) if create is not None else None

    def exec_module(self, module: ModuleType) -> None:
        # The library's own loader again, on the module and its spec, before its body runs:
        # nothing ever reads the wrapper (Note [a hook on import, in either order]).
        module.__loader__ = self._inner
        if module.__spec__ is not None:
            module.__spec__.loader = self._inner
        self._inner.exec_module(module)
        _run(self._name, module)

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._inner, attr)


class _Finder(importlib.abc.MetaPathFinder):
    """At the front of ``sys.meta_path``: wraps the loader of the hooked names only."""

    def __init__(self) -> None:
        self._busy = threading.local()

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in _hooks or getattr(self._busy, "name", None) == fullname:
            return None
        self._busy.name = fullname  # a finder behind us that asks meta_path again: pass
        try:
            spec = None
            for finder in list(sys.meta_path):
                find = getattr(finder, "find_spec", None)
                if finder is self or find is None:
                    continue
                spec = find(fullname, path, target)
                if spec is not None:
                    break
        finally:
            self._busy.name = None
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None  # not found, or a kind we do not wrap: the normal search decides
        spec.loader = _HookedLoader(spec.loader, fullname)
        return spec


_finder = _Finder()


def when_imported(name: str, hook: Hook) -> None:
    """Call ``hook(module)`` when module ``name`` has been imported: now, if it is already,
    else right after its import (Note [a hook on import, in either order])."""
    with _lock:
        _hooks.setdefault(name, []).append(hook)
        if _finder not in sys.meta_path:
            sys.meta_path.insert(0, _finder)
        module = sys.modules.get(name)
    spec = getattr(module, "__spec__", None)
    if module is not None and not getattr(spec, "_initializing", False):
        _run(name, module, [hook])
