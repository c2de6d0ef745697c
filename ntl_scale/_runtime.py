"""How the library meets its runtime: device-side input checks, graph tracing, optional dependencies.

* :func:`device_check`: input checks that need device values, without a host synchronisation in the
  training path. By default a check is a device-side assert (``torch._assert_async``): on a GPU it is
  queued with the kernels and never stalls the host (a failure is a device-side assert error naming the
  problem); on the CPU it runs at once, and a failure is turned into the full ``ValueError`` that names
  the value. ``set_debug_checks(True)`` reads every checked value on the host instead and raises the full
  error on any device, at the cost of one synchronisation per check.
* :func:`is_tracing`: whether a graph is being traced (``torch.compile`` / Dynamo, or ``make_fx``, torchtitan's
  graph trainer). Code that keeps tensors across calls (caches) or writes into preallocated buffers with
  ``out=`` asks this: a traced call must not leave its traced tensors in a cache, and the replay of a trace
  records the ops of an autograd Function's forward for autograd, which refuses ``out=`` ops.
* :func:`require`: lazy imports of optional dependencies with an actionable error naming the extra to install.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from types import ModuleType

import torch

__all__ = ["debug_checks_enabled", "device_check", "is_tracing", "require", "set_debug_checks"]

_DEBUG = False


def set_debug_checks(enabled: bool) -> bool:
    """Host-side input checks with the offending value in the message (one sync each); returns the previous setting."""
    global _DEBUG
    if not isinstance(enabled, bool):
        raise TypeError(f"set_debug_checks takes True or False, got {enabled!r}")
    previous, _DEBUG = _DEBUG, enabled
    return previous


def debug_checks_enabled() -> bool:
    """Whether :func:`set_debug_checks` is on."""
    return _DEBUG


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
