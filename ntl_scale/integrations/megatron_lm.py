"""Deprecated alias of :mod:`ntl_scale.integrations.megatron.lm` (kept for one release).

The Megatron-LM route (``GPTModelNTL``, ``MicroBatchScale``, ``NTLForwardStep``, ``NTLStats``,
``StepGroups``, ``apply_ntl``, ``remove_ntl``, ``find_language_model``) moved to
``ntl_scale.integrations.megatron.lm``.
"""

import warnings

from .megatron.lm import (
    GPTModelNTL,
    MicroBatchScale,
    NTLForwardStep,
    NTLStats,
    StepGroups,
    apply_ntl,
    find_language_model,
    remove_ntl,
)

__all__ = [
    "GPTModelNTL",
    "MicroBatchScale",
    "NTLForwardStep",
    "NTLStats",
    "StepGroups",
    "apply_ntl",
    "find_language_model",
    "remove_ntl",
]

warnings.warn(
    "ntl_scale.integrations.megatron_lm is deprecated; import from ntl_scale.integrations.megatron.lm",
    DeprecationWarning,
    stacklevel=2,
)
