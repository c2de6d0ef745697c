"""Normalisation of CE + NTL over a training step, defined once for every front end (docs/normalization.md)::

    L = sum_t m_t CE_t / max(N, 1)  +  w * sum_t m_t NTL_t / max(K, 1)
    N = sum_t m_t,  K = sum_t m_t [t in ntl_positions]

``global``: ``N``, ``K`` are the step's (:func:`step_counts`, one SUM all-reduce), so the split into
micro-batches and ranks changes neither ``L`` nor its gradient; ``micro-batch``: each micro-batch's own.
A front end passes its framework's rescale as ``scale``. Nothing here reads a value on the host.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist

from .number_vocab import NumberVocab
from .options import NTLOptions
from .terms import PerTokenTerms, ntl_counts

__all__ = [
    "MicroBatchSums",
    "apply_factors",
    "factors",
    "means",
    "micro_batch_sums",
    "objective",
    "objective_of_means",
    "step_counts",
]

Count = float | torch.Tensor
"""A count or a rescale: a tensor, or a host number (``int`` too: torchtitan's ``global_valid_tokens``)."""


class MicroBatchSums(NamedTuple):
    """The sums of one micro-batch that every normalisation is built from (0-d tensors, dtype of CE)."""

    ce: torch.Tensor
    ntl: torch.Tensor
    tokens: torch.Tensor
    numbers: torch.Tensor
    hits: torch.Tensor


def micro_batch_sums(terms: PerTokenTerms, mask: torch.Tensor) -> MicroBatchSums:
    """Sums the per-token terms of one micro-batch with loss weights ``mask``."""
    weight = mask.to(terms.ce.dtype)
    numbers = terms.number_mask.to(weight.dtype) * weight
    return MicroBatchSums(
        ce=(terms.ce * weight).sum(),
        ntl=(terms.ntl * numbers).sum(),
        tokens=weight.sum(),
        numbers=numbers.sum(),
        hits=(terms.hit.to(weight.dtype) * numbers).sum(),
    )


def step_counts(
    labels: Sequence[torch.Tensor],
    vocab: NumberVocab,
    options: NTLOptions | None = None,
    *,
    loss_masks: Sequence[torch.Tensor] | None = None,
    pieces: int = 1,
    group: dist.ProcessGroup | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """``[N, K]`` of one step: the tokens and NTL positions of these micro-batches, summed over ``group``.

    One SUM all-reduce of both counts (on ``device``: NCCL reduces device tensors only), from the labels, so
    before the first forward. ``labels`` may be empty: a rank without data still joins with zeros.
    """
    if loss_masks is not None and len(loss_masks) != len(labels):
        raise ValueError(
            f"step_counts: {len(loss_masks)} loss masks for {len(labels)} micro-batches; pass one per micro-batch"
        )
    counts = torch.zeros(2, dtype=torch.float64, device=labels[0].device if len(labels) else device)
    for i, targets in enumerate(labels):
        mask = None if loss_masks is None else loss_masks[i]
        counts += ntl_counts(targets, vocab, options, loss_mask=mask, pieces=pieces)
    if device is not None:
        counts = counts.to(device)
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(counts, group=group)
    return counts


def _at_least_one(count: Count) -> Count:
    return count.clamp_min(1) if isinstance(count, torch.Tensor) else max(count, 1.0)


def objective(
    sums: MicroBatchSums, counts: tuple[Count, Count], weight: float, *, scale: Count | None = None
) -> torch.Tensor:
    """``L = sum CE / max(N, 1) + weight * sum NTL / max(K, 1)`` of one micro-batch's sums, times ``scale``.

    ``weight`` 0 adds no ``0 * NTL`` term (a run with NTL off is its framework's CE bit for bit); ``scale`` is
    undone by the framework's own division (docs/normalization.md has the table).
    """
    tokens, numbers = counts
    loss = sums.ce / _at_least_one(tokens)
    if weight != 0:
        loss = loss + weight * sums.ntl / _at_least_one(numbers)
    return loss if scale is None else loss * scale


def factors(
    counts: tuple[torch.Tensor, torch.Tensor], scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(a, b)`` with ``a * sum CE + b * weight * sum NTL = scale * L``: :func:`objective` as per-token weights.

    ``scale`` None: the framework divides by ``N`` itself, so ``a = 1``, ``b = max(N, 1) / max(K, 1)``.
    """
    tokens, numbers = counts[0].clamp_min(1), counts[1].clamp_min(1)
    if scale is None:
        return torch.ones_like(tokens), tokens / numbers
    return scale / tokens, scale / numbers


def apply_factors(
    ab: tuple[torch.Tensor, torch.Tensor], ce: torch.Tensor, ntl: torch.Tensor, weight: float
) -> torch.Tensor:
    """``a * ce + weight * ntl * b`` for ``(a, b)`` of :func:`factors`: per token (``CE_t``, ``NTL_t``) or of
    a micro-batch's sums."""
    a, b = ab
    return a * ce + weight * ntl * b


def means(sums: MicroBatchSums, counts: tuple[Count, Count]) -> tuple[torch.Tensor, torch.Tensor]:
    """The two normalised terms ``(sum CE / max(N, 1), sum NTL / max(K, 1))``, before the weight (for logging)."""
    tokens, numbers = counts
    return sums.ce / _at_least_one(tokens), sums.ntl / _at_least_one(numbers)


def objective_of_means(means: Mapping[str, float], weight: float) -> float:
    """``ce + weight * ntl`` of logged means (host floats: a metrics row, held-out metrics): ``L`` as a number."""
    return means.get("ce", 0.0) + weight * means.get("ntl", 0.0)
