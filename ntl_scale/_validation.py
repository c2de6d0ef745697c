"""Checks of user input to the losses; device values go through :func:`ntl_scale._runtime.device_check`."""

from __future__ import annotations

import warnings

import torch

from ._runtime import device_check
from .number_vocab import (
    DIGIT_LEVEL_WAS,
    SCALE_TOLERANCE,
    NumberTableWarning,
    NumberVocab,
    check_number_level_table,
    digit_scale_squash_factor,
    untrained_was,
)
from .options import REDUCTIONS, NTLOptions, surface_name

__all__ = [
    "check_float_level",
    "check_inputs",
    "check_reduction",
    "check_table",
    "check_table_scale",
    "check_weights",
    "check_width",
]


def check_inputs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    vocab: NumberVocab,
    options: NTLOptions,
    tp_size: int,
    vocab_start: int | None = None,
    source: str = "the logits' last dimension",
) -> int:
    """Validates user input; returns the global vocabulary size (the table's ``vocab_size``)."""
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
    global_vocab = check_width(logits.shape[-1], vocab, tp_size, vocab_start, source)
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


def check_width(width: int, vocab: NumberVocab, tp_size: int, vocab_start: int | None, source: str) -> int:
    """Refuses logits whose width is neither the table's ``vocab_size`` nor, under TP, its shard's."""
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


def check_weights(loss_weights: torch.Tensor | None, labels: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """``loss_weights`` shaped like the labels, finite and >= 0, cast to ``dtype`` on the labels' device (or None)."""
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


def check_reduction(reduction: str) -> None:
    """Refuses a reduction that is not one of ``REDUCTIONS``."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"unknown reduction {reduction!r}; expected one of {REDUCTIONS}")


def check_float_level(vocab: NumberVocab, options: NTLOptions) -> None:
    """Refuses ``float_level=True`` with a number table that does not know the ``'.'`` token."""
    if options.loss == "number" and options.float_level and vocab.decimal_point_id is None:
        raise ValueError("float_level=True needs the '.' token id; the number table has no decimal_point_id")


def check_table(vocab: NumberVocab, options: NTLOptions, surface: str = "hf") -> None:
    """The number table against the NTL variant, when a front end builds its loss (not at the first step)."""
    if options.loss == "number":
        check_number_level_table(vocab)
    else:
        check_table_scale(vocab, options, surface)


def _point_scale(values: list[float], options: NTLOptions) -> float:
    """A point loss of an untrained model (uniform predictions: ``yhat`` the mean value) over uniform targets."""
    guess = sum(values) / len(values)
    delta = options.huber_delta

    def point(error: float) -> float:
        if options.loss == "mse":
            return error * error
        if options.loss == "huber" and abs(error) <= delta:
            return 0.5 * error * error
        return abs(error) - 0.5 * delta if options.loss == "huber" else abs(error)

    return sum(point(guess - t) for t in values) / len(values)


def check_table_scale(vocab: NumberVocab, options: NTLOptions, surface: str = "hf") -> None:
    """Refuses a number table that puts token-level NTL far off the digit level's scale, where a weight was tuned."""
    key = ("_ntl_scale_ok", options.loss, options.squash_factor, options.huber_delta)
    checked: set[tuple[object, ...]] = getattr(vocab, "_ntl_scale_checked", set())
    if key in checked:
        return
    values = vocab.values.double().tolist()
    low, high = min(values), max(values)
    squash_name = surface_name("squash_factor", surface)
    table_name = surface_name("digit_level", surface) or "NumberVocab.from_tokenizer(tokenizer, digit_level=True)"
    described = f"this {len(values)}-token number table (values {low:g} to {high:g})"
    if options.loss == "was":
        scale = untrained_was(values, options.squash_factor)
        ratio = scale / DIGIT_LEVEL_WAS
        squash = digit_scale_squash_factor(values)
        fix = f"{squash_name}={squash:.1f}" if squash is not None else f"{table_name} (a digit table)"
        if options.squash_factor is None and ratio > SCALE_TOLERANCE:
            raise ValueError(
                f"NTL-WAS on {described} starts at {scale:.1f} for an untrained model, {ratio:.0f}x the digit "
                f"table's {DIGIT_LEVEL_WAS} that the NTL weight is tuned for, so NTL would swamp CE. Set {fix}: "
                "derived from the table so that an untrained model's NTL is the digit level's "
                "(ntl_scale.number_vocab.digit_scale_squash_factor(vocab.values); docs/number_vocab.md, recipes)"
            )
        if options.squash_factor is not None and not 1 / SCALE_TOLERANCE <= ratio <= SCALE_TOLERANCE:
            warnings.warn(
                f"{squash_name}={options.squash_factor:g} puts NTL-WAS on {described} at {scale:.2f} for an "
                f"untrained model, {ratio:.2f}x the digit level's {DIGIT_LEVEL_WAS}; {fix} matches it",
                NumberTableWarning,
                stacklevel=3,
            )
    else:
        scale = _point_scale(values, options)
        digit = _point_scale([float(d) for d in range(10)], options)
        if scale / digit > SCALE_TOLERANCE:
            warnings.warn(
                f"loss={options.loss!r} on {described} starts at {scale:.1f} for an untrained model, "
                f"{scale / digit:.0f}x its {digit:.2f} on the ten digits, so at the same weight NTL would swamp "
                f"CE (no squash factor applies to a point loss). Use loss='was' with "
                f"{squash_name}={digit_scale_squash_factor(values) or 1:.1f}, or a digit table ({table_name})",
                NumberTableWarning,
                stacklevel=3,
            )
    object.__setattr__(vocab, "_ntl_scale_checked", checked | {key})
