"""CE + NTL from hidden states without the logits: checks, autocast, DTensor resolution, then the chunked op.

Under tensor parallelism ``weight`` is the vocab shard ``[V/tp, H]`` and ``hidden`` the full hidden states; the
gradient of ``hidden`` is this shard's part, summed by the caller's layer (as ``ColumnParallelLinear`` does). A
``DTensor`` weight (``Shard(0)`` or replicated) needs a replicated ``DTensor`` hidden on its mesh.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ._validation import check_float_level, check_inputs, check_reduction, check_weights
from .number_vocab import NumberVocab
from .ops.chunked_linear import ChunkedLinearCENTL
from .ops.logits import use_triton
from .ops.shard_math import compute_dtype
from .ops.shards import group_rank, group_size, is_dtensor, resolve_vocab_shard
from .options import NTLOptions, check_option
from .reductions import CENTLOutput, combine_terms, reduce_ntl
from .terms import (
    PerTokenTerms,
    check_lse,
    check_passthrough,
    check_plain_labels,
    like,
    shard_inputs,
    shard_start,
    terms_from_stats,
    variant_options,
)

__all__ = ["linear_beside_ce", "linear_ce_ntl", "linear_ce_with_ntl", "linear_number_token_loss"]


def _autocast_dtype(hidden: object, weight: object) -> torch.dtype | None:
    """The autocast dtype when autocast is on for the inputs' device (None otherwise, or for non-tensors,
    which the checks refuse with their own message)."""
    if not isinstance(hidden, torch.Tensor) or not isinstance(weight, torch.Tensor):
        return None
    device = hidden.device.type
    if device == "meta":  # shape-only tensors (cost counts): no autocast state
        return None
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None


def _amp_cast(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The cast autocast applies to a matmul input: fp32/fp16/bf16 to ``dtype``; fp64 is left as it is."""
    return tensor.to(dtype) if tensor.dtype in (torch.float32, torch.float16, torch.bfloat16) else tensor


def _check_linear(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> None:
    for name, value in (("hidden", hidden), ("weight", weight)):
        if not isinstance(value, torch.Tensor) or not torch.is_floating_point(value):
            kind = value.dtype if isinstance(value, torch.Tensor) else type(value).__name__
            raise TypeError(f"{name} must be a floating-point tensor (fp32/bf16/fp16/fp64), got {kind}")
    if weight.dim() != 2:
        raise ValueError(
            "weight must be the output layer's [vocab, hidden] matrix (or its TP shard), "
            f"got shape {tuple(weight.shape)}"
        )
    if hidden.dim() < 1 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"hidden's last dim {tuple(hidden.shape)[-1:]} must equal the weight's hidden size {weight.shape[1]} "
            f"(weight shape {tuple(weight.shape)}: [vocab, hidden], as nn.Linear stores it)"
        )
    if hidden.dtype != weight.dtype:
        raise TypeError(f"hidden ({hidden.dtype}) and weight ({weight.dtype}) must have the same dtype")
    if hidden.device != weight.device:
        raise ValueError(f"hidden is on {hidden.device} and weight on {weight.device}; put both on one device")


def _refuse_ambiguous_split(hidden: Any, weight: Any) -> None:
    """Refuses a row-split DTensor ``weight`` beside a plain ``hidden`` (TP and FSDP2 look alike there)."""
    if is_dtensor(hidden):
        return
    from torch.distributed.tensor import Shard

    placements = tuple(weight.placements)
    if not any(isinstance(p, Shard) and p.dim % max(weight.dim(), 1) == 0 for p in placements):
        return  # no row split (replicated: the whole weight; other placements: dtensor_vocab_shard's errors)
    mesh = weight.device_mesh
    raise ValueError(
        f"weight is a DTensor with placements {placements} on {mesh} but hidden is a plain tensor, which does not "
        "say whether the ranks of that mesh hold the same tokens (a vocabulary-parallel output layer under tensor "
        "parallelism) or their own (an FSDP2 fully_shard parameter used outside its module's forward, sharded over "
        "data-parallel ranks: taking it for a vocabulary split would mix the ranks' tokens). Tensor parallelism: "
        "pass hidden as a DTensor replicated on the weight's mesh (DTensor.from_local(hidden, weight.device_mesh, "
        "[Replicate()] * weight.device_mesh.ndim)), or weight.to_local() with tp_group and vocab_start. FSDP2: call "
        "the loss inside the sharded module's forward, where FSDP2 has gathered the weight "
        "(ntl_scale.integrations.hf.ChunkedLossCausalLM does), or gather it with its gradient reduced over the "
        "data-parallel ranks as FSDP2 reduces it: weight.redistribute(placements=[Replicate()] * "
        "weight.device_mesh.ndim).to_local(grad_placements=[Partial('avg')] * weight.device_mesh.ndim)"
    )


