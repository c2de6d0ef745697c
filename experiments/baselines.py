"""Competitor losses for the studies (issue 33): DEL and NTL-WAS over the ten digit logits only.

Research baselines, not part of ``ntl_scale`` (the library gains no DEL). Both are per-token terms
of full (unsharded) logits, added to CE by :mod:`experiments.train_baselines`; every choice below is
written from the definitions and names its source in ``PolyU-VCLab/DEL`` (commit 68c3d4d,
``train-qwen-deepseek.py``, the file its Qwen and DeepSeek runs train with) or says what we chose
where that source leaves it open. ``docs/results.md`` ("DEL baseline (implementation)") has the table.

Notation per position ``t`` with a digit target ``y`` in 0..9: ``z`` = the logits of the ten digit
tokens "0".."9" (raw logits, not log-probabilities), ``p = softmax(z)`` over those ten only.

* **DEL** (Digit Entropy Loss, arXiv 2605.20369; their ``DEL``, lines 516-591; added to CE at lines 610-633)::

      DEL_t = w_t * (1/10) * sum_k BCEwithLogits(z_k, [k == y]) * p_k
      BCEwithLogits(z, 1) = softplus(-z),  BCEwithLogits(z, 0) = softplus(z)

  ``p`` is not detached (their ``probs_digit``, line 572, carries gradient). The place weight ``w_t``
  (their ``generate_place``, lines 355-386): a number is a run of consecutive digit and ``"."``
  targets; an integer-part digit ``k`` places from the right of its integer part (units ``k = 1``)
  gets ``w = 2k`` (they form ``1.02^(k-1)``, take ``log_1.02`` of it, add 1 and double: lines 372,
  376, 382, so the weight is linear in the place, not ``1.02^place``); the ``m``-th digit after the
  first point gets ``w = 1.02^-(m+1)``; a run whose first token is the point counts as an integer
  (their ``ind > 0`` test). Points carry no term.
* **NTL-WAS over the digit logits** (their ``NTL_WAS``, lines 424-445)::

      WAS_t = sum_k p_k * |k - y|

  the Wasserstein-1 distance of NTL with the softmax over the ten digit logits instead of over the
  whole vocabulary (``ntloss`` and the NTL paper). Their code then takes ``.mean()`` over the ten
  classes too (a factor 1/10); ours sums over ``k``, so at the same weight it differs from our
  ``CE + NTL-WAS`` arm only in the softmax's domain.

Masking: only positions whose target is one of the ten digit tokens carry a term (ignored targets,
``ignore_index``, and every other token give 0). Reduction: the caller divides the sum by the number
of digit targets (see :mod:`experiments.train_baselines`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F

from ntl_scale.number_vocab import NumberVocab

__all__ = ["BASELINES", "BaselineTerm", "del_term", "digit_ids", "digit_mask", "digit_was_term", "place_weights"]

DIGITS = tuple("0123456789")
"""The ten digit tokens, in value order."""

PLACE_BASE = 1.02
"""The base of DEL's place weights (their ``generate_place``, lines 372 and 376)."""


class BaselineTerm(NamedTuple):
    """Per-token values of a baseline term and the positions that carry it, each shaped like the labels.

    Attributes:
        value: the term (0 where ``mask`` is False), float32 (float64 for float64 logits), differentiable.
        mask: the positions whose target is a digit token.
    """

    value: torch.Tensor
    mask: torch.Tensor


def digit_ids(vocab: NumberVocab) -> torch.Tensor:
    """The ids of the tokens "0".."9", in the order of their values (index = digit).

    Raises:
        ValueError: the table's tokens are unknown or do not hold each digit exactly once.
    """
    if vocab.tokens is None:
        raise ValueError("DEL needs the number table's token strings (NumberVocab.tokens); build it from a tokenizer")
    found = {token: int(i) for token, i in zip(vocab.tokens, vocab.ids.tolist()) if token in DIGITS}
    missing = [d for d in DIGITS if d not in found]
    if missing:
        raise ValueError(
            f"DEL and the digit-only NTL-WAS need one token per digit; the tokenizer has no token for {missing}: use a "
            "tokenizer that splits numbers into digits (model.tokenizer=builtin:char, or ntl_scale.add_digit_tokens)"
        )
    return torch.tensor([found[d] for d in DIGITS], dtype=torch.long)


