"""Per-token CE and NTL from the fused op's per-token statistics (``ce``, ``expect``, ``mass``; docs/math.md).

Point losses, reweighing and number-level assembly act on ``[T]`` vectors. :func:`ntl_positions` defines
the positions that carry NTL (what every mean of NTL divides by).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ._validation import check_float_level, check_inputs, check_width
from .number_vocab import NumberVocab, check_number_level_table
from .ops.logits import fused_shard_stats
from .ops.shard_math import ShardInputs, compute_dtype
from .ops.shards import group_rank, group_size, is_dtensor, resolve_vocab_shard
from .options import NTLOptions, check_option

__all__ = [
    "MAX_NUMBER_LENGTH",
    "SMAPE_EPS",
    "NumberPrediction",
    "PerTokenTerms",
    "assemble_numbers",
    "max_loss",
    "ntl_counts",
    "ntl_positions",
    "number_starts",
    "per_token_ce_ntl",
    "point_loss",
    "predict_numbers",
    "shard_inputs",
    "shard_start",
    "symmetric_mape",
    "terms_from_stats",
]

# Reweighing charges mass outside the number tokens this factor of the largest loss (as the reference).
_REWEIGH_MARGIN = 1.01
# Number-level NTL: digits beyond this many in one run share the largest exponent, as in the reference.
MAX_NUMBER_LENGTH = 20
# The reference adds float32's machine epsilon to the sMAPE denominator regardless of dtype.
SMAPE_EPS = float(torch.finfo(torch.float32).eps)


class PerTokenTerms(NamedTuple):
    """Per-token outputs of :func:`per_token_ce_ntl`, each shaped like the labels.

    Attributes:
        ce: the CE term (0 where ignored), label-smoothed, plus the z-loss ``z_loss_weight * lse**2``; 0 with
            ``need_ce=False``.
        ntl: NTL (0 where ``number_mask`` is False).
        number_mask: positions that carry NTL.
        hit: the label is the arg-max over the whole vocabulary (False when CE was not computed).
        lse: the log-sum-exp of the (soft-capped) logits over the whole vocabulary at every position (0 when
            CE was not computed); differentiable.
        number_choice_hit: with ``need_ce=False`` only: the label is the arg-max among the number columns, on
            ``number_mask``. Not number accuracy: a token outside the numbers may have the larger logit.
    """

    ce: torch.Tensor
    ntl: torch.Tensor
    number_mask: torch.Tensor
    hit: torch.Tensor
    lse: torch.Tensor
    number_choice_hit: torch.Tensor


def per_token_ce_ntl(
    logits_shard: torch.Tensor,
    labels: torch.Tensor,
    vocab: NumberVocab,
    options: NTLOptions | None = None,
    *,
    tp_group: dist.ProcessGroup | None = None,
    inplace: bool = False,
    check_finite: bool = False,
    chunk_tokens: int | None = None,
    need_ce: bool = True,
    vocab_start: int | None = None,
    lse: torch.Tensor | None = None,
    passthrough: list[torch.Tensor] | None = None,
) -> PerTokenTerms:
    """:func:`ntl_scale.vocab_parallel_ce_ntl` with the variant as one :class:`NTLOptions`, plus the arg-max hit.

    ``need_ce=False``: NTL alone, beside a CE computed elsewhere (``ce`` and ``hit`` are 0,
    ``number_choice_hit`` is filled); only the number columns are read, unless reweighing needs the whole
    vocabulary's log-sum-exp and ``lse`` (of the soft-capped logits, as the CE kernel returns it) is not given.
    A differentiable ``lse`` carries the reweighing's gradient on the other columns. ``passthrough`` (NTL alone,
    no reweighing): a list that receives the logits for the partner CE, whose gradient NTL's columns join in
    place (:func:`ntl_scale.ops.logits.writable_grad`). ``logits_shard`` may be a ``DTensor`` split on the
    vocabulary (``Shard(-1)``) or replicated; its group and offset replace ``tp_group`` and ``vocab_start``.
    The labels are a plain tensor, the same on every rank of that group.
    """
    options = NTLOptions() if options is None else options
    if inplace and is_dtensor(logits_shard):
        raise ValueError(
            "inplace=True overwrites the logits buffer, which a DTensor's local view cannot give up to autograd; "
            "use inplace=False, or pass logits.to_local() with tp_group and vocab_start (the plain-shard route)"
        )
    check_passthrough(passthrough is not None, need_ce, options)
    original = logits_shard
    if isinstance(vocab, NumberVocab):
        logits_shard, tp_group, vocab_start = resolve_vocab_shard(logits_shard, vocab.vocab_size, tp_group, vocab_start)
    check_plain_labels(labels)
    tp_size, tp_rank = group_size(tp_group), group_rank(tp_group)
    check_inputs(logits_shard, labels, vocab, options, tp_size, vocab_start)
    check_option("chunk_tokens", chunk_tokens)
    if inplace and logits_shard.dtype not in (torch.float32, torch.float64):
        raise ValueError(
            f"inplace=True reuses the logits buffer for fp32 math and needs float32/float64 logits, "
            f"got {logits_shard.dtype}; use inplace=False for half-precision logits"
        )
    check_float_level(vocab, options)
    if lse is not None:  # read only by reweighing (the number mass)
        lse = check_lse(lse, labels, need_ce) if options.reweigh or need_ce else None
    shape = labels.shape
    width = logits_shard.shape[-1]
    dtype = compute_dtype(logits_shard.dtype)
    flat_labels = labels.reshape(-1)
    inputs, row = shard_inputs(flat_labels, vocab, options, shard_start(vocab_start, tp_rank, width), width, dtype)
    need_full = need_ce or (options.reweigh and lse is None)
    # NTL alone takes the logits as they are: its gradient comes back in their shape, not through a view
    flat = logits_shard.reshape(-1, width) if need_full else logits_shard
    if options.logit_softcap is not None and need_full:
        # before everything (CE, z-loss and NTL see the capped logits); a new tensor, the caller's is kept
        flat, inplace = soft_cap(flat, options.logit_softcap), False
    *through, ce, expect, mass, hit, lse_out = fused_shard_stats(
        flat,
        inputs,
        need_full=need_full,
        inplace=inplace,
        check_finite=check_finite,
        tp_group=tp_group,
        chunk_tokens=chunk_tokens,
        impl=options.impl,
        features=options.ce_features,
        cap=None if need_full else options.logit_softcap,
        lse=lse,
        passthrough=passthrough is not None,
    )
    if passthrough is not None:
        passthrough.append(like(through[0], original))
    return terms_from_stats(ce, expect, mass, hit, inputs, row, shape, vocab, options, lse_out, need_full)


def check_passthrough(passthrough: bool, need_ce: bool, options: NTLOptions) -> None:
    """Refuses the passthrough form where it cannot serve: with CE, or with reweighing."""
    if passthrough and (need_ce or options.reweigh):
        raise ValueError(
            "the passthrough form (beside_ce / linear_beside_ce) is NTL alone without reweighing: reweighing reads "
            "the partner CE's log-sum-exp, which exists only after that CE ran; pass reweigh=False, or run the CE "
            "first and add number_token_loss(..., reweigh=True, lse=) (linear_number_token_loss(..., lse=))"
        )


NTL_VARIANT = ("loss", "squash_factor", "reweigh", "huber_delta", "float_level", "ignore_index", "logit_softcap")


def variant_options(variant: dict[str, object]) -> NTLOptions:
    """The :class:`NTLOptions` of an NTL-alone call's ``**variant``; CE and run options are refused."""
    other = sorted(set(variant) - set(NTL_VARIANT))
    if other:
        raise ValueError(
            f"{other} are not options of NTL alone (the partner CE computes CE and never sees them); expected only "
            f"{list(NTL_VARIANT)}: set them on the partner CE, or use ce_with_ntl / linear_ce_with_ntl"
        )
    return NTLOptions(**variant)  # type: ignore[arg-type]


