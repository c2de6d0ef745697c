"""Megatron (both routes): per-token CE + NTL in Megatron's layouts, from the logits or the hidden states.

* :func:`sequence_first_terms`: the terms of the vocab-sharded ``[s, b, V/tp]`` logits for ``[b, s]`` labels;
* :func:`output_layer_terms`: the terms of the (column-parallel) output layer applied to the final
  hidden states, chunk by chunk, without the logits;
* the reporting pieces both routes share: :func:`is_evaluation` (Megatron's ``evaluate``: no gradient,
  ``model.eval()``), :func:`without_z_loss` (``terms.ce`` less its z-loss: ``lm loss``; the z-loss: ``z loss``) and
  :func:`megatron_num_tokens` (the whole number Megatron divides a micro-batch's loss by).

* :func:`megatron_cross_entropy`: Megatron's own vocab-parallel CE (plain, ``native`` fused or ``te``), which
  ``--ntl-ce-kernel framework`` keeps, NTL beside it.

``megatron.core`` is imported on first use (by :func:`output_layer_terms`, :func:`megatron_cross_entropy`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ...linear import linear_ce_ntl
from ...number_vocab import NumberVocab
from ...options import NTLOptions
from ...terms import PerTokenTerms, per_token_ce_ntl

__all__ = [
    "batch_first_terms",
    "context_parallel_pieces",
    "is_evaluation",
    "megatron_cross_entropy",
    "megatron_num_tokens",
    "output_layer_terms",
    "sequence_first_terms",
    "without_z_loss",
]


def is_evaluation(model: Any = None) -> bool:
    """Whether this forward is an evaluation: no gradient (Megatron's ``evaluate`` runs ``forward_step`` under
    ``torch.no_grad()``) or the model in eval mode (``evaluate`` calls ``model.eval()`` first).

    Evaluation reports the plain cross entropy (:meth:`ntl_scale.NTLOptions.for_evaluation`: no label smoothing,
    no z-loss), so ``lm loss`` and its perplexity are the model's own; NTL and number accuracy as in training.
    """
    return not torch.is_grad_enabled() or not getattr(model, "training", True)


def without_z_loss(
    terms: PerTokenTerms, labels: torch.Tensor, options: NTLOptions, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ce, z_sum)``, detached: ``ce`` the cross entropy per token, ``terms.ce`` less its z-loss part
    ``options.z_loss_weight * lse**2`` (which :func:`ntl_scale.per_token_ce_ntl` adds where the label is not
    ignored): label-smoothed with ``options.label_smoothing``, what ``lm loss`` reports; ``z_sum`` that z-loss
    summed under the loss weights ``mask`` (0 without z-loss), logged as ``z loss``."""
    z = torch.zeros_like(terms.ce)
    if options.z_loss_weight:
        valid = labels.reshape(terms.ce.shape) != options.ignore_index
        z_all = options.z_loss_weight * terms.lse.square()
        z = torch.where(valid.to(z_all.device), z_all, torch.zeros_like(z_all))
    z = z.detach()
    return terms.ce.detach() - z, (z * mask.to(z.dtype)).sum()


def megatron_num_tokens(loss_mask: torch.Tensor) -> torch.Tensor:
    """The ``num_tokens`` Megatron-LM's GPT ``loss_func`` returns for this loss mask, and so what the schedule
    divides the micro-batch's loss by (``clamp(num_tokens, 1)``) or, with ``--calculate-per-token-loss``, adds
    up into the step's divisor: ``loss_mask.view(-1).float().sum().to(torch.int)``, Megatron's own expression
    (the float sum truncated to a whole number: 3.5 for a mask of weights 0.5 and 1.5 counts as 3). A 0-d
    ``torch.int`` tensor on the mask's device; no host read."""
    return loss_mask.reshape(-1).float().sum().to(torch.int)