def _digit_targets(labels: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(mask of digit targets, the digit 0..9 of each, 0 elsewhere)."""
    ids = ids.to(labels.device)
    hit = labels.unsqueeze(-1) == ids
    return hit.any(-1), hit.long().argmax(-1)


def digit_mask(labels: torch.Tensor, vocab: NumberVocab) -> torch.Tensor:
    """The positions whose target is one of the ten digit tokens (those that carry a term), bool like ``labels``."""
    return _digit_targets(labels, digit_ids(vocab))[0]


def _next_at_or_after(flag: torch.Tensor) -> torch.Tensor:
    """Per position ``t`` of each row: the first ``s >= t`` with ``flag[s]``, or the row length."""
    length = flag.shape[-1]
    pos = torch.arange(length, device=flag.device).expand_as(flag)
    marked = torch.where(flag, pos, torch.full_like(pos, length))
    return marked.flip(-1).cummin(-1).values.flip(-1)


def place_weights(
    labels: torch.Tensor, ids: torch.Tensor, point_id: int | None, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """DEL's place weight of each digit target (0 elsewhere), ``[B, T]`` of ``dtype``.

    Numbers are runs of digit and point targets within one row; any other target (an ignored one
    included) ends a run. See the module docstring for the weights.

    Args:
        labels: the targets ``[B, T]`` (next tokens for a causal model; ``-100`` ignored).
        ids: :func:`digit_ids`.
        point_id: the id of the ``"."`` token (``NumberVocab.decimal_point_id``); None: integers only.
    """
    is_digit, _ = _digit_targets(labels, ids)
    is_point = labels == point_id if point_id is not None else torch.zeros_like(is_digit)
    length = labels.shape[-1]
    pos = torch.arange(length, device=labels.device).expand_as(labels)
    run_end = _next_at_or_after(~(is_digit | is_point))  # first non-number position at or after t
    before = torch.where(~(is_digit | is_point), pos, torch.full_like(pos, -1))
    run_start = before.cummax(-1).values + 1
    next_point = _next_at_or_after(is_point)
    first_point = next_point.gather(-1, run_start.clamp(max=length - 1))  # the run's first point, if any
    has_point = (first_point < run_end) & (first_point > run_start)  # a point after the run's first token
    integer = is_digit & (~has_point | (pos < first_point))
    fraction = is_digit & has_point & (pos > first_point)
    place = torch.where(has_point, first_point - pos, run_end - pos).to(dtype)  # units: 1
    after_point = (pos - first_point).to(dtype)  # m: 1 for the first digit after the point
    weights = torch.where(integer, 2.0 * place, torch.zeros_like(place))
    return torch.where(fraction, PLACE_BASE ** -(after_point + 1.0), weights)


def _upcast(z: torch.Tensor) -> torch.Tensor:
    """Half-precision logits in float32 (as their code: ``outputs.logits.float()``, line 593); float64 stays."""
    return z if z.dtype == torch.float64 else z.float()


def del_term(logits: torch.Tensor, labels: torch.Tensor, vocab: NumberVocab) -> BaselineTerm:
    """DEL per token: ``w_t * mean_k BCEwithLogits(z_k, [k == y]) * softmax(z)_k`` over the ten digit
    logits ``z`` (module docstring), 0 where the target is not a digit.

    Shape:
        ``logits``: ``[B, T, V]`` (full vocabulary); ``labels``: ``[B, T]``; the result: ``[B, T]``.
    """
    ids = digit_ids(vocab).to(logits.device)
    mask, digit = _digit_targets(labels, ids)
    z = _upcast(logits[..., ids])
    target = F.one_hot(digit, 10).to(z.dtype)
    bce = F.binary_cross_entropy_with_logits(z, target, reduction="none")
    value = (bce * z.softmax(-1)).mean(-1) * place_weights(labels, ids, vocab.decimal_point_id, z.dtype)
    return BaselineTerm(torch.where(mask, value, torch.zeros_like(value)), mask)


def digit_was_term(logits: torch.Tensor, labels: torch.Tensor, vocab: NumberVocab) -> BaselineTerm:
    """NTL-WAS with the softmax over the ten digit logits only: ``sum_k p_k |k - y|``, 0 where the
    target is not a digit.

    Shape:
        ``logits``: ``[B, T, V]``; ``labels``: ``[B, T]``; the result: ``[B, T]``.
    """
    ids = digit_ids(vocab).to(logits.device)
    mask, digit = _digit_targets(labels, ids)
    z = _upcast(logits[..., ids])
    values = torch.arange(10, device=z.device, dtype=z.dtype)
    value = (z.softmax(-1) * (values - digit.unsqueeze(-1).to(z.dtype)).abs()).sum(-1)
    return BaselineTerm(torch.where(mask, value, torch.zeros_like(value)), mask)


BASELINES: dict[str, Callable[[torch.Tensor, torch.Tensor, NumberVocab], BaselineTerm]] = {
    "del": del_term,
    "digit_was": digit_was_term,
}
"""The terms ``baseline.loss`` of :mod:`experiments.train_baselines` can name."""
