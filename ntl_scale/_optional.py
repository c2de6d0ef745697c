"""Lazy imports of optional dependencies with an actionable error naming the extra to install."""

from __future__ import annotations

import importlib
from types import ModuleType


def require(module: str, extra: str, feature: str) -> ModuleType:
    """Imports ``module`` or raises an ImportError that says which extra provides it.

    Args:
        module: the module to import (e.g. ``"transformers"``).
        extra: the ntl_scale extra that installs it (e.g. ``"hf"``).
        feature: what needs it, for the message.

    Returns:
        The imported module.
    """
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(
            f"{feature} needs the optional dependency '{module}', which is not installed. "
            f"Install it with: pip install 'ntl_scale[{extra}]'"
        ) from e