def context_parallel_pieces(context_parallel_size: int, options: NTLOptions, *, whole_sequence: bool = False) -> int:
    """Where number-level NTL cuts numbers under context parallelism: the one rule of every Megatron route.

    Megatron's load-balanced split cuts each sequence into ``2 x cp`` equal slices; context-parallel rank
    ``r`` holds slices ``r`` and ``2 cp - 1 - r`` back to back. Numbers are cut at every slice border (each
    rank assembles numbers from its own slices only; ``docs/megatron.md``), so a number whose digits end
    slice ``r`` and start slice ``2 cp - 1 - r`` is two numbers, not one across the seam. The result is the
    ``pieces`` of :func:`ntl_scale.ntl_positions`: 2 for a rank's local sequence (what its loss sees), ``2 x
    cp`` for a whole sequence (what a step count reads before the split, ``whole_sequence=True``); 1 (no
    cut) without context parallelism or for the token-level variants.

    Raises:
        ValueError: ``context_parallel_size`` not a whole number >= 1.
    """
    if (
        isinstance(context_parallel_size, bool)
        or not isinstance(context_parallel_size, int)
        or context_parallel_size < 1
    ):
        raise ValueError(
            f"context_parallel_size must be a whole number >= 1 (Megatron's --context-parallel-size), got "
            f"{context_parallel_size!r}"
        )
    if context_parallel_size == 1 or options.loss != "number":
        return 1
    return 2 * context_parallel_size if whole_sequence else 2