def like(local: torch.Tensor, original: torch.Tensor) -> torch.Tensor:
    """``local`` as ``original`` was: the same ``DTensor`` placement (differentiable), or as is."""
    if not is_dtensor(original):
        return local
    from torch.distributed.tensor import DTensor

    assert isinstance(original, DTensor)  # is_dtensor
    return DTensor.from_local(
        local, original.device_mesh, original.placements, run_check=False, shape=original.shape,
        stride=original.stride(),
    )  # fmt: skip


def check_lse(lse: object, labels: torch.Tensor, need_ce: bool) -> torch.Tensor:
    """The caller's per-token log-sum-exp for NTL alone, flattened; a ValueError when it cannot serve."""
    if need_ce:
        raise ValueError("lse= is for NTL alone (need_ce=False), where the CE kernel beside it returns it; drop lse=")
    if is_dtensor(lse):
        raise ValueError("lse is a DTensor; pass lse.full_tensor(), the per-token log-sum-exp as a plain tensor")
    if not isinstance(lse, torch.Tensor) or not torch.is_floating_point(lse) or lse.shape != labels.shape:
        shape = tuple(lse.shape) if isinstance(lse, torch.Tensor) else type(lse).__name__
        raise ValueError(
            f"lse must be a floating-point tensor shaped like the labels {tuple(labels.shape)}, got {shape}: the "
            "log-sum-exp of every token's (soft-capped) logits over the whole vocabulary (torch.logsumexp(logits, "
            "-1), or the lse a CE kernel returns)"
        )
    return lse.reshape(-1)