def _local_hidden(hidden: Any, weight: Any) -> torch.Tensor:
    """``hidden`` for a DTensor ``weight``: a plain tensor as it is, a replicated DTensor as its local tensor
    whose gradient is ``Partial`` where the weight is sharded (each shard gives its part of the sum)."""
    if not is_dtensor(hidden):
        return hidden
    from torch.distributed.tensor import Partial, Replicate

    placements = tuple(hidden.placements)
    if hidden.device_mesh != weight.device_mesh or any(not isinstance(p, Replicate) for p in placements):
        raise ValueError(
            f"hidden is a DTensor with placements {placements} on {hidden.device_mesh}; with a DTensor weight it "
            f"must be replicated on the weight's mesh {weight.device_mesh} (hidden.redistribute(placements="
            "[Replicate()])); a plain hidden goes only with a replicated weight or weight.to_local() and tp_group"
        )
    grad = [Replicate() if isinstance(p, Replicate) else Partial() for p in weight.placements]
    return hidden.to_local(grad_placements=grad)


def linear_ce_ntl(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    vocab: NumberVocab,
    options: NTLOptions | None = None,
    *,
    tp_group: dist.ProcessGroup | None = None,
    check_finite: bool = False,
    chunk_tokens: int | None = None,
    need_ce: bool = True,
    token_weights: torch.Tensor | None = None,
    vocab_start: int | None = None,
    proportional_grad: bool = False,
    lse: torch.Tensor | None = None,
    passthrough: list[torch.Tensor] | None = None,
) -> PerTokenTerms:
    """Per-token CE and NTL of ``hidden @ weight.T`` without materialising those logits.

    The same terms as :func:`ntl_scale.per_token_ce_ntl` on the logits ``hidden @ weight.T`` (every
    variant of :class:`NTLOptions`), differentiable w.r.t. ``hidden`` and ``weight``.

    Args:
        hidden: final hidden states ``[..., H]`` (after the final norm), fp32/bf16/fp16/fp64.
        weight: the output layer's weight ``[V, H]`` (``lm_head.weight``), or its vocab shard
            ``[V/tp, H]`` with ``tp_group``. A bias-free output layer, as in GPT/Llama/Granite.
        labels: token ids ``[...]`` (``options.ignore_index`` to skip).
        vocab: the number-token table.
        options: the NTL variant (default: NTL-WAS); ``options.impl`` picks the code of each chunk's
            statistics and softmax (``auto``, ``torch`` or ``triton``; ``docs/kernels.md``).
        tp_group: the tensor-parallel group over which the vocabulary is split; None = one device.
            The gradient of ``hidden`` is then this shard's part (see the module docs).
        check_finite: raise when the logits hold NaN/Inf (one host sync; default off, NaN reaches the loss).
        chunk_tokens: tokens per chunk (default: :func:`ntl_scale.ops.chunked_linear.choose_chunk_tokens`).
        need_ce: False: NTL alone, from ``z_N = h W_N^T`` only (``[T, K]``), unless reweighing needs the
            vocabulary's log-sum-exp and ``lse`` is not given (then one pass over the vocabulary).
        token_weights: the non-negative weights ``[...]`` the caller's reduction applies to CE (e.g.
            the loss mask); with them the weight gradient is built in the forward. Default: 1 on
            every non-ignored label. Other reductions are exact too, at one more pass of matmuls.
        vocab_start: the global id of this weight shard's first row, for uneven vocabulary splits
            (see :func:`ntl_scale.vocab_parallel_ce_ntl`); None: ``rank * rows``.
        proportional_grad: the caller guarantees that the gradient reaching CE is one scale times
            ``token_weights`` and that the number-token mass gets none (a sum or mean of CE with
            those weights, no reweighing), as :func:`ntl_scale.linear_ce_with_ntl` does. The backward
            then reuses the forward's weight gradient without checking (no host sync). False: it
            checks, with one host read, and recomputes when the gradient is not proportional.
        lse: with ``need_ce=False`` and reweighing: the whole vocabulary's per-token log-sum-exp ``[...]`` of the
            (capped) logits, from the CE beside it (see :func:`ntl_scale.per_token_ce_ntl`).
        passthrough: NTL alone without reweighing: a list that receives ``hidden, weight`` for the
            partner CE, whose gradients NTL's join in place (:func:`ntl_scale.linear_beside_ce`).

    Returns:
        :class:`ntl_scale.PerTokenTerms` shaped like ``labels``.
    """
    options = NTLOptions() if options is None else options
    amp = _autocast_dtype(hidden, weight)
    if amp is not None:
        # as an autocast linear layer: differentiable casts to the autocast dtype, then the half-precision path
        with torch.autocast(hidden.device.type, enabled=False):
            return linear_ce_ntl(
                _amp_cast(hidden, amp), _amp_cast(weight, amp), labels, vocab, options, tp_group=tp_group,
                check_finite=check_finite, chunk_tokens=chunk_tokens, need_ce=need_ce, token_weights=token_weights,
                vocab_start=vocab_start, proportional_grad=proportional_grad, lse=lse, passthrough=passthrough,
            )  # fmt: skip
    check_passthrough(passthrough is not None, need_ce, options)
    original = (hidden, weight)
    if is_dtensor(weight):
        if not isinstance(vocab, NumberVocab):
            raise TypeError(f"vocab must be an ntl_scale.NumberVocab, got {type(vocab).__name__}")
        _refuse_ambiguous_split(hidden, weight)
        hidden = _local_hidden(hidden, weight)
        weight, tp_group, vocab_start = resolve_vocab_shard(
            weight, vocab.vocab_size, tp_group, vocab_start, dim=0, name="weight"
        )
    elif is_dtensor(hidden):
        raise ValueError(
            "hidden is a DTensor but weight is a plain tensor; pass both as DTensors (weight Shard(0) or "
            "Replicate, hidden Replicate) or both as local tensors (hidden.to_local(), with tp_group)"
        )
    check_plain_labels(labels)
    _check_linear(hidden, weight, labels)
    tp_size, tp_rank = group_size(tp_group), group_rank(tp_group)
    # the checks of the logits path, on a shape-only (meta) stand-in for the logits
    stand_in = torch.empty(*hidden.shape[:-1], weight.shape[0], dtype=hidden.dtype, device="meta")
    check_inputs(stand_in, labels, vocab, options, tp_size, vocab_start, source="the output weight's first dimension")
    check_float_level(vocab, options)
    check_option("chunk_tokens", chunk_tokens)
    if lse is not None:  # read only by reweighing (the number mass)
        lse = check_lse(lse, labels, need_ce) if options.reweigh or need_ce else None
    need_full = need_ce or (options.reweigh and lse is None)
    kernels = use_triton(options.impl, hidden, options.ce_features)
    shape, width = labels.shape, weight.shape[0]
    dtype = compute_dtype(hidden.dtype)
    flat_labels = labels.reshape(-1)
    inputs, row = shard_inputs(flat_labels, vocab, options, shard_start(vocab_start, tp_rank, width), width, dtype)
    weights = check_weights(token_weights, labels, dtype)
    weights = inputs.valid.to(dtype) if weights is None else weights.reshape(-1) * inputs.valid
    *through, ce, expect, mass, hit, lse_out = ChunkedLinearCENTL.apply(
        hidden.reshape(-1, hidden.shape[-1]),
        weight,
        inputs,
        need_full,
        check_finite,
        tp_group,
        chunk_tokens,
        weights,
        proportional_grad,
        # what the backward will ask for; inside the Function's forward grad mode is always off
        (torch.is_grad_enabled() and hidden.requires_grad, torch.is_grad_enabled() and weight.requires_grad),
        kernels,
        options.z_loss_weight,
        options.logit_softcap,
        lse,
        passthrough is not None,
    )
    if passthrough is not None:
        # a replicated DTensor hidden goes to the partner as it is (its gradient comes back Partial, which a
        # re-wrapped Replicate would all-reduce): NTL's [T, H] part is then summed by autograd, O(T H) as before
        h_ce = original[0] if is_dtensor(original[0]) else through[0].view(hidden.shape)
        passthrough.extend((h_ce, like(through[1], original[1])))
    return terms_from_stats(ce, expect, mass, hit, inputs, row, shape, vocab, options, lse_out, need_full)


