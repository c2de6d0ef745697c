"""Deprecated names kept for one release: a call warns with ``DeprecationWarning`` and runs the new one;
an import of a moved module's old name warns and gives the module at its new name."""

from __future__ import annotations

import functools
import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


def deprecated_alias(new: F, old: str, *, removed_in: str = "0.3.0") -> F:
    """``new`` under its former name ``old`` (``module.name``): same signature, a warning naming the new name."""

    @functools.wraps(new)
    def alias(*args: Any, **kwargs: Any) -> Any:
        warnings.warn(
            f"{old} is renamed {new.__module__}.{new.__name__}; the old name goes in {removed_in}",
            DeprecationWarning,
            stacklevel=2,
        )
        return new(*args, **kwargs)

    alias.__name__ = alias.__qualname__ = old.rsplit(".", 1)[-1]
    alias.__doc__ = f"Deprecated alias of :func:`{new.__module__}.{new.__name__}` (removed in {removed_in})."
    return alias  # type: ignore[return-value]


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports of a moved module's old name give the module at its new name, with a warning.

    The old name is the same module object (a monkeypatch through either name is seen by both); no file
    is left at the old path, so version control follows the move as a rename."""

    def __init__(self, moved: dict[str, str], removed_in: str) -> None:
        self.moved = moved
        self.removed_in = removed_in
        self.specs: dict[str, Any] = {}

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self.moved:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        new = self.moved[spec.name]
        warnings.warn(
            f"{spec.name} is deprecated; import {new} (the old name goes in {self.removed_in})",
            DeprecationWarning,
            stacklevel=2,
        )
        module = importlib.import_module(new)
        self.specs[spec.name] = module.__spec__
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        # the import system set the old name's spec on the new module: give it back its own
        module.__spec__ = self.specs.pop(module.__spec__.name)  # type: ignore[union-attr]


def moved_names(module: str, moved: dict[str, str], *, removed_in: str = "0.3.0") -> Callable[[str], Any]:
    """A module ``__getattr__`` for names that moved out of ``module`` (name -> its new module): the
    old access warns with ``DeprecationWarning`` and gives the object from the new module."""

    def __getattr__(name: str) -> Any:
        if name not in moved:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        warnings.warn(
            f"{module}.{name} is moved to {moved[name]}.{name} (the old name goes in {removed_in})",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module(moved[name]), name)

    return __getattr__


def deprecated_modules(moved: dict[str, str], *, removed_in: str = "0.3.0") -> None:
    """Keeps each old module name of ``moved`` (old dotted name -> new dotted name) importable for one
    release: the import warns with ``DeprecationWarning`` and returns the new module itself."""
    if not any(isinstance(finder, _MovedModules) and finder.moved == moved for finder in sys.meta_path):
        sys.meta_path.append(_MovedModules(moved, removed_in))
