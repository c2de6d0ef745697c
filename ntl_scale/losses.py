"""Cross entropy and Number Token Loss on full or vocab-sharded logits: the functional API and its modules.

:func:`ce_with_ntl` (CE + w NTL in one fused pass), :func:`number_token_loss` (NTL alone, on the number columns,
beside any CE), :func:`vocab_parallel_ce_ntl` (the per-token terms) and the ``nn.Module`` forms; ``impl=``
chooses the code per call. The math and the collectives are in :mod:`ntl_scale.ops.logits`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ._validation import check_reduction
from .number_vocab import NumberVocab
from .options import NTLOptions, check_option
from .reductions import CENTLOutput, combine_terms, reduce_ntl
from .terms import per_token_ce_ntl, variant_options

__all__ = ["CEWithNTL", "NumberTokenLoss", "beside_ce", "ce_with_ntl", "number_token_loss", "vocab_parallel_ce_ntl"]


def vocab_parallel_ce_ntl(
    logits_shard: torch.Tensor,
    labels: torch.Tensor,
    vocab: NumberVocab,
    *,
    loss: str = "was",
    squash_factor: float | None = None,
    reweigh: bool = False,
    huber_delta: float = 1.0,
    float_level: bool = False,
    ignore_index: int = -100,
    tp_group: dist.ProcessGroup | None = None,
    inplace: bool = False,
    check_finite: bool = False,
    chunk_tokens: int | None = None,
    vocab_start: int | None = None,
    impl: str = "auto",
    z_loss_weight: float = 0.0,
    label_smoothing: float = 0.0,
    logit_softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token cross entropy and NTL from a vocab-parallel logits shard, fused.

    Rank ``r`` of ``tp_group`` holds the columns ``[r*V/tp, (r+1)*V/tp)`` (Megatron's split), or with
    ``vocab_start`` any contiguous slice (uneven splits). One MAX and one SUM all-reduce in the forward, none in
    the backward; ``tp_group=None`` is one device, through the same code.

    Args:
        logits_shard: local logits ``[..., V/tp]`` with ``V = vocab.vocab_size`` (with ``vocab_start``:
            any contiguous slice of ``[0, V)``; another width is a ValueError); fp32, bf16, fp16 or
            fp64 (math in fp32, or fp64 for fp64 input).
        labels: global token ids ``[...]``, identical on all TP ranks; ``ignore_index`` marks
            positions without loss. For ``loss="number"`` the last dim is the sequence.
        vocab: the number-token table of the global vocabulary.
        loss: ``"was"``, ``"mse"``, ``"mae"``, ``"huber"`` or ``"number"``.
        squash_factor: NTL-WAS distance squashing (> 1), or None.
        reweigh: reweigh by the number-token probability mass (reference default; off in the paper).
        huber_delta: threshold of the Huber loss.
        float_level: number-level only: a decimal point between digits joins one number.
        ignore_index: label value to ignore.
        tp_group: the tensor-parallel group the vocabulary is split over, or None.
        inplace: reuse the logits buffer for the softmax and the gradient (fp32/fp64 logits only),
            like Megatron; the logits hold garbage afterwards.
        check_finite: raise a ValueError on NaN/Inf logits (one host sync; default off: NaN reaches the loss).
        chunk_tokens: tokens per chunk of temporaries (default: a 64 MiB fp32 budget).
        vocab_start: the global id of this shard's first column, for uneven splits; the shards of
            the group must then tile ``[0, vocab.vocab_size)``. None: ``rank * width``.
        impl: which code computes the fused statistics: ``"auto"`` (default), ``"torch"`` or
            ``"triton"`` (:attr:`NTLOptions.impl`, ``docs/kernels.md``); the same numbers to rounding.
        z_loss_weight: the z-loss ``z_loss_weight * logsumexp(z)**2`` added to CE (:attr:`NTLOptions.z_loss_weight`).
        label_smoothing: CE label smoothing over the whole vocabulary (:attr:`NTLOptions.label_smoothing`).
        logit_softcap: ``cap * tanh(z / cap)`` before everything (:attr:`NTLOptions.logit_softcap`).

    Returns:
        ``(ce, ntl, number_mask)``: per-token CE (0 where ignored), per-token NTL (0 where the mask
        is False) and the bool mask of positions that carry NTL (number labels; for number-level the
        first digit of each number). Identical on every TP rank.
    """
    options = NTLOptions(
        loss=loss, squash_factor=squash_factor, reweigh=reweigh, huber_delta=huber_delta, float_level=float_level,
        ignore_index=ignore_index, impl=impl, z_loss_weight=z_loss_weight, label_smoothing=label_smoothing,
        logit_softcap=logit_softcap,
    )  # fmt: skip
    terms = per_token_ce_ntl(
        logits_shard,
        labels,
        vocab,
        options,
        tp_group=tp_group,
        inplace=inplace,
        check_finite=check_finite,
        chunk_tokens=chunk_tokens,
        vocab_start=vocab_start,
    )
    return terms.ce, terms.ntl, terms.number_mask


