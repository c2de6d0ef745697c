"""Deprecated alias of :mod:`ntl_scale.integrations.hf.loss` (kept for one release).

Moved: ``NTLCausalLMLoss``, ``apply_ntl``, ``remove_ntl``, ``installed_loss``, ``is_chunked`` to
``ntl_scale.integrations.hf.loss`` (also importable from ``ntl_scale.integrations.hf``).
"""

import warnings

from .hf.loss import NTLCausalLMLoss, apply_ntl, installed_loss, is_chunked, remove_ntl

__all__ = ["NTLCausalLMLoss", "apply_ntl", "installed_loss", "is_chunked", "remove_ntl"]

warnings.warn(
    "ntl_scale.integrations.hf_loss is deprecated; import from ntl_scale.integrations.hf",
    DeprecationWarning,
    stacklevel=2,
)
