"""Megatron (both routes): the ``--ntl-*`` flags, the validated :class:`NTLSettings` and the number table.

* :func:`add_ntl_args`: the ``--ntl-*`` argument group, for Megatron's ``extra_args_provider``;
* :class:`NTLSettings`: the validated settings (``NTLSettings.from_args(args)``);
* :func:`build_number_vocab`: the number table for Megatron's tokenizer (``inv_vocab``) and padded
  vocabulary, or loaded from a saved JSON table.

Nothing here imports Megatron.
"""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass
from typing import Any

from ...losses import LOSS_KINDS, NTLOptions, check_number_level_table
from ...number_vocab import NumberVocab

__all__ = ["NORMALIZATIONS", "VOCAB_RULES", "NTLSettings", "add_ntl_args", "build_number_vocab"]

NORMALIZATIONS = ("micro-batch", "global")
VOCAB_RULES = ("digits", "multi-digit")


@dataclass(frozen=True)
class NTLSettings:
    """NTL settings of a Megatron run.

    Attributes:
        weight: weight of the NTL term; 0 turns NTL off (the plain Megatron loss, bit for bit).
        loss: ``was``, ``mse``, ``mae``, ``huber`` or ``number``.
        number_vocab: ``digits`` (the ten digit tokens), ``multi-digit``, or the path of a table
            saved with ``NumberVocab.save``.
        reweigh: reweigh by the probability mass on number tokens.
        squash_factor: NTL-WAS distance squashing (> 1), or None.
        huber_delta: the Huber threshold.
        normalization: ``micro-batch`` or ``global`` (see the module docstring).
        chunked: compute CE + NTL from the hidden states and the output weight in token chunks,
            never materialising the logits (``--ntl-chunked``).
        chunk_tokens: tokens per chunk of the chunked route; None = the op's default.
    """

    weight: float = 0.0
    loss: str = "was"
    number_vocab: str = "digits"
    reweigh: bool = False
    squash_factor: float | None = None
    huber_delta: float = 1.0
    normalization: str = "micro-batch"
    chunked: bool = False
    chunk_tokens: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.weight, (int, float)) or not math.isfinite(self.weight) or self.weight < 0:
            raise ValueError(
                f"--ntl-weight must be a finite number >= 0 (0 = off, 0.3 in the paper), got {self.weight!r}"
            )
        if self.normalization not in NORMALIZATIONS:
            raise ValueError(f"--ntl-normalization must be one of {NORMALIZATIONS}, got {self.normalization!r}")
        if not self.number_vocab:
            raise ValueError("--ntl-number-vocab must be 'digits', 'multi-digit' or the path of a saved table")
        if self.chunk_tokens is not None and (not isinstance(self.chunk_tokens, int) or self.chunk_tokens < 1):
            raise ValueError(f"--ntl-chunk-tokens must be a positive integer, got {self.chunk_tokens!r}")
        self.options()  # validates loss, squash factor and Huber delta with the library's own checks
        if self.loss == "number" and self.number_vocab == "multi-digit":
            raise ValueError(
                "--ntl-loss number assembles numbers from single-digit tokens and cannot read a multi-digit table "
                "(a token worth 123 would count as one digit); use --ntl-number-vocab digits (a digit table), or a "
                "token-level --ntl-loss (was, mse, mae, huber) with --ntl-number-vocab multi-digit"
            )

    @property
    def enabled(self) -> bool:
        """Whether NTL contributes to the loss."""
        return self.weight > 0

    def options(self) -> NTLOptions:
        """The library's :class:`~ntl_scale.NTLOptions` for these settings."""
        return NTLOptions(
            loss=self.loss, squash_factor=self.squash_factor, reweigh=self.reweigh, huber_delta=self.huber_delta
        )

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> NTLSettings:
        """Reads the ``--ntl-*`` arguments of a parsed Megatron namespace."""
        return cls(
            weight=args.ntl_weight,
            loss=args.ntl_loss,
            number_vocab=args.ntl_number_vocab,
            reweigh=args.ntl_reweigh,
            squash_factor=args.ntl_squash_factor,
            huber_delta=args.ntl_huber_delta,
            normalization=args.ntl_normalization,
            chunked=getattr(args, "ntl_chunked", False),
            chunk_tokens=getattr(args, "ntl_chunk_tokens", None),
        )


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _squash(text: str) -> float:
    value = _non_negative_float(text)
    if value <= 1:
        raise argparse.ArgumentTypeError(f"the squash factor must be > 1, got {text!r}")
    return value