def number_token_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    vocab: NumberVocab,
    *,
    loss: str = "was",
    squash_factor: float | None = None,
    reweigh: bool = False,
    huber_delta: float = 1.0,
    float_level: bool = False,
    loss_weights: torch.Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    check_finite: bool = False,
    impl: str = "auto",
    tp_group: dist.ProcessGroup | None = None,
    vocab_start: int | None = None,
    logit_softcap: float | None = None,
    lse: torch.Tensor | None = None,
) -> torch.Tensor:
    """Number Token Loss alone, on full logits, a vocab shard or a ``DTensor`` ``Shard(-1)``: beside any CE.

    Only the number-token columns are read, except with ``reweigh`` and no ``lse`` (one pass over the
    vocabulary for its log-sum-exp). ``CE + w * number_token_loss`` equals :func:`ce_with_ntl`.

    Args:
        logits: ``[..., V]``, ``V = vocab.vocab_size`` (fp32/bf16/fp16/fp64; math in fp32, fp64 for fp64 input).
        labels: token ids ``[...]``; for ``loss="number"`` the last dim is the sequence.
        vocab: the number-token table.
        loss: ``"was"`` (default), ``"mse"``, ``"mae"``, ``"huber"`` or ``"number"``.
        squash_factor: NTL-WAS distance squashing (> 1), or None.
        reweigh: reweigh by the probability mass on number tokens.
        huber_delta: threshold of the Huber loss.
        float_level: number-level only: a decimal point between digits joins one number.
        loss_weights: optional non-negative weights ``[...]`` (a loss mask).
        ignore_index: label value to ignore.
        reduction: ``"mean"`` over number positions (weighted), ``"sum"`` or ``"none"``.
        check_finite: raise on NaN/Inf logits (one host sync; default off, NaN reaches the loss).
        impl: which code computes the statistics (see :func:`vocab_parallel_ce_ntl`); only used with
            ``reweigh`` and no ``lse``, the one case that reads the whole vocabulary.
        tp_group: the tensor-parallel group of the vocab split of ``logits`` (see :func:`vocab_parallel_ce_ntl`).
        vocab_start: the shard's first global id for uneven splits.
        logit_softcap: ``cap * tanh(z / cap)`` of the number columns, where the CE beside it caps the logits.
        lse: the whole vocabulary's log-sum-exp of the (capped) logits per token ``[...]``, as a CE kernel
            returns it (or ``torch.logsumexp``): with ``reweigh``, the number columns suffice. Differentiable:
            the reweighing's gradient on the other columns flows through it (a detached one drops that part).

    Returns:
        A 0-d tensor for ``mean``/``sum``, ``[...]`` for ``none`` (0 at non-number positions).
        Exactly 0 with zero gradient when the batch holds no number label.
    """
    check_reduction(reduction)
    options = NTLOptions(
        loss=loss,
        squash_factor=squash_factor,
        reweigh=reweigh,
        huber_delta=huber_delta,
        float_level=float_level,
        ignore_index=ignore_index,
        impl=impl,
        logit_softcap=logit_softcap,
    )
    terms = per_token_ce_ntl(
        logits, labels, vocab, options, check_finite=check_finite, need_ce=False, tp_group=tp_group,
        vocab_start=vocab_start, lse=lse,
    )  # fmt: skip
    return reduce_ntl(terms, labels, loss_weights, reduction)


