"""NTL beside a framework's own cross entropy (``ce_kernel="framework"``): :func:`beside` puts the framework's
per-token CE into NTL-alone terms (``need_ce=False``), so normalisation and logs are the same code."""

from __future__ import annotations

import torch

from ..options import NTLOptions
from ..terms import PerTokenTerms

__all__ = ["CHOICE", "beside", "framework_ce"]

CHOICE = "number_choice_accuracy"
"""The share of NTL positions whose label is the arg-max among the number columns (the full arg-max is inside
the framework's kernel); logged in place of number accuracy with ``ce_kernel="framework"``."""


def framework_ce(options: NTLOptions) -> bool:
    """Whether ``options`` keep the stack's own cross entropy (``ce_kernel="framework"``)."""
    return options.ce_kernel == "framework"


def beside(ce: torch.Tensor, ntl: PerTokenTerms, hit: torch.Tensor | None = None) -> PerTokenTerms:
    """``ntl`` (terms of ``need_ce=False``) with the framework's per-token CE ``ce`` (0 where ignored) and as
    ``hit`` the full arg-max where a stack has the logits at hand, else ``number_choice_hit``."""
    shape = ntl.ntl.shape
    return ntl._replace(ce=ce.reshape(shape), hit=ntl.number_choice_hit if hit is None else hit.reshape(shape))
