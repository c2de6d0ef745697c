"""Megatron (both routes): per-token CE + NTL in Megatron's layouts, from the logits or the hidden states.

:func:`sequence_first_terms` and :func:`batch_first_terms` of vocab-sharded logits, :func:`output_layer_terms`
of the output layer chunk by chunk, :func:`megatron_cross_entropy` (Megatron's own CE, for
``--ntl-ce-kernel framework``) and the reporting pieces both routes share. ``megatron.core`` is imported on first use.
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
    """Megatron's ``evaluate``: no gradient or the model in eval mode (the plain CE is reported then)."""
    return not torch.is_grad_enabled() or not getattr(model, "training", True)


def without_z_loss(
    terms: PerTokenTerms, labels: torch.Tensor, options: NTLOptions, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ce, z_sum)``, detached: ``terms.ce`` less its z-loss (``lm loss``), and the z-loss summed under ``mask``."""
    z = torch.zeros_like(terms.ce)
    if options.z_loss_weight:
        valid = labels.reshape(terms.ce.shape) != options.ignore_index
        z_all = options.z_loss_weight * terms.lse.square()
        z = torch.where(valid.to(z_all.device), z_all, torch.zeros_like(z_all))
    z = z.detach()
    return terms.ce.detach() - z, (z * mask.to(z.dtype)).sum()


def megatron_num_tokens(loss_mask: torch.Tensor) -> torch.Tensor:
    """Megatron's ``num_tokens`` of a loss mask, what the schedule divides by: the float sum truncated (0-d int)."""
    return loss_mask.reshape(-1).float().sum().to(torch.int)


def context_parallel_pieces(context_parallel_size: int, options: NTLOptions, *, whole_sequence: bool = False) -> int:
    """The ``pieces`` of :func:`ntl_scale.ntl_positions` under context parallelism, every Megatron route's rule.

    Rank ``r`` holds slices ``r`` and ``2 cp - 1 - r`` of Megatron's load-balanced split, and numbers are cut
    at every slice border: 2 for a local sequence, ``2 x cp`` for a whole one (``whole_sequence``), 1 without
    context parallelism or for the token-level variants.
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
    """The ``[pieces, seq / pieces]`` split of a local sequence."""
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

    The logits are read in the output layer's layout (labels and terms are transposed instead; number-level
    NTL takes ``[b, s]``) and fp32/fp64 logits are overwritten in place, as Megatron's CE does.
    ``pieces``: context-parallel slices no number crosses (:func:`context_parallel_pieces`).
    """
    inplace = logits.dtype in (torch.float32, torch.float64)
    if options.loss == "number":
        b, s = labels.shape
        split = _pieces(s, pieces)
        terms = per_token_ce_ntl(
            logits.transpose(0, 1).unflatten(1, split), labels.unflatten(1, split), vocab, options,
            inplace=inplace, **kwargs,
        )  # fmt: skip
        through = kwargs.get("passthrough")
        if through:  # back in the output layer's [s, b, V/tp] layout, for the CE beside NTL
            through[0] = through[0].flatten(1, 2).transpose(0, 1)
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
    """:func:`per_token_ce_ntl` of ``[b, s, V/tp]`` logits for ``[b, s]`` labels, numbers cut into ``pieces``."""
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
    """Per-token CE + NTL ``[b, s]`` of Megatron's (column-parallel) output layer on ``hidden``, no logits.

    Args:
        layer: the model's ``output_layer`` (its ``sequence_parallel`` flag decides the input path).
        hidden: final hidden states ``[s(/tp), b, H]``.
        weight: the layer's weight shard ``[V/tp, H]`` (or the shared embedding when tied).
        labels: ``[b, s]``.
        vocab: the number table.
        options: the NTL variant.
        tp_group: the output layer's TP group.
        chunk_tokens: tokens per chunk.
        check_finite: raise on non-finite logits.
        pieces: context-parallel slices no number crosses (:func:`context_parallel_pieces`).
    """
    from megatron.core import tensor_parallel

    # ColumnParallelLinear's input path; its gradient reductions need the [s, b] -> [b, s] transpose first
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
    """Megatron's per-token CE of vocab-sharded logits: ``vocab_parallel_cross_entropy`` (None) or the fused
    ``native`` / ``te`` one over ``tp_group``. It overwrites fp32 logits: compute NTL of them first."""
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
