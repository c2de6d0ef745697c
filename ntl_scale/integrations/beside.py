"""NTL beside a framework's own cross entropy (``ce_kernel="framework"``): one rule for every stack.

The framework's CE runs as it is; NTL comes from :func:`ntl_scale.per_token_ce_ntl` with ``need_ce=False``
(the number columns only). :func:`beside` puts the framework's per-token CE into those terms, so the
normalisation (:mod:`ntl_scale.normalization`) and the logs stay the same code. The full-vocabulary arg-max
is the framework's: ``hit`` stays False and a stack without the full logits logs no ``number_accuracy``.
"""

from __future__ import annotations

import torch

from ..options import NTLOptions
from ..terms import PerTokenTerms

__all__ = ["beside", "framework_ce"]


def framework_ce(options: NTLOptions) -> bool:
    """Whether ``options`` keep the stack's own cross entropy (``ce_kernel="framework"``)."""
    return options.ce_kernel == "framework"


def beside(ce: torch.Tensor, ntl: PerTokenTerms, hit: torch.Tensor | None = None) -> PerTokenTerms:
    """``ntl`` (terms of ``need_ce=False``) with the framework's per-token CE ``ce`` (0 where ignored) and, where
    a stack has the full logits at hand, the arg-max ``hit``; reshaped to the terms' shape."""
    shape = ntl.ntl.shape
    return ntl._replace(ce=ce.reshape(shape), hit=ntl.hit if hit is None else hit.reshape(shape))