def _pieces(seq: int, pieces: int) -> tuple[int, int]:
    """The ``[pieces, seq / pieces]`` split of a local sequence (context-parallel slices)."""
    if pieces > 1 and seq % pieces:
        raise ValueError(
            f"the local sequence of {seq} tokens does not split into {pieces} context-parallel slices; "
            "the sequence length must be divisible by 2 x the context-parallel size, as Megatron requires"
        )
    return (pieces, seq // pieces)


def sequence_first_terms(
    logits: torch.Tensor,
    labels: torch.Tensor,
    vocab: NumberVocab,
    options: NTLOptions,
    *,
    pieces: int = 1,
    **kwargs: Any,
) -> PerTokenTerms:
    """:func:`per_token_ce_ntl` of Megatron's ``[s, b, V/tp]`` logits for ``[b, s]`` labels; terms ``[b, s]``.

    Costs what Megatron's own ``vocab_parallel_cross_entropy`` costs in ``compute_language_model_loss``:

    - the logits are read in the layout the output layer wrote them (a ``[b, s]`` view of them would
      be copied whole by the op's flattening); the labels and the per-token terms are transposed
      instead. Number-level NTL assembles numbers along each sequence and so takes the ``[b, s]``
      layout (that copy included);
    - fp32/fp64 logits are overwritten with the softmax and then the gradient (``inplace``), as
      Megatron's CE overwrites them in the same place: they are not read after the loss. Half-precision
      logits go through the op's fp32 chunk buffer instead.

    ``pieces``: number-level NTL only: the local sequence is this many slices of the global one that are
    not neighbours (context parallelism: Megatron's load-balanced split gives each rank 2), so no number
    is assembled across their seam (:func:`ntl_scale.ntl_positions` counts the same way).
    """
    inplace = logits.dtype in (torch.float32, torch.float64)
    if options.loss == "number":
        b, s = labels.shape
        split = _pieces(s, pieces)
        terms = per_token_ce_ntl(
            logits.transpose(0, 1).unflatten(1, split), labels.unflatten(1, split), vocab, options,
            inplace=inplace, **kwargs,
        )  # fmt: skip
        return PerTokenTerms(*(t.reshape(b, s) for t in terms))
    terms = per_token_ce_ntl(logits, labels.t(), vocab, options, inplace=inplace, **kwargs)
    return PerTokenTerms(*(t.t().contiguous() for t in terms))  # Megatron's loss_func views them flat


def batch_first_terms(
    logits: torch.Tensor,
    labels: torch.Tensor,
    vocab: NumberVocab,
    options: NTLOptions,
    *,
    pieces: int = 1,
    **kwargs: Any,
) -> PerTokenTerms:
    """:func:`per_token_ce_ntl` of ``[b, s, V/tp]`` logits (a ``GPTModel`` called without labels) for ``[b, s]``
    labels, numbers cut into ``pieces`` slices of the sequence (:func:`context_parallel_pieces`); terms ``[b, s]``."""
    if pieces == 1 or options.loss != "number":
        return per_token_ce_ntl(logits, labels, vocab, options, **kwargs)
    b, s = labels.shape
    split = _pieces(s, pieces)
    terms = per_token_ce_ntl(logits.unflatten(1, split), labels.unflatten(1, split), vocab, options, **kwargs)
    return PerTokenTerms(*(t.reshape(b, s) for t in terms))


def output_layer_terms(
    layer: Any,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    vocab: NumberVocab,
    options: NTLOptions,
    tp_group: dist.ProcessGroup | None,
    *,
    chunk_tokens: int | None = None,
    check_finite: bool = False,
    pieces: int = 1,
) -> PerTokenTerms:
    """Per-token CE + NTL of Megatron's (column-parallel) output layer applied to ``hidden``, without the logits.

    Args:
        layer: the model's ``output_layer`` (its ``sequence_parallel`` flag decides the input path).
        hidden: final hidden states ``[s(/tp), b, H]`` (sequence-split under sequence parallel).
        weight: the layer's weight shard ``[V/tp, H]`` (or the shared embedding when tied).
        labels: ``[b, s]``.
        vocab: the number table; options: the NTL variant; tp_group: the output layer's TP group.
        chunk_tokens: tokens per chunk; check_finite: raise on non-finite logits.
        pieces: number-level NTL: slices of the local sequence that are not neighbours (see
            :func:`sequence_first_terms`).

    Returns:
        :class:`~ntl_scale.PerTokenTerms` shaped ``[b, s]``.
    """
    from megatron.core import tensor_parallel

    # What ColumnParallelLinear does with its input: all-reduce (or reduce-scatter under sequence
    # parallel) of the input gradient over the TP group in the backward. Megatron's reductions need a
    # contiguous gradient, so the [s, b] -> [b, s] transpose happens before them.
    sequence_parallel = getattr(layer, "sequence_parallel", False)
    if sequence_parallel:
        hidden = tensor_parallel.gather_from_sequence_parallel_region(hidden, group=tp_group)
    hidden = hidden.transpose(0, 1).contiguous()
    if not sequence_parallel and tp_group is not None and dist.get_world_size(tp_group) > 1:
        hidden = tensor_parallel.copy_to_tensor_model_parallel_region(hidden, group=tp_group)
    b, s = labels.shape
    split = _pieces(s, pieces if options.loss == "number" else 1)
    terms = linear_ce_ntl(
        hidden.unflatten(1, split),
        weight,
        labels.unflatten(1, split),
        vocab,
        options,
        tp_group=tp_group,
        check_finite=check_finite,
        chunk_tokens=chunk_tokens,
    )
    return PerTokenTerms(*(t.reshape(b, s) for t in terms))


FUSION_IMPLS = (None, "native", "te")


def megatron_cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, tp_group: dist.ProcessGroup | None, fusion_impl: str | None = None
) -> torch.Tensor:
    """Megatron's per-token CE of vocab-sharded ``[..., V/tp]`` logits for ``[...]`` labels, as its
    ``compute_language_model_loss`` picks it: ``fusion_impl`` None is ``vocab_parallel_cross_entropy`` (over
    Megatron's own tensor-parallel group), ``native`` and ``te`` are ``--cross-entropy-loss-fusion`` with that
    ``--cross-entropy-fusion-impl`` (over ``tp_group``). Overwrites fp32 logits in place (Megatron's kernels):
    compute NTL of the same logits first."""
    if fusion_impl not in FUSION_IMPLS:
        raise ValueError(f"cross_entropy_fusion_impl must be one of {FUSION_IMPLS}, got {fusion_impl!r}")
    if fusion_impl is None:
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

        return vocab_parallel_cross_entropy(logits, labels)
    if fusion_impl == "native":
        from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy

        return fused_vocab_parallel_cross_entropy(logits, labels, tp_group)
    from megatron.core.extensions import transformer_engine as te

    if getattr(te, "te_parallel_cross_entropy", None) is None:
        raise ValueError(
            "cross_entropy_fusion_impl='te' runs Transformer Engine's CE, which is not installed: install "
            "transformer_engine, or use 'native'"
        )
    return te.te_parallel_cross_entropy(logits, labels, tp_group)