def linear_ce_with_ntl(
    hidden: torch.Tensor,
    weight: torch.Tensor,
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
    check_finite: bool = False,
    chunk_tokens: int | None = None,
    impl: str = "auto",
    z_loss_weight: float = 0.0,
    label_smoothing: float = 0.0,
    logit_softcap: float | None = None,
    vocab_start: int | None = None,
) -> CENTLOutput:
    """:func:`ntl_scale.ce_with_ntl` from hidden states and the output weight, without the logits.

    ``hidden [..., H]`` and ``weight [V, H]`` (or its TP shard) replace ``logits``; every other
    argument means what it means there (``impl``: ``"auto"``, ``"torch"`` or ``"triton"``, the code of
    each chunk's statistics and softmax; ``z_loss_weight``, ``label_smoothing``, ``logit_softcap``: the CE
    features of :class:`NTLOptions`). Returns a :class:`ntl_scale.CENTLOutput`.
    """
    check_reduction(reduction)
    check_option("weight", ntl_weight, "ntl_weight")
    options = NTLOptions(
        loss=loss, squash_factor=squash_factor, reweigh=reweigh, huber_delta=huber_delta, float_level=float_level,
        ignore_index=ignore_index, impl=impl, z_loss_weight=z_loss_weight, label_smoothing=label_smoothing,
        logit_softcap=logit_softcap,
    )  # fmt: skip
    terms = linear_ce_ntl(
        hidden,
        weight,
        labels,
        vocab,
        options,
        tp_group=tp_group,
        check_finite=check_finite,
        chunk_tokens=chunk_tokens,
        token_weights=loss_weights,
        vocab_start=vocab_start,
        proportional_grad=reduction in ("mean", "sum") and not reweigh,
    )
    return combine_terms(terms, labels, vocab, options, ntl_weight, loss_weights, reduction)