def soft_cap(logits: torch.Tensor, cap: float) -> torch.Tensor:
    """``cap * tanh(z / cap)`` (Gemma 2's final-logit soft-capping), in the compute dtype; differentiable."""
    z = logits.to(compute_dtype(logits.dtype))
    return torch.tanh(z / cap) * cap


def check_plain_labels(labels: object) -> None:
    """Refuses DTensor labels: the losses take the labels as a plain tensor, the same on every rank."""
    if is_dtensor(labels):
        raise ValueError(
            f"labels is a DTensor (placements {tuple(getattr(labels, 'placements', ()))}); the losses take the "
            "labels as a plain tensor, the same on every rank of the vocabulary split: pass labels.full_tensor() (or "
            "labels.to_local() if replicated)"
        )


def point_loss(options: NTLOptions, pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Element-wise loss between an expected value and its target (``options.loss``: mse, mae or huber)."""
    if options.loss == "mse":
        return (pred - target).square()
    if options.loss == "mae":
        return (pred - target).abs()
    return F.huber_loss(pred, target, reduction="none", delta=float(options.huber_delta))


def max_loss(options: NTLOptions, vocab: NumberVocab) -> torch.Tensor:
    """The largest per-token loss, as a 0-dim float64 CPU tensor (no host read: no graph break)."""
    if options.loss == "number":
        return torch.ones((), dtype=torch.float64)
    if options.loss == "was":
        return vocab.distance_table(options.squash_factor).max().double()
    low, high = vocab.values.min(), vocab.values.max()
    return torch.maximum(point_loss(options, low, high).abs(), point_loss(options, high, low).abs()).double()


def terms_from_stats(
    ce: torch.Tensor,
    expect: torch.Tensor,
    mass: torch.Tensor,
    hit: torch.Tensor,
    inputs: ShardInputs,
    row: torch.Tensor,
    shape: torch.Size,
    vocab: NumberVocab,
    options: NTLOptions,
    lse: torch.Tensor | None = None,
    need_full: bool = True,
) -> PerTokenTerms:
    """Per-token CE (plus the z-loss ``z_loss_weight * lse**2``) and the NTL variant from the fused statistics.

    Without ``need_full`` the op's ``hit`` is the arg-max among the number columns (``number_choice_hit``).
    """
    loss, reweigh, dtype = options.loss, options.reweigh, ce.dtype
    is_number = row >= 0
    zero = torch.zeros((), dtype=dtype, device=ce.device)
    if loss == "number":
        check_number_level_table(vocab)
        sequences = shape[-1] if len(shape) else 1
        digits = is_number.view(-1, sequences)
        dots = None
        if options.float_level:
            dots = (inputs.valid & (inputs.labels == vocab.decimal_point_id)).view(-1, sequences)
        # Target digits in float64: the assembled target numbers are exact whatever the logits' dtype.
        targets = vocab.values.to(device=ce.device, dtype=torch.float64)[row.clamp_min(0)]
        pred, target, starts = assemble_numbers(expect.view(-1, sequences), targets.view(-1, sequences), digits, dots)
        mask = starts.reshape(-1)
        ntl = symmetric_mape(pred.reshape(-1), target.reshape(-1)).to(dtype)
    elif loss == "was":
        mask, ntl = is_number, expect
    else:
        mask = is_number
        targets = vocab.values.to(device=ce.device, dtype=dtype)[row.clamp_min(0)]
        ntl = point_loss(options, expect, targets)
    if reweigh:
        penalty = _REWEIGH_MARGIN * max_loss(options, vocab)
        ntl = ntl * mass + penalty * (1 - mass)
    ntl = torch.where(mask, ntl, zero)
    if options.z_loss_weight:
        if lse is None:
            raise ValueError("internal: z_loss_weight needs the fused op's per-token log-sum-exp")
        ce = ce + torch.where(inputs.valid, options.z_loss_weight * lse.square(), zero)
    lse = torch.zeros_like(ce) if lse is None else lse
    choice = hit & mask if not need_full else torch.zeros_like(mask)
    hit = hit if need_full else torch.zeros_like(mask)
    return PerTokenTerms(
        ce.view(shape), ntl.view(shape), mask.view(shape), hit.view(shape), lse.view(shape), choice.view(shape)
    )


def shard_start(vocab_start: int | None, tp_rank: int, width: int) -> int:
    """The global id of a shard's first column: ``vocab_start``, or Megatron's even split ``rank * width``."""
    return tp_rank * width if vocab_start is None else vocab_start


def shard_inputs(
    labels: torch.Tensor,
    vocab: NumberVocab,
    options: NTLOptions,
    start: int,
    width: int,
    dtype: torch.dtype,
) -> tuple[ShardInputs, torch.Tensor]:
    """Resolves labels and the table to this shard; returns the inputs and the label table index."""
    device = labels.device
    valid = labels != options.ignore_index
    safe_labels = torch.where(valid, labels, torch.zeros_like(labels))
    row = torch.where(valid, vocab.index_of_id(device)[safe_labels], -1)
    table_index = vocab.shard_tensor(start, start + width, "table_index", device)
    local_ids = vocab.shard_tensor(start, start + width, "local_ids", device)
    if options.loss == "was":
        distances = vocab.distance_table_on(options.squash_factor, device, dtype)[:, table_index]
        a_table = torch.where((row >= 0).unsqueeze(1), distances[row.clamp_min(0)], 0)
    else:
        values = vocab.shard_tensor(start, start + width, "values", device).to(dtype)
        a_table = values.unsqueeze(0).expand(labels.numel(), -1)
    return ShardInputs(safe_labels, valid, local_ids, a_table, start, options.label_smoothing), row


def ntl_positions(
    labels: torch.Tensor, vocab: NumberVocab, options: NTLOptions | None = None, *, pieces: int = 1
) -> torch.Tensor:
    """The label positions that carry an NTL term: what NTL's mean divides by.

    Token-level variants: every non-ignored number-token label. ``loss="number"``: the first digit of each
    maximal run of digit labels along the last axis (``float_level``: a decimal point between two digits
    joins them). :func:`per_token_ce_ntl` returns the same mask as ``number_mask``.

    Args:
        labels: token ids ``[...]`` (for ``loss="number"`` the last axis is the sequence).
        options: the NTL variant (default NTL-WAS) and its ``ignore_index``.
        pieces: ``loss="number"`` only: cut numbers at the borders of this many equal slices of the
            sequence, as context parallelism does (Megatron's load-balanced split: ``2 x`` the CP size).

    Returns bool ``[...]`` on the labels' device, without a host sync.
    """
    options = NTLOptions() if options is None else options
    valid = labels != options.ignore_index
    is_number = valid & vocab.number_mask(labels)
    if options.loss != "number":
        return is_number
    check_number_level_table(vocab)
    dots = None
    if options.float_level:
        check_float_level(vocab, options)
        dots = valid & (labels == vocab.decimal_point_id)
    if labels.dim() == 0:
        return is_number
    return number_starts(is_number, dots, pieces=pieces)


def ntl_counts(
    labels: torch.Tensor,
    vocab: NumberVocab,
    options: NTLOptions | None = None,
    *,
    loss_mask: torch.Tensor | None = None,
    pieces: int = 1,
) -> torch.Tensor:
    """``[tokens, NTL positions]`` of some labels, float64 ``[2]`` on their device, weighted by ``loss_mask``.

    Summed over a step's micro-batches and ranks they are the denominators of global normalisation.
    """
    options = NTLOptions() if options is None else options
    positions = ntl_positions(labels, vocab, options, pieces=pieces).to(torch.float64)
    if loss_mask is None:
        weight = (labels != options.ignore_index).to(torch.float64)
    else:
        weight = loss_mask.to(device=labels.device, dtype=torch.float64)
    return torch.stack([weight.sum(), (weight * positions).sum()])


class NumberPrediction(NamedTuple):
    """Per-position outputs of :func:`predict_numbers`, each shaped like the logits without the vocab dim.

    Attributes:
        value: the expected number value ``sum_k p_k v_k`` under the number-token distribution.
        mass: the probability mass the full softmax puts on number tokens.
    """

    value: torch.Tensor
    mass: torch.Tensor


def predict_numbers(logits: torch.Tensor, vocab: NumberVocab) -> NumberPrediction:
    """The expected number value and the number-token mass at every position (as ``ntloss``'s ``predict_numbers``).

    Value: the softmax over the number-token columns dotted with their values; mass: the full softmax's sum
    over those columns. Computed in fp32 (fp64 for fp64 logits).

    ``logits``: ``[..., V]`` full-vocabulary logits (gather TP shards first); returns ``(value, mass)``, each ``[...]``.
    """
    if not isinstance(vocab, NumberVocab):
        raise TypeError(f"vocab must be an ntl_scale.NumberVocab, got {type(vocab).__name__}")
    if not isinstance(logits, torch.Tensor) or not torch.is_floating_point(logits) or logits.dim() < 1:
        raise TypeError("logits must be a floating-point tensor [..., vocab]")
    check_width(logits.shape[-1], vocab, 1, None, "the logits' last dimension")  # full logits: gather TP shards
    z = logits.to(compute_dtype(logits.dtype))
    ids = vocab.ids.to(z.device)
    number_logits = z.index_select(-1, ids)
    value = (torch.softmax(number_logits, dim=-1) * vocab.values.to(z.device, z.dtype)).sum(-1)
    mass = torch.exp(torch.logsumexp(number_logits, dim=-1) - torch.logsumexp(z, dim=-1))
    return NumberPrediction(value, mass)


# -- number-level NTL: whole numbers from runs of consecutive digit positions ---------------------------
# Every maximal run of digit labels is one number, ``sum_i digit_i * 10**e_i`` with ``e_i`` the digits after
# position ``i``, written at the run's first digit and compared by symmetric MAPE. Assembled in float64: a
# target of up to 15 digits is exact. Only per-token ``yhat`` enters, so TP needs nothing more; under CP a
# number split across a slice border is two numbers (docs/math.md).


def _shift_right(x: torch.Tensor) -> torch.Tensor:
    """``x[..., t-1]`` at position ``t`` (False/0 at t=0)."""
    return F.pad(x[..., :-1], (1, 0))


def _shift_left(x: torch.Tensor) -> torch.Tensor:
    """``x[..., t+1]`` at position ``t`` (False/0 at the end)."""
    return F.pad(x[..., 1:], (0, 1))


def _runs(is_digit: torch.Tensor, is_dot: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(in_run, starts)``: positions inside a number, and each number's first position (a digit)."""
    in_run = is_digit
    if is_dot is not None:
        in_run = is_digit | (is_dot & _shift_right(is_digit) & _shift_left(is_digit))
    return in_run, in_run & ~_shift_right(in_run)


def number_starts(is_digit: torch.Tensor, is_dot: torch.Tensor | None = None, *, pieces: int = 1) -> torch.Tensor:
    """Bool ``[..., S]``: the first digit of every number (``is_dot``: decimal points join runs; ``pieces``: as
    :func:`ntl_positions`)."""
    if isinstance(pieces, bool) or not isinstance(pieces, int) or pieces < 1:
        raise ValueError(f"pieces must be a positive int (1: no cut), got {pieces!r}")
    seq = is_digit.shape[-1]
    if pieces > 1:
        if seq % pieces:
            raise ValueError(f"the sequence length {seq} is not divisible into pieces={pieces} equal slices")
        split = (*is_digit.shape[:-1], pieces, seq // pieces)
        is_digit = is_digit.reshape(split)
        is_dot = None if is_dot is None else is_dot.reshape(split)
    starts = _runs(is_digit, is_dot)[1]
    return starts.reshape(*starts.shape[:-2], seq) if pieces > 1 else starts


def assemble_numbers(
    digit_pred: torch.Tensor,
    digit_target: torch.Tensor,
    is_digit: torch.Tensor,
    is_dot: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(number_pred, number_target, starts)``, all ``[B, S]``: float64 numbers at each run's first digit."""
    batch, seq = is_digit.shape
    in_run, starts = _runs(is_digit, is_dot)
    run = torch.cumsum(starts.long(), dim=1)
    # One bin per run and row; bin 0 of every row collects positions outside any run.
    row_base = torch.arange(batch, device=is_digit.device).unsqueeze(1) * (seq + 1)
    bins = (row_base + torch.where(in_run, run, 0)).flatten()
    num_bins = batch * (seq + 1)

    digits = is_digit.long()
    digits_in_run = torch.zeros(num_bins, dtype=torch.long, device=bins.device).scatter_add_(0, bins, digits.flatten())
    digit_count = torch.cumsum(digits, dim=1)
    # Digits seen in the row before the current run began: the count at the run's start, carried
    # forward by a running maximum (the count never decreases), so no position is looked up by mask.
    before_run = torch.where(starts, digit_count - 1, 0).cummax(dim=1).values
    exponent = (digits_in_run[bins] - (digit_count - before_run).flatten()).clamp(0, MAX_NUMBER_LENGTH - 1)
    scale = torch.pow(10.0, exponent.to(torch.float64))

    mask = is_digit.flatten()
    zero = torch.zeros((), dtype=torch.float64, device=digit_pred.device)
    pred_terms = torch.where(mask, digit_pred.flatten().to(torch.float64) * scale, zero)
    target_terms = torch.where(mask, digit_target.flatten().to(torch.float64) * scale, zero)
    pred_sum = torch.zeros(num_bins, dtype=torch.float64, device=bins.device).scatter_add(0, bins, pred_terms)
    target_sum = torch.zeros(num_bins, dtype=torch.float64, device=bins.device).scatter_add(0, bins, target_terms)

    start_flat = starts.flatten()
    number_pred = torch.where(start_flat, pred_sum[bins], zero).view(batch, seq)
    number_target = torch.where(start_flat, target_sum[bins], zero).view(batch, seq)
    return number_pred, number_target, starts


def symmetric_mape(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``|pred - target| / (|pred| + |target| + eps)``, bounded in ``[0, 1]``."""
    return (pred - target).abs() / (pred.abs() + target.abs() + SMAPE_EPS)
