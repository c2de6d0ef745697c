"""The pieces of a CE + NTL training step that do not depend on DeepSpeed: global token counts,
and the per-micro-batch loss with exact global normalisation.

The counts and the normalisations are :mod:`ntl_scale.normalization`'s; what is DeepSpeed's own here is
the rescale (``scale``: the engine divides the loss by the accumulation steps and averages the
gradients over the data-parallel ranks) and the counts read on the host once per step."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ...normalization import micro_batch_sums, objective, step_counts
from ...number_vocab import NumberVocab
from ...options import NTLOptions
from ...terms import PerTokenTerms
from ...training.config import NTLConfig

__all__ = ["global_counts", "loss_from_terms", "shift_for_causal", "z_loss_sum"]


def shift_for_causal(labels: torch.Tensor) -> torch.Tensor:
    """Next-token targets: position ``t`` predicts ``labels[t + 1]``; the last position is ignored."""
    pad = torch.full_like(labels[:, :1], -100)
    return torch.cat([labels[:, 1:], pad], dim=1)


def global_counts(
    targets: list[torch.Tensor],
    vocab: NumberVocab,
    group: dist.ProcessGroup | None,
    options: NTLOptions | None = None,
) -> tuple[float, float]:
    """Target tokens and NTL positions of a whole step: all micro-batches, all DP ranks (``group``)."""
    counts = step_counts(targets, vocab, options, group=group)
    return float(counts[0]), float(counts[1])


def ntl_options(ntl: NTLConfig) -> NTLOptions:
    """The loss variant of a run config, and its ``impl`` (:meth:`ntl_scale.options.NTLRunOptions.options`)."""
    return ntl.options()


def loss_from_terms(
    terms: PerTokenTerms,
    targets: torch.Tensor,
    ntl: NTLConfig,
    *,
    counts: tuple[float, float] | None,
    scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The loss to back-propagate for one micro-batch, and its logging sums, from its per-token terms (of
    the logits, of a vocabulary shard, or of the chunked loss: :meth:`.engine.Engine.forward_terms`).

    Nothing is read on the host: the sums ``[ce_sum, ntl_sum, tokens, numbers, hits]`` come back as one float64
    tensor for the caller to add up and read once per step (``ce_sum`` without the z-loss).
    """
    valid = targets != -100
    sums = micro_batch_sums(terms, valid)
    if ntl.normalization == "global":
        if counts is None:
            raise ValueError("ntl.normalization=global needs the step's global counts")
        loss = objective(sums, counts, ntl.weight, scale=scale)  # scale: the engine's ga x dp, undone by it
    else:
        loss = objective(sums, (sums.tokens, sums.numbers), ntl.weight)
    ce_sum = sums.ce.detach().double() - z_loss_sum(terms, targets, ntl.options().z_loss_weight)
    stats = torch.stack([ce_sum, sums.ntl.detach().double(), sums.tokens.double(),
                         sums.numbers.double(), sums.hits.double()])  # fmt: skip
    return loss, stats


def z_loss_sum(terms: PerTokenTerms, targets: torch.Tensor, z_loss_weight: float) -> torch.Tensor:
    """The z-loss part of a micro-batch's CE term, ``z_loss_weight * sum lse**2`` over its targets (float64
    0-d, detached, no host read): what the training ``z_loss`` logs."""
    if not z_loss_weight:
        return torch.zeros((), dtype=torch.float64, device=terms.ce.device)
    valid = (targets != -100).reshape(terms.lse.shape)
    return z_loss_weight * (terms.lse.detach().double().square() * valid).sum()