def linear_number_token_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
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
    tp_group: dist.ProcessGroup | None = None,
    vocab_start: int | None = None,
    logit_softcap: float | None = None,
    lse: torch.Tensor | None = None,
    chunk_tokens: int | None = None,
) -> torch.Tensor:
    """:func:`ntl_scale.number_token_loss` from hidden states, reading only the number rows of the weight.

    NTL alone, beside a CE computed elsewhere: ``z_N = h W_N^T`` is a ``T x K x H`` product; the gradients
    reach ``hidden`` and the weight's number rows only. ``weight`` as in :func:`linear_ce_ntl` (plain, a
    vocabulary shard with ``tp_group``/``vocab_start``, or a ``DTensor`` ``Shard(0)``). ``reweigh`` needs
    ``lse``, the whole vocabulary's per-token log-sum-exp of the (capped) logits from that CE; the other
    arguments mean what they mean in :func:`ntl_scale.number_token_loss`.

    Raises:
        ValueError: ``reweigh=True`` without ``lse``.
    """
    check_reduction(reduction)
    if reweigh and lse is None:
        raise ValueError(
            "reweigh=True needs the whole vocabulary's log-sum-exp, which the number rows alone do not give: pass "
            "lse= (per token, as the CE kernel beside it returns it), or use ntl_scale.linear_ce_ntl (CE and NTL "
            "together, one pass over the vocabulary)"
        )
    options = NTLOptions(
        loss=loss, squash_factor=squash_factor, reweigh=reweigh, huber_delta=huber_delta, float_level=float_level,
        ignore_index=ignore_index, logit_softcap=logit_softcap,
    )  # fmt: skip
    terms = linear_ce_ntl(
        hidden, weight, labels, vocab, options, tp_group=tp_group, check_finite=check_finite,
        chunk_tokens=chunk_tokens, need_ce=False, vocab_start=vocab_start, lse=lse,
    )  # fmt: skip
    return reduce_ntl(terms, labels, loss_weights, reduction)


def linear_beside_ce(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    vocab: NumberVocab,
    *,
    loss_weights: torch.Tensor | None = None,
    reduction: str = "mean",
    check_finite: bool = False,
    tp_group: dist.ProcessGroup | None = None,
    vocab_start: int | None = None,
    chunk_tokens: int | None = None,
    **variant: Any,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`ntl_scale.beside_ce` from hidden states: ``(hidden_for_ce, weight_for_ce, ntl)``, one autograd node.

    Hand ``hidden_for_ce`` and ``weight_for_ce`` (the same tensors; DTensors for DTensors) to the fused linear
    CE and add ``w * ntl``: the backward adds NTL's ``[T, H]`` hidden gradient and its K weight rows into that
    CE's gradients in place, no ``[V, H]`` fill or sum. The arguments are those of
    :func:`linear_number_token_loss`; reweighing is refused (see :func:`ntl_scale.beside_ce`).
    """
    check_reduction(reduction)
    through: list[torch.Tensor] = []
    terms = linear_ce_ntl(
        hidden, weight, labels, vocab, variant_options(variant), tp_group=tp_group, check_finite=check_finite,
        chunk_tokens=chunk_tokens, need_ce=False, vocab_start=vocab_start, passthrough=through,
    )  # fmt: skip
    return through[0], through[1], reduce_ntl(terms, labels, loss_weights, reduction)
