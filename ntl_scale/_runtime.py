"""Device-side input checks, graph-tracing detection and optional imports.

:func:`device_check` is a ``torch._assert_async`` (no host sync; on the CPU the full ``ValueError``);
``set_debug_checks(True)`` reads each checked value on the host instead, naming it in the error.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from types import ModuleType

import torch

__all__ = ["device_check", "is_tracing", "require", "set_debug_checks"]

_DEBUG = False


def set_debug_checks(enabled: bool) -> bool:
    """Host-side input checks with the offending value in the message (one sync each); returns the previous setting."""
    global _DEBUG
    if not isinstance(enabled, bool):
        raise TypeError(f"set_debug_checks takes True or False, got {enabled!r}")
    previous, _DEBUG = _DEBUG, enabled
    return previous


def device_check(ok: torch.Tensor, error: Callable[[], Exception], message: str) -> None:
    """Fails with ``error()`` unless the scalar bool tensor ``ok`` is True; no host sync unless debugging."""
    if _DEBUG:
        if not bool(ok):
            raise error()
        return
    try:
        torch._assert_async(ok, f"ntl_scale: {message}; ntl_scale.set_debug_checks(True) names the value")
    except RuntimeError:  # on the CPU the assert runs at once: report the full error
        raise error() from None


def is_tracing() -> bool:
    """True inside ``torch.compile`` or under ``make_fx``'s proxy mode."""
    if torch.compiler.is_compiling():
        return True
    from torch.fx.experimental.proxy_tensor import get_proxy_mode

    return get_proxy_mode() is not None


def require(module: str, extra: str, feature: str) -> ModuleType:
    """Imports ``module`` or raises an ImportError that says which extra provides it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(
            f"{feature} needs the optional dependency '{module}', which is not installed. "
            f"Install it with: pip install 'ntl_scale[{extra}]'"
        ) from e
