"""Reductions of per-token CE and NTL terms to the losses a training step back-propagates.

CE is averaged over the non-ignored tokens and NTL over the positions that carry it
(:func:`ntl_scale.ntl_positions`), each weighted by optional loss weights; ``sum`` and ``none``
skip the division. Nothing here reads a value on the host.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ._validation import check_reduction, check_weights
from .number_vocab import NumberVocab
from .options import NTLOptions
from .terms import PerTokenTerms

__all__ = ["CENTLOutput", "combine_terms", "reduce_loss"]


class CENTLOutput(NamedTuple):
    """Result of :func:`ce_with_ntl`.

    Attributes:
        loss: ``ce + ntl_weight * ntl`` (what to call ``backward`` on).
        ce: the cross-entropy term.
        ntl: the NTL term (unweighted).
        num_tokens: weight (count) of the tokens CE was averaged over.
        num_number_tokens: weight (count) of the positions NTL was averaged over
            (:func:`ntl_positions`: number-token labels; one per number for ``loss="number"``).
        number_accuracy: share of those same positions whose label is the arg-max over the whole
            vocabulary (greedy next-token accuracy where NTL is charged: every number-token label,
            or the first digit of each number for ``loss="number"``; a metric, not differentiable).
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
    """Reduces a per-token loss over the masked positions; returns ``(loss, total weight)``.

    ``mean`` is ``sum(l * w) / max(sum(w), eps)`` over the mask (exactly 0, with zero gradient,
    when nothing is selected); ``sum`` is ``sum(l * w)``; ``none`` is ``l * w`` per position.
    """
    check_reduction(reduction)
    w = mask.to(per_token.dtype) if weights is None else torch.where(mask, weights, 0)
    total = w.sum()
    if reduction == "none":
        return per_token * w, total
    summed = (per_token * w).sum()
    if reduction == "sum":
        return summed, total
    return summed / total.clamp_min(torch.finfo(per_token.dtype).eps), total


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
    number_positions = terms.number_mask  # ntl_positions: accuracy is counted where NTL is
    hits = (number_positions & terms.hit).sum().to(terms.ce.dtype)
    accuracy = (hits / number_positions.sum().clamp_min(1)).detach()
    return CENTLOutput(ce_red + ntl_weight * ntl_red, ce_red, ntl_red, num_tokens, num_numbers, accuracy)
