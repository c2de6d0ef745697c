"""Reductions of per-token CE and NTL to a loss: CE over the non-ignored tokens, NTL over its positions,
each with optional loss weights. No host read.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ._validation import check_reduction, check_weights
from .number_vocab import NumberVocab
from .options import NTLOptions
from .terms import PerTokenTerms

__all__ = ["CENTLOutput", "combine_terms", "reduce_loss", "weighted_mean"]


class CENTLOutput(NamedTuple):
    """Result of :func:`ce_with_ntl`.

    Attributes:
        loss: ``ce + ntl_weight * ntl`` (what to call ``backward`` on).
        ce: the cross-entropy term.
        ntl: the NTL term (unweighted).
        num_tokens: weight (count) of the tokens CE was averaged over.
        num_number_tokens: weight (count) of the positions NTL was averaged over (:func:`ntl_positions`).
        number_accuracy: the weighted share of those positions whose label is the arg-max over the whole
            vocabulary (a metric, not differentiable).
    """

    loss: torch.Tensor
    ce: torch.Tensor
    ntl: torch.Tensor
    num_tokens: torch.Tensor
    num_number_tokens: torch.Tensor
    number_accuracy: torch.Tensor


def reduce_loss(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    weights: torch.Tensor | None,
    reduction: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reduces a per-token loss over the masked positions; returns ``(loss, sum(w))``.

    ``mean``: :func:`weighted_mean` (0, with zero gradient, when every weight is 0); ``sum``: ``sum(l * w)``;
    ``none``: ``l * w`` per position.
    """
    check_reduction(reduction)
    w = mask.to(per_token.dtype) if weights is None else torch.where(mask, weights, 0)
    total = w.sum()
    if reduction == "none":
        return per_token * w, total
    if reduction == "sum":
        return (per_token * w).sum(), total
    return weighted_mean(per_token, w), total


def weighted_mean(values: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``sum(v * w) / sum(w)`` for weights ``w >= 0``; 0 (zero gradient) when every weight is 0.

    The weights are divided by their largest first: a tiny total is not clamped to an epsilon, and 0/1
    weights give the bits of ``sum(v * w) / max(sum(w), 1)``.
    """
    if weights.numel() == 0:
        return (values * weights).sum()
    peak = weights.amax()
    unit = weights / torch.where(peak > 0, peak, torch.ones_like(peak))
    return (values * unit).sum() / unit.sum().clamp_min(1)


def reduce_ntl(
    terms: PerTokenTerms, labels: torch.Tensor, loss_weights: torch.Tensor | None, reduction: str
) -> torch.Tensor:
    """NTL alone reduced over its positions (``terms`` of ``need_ce=False``), weighted by ``loss_weights``."""
    weights = check_weights(loss_weights, labels, terms.ntl.dtype)
    return reduce_loss(terms.ntl, terms.number_mask, weights, reduction)[0]


def combine_terms(
    terms: PerTokenTerms,
    labels: torch.Tensor,
    vocab: NumberVocab,
    options: NTLOptions,
    ntl_weight: float,
    loss_weights: torch.Tensor | None,
    reduction: str,
) -> CENTLOutput:
    """Reduces per-token terms to :class:`CENTLOutput` (CE over valid tokens, NTL over its mask)."""
    weights = check_weights(loss_weights, labels, terms.ce.dtype)
    valid = labels != options.ignore_index
    ce_red, num_tokens = reduce_loss(terms.ce, valid, weights, reduction)
    ntl_red, num_numbers = reduce_loss(terms.ntl, terms.number_mask, weights, reduction)
    # accuracy over the NTL positions, each weighted as NTL weights it
    hits = terms.hit.to(terms.ce.dtype)
    accuracy = reduce_loss(hits, terms.number_mask, weights, "mean")[0].detach()
    return CENTLOutput(ce_red + ntl_weight * ntl_red, ce_red, ntl_red, num_tokens, num_numbers, accuracy)