def beside_ce(
    logits: torch.Tensor,
    labels: torch.Tensor,
    vocab: NumberVocab,
    *,
    loss_weights: torch.Tensor | None = None,
    reduction: str = "mean",
    check_finite: bool = False,
    tp_group: dist.ProcessGroup | None = None,
    vocab_start: int | None = None,
    **variant: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """NTL alone beside a partner CE, in one autograd node: ``(logits_for_ce, ntl)``.

    Hand ``logits_for_ce`` (the same tensor; a ``DTensor`` for a ``DTensor``) to the CE and add ``w * ntl``:
    the backward adds NTL's gradient on the K number columns into the CE's logits gradient in place, so NTL
    costs ``O(T K)`` bytes beside it, not the ``[T, V]`` gradient and its sum that :func:`number_token_loss`
    beside the CE costs. NTL is computed here, before the CE, so a CE that overwrites its input (Megatron's
    ``vocab_parallel_cross_entropy``, Liger's) may run after. The CE's gradient is written in place when
    contiguous, of the logits' shape and dtype and outside a ``create_graph`` backward, else copied once
    (:func:`ntl_scale.ops.logits.writable_grad`, which names the one unsafe partner).

    ``logits``, ``labels``, ``vocab``, ``loss_weights``, ``reduction``, ``check_finite``, ``tp_group`` and
    ``vocab_start`` are as in :func:`number_token_loss`.

    Args:
        **variant: the NTL variant, fields of :class:`NTLOptions` (``loss``, ``squash_factor``, ``huber_delta``,
            ``float_level``, ``ignore_index``, ``logit_softcap``). Reweighing needs the CE's log-sum-exp, which
            exists only after the CE ran: it is refused here; use ``number_token_loss(..., lse=)`` for it.
    """
    check_reduction(reduction)
    through: list[torch.Tensor] = []
    terms = per_token_ce_ntl(
        logits, labels, vocab, variant_options(variant), check_finite=check_finite, need_ce=False, tp_group=tp_group,
        vocab_start=vocab_start, passthrough=through,
    )  # fmt: skip
    return through[0], reduce_ntl(terms, labels, loss_weights, reduction)


def ce_with_ntl(
    logits: torch.Tensor,
    labels: torch.Tensor,
    vocab: NumberVocab,
    *,
    ntl_weight: float = 0.3,
    loss: str = "was",
    squash_factor: float | None = None,
    reweigh: bool = False,
    huber_delta: float = 1.0,
    float_level: bool = False,
    loss_weights: torch.Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    tp_group: dist.ProcessGroup | None = None,
    inplace: bool = False,
    check_finite: bool = False,
    vocab_start: int | None = None,
    impl: str = "auto",
    z_loss_weight: float = 0.0,
    label_smoothing: float = 0.0,
    logit_softcap: float | None = None,
) -> CENTLOutput:
    """``CE + ntl_weight * NTL`` in one fused pass, returning both terms for logging.

    CE is averaged over non-ignored tokens and NTL over number positions, each weighted by
    ``loss_weights``. With ``tp_group`` the logits are the local vocab shard (see
    :func:`vocab_parallel_ce_ntl`).

    Args:
        logits: ``[..., V]`` or the TP shard ``[..., V/tp]``, ``V = vocab.vocab_size``.
        labels: token ids ``[...]``.
        vocab: the number-token table.
        ntl_weight: weight of the NTL term (0.3 in the paper).
        loss: the NTL variant, ``"was"``, ``"mse"``, ``"mae"``, ``"huber"`` or ``"number"``.
        squash_factor: NTL-WAS distance squashing (see :func:`number_token_loss`).
        reweigh: scale NTL by the number-token probability mass (see :func:`number_token_loss`).
        huber_delta: the Huber threshold.
        float_level: number-level NTL across a decimal point.
        loss_weights: optional non-negative weights ``[...]`` applied to both terms.
        ignore_index: label value to ignore.
        reduction: ``"mean"``, ``"sum"`` or ``"none"`` (per-token terms).
        tp_group: tensor-parallel group of the vocab split, or None.
        vocab_start: the shard's first global id for uneven splits (:func:`vocab_parallel_ce_ntl`).
        inplace: reuse the fp32 logits buffer (Megatron-style); logits are garbage afterwards.
        check_finite: raise on NaN/Inf logits (one host sync; default off, NaN reaches the loss).
        impl: ``"auto"``, ``"torch"`` or ``"triton"``: the code of the fused op (see :func:`vocab_parallel_ce_ntl`).
        z_loss_weight: the z-loss ``z_loss_weight * logsumexp(z)**2`` added to CE (:attr:`NTLOptions.z_loss_weight`);
            the ``ce`` of the output is then the CE term with it, reduced like CE.
        label_smoothing: CE label smoothing over the whole vocabulary (:attr:`NTLOptions.label_smoothing`).
        logit_softcap: ``cap * tanh(z / cap)`` before everything (:attr:`NTLOptions.logit_softcap`).

    Returns:
        A :class:`CENTLOutput` ``(loss, ce, ntl, num_tokens, num_number_tokens, number_accuracy)``.
    """
    check_reduction(reduction)
    check_option("weight", ntl_weight, "ntl_weight")
    options = NTLOptions(
        loss=loss, squash_factor=squash_factor, reweigh=reweigh, huber_delta=huber_delta, float_level=float_level,
        ignore_index=ignore_index, impl=impl, z_loss_weight=z_loss_weight, label_smoothing=label_smoothing,
        logit_softcap=logit_softcap,
    )  # fmt: skip
    terms = per_token_ce_ntl(
        logits,
        labels,
        vocab,
        options,
        tp_group=tp_group,
        inplace=inplace,
        check_finite=check_finite,
        vocab_start=vocab_start,
    )
    return combine_terms(terms, labels, vocab, options, ntl_weight, loss_weights, reduction)


class NumberTokenLoss(torch.nn.Module):
    """``nn.Module`` form of :func:`number_token_loss`.

    Args:
        vocab: the number-token table.
        **options: ``loss``, ``squash_factor``, ``reweigh``, ``huber_delta``, ``float_level``,
            ``ignore_index``, ``impl``, ``reduction``, ``check_finite`` (see :func:`number_token_loss`).
    """

    def __init__(self, vocab: NumberVocab, **options: object) -> None:
        super().__init__()
        self.vocab = vocab
        self.reduction = str(options.pop("reduction", "mean"))
        self.check_finite = bool(options.pop("check_finite", False))
        check_reduction(self.reduction)
        self.options = NTLOptions(**options)  # type: ignore[arg-type]

    def forward(
        self, logits: torch.Tensor, labels: torch.Tensor, loss_weights: torch.Tensor | None = None
    ) -> torch.Tensor:
        """See :func:`number_token_loss`."""
        terms = per_token_ce_ntl(
            logits, labels, self.vocab, self.options, check_finite=self.check_finite, need_ce=False
        )
        return reduce_ntl(terms, labels, loss_weights, self.reduction)

    def extra_repr(self) -> str:
        return f"{self.options}, reduction={self.reduction!r}, numbers={len(self.vocab)}"


class CEWithNTL(torch.nn.Module):
    """``nn.Module`` form of :func:`ce_with_ntl`.

    Args:
        vocab: the number-token table.
        ntl_weight: weight of the NTL term.
        tp_group: tensor-parallel group of the vocab split, or None.
        **options: the NTL variant (the fields of :class:`NTLOptions`, ``impl`` included) and
            ``reduction``, ``inplace``, ``check_finite``.
    """

    def __init__(
        self,
        vocab: NumberVocab,
        ntl_weight: float = 0.3,
        tp_group: dist.ProcessGroup | None = None,
        **options: object,
    ) -> None:
        super().__init__()
        check_option("weight", ntl_weight, "ntl_weight")
        self.vocab, self.ntl_weight, self.tp_group = vocab, ntl_weight, tp_group
        self.reduction = str(options.pop("reduction", "mean"))
        self.inplace = bool(options.pop("inplace", False))
        self.check_finite = bool(options.pop("check_finite", False))
        check_reduction(self.reduction)
        self.options = NTLOptions(**options)  # type: ignore[arg-type]

    def forward(
        self, logits: torch.Tensor, labels: torch.Tensor, loss_weights: torch.Tensor | None = None
    ) -> CENTLOutput:
        """See :func:`ce_with_ntl`."""
        terms = per_token_ce_ntl(
            logits,
            labels,
            self.vocab,
            self.options,
            tp_group=self.tp_group,
            inplace=self.inplace,
            check_finite=self.check_finite,
        )
        return combine_terms(terms, labels, self.vocab, self.options, self.ntl_weight, loss_weights, self.reduction)