def add_ntl_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds the ``--ntl-*`` group; pass it as (or call it from) Megatron's ``extra_args_provider``.

    Args:
        parser: Megatron's argument parser.

    Returns:
        The same parser.
    """
    group = parser.add_argument_group("number token loss (ntl_scale)")
    group.add_argument(
        "--ntl-weight", type=_non_negative_float, default=0.0, help="weight of NTL; 0 (default) = off, 0.3 in the paper"
    )
    group.add_argument("--ntl-loss", choices=LOSS_KINDS, default="was", help="NTL variant (default: was)")
    group.add_argument(
        "--ntl-number-vocab",
        default="digits",
        help="'digits' (default), 'multi-digit', or the path of a table saved with NumberVocab.save",
    )
    group.add_argument("--ntl-reweigh", action="store_true", help="reweigh by the number-token probability mass")
    group.add_argument("--ntl-squash-factor", type=_squash, default=None, help="NTL-WAS distance squashing (> 1)")
    group.add_argument("--ntl-huber-delta", type=_non_negative_float, default=1.0, help="Huber threshold")
    group.add_argument(
        "--ntl-normalization",
        choices=NORMALIZATIONS,
        default="micro-batch",
        help="NTL mean per micro-batch (paper) or over the global batch (split-invariant)",
    )
    group.add_argument(
        "--ntl-chunked",
        action="store_true",
        help="CE + NTL from the hidden states in token chunks, never materialising the logits",
    )
    group.add_argument("--ntl-chunk-tokens", type=_positive_int, default=None, help="tokens per chunk of --ntl-chunked")
    return parser


def build_number_vocab(settings: NTLSettings, tokenizer: Any, padded_vocab_size: int) -> NumberVocab:
    """The number table for a Megatron run.

    Args:
        settings: the NTL settings.
        tokenizer: Megatron's tokenizer (anything ``NumberVocab.from_tokenizer`` accepts, e.g. one
            with ``inv_vocab``); unused when ``number_vocab`` is a path.
        padded_vocab_size: Megatron's ``args.padded_vocab_size`` (the logits' global width).

    Returns:
        The table, sized to the padded vocabulary.
    """
    vocab = _build_number_vocab(settings, tokenizer, padded_vocab_size)
    if settings.loss == "number":
        check_number_level_table(vocab)  # a saved table of other tokens, refused before the first step
    return vocab


def _build_number_vocab(settings: NTLSettings, tokenizer: Any, padded_vocab_size: int) -> NumberVocab:
    rule = settings.number_vocab
    if rule in VOCAB_RULES:
        try:
            return NumberVocab.from_tokenizer(tokenizer, vocab_size=padded_vocab_size, digit_level=rule == "digits")
        except (NotImplementedError, TypeError) as e:
            # NullTokenizer and similar raise NotImplementedError from inv_vocab.
            raise ValueError(
                f"--ntl-number-vocab {rule!r} reads the number tokens from the tokenizer, but "
                f"{type(tokenizer).__name__} has no token table ({type(e).__name__}: {e}). Pass "
                "--ntl-number-vocab PATH with a table saved by `python -m ntl_scale.save_number_vocab "
                "TOKENIZER --out PATH` or NumberVocab.from_tokenizer(...).save(PATH)"
            ) from None
    if not os.path.isfile(rule):
        raise ValueError(
            f"--ntl-number-vocab {rule!r} is neither one of {VOCAB_RULES} nor an existing file; "
            "build a table with NumberVocab.from_tokenizer(...).save(path)"
        )
    return NumberVocab.load(rule, vocab_size=padded_vocab_size)
