"""Deprecated names kept for one release: a call warns with ``DeprecationWarning`` and runs the new one."""

from __future__ import annotations

import functools
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
