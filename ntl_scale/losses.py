"""Cross entropy and Number Token Loss on full or vocab-sharded logits.

Layers, bottom up (one definition of the math):

1. :func:`ntl_scale.parallel.fused_shard_stats`: per-token ``ce``, ``expect``, ``mass`` of a logits
   shard, with the two TP all-reduces (none when ``tp_group`` is None).
2. :func:`vocab_parallel_ce_ntl`: per-token CE, per-token NTL of the chosen kind and the mask of
   positions that carry NTL. Point losses, reweighing and number-level assembly act on ``[T]``
   vectors here, so they cost nothing next to the vocabulary-wide softmax.
3. :func:`number_token_loss` and :func:`ce_with_ntl`: reductions with loss weights.
4. :class:`NumberTokenLoss` and :class:`CEWithNTL`: thin ``nn.Module`` wrappers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ._checks import device_check
from .number_level import assemble_numbers, number_starts, symmetric_mape
from .number_vocab import NumberVocab
from .parallel import ShardInputs, check_chunk_tokens, compute_dtype, fused_shard_stats, group_rank, group_size

__all__ = [
    "LOSS_KINDS",
    "REDUCTIONS",
    "CENTLOutput",
    "CEWithNTL",
    "NTLOptions",
    "NumberPrediction",
    "NumberTokenLoss",
    "PerTokenTerms",
    "ce_with_ntl",
    "check_number_level_table",
    "ntl_counts",
    "ntl_positions",
    "number_token_loss",
    "per_token_ce_ntl",
    "predict_numbers",
    "reduce_loss",
    "vocab_parallel_ce_ntl",
]

LOSS_KINDS = ("was", "mse", "mae", "huber", "number")
REDUCTIONS = ("mean", "sum", "none")
# Reweighing replaces the loss on mass outside the number tokens by this factor of the largest
# possible loss, so such predictions always cost more than the worst number (as the reference).
_REWEIGH_MARGIN = 1.01


@dataclass(frozen=True)
class NTLOptions:
    """Which NTL variant to compute.

    Attributes:
        loss: ``"was"`` (Wasserstein-1, the paper's default), ``"mse"``, ``"mae"``, ``"huber"``
            (point loss of the expected value), or ``"number"`` (number-level symmetric MAPE).
        squash_factor: for ``"was"``: map nonzero distances onto ``[1, squash_factor]`` (> 1).
        reweigh: scale by the probability mass on number tokens and charge the remaining mass
            ``1.01 * max loss`` (the reference's default; not used in the paper).
        huber_delta: the Huber threshold.
        float_level: for ``"number"``: a decimal point between digits joins them into one number.
        ignore_index: label value that carries no loss.
    """

    loss: str = "was"
    squash_factor: float | None = None
    reweigh: bool = False
    huber_delta: float = 1.0
    float_level: bool = False
    ignore_index: int = -100

    def __post_init__(self) -> None:
        if self.loss not in LOSS_KINDS:
            raise ValueError(f"unknown NTL loss {self.loss!r}; expected one of {LOSS_KINDS}")
        if self.squash_factor is not None:
            if self.loss != "was":
                raise ValueError(f"squash_factor applies to loss='was' only, got loss={self.loss!r}")
            if isinstance(self.squash_factor, bool) or not isinstance(self.squash_factor, (int, float)):
                raise TypeError(f"squash_factor must be a number > 1 or None, got {self.squash_factor!r}")
            if not self.squash_factor > 1:
                raise ValueError(
                    f"squash_factor must be > 1 (1 would turn NTL-WAS into cross entropy), got {self.squash_factor}"
                )
        if not isinstance(self.huber_delta, (int, float)) or not self.huber_delta > 0:
            raise ValueError(f"huber_delta must be a number > 0, got {self.huber_delta!r}")
        if self.float_level and self.loss != "number":
            raise ValueError(f"float_level applies to loss='number' only, got loss={self.loss!r}")
        if not isinstance(self.ignore_index, int) or isinstance(self.ignore_index, bool):
            raise TypeError(f"ignore_index must be an int, got {self.ignore_index!r}")

    def point_loss(self, pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Element-wise loss between an expected value and its target (mse/mae/huber)."""
        if self.loss == "mse":
            return (pred - target).square()
        if self.loss == "mae":
            return (pred - target).abs()
        return F.huber_loss(pred, target, reduction="none", delta=float(self.huber_delta))

    def max_loss(self, vocab: NumberVocab) -> torch.Tensor:
        """The largest value the per-token loss can take (the reweighing constant's base).

        A 0-dim float64 CPU tensor (usable with tensors on any device, like a Python number): no
        host read, so ``torch.compile`` traces it without a graph break.
        """
        if self.loss == "number":
            return torch.ones((), dtype=torch.float64)
        if self.loss == "was":
            return vocab.distance_table(self.squash_factor).max().double()
        low, high = vocab.values.min(), vocab.values.max()
        return torch.maximum(self.point_loss(low, high).abs(), self.point_loss(high, low).abs()).double()


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


# ---------------------------------------------------------------------------------- validation


def _check_inputs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    vocab: NumberVocab,
    options: NTLOptions,
    tp_size: int,
    vocab_start: int | None = None,
    source: str = "the logits' last dimension",
) -> int:
    """Validates user input; returns the global vocabulary size (the table's ``vocab_size``).

    The logits' width is checked against the table (:func:`_check_width`); ``source`` names what
    holds the columns in the messages (the chunked op passes the output weight's rows).
    """
    if not isinstance(vocab, NumberVocab):
        raise TypeError(f"vocab must be an ntl_scale.NumberVocab, got {type(vocab).__name__}")
    if not isinstance(logits, torch.Tensor) or not torch.is_floating_point(logits):
        kind = logits.dtype if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise TypeError(f"logits must be a floating-point tensor (fp32/bf16/fp16/fp64), got {kind}")
    if not isinstance(labels, torch.Tensor) or labels.dtype in (torch.bool,) or labels.is_floating_point():
        kind = labels.dtype if isinstance(labels, torch.Tensor) else type(labels).__name__
        raise TypeError(f"labels must be an integer tensor of token ids (torch.long), got {kind}")
    if labels.is_complex():
        raise TypeError(f"labels must be an integer tensor of token ids (torch.long), got {labels.dtype}")
    if logits.dim() < 2:
        raise ValueError(f"logits must have shape [..., vocab] with at least 2 dims, got {tuple(logits.shape)}")
    if tuple(labels.shape) != tuple(logits.shape[:-1]):
        raise ValueError(
            f"labels shape {tuple(labels.shape)} must equal logits shape without the vocab dim "
            f"{tuple(logits.shape[:-1])}; shift labels and logits to the same length first"
        )
    global_vocab = _check_width(logits.shape[-1], vocab, tp_size, vocab_start, source)
    if labels.numel():
        bad = (labels != options.ignore_index) & ((labels < 0) | (labels >= global_vocab))

        def error() -> ValueError:
            value = int(labels[bad].flatten()[0])
            return ValueError(
                f"label id {value} is outside [0, {global_vocab}) and is not ignore_index="
                f"{options.ignore_index}; mask padding with ignore_index or pass the right ignore_index"
            )

        device_check(~bad.any(), error, f"a label id is outside [0, {global_vocab}) and is not ignore_index")
    return global_vocab


def _check_width(width: int, vocab: NumberVocab, tp_size: int, vocab_start: int | None, source: str) -> int:
    """Refuses logits whose width is neither the table's ``vocab_size`` nor, under TP, its shard's.

    A shape check (host values, no sync). Wider logits would add columns the table never knew to
    the softmax (CE, the number-token mass of ``reweigh``); narrower ones would lose columns. Without
    ``vocab_start`` the shard is Megatron's even split, ``vocab_size / tp`` columns; with it (an uneven
    split) ``[vocab_start, vocab_start + width)`` must lie inside the vocabulary, and on one device
    cover it. Returns the global vocabulary size.
    """
    size = vocab.vocab_size
    fix = (
        "build the number table for the model's output size, e.g. NumberVocab.from_tokenizer(tokenizer, "
        "vocab_size=model.config.vocab_size) (Megatron: its padded vocabulary, ntl_scale.pad_vocab_size), "
        "or vocab.with_vocab_size(N)"
    )
    if vocab_start is not None:
        if isinstance(vocab_start, bool) or not isinstance(vocab_start, int) or vocab_start < 0:
            raise ValueError(
                f"vocab_start must be an integer >= 0 (this shard's first vocabulary id), got {vocab_start!r}"
            )
        if vocab_start + width > size:
            raise ValueError(
                f"the shard [{vocab_start}, {vocab_start + width}) ({source} {width} from vocab_start={vocab_start}) "
                f"reaches past the vocabulary of {size} (the number table's vocab_size); {fix}"
            )
        if tp_size == 1 and (vocab_start, width) != (0, size):
            raise ValueError(
                f"without a tensor-parallel group the columns must cover the number table's whole vocabulary "
                f"[0, {size}), got [{vocab_start}, {vocab_start + width}) ({source} {width}, vocab_start="
                f"{vocab_start}); pass tp_group for a shard, or {fix}"
            )
        return size
    if tp_size == 1:
        if width != size:
            raise ValueError(
                f"{source} is {width} but the number table was built for vocab_size={size}; they must be equal "
                f"(the softmax runs over every column). Fix: {fix}, here N={width}"
            )
        return size
    if size % tp_size:
        raise ValueError(
            f"the number table's vocab_size {size} is not divisible by tp={tp_size}, so its even shards are "
            f"undefined ({source} is {width}); build the table with the padded vocabulary "
            f"(ntl_scale.pad_vocab_size({size}, tp_size={tp_size})), or pass vocab_start for an uneven split"
        )
    if width != size // tp_size:
        raise ValueError(
            f"{source} is {width} on this rank but the number table's vocab_size={size} over tp={tp_size} gives "
            f"{size // tp_size} per rank; they must be equal. Fix: {fix}, here N={width * tp_size}; for an "
            "uneven split pass vocab_start"
        )
    return size


def _check_weights(loss_weights: torch.Tensor | None, labels: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    if loss_weights is None:
        return None
    if not isinstance(loss_weights, torch.Tensor):
        raise TypeError(f"loss_weights must be a tensor shaped like labels, got {type(loss_weights).__name__}")
    if tuple(loss_weights.shape) != tuple(labels.shape):
        raise ValueError(
            f"loss_weights shape {tuple(loss_weights.shape)} must equal the labels shape {tuple(labels.shape)}"
        )
    weights = loss_weights.to(device=labels.device, dtype=dtype)
    if weights.numel():
        bad = ~torch.isfinite(weights) | (weights < 0)

        def error() -> ValueError:
            value = weights[bad].flatten()[0].item()
            return ValueError(f"loss_weights must be finite and >= 0, found {value}; use 0 to mask a position")

        device_check(~bad.any(), error, "loss_weights must be finite and >= 0")
    return weights


def _check_reduction(reduction: str) -> None:
    if reduction not in REDUCTIONS:
        raise ValueError(f"unknown reduction {reduction!r}; expected one of {REDUCTIONS}")


# ---------------------------------------------------------------------------------- per token


def check_number_level_table(vocab: NumberVocab) -> None:
    """Refuses a number table that number-level NTL (``loss="number"``) cannot read.

    Number-level NTL rebuilds a number from a run of digit labels, one decimal digit per position; a
    token worth ``123`` or ``-4`` or ``0.5``, or a digit with a word prefix (``"▁3"``, which starts a
    new word), would be weighted as one digit and assemble a wrong number. The table must therefore
    hold single digits only: at most the ten values 0-9, each once, and (when the table knows its
    token strings) each token exactly one ASCII digit, as ``NumberVocab.from_tokenizer(tokenizer,
    digit_level=True)`` builds it.

    Raises:
        ValueError: naming the offending entry and the fix.
    """
    cached = getattr(vocab, "_ntl_digit_table_ok", None)
    if cached is True:
        return
    problem = None
    tokens = vocab.tokens
    if len(vocab) > 10:
        problem = f"it has {len(vocab)} number tokens (a digit table has at most the ten digits 0-9)"
    else:
        values = vocab.values.tolist()
        for i, value in enumerate(values):
            token = None if tokens is None else tokens[i]
            shown = f"{token!r} (value {value:g})" if token is not None else f"value {value:g}"
            if value not in range(10):
                problem = f"its token {shown} is not a single digit 0-9"
            elif values.count(value) > 1:
                problem = f"the digit {value:g} appears {values.count(value)} times (e.g. {shown})"
            elif token is not None and not (len(token) == 1 and token in "0123456789"):
                problem = f"its token {shown} is not exactly one ASCII digit (a prefixed or multi-character token)"
            if problem:
                break
    if problem is not None:
        raise ValueError(
            f'loss="number" assembles numbers from single-digit tokens, but the number table cannot be read so: '
            f"{problem}. Build a digit table with NumberVocab.from_tokenizer(tokenizer, digit_level=True) "
            "(Megatron: --ntl-number-vocab digits; train config: ntl.digit_level=true), or use a token-level "
            'loss ("was", "mse", "mae", "huber") with this table'
        )
    object.__setattr__(vocab, "_ntl_digit_table_ok", True)  # the table is immutable: check it once


def ntl_positions(
    labels: torch.Tensor, vocab: NumberVocab, options: NTLOptions | None = None, *, pieces: int = 1
) -> torch.Tensor:
    """The label positions that carry an NTL term: what NTL's mean divides by (its denominator).

    The one definition every reduction and every integration counts with: for the token-level
    variants (``was``, ``mse``, ``mae``, ``huber``), every non-ignored label that is a number token;
    for ``loss="number"``, one position per number, the first digit of each maximal run of digit
    labels along the last axis (with ``float_level`` a decimal point between two digits joins them).
    :func:`per_token_ce_ntl` returns the same mask as ``number_mask``.

    Args:
        labels: token ids ``[...]`` (for ``loss="number"`` the last axis is the sequence).
        vocab: the number table.
        options: the NTL variant (default NTL-WAS); its ``ignore_index`` marks positions without loss.
        pieces: ``loss="number"`` only: numbers are cut at the borders of this many equal slices of the
            sequence, as under context parallelism, where each rank assembles numbers from its own
            slice (Megatron's load-balanced split: ``2 x`` the context-parallel size).

    Returns:
        bool ``[...]``, on the labels' device; no host synchronisation.
    """
    options = NTLOptions() if options is None else options
    valid = labels != options.ignore_index
    is_number = valid & vocab.number_mask(labels)
    if options.loss != "number":
        return is_number
    check_number_level_table(vocab)
    dots = None
    if options.float_level:
        if vocab.decimal_point_id is None:
            raise ValueError("float_level=True needs the '.' token id; the number table has no decimal_point_id")
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
    """``[tokens, NTL positions]`` of some labels, float64 ``[2]`` on their device: the step-count material.

    ``tokens`` is the loss-mask weight of the labels (default: the non-ignored labels) and ``NTL
    positions`` the loss-mask weight of :func:`ntl_positions`. Summed over a step's micro-batches and
    ranks they are the denominators of global normalisation, for every variant.
    """
    options = NTLOptions() if options is None else options
    positions = ntl_positions(labels, vocab, options, pieces=pieces).to(torch.float64)
    if loss_mask is None:
        weight = (labels != options.ignore_index).to(torch.float64)
    else:
        weight = loss_mask.to(device=labels.device, dtype=torch.float64)
    return torch.stack([weight.sum(), (weight * positions).sum()])


def shard_start(vocab_start: int | None, tp_rank: int, width: int) -> int:
    """The global id of a shard's first column: ``vocab_start``, or Megatron's even split ``rank * width``."""
    return tp_rank * width if vocab_start is None else vocab_start


def _shard_inputs(
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
    return ShardInputs(safe_labels, valid, local_ids, a_table, start), row


class PerTokenTerms(NamedTuple):
    """Per-token outputs of :func:`per_token_ce_ntl`, each shaped like the labels.

    Attributes:
        ce: cross entropy (0 where ignored).
        ntl: NTL (0 where ``number_mask`` is False).
        number_mask: positions that carry NTL.
        hit: the label is the arg-max over the whole vocabulary (for token accuracy; False when
            CE was not computed).
    """

    ce: torch.Tensor
    ntl: torch.Tensor
    number_mask: torch.Tensor
    hit: torch.Tensor


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
) -> PerTokenTerms:
    """Per-token CE and the NTL variant from the fused per-token statistics (logits or hidden states)."""
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
        ntl = options.point_loss(expect, targets)
    if reweigh:
        penalty = _REWEIGH_MARGIN * options.max_loss(vocab)
        ntl = ntl * mass + penalty * (1 - mass)
    ntl = torch.where(mask, ntl, zero)
    return PerTokenTerms(ce.view(shape), ntl.view(shape), mask.view(shape), hit.view(shape))


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
) -> PerTokenTerms:
    """:func:`vocab_parallel_ce_ntl` with the variant as one :class:`NTLOptions`, plus the arg-max hit.

    The form for integrations. ``need_ce=False`` skips the full-vocabulary softmax when neither CE
    nor reweighing needs it (``ce`` and ``hit`` are then 0). ``vocab_start``: see
    :func:`vocab_parallel_ce_ntl`.
    """
    options = NTLOptions() if options is None else options
    loss, reweigh = options.loss, options.reweigh
    tp_size, tp_rank = group_size(tp_group), group_rank(tp_group)
    _check_inputs(logits_shard, labels, vocab, options, tp_size, vocab_start)
    check_chunk_tokens(chunk_tokens)
    if inplace and logits_shard.dtype not in (torch.float32, torch.float64):
        raise ValueError(
            f"inplace=True reuses the logits buffer for fp32 math and needs float32/float64 logits, "
            f"got {logits_shard.dtype}; use inplace=False for half-precision logits"
        )
    if loss == "number" and options.float_level and vocab.decimal_point_id is None:
        raise ValueError("float_level=True needs the '.' token id; the number table has no decimal_point_id")
    shape = labels.shape
    width = logits_shard.shape[-1]
    dtype = compute_dtype(logits_shard.dtype)
    flat_labels = labels.reshape(-1)
    inputs, row = _shard_inputs(flat_labels, vocab, options, shard_start(vocab_start, tp_rank, width), width, dtype)
    need_full = need_ce or reweigh
    ce, expect, mass, hit = fused_shard_stats(
        logits_shard.reshape(-1, width),
        inputs,
        need_full=need_full,
        inplace=inplace,
        check_finite=check_finite,
        tp_group=tp_group,
        chunk_tokens=chunk_tokens,
    )
    return terms_from_stats(ce, expect, mass, hit, inputs, row, shape, vocab, options)


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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token cross entropy and NTL from a vocab-parallel logits shard, fused.

    Rank ``r`` of ``tp_group`` holds the columns ``[r*V/tp, (r+1)*V/tp)`` of the (padded)
    vocabulary (Megatron's split), or, with ``vocab_start``, any contiguous slice: uneven splits
    such as DeepSpeed's of a vocabulary that the TP size does not divide. The forward issues one MAX
    and one SUM all-reduce on ``tp_group`` (CE and NTL share them); the backward issues none. With
    ``tp_group=None`` (or size 1) this is the single-device computation on full logits, through the
    same code.

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
        check_finite: raise a ValueError when the logits hold NaN/Inf (one host sync; off by default:
            a non-finite logit then makes the loss NaN, for the training loop's own NaN check).
        chunk_tokens: tokens per chunk of temporaries (default: a 64 MiB fp32 budget).
        vocab_start: the global id of this shard's first column, for uneven splits; the shards of
            the group must then tile ``[0, vocab.vocab_size)``. None: ``rank * width``.

    Shape:
        ``logits_shard``: ``[..., V/tp]``; ``labels`` and every output: ``[...]``.

    Returns:
        ``(ce, ntl, number_mask)``: per-token CE (0 where ignored), per-token NTL (0 where the mask
        is False) and the bool mask of positions that carry NTL (number labels; for number-level the
        first digit of each number). Identical on every TP rank.
    """
    options = NTLOptions(loss, squash_factor, reweigh, huber_delta, float_level, ignore_index)
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


# ---------------------------------------------------------------------------------- reductions


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
    _check_reduction(reduction)
    w = mask.to(per_token.dtype) if weights is None else torch.where(mask, weights, 0)
    total = w.sum()
    if reduction == "none":
        return per_token * w, total
    summed = (per_token * w).sum()
    if reduction == "sum":
        return summed, total
    return summed / total.clamp_min(torch.finfo(per_token.dtype).eps), total


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
) -> torch.Tensor:
    """Number Token Loss on full logits.

    Without ``reweigh`` only the number-token columns of the logits are read.

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

    Shape:
        ``logits``: ``[..., V]``; ``labels``, ``loss_weights``: ``[...]``.

    Returns:
        A 0-d tensor for ``mean``/``sum``, ``[...]`` for ``none`` (0 at non-number positions).
        Exactly 0 with zero gradient when the batch holds no number label.
    """
    _check_reduction(reduction)
    options = NTLOptions(loss, squash_factor, reweigh, huber_delta, float_level, ignore_index)
    terms = per_token_ce_ntl(logits, labels, vocab, options, check_finite=check_finite, need_ce=False)
    weights = _check_weights(loss_weights, labels, terms.ntl.dtype)
    return reduce_loss(terms.ntl, terms.number_mask, weights, reduction)[0]


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

    Returns:
        A :class:`CENTLOutput` ``(loss, ce, ntl, num_tokens, num_number_tokens, number_accuracy)``.
    """
    _check_reduction(reduction)
    _check_ntl_weight(ntl_weight)
    options = NTLOptions(loss, squash_factor, reweigh, huber_delta, float_level, ignore_index)
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
    return _combine(terms, labels, vocab, options, ntl_weight, loss_weights, reduction)


def _check_ntl_weight(ntl_weight: float) -> None:
    if isinstance(ntl_weight, bool) or not isinstance(ntl_weight, (int, float)) or ntl_weight < 0:
        raise ValueError(f"ntl_weight must be a number >= 0, got {ntl_weight!r}")


def _combine(
    terms: PerTokenTerms,
    labels: torch.Tensor,
    vocab: NumberVocab,
    options: NTLOptions,
    ntl_weight: float,
    loss_weights: torch.Tensor | None,
    reduction: str,
) -> CENTLOutput:
    """Reduces per-token terms to :class:`CENTLOutput` (CE over valid tokens, NTL over its mask)."""
    weights = _check_weights(loss_weights, labels, terms.ce.dtype)
    valid = labels != options.ignore_index
    ce_red, num_tokens = reduce_loss(terms.ce, valid, weights, reduction)
    ntl_red, num_numbers = reduce_loss(terms.ntl, terms.number_mask, weights, reduction)
    number_positions = terms.number_mask  # ntl_positions: accuracy is counted where NTL is
    hits = (number_positions & terms.hit).sum().to(terms.ce.dtype)
    accuracy = (hits / number_positions.sum().clamp_min(1)).detach()
    return CENTLOutput(ce_red + ntl_weight * ntl_red, ce_red, ntl_red, num_tokens, num_numbers, accuracy)


# ---------------------------------------------------------------------------------- modules


class NumberPrediction(NamedTuple):
    """Per-position outputs of :func:`predict_numbers`, each shaped like the logits without the vocab dim.

    Attributes:
        value: the expected number value ``sum_k p_k v_k`` under the number-token distribution.
        mass: the probability mass the full softmax puts on number tokens.
    """

    value: torch.Tensor
    mass: torch.Tensor


def predict_numbers(logits: torch.Tensor, vocab: NumberVocab) -> NumberPrediction:
    """The expected number value and the number-token mass at every position (for evaluation and logs).

    The same quantities as ``ntloss``'s ``predict_numbers``: the value is the dot product of the
    softmax over the number-token columns with their values, the mass the full softmax's sum over
    those columns. Computed in fp32 (fp64 for fp64 logits), without gradient tracking of its own.

    Args:
        logits: ``[..., V]`` full-vocabulary logits, ``V`` the table's ``vocab_size`` (gather TP shards first).
        vocab: the number-token table.

    Returns:
        :class:`NumberPrediction` ``(value, mass)``, each ``[...]``.
    """
    if not isinstance(vocab, NumberVocab):
        raise TypeError(f"vocab must be an ntl_scale.NumberVocab, got {type(vocab).__name__}")
    if not isinstance(logits, torch.Tensor) or not torch.is_floating_point(logits) or logits.dim() < 1:
        raise TypeError("logits must be a floating-point tensor [..., vocab]")
    _check_width(logits.shape[-1], vocab, 1, None, "the logits' last dimension")  # full logits: gather TP shards
    z = logits.to(compute_dtype(logits.dtype))
    ids = vocab.ids.to(z.device)
    number_logits = z.index_select(-1, ids)
    value = (torch.softmax(number_logits, dim=-1) * vocab.values.to(z.device, z.dtype)).sum(-1)
    mass = torch.exp(torch.logsumexp(number_logits, dim=-1) - torch.logsumexp(z, dim=-1))
    return NumberPrediction(value, mass)


class NumberTokenLoss(torch.nn.Module):
    """``nn.Module`` form of :func:`number_token_loss`.

    Args:
        vocab: the number-token table.
        **options: ``loss``, ``squash_factor``, ``reweigh``, ``huber_delta``, ``float_level``,
            ``ignore_index``, ``reduction``, ``check_finite`` (see :func:`number_token_loss`).
    """

    def __init__(self, vocab: NumberVocab, **options: object) -> None:
        super().__init__()
        self.vocab = vocab
        self.reduction = str(options.pop("reduction", "mean"))
        self.check_finite = bool(options.pop("check_finite", False))
        _check_reduction(self.reduction)
        self.options = NTLOptions(**options)  # type: ignore[arg-type]

    def forward(
        self, logits: torch.Tensor, labels: torch.Tensor, loss_weights: torch.Tensor | None = None
    ) -> torch.Tensor:
        """See :func:`number_token_loss`."""
        terms = per_token_ce_ntl(
            logits, labels, self.vocab, self.options, check_finite=self.check_finite, need_ce=False
        )
        weights = _check_weights(loss_weights, labels, terms.ntl.dtype)
        return reduce_loss(terms.ntl, terms.number_mask, weights, self.reduction)[0]

    def extra_repr(self) -> str:
        return f"{self.options}, reduction={self.reduction!r}, numbers={len(self.vocab)}"


class CEWithNTL(torch.nn.Module):
    """``nn.Module`` form of :func:`ce_with_ntl`.

    Args:
        vocab: the number-token table.
        ntl_weight: weight of the NTL term.
        tp_group: tensor-parallel group of the vocab split, or None.
        **options: the NTL variant and ``reduction``, ``inplace``, ``check_finite``.
    """

    def __init__(
        self,
        vocab: NumberVocab,
        ntl_weight: float = 0.3,
        tp_group: dist.ProcessGroup | None = None,
        **options: object,
    ) -> None:
        super().__init__()
        _check_ntl_weight(ntl_weight)
        self.vocab, self.ntl_weight, self.tp_group = vocab, ntl_weight, tp_group
        self.reduction = str(options.pop("reduction", "mean"))
        self.inplace = bool(options.pop("inplace", False))
        self.check_finite = bool(options.pop("check_finite", False))
        _check_reduction(self.reduction)
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
        return _combine(terms, labels, self.vocab, self.options, self.ntl_weight, loss_weights, self.reduction)
