"""Deprecated alias of :mod:`ntl_scale.integrations.hf.chunked` (kept for one release).

Moved to ``ntl_scale.integrations.hf.chunked``: ``check_head``, ``linear_head``, ``logit_multiplier``,
``chunked_forward``, ``hidden_state_terms``; renamed there: ``install_chunked_head`` is
``install_linear_loss_head`` and ``remove_chunked_head`` is ``remove_linear_loss_head``.
"""

import warnings

from .hf.chunked import (
    check_head,
    chunked_forward,
    hidden_state_terms,
    linear_head,
    logit_multiplier,
)
from .hf.chunked import install_linear_loss_head as install_chunked_head
from .hf.chunked import remove_linear_loss_head as remove_chunked_head

__all__ = [
    "check_head",
    "chunked_forward",
    "hidden_state_terms",
    "install_chunked_head",
    "linear_head",
    "logit_multiplier",
    "remove_chunked_head",
]

warnings.warn(
    "ntl_scale.integrations.hf_chunked is deprecated; import from ntl_scale.integrations.hf.chunked "
    "(install_chunked_head is now install_linear_loss_head)",
    DeprecationWarning,
    stacklevel=2,
)
