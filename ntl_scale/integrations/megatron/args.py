"""Megatron (both routes): the ``--ntl-*`` flags built from the option spec, the validated
:class:`NTLSettings` and the number table. Nothing here imports Megatron.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Any

from ..._validation import check_table
from ...number_vocab import NumberVocab
from ...options import (
    NUMERIC_CHECKS,
    VOCAB_RULES,
    NTLOptions,
    OptionField,
    check_option,
    check_run_options,
    option_fields,
    surface_default,
    surface_name,
    table_source,
    variant_fields,
    variant_of,
)

__all__ = ["NTLSettings", "add_ntl_args", "build_number_vocab", "ignored_megatron_flags"]


@dataclass(frozen=True)
@variant_fields
class NTLSettings:
    """NTL settings of a Megatron run: the run-level fields below, then the variant fields of
    :class:`~ntl_scale.NTLOptions` (``loss``, ``squash_factor``, ``reweigh``, ``huber_delta``, ``float_level``,
    ``impl``, ``z_loss_weight``, ``label_smoothing``, ``logit_softcap``; added by
    :func:`~ntl_scale.options.variant_fields`, documented there once). Megatron's defaults (``weight`` 0,
    ``micro-batch``) change nothing until ``--ntl-weight`` is given."""

    weight: float = surface_default("weight", "megatron")
    number_vocab: str = surface_default("digit_level", "megatron")
    normalization: str = surface_default("normalization", "megatron")
    chunked: bool = surface_default("chunked", "megatron")
    chunk_tokens: int | None = surface_default("chunk_tokens", "megatron")

    def __post_init__(self) -> None:
        options = check_run_options(self, "megatron")
        if options.ce_features and not self.enabled:
            flags = ", ".join(str(surface_name(name, "megatron")) for name in options.ce_features)
            raise ValueError(
                f"{flags}: these apply to the NTL loss, which --ntl-weight 0 leaves off (Megatron's own CE runs "
                "then, without them): give --ntl-weight > 0, or drop those flags"
            )
        if self.chunked and options.ce_kernel == "framework":
            raise ValueError(
                "--ntl-chunked computes ntl_scale's CE from the hidden states; --ntl-ce-kernel framework runs "
                "Megatron's CE on the logits: drop one of them"
            )

    @property
    def enabled(self) -> bool:
        """Whether NTL contributes to the loss."""
        return self.weight > 0

    def options(self) -> NTLOptions:
        """The library's :class:`~ntl_scale.NTLOptions` for these settings."""
        return variant_of(self)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> NTLSettings:
        """Reads the ``--ntl-*`` arguments of a parsed Megatron namespace (:func:`add_ntl_args`)."""
        values = {"weight": args.ntl_weight}
        for option in option_fields():
            dest = _dest(option)
            values.setdefault(_field(option), getattr(args, dest, surface_default(option.name, "megatron")))
        return cls(**values)  # type: ignore[arg-type]


def _dest(option: OptionField) -> str:
    """The namespace attribute of an option's flag (``--ntl-number-vocab`` -> ``ntl_number_vocab``)."""
    flag = str(surface_name(option.name, "megatron"))  # every option has one (tests/unit/test_options_surfaces.py)
    return flag.lstrip("-").replace("-", "_")


def _field(option: OptionField) -> str:
    """The :class:`NTLSettings` field of an option: its name, but ``number_vocab`` for ``digit_level``."""
    return "number_vocab" if option.name == "digit_level" else option.name


def _number_flag(name: str) -> Any:
    """The argparse ``type`` of the numeric option ``name``: parses the text, then the spec's one check
    (:func:`ntl_scale.options.check_option`: finite, in range), naming the flag."""
    flag = str(surface_name(name, "megatron"))
    whole = name == "chunk_tokens"

    def parse(text: str) -> Any:
        try:
            value = int(text) if whole else float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected {'a whole number' if whole else 'a number'}, got {text!r}"
            ) from None
        try:
            return check_option(name, value, flag)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"{e} (the text {text!r})") from None

    parse.__name__ = name  # argparse names the type in its messages
    return parse


# How a flag parses its text, where not by its choices or as a switch.
_PARSERS = {name: _number_flag(name) for name in NUMERIC_CHECKS}
# Help where the spec's text does not fit a flag (another default, another spelling).
_HELP = {
    "weight": "weight of NTL; 0 (default) = off, 0.3 in the paper",
    "digit_level": "'digits' (default), 'multi-digit', or the path of a table saved with NumberVocab.save",
    "normalization": "NTL mean per micro-batch (default, the paper's) or over the global batch (split-invariant)",
}


def _help(option: OptionField) -> str:
    """The spec's first sentence of ``option``'s documentation, without markup, and the default."""
    if option.name in _HELP:
        return _HELP[option.name]
    text = " ".join(option.doc.replace("``", "").split())
    first = text.split(". ")[0].rstrip(".")
    default = surface_default(option.name, "megatron")
    return first if isinstance(default, bool) or default is None else f"{first} (default: {default})"


def add_ntl_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds the ``--ntl-*`` group; pass it as (or call it from) Megatron's ``extra_args_provider``."""
    group = parser.add_argument_group("number token loss (ntl_scale)")
    weight_first = sorted(option_fields(), key=lambda option: option.name != "weight")
    for option in weight_first:
        flag = str(surface_name(option.name, "megatron"))
        default = surface_default(option.name, "megatron")
        kwargs: dict[str, Any] = {"default": default, "help": _help(option)}
        if option.name == "digit_level":
            pass  # --ntl-number-vocab: a rule or a path (VOCAB_RULES), checked when the table is built
        elif option.type == "bool":
            kwargs["action"] = "store_true"  # every boolean option defaults to False
        elif option.choices is not None:
            kwargs["choices"] = option.choices
        else:
            kwargs["type"] = _PARSERS[option.name]
        group.add_argument(flag, **kwargs)
    return parser


def ignored_megatron_flags(args: Any) -> list[str]:
    """Megatron flags set in ``args`` that have no effect with NTL on, one sentence each."""
    notes = []
    framework = getattr(args, "ntl_ce_kernel", None) == "framework"
    if getattr(args, "cross_entropy_loss_fusion", False) and not framework:
        impl = getattr(args, "cross_entropy_fusion_impl", None)
        flag = "--cross-entropy-loss-fusion" + (f" (--cross-entropy-fusion-impl {impl})" if impl else "")
        notes.append(
            f"{flag} is ignored with --ntl-weight > 0: ntl_scale's fused CE + NTL op computes the cross entropy "
            "instead (from the vocab-sharded logits, or the hidden states with --ntl-chunked; the same two "
            "all-reduces as Megatron's fused CE). With --ntl-ce-kernel framework (or --ntl-weight 0) Megatron's own "
            "CE runs as set."
        )
    return notes


def build_number_vocab(settings: NTLSettings, tokenizer: Any, padded_vocab_size: int) -> NumberVocab:
    """The number table for a Megatron run."""
    vocab = _build_number_vocab(settings, tokenizer, padded_vocab_size)
    check_table(vocab, settings.options(), "megatron")  # a saved table of other tokens, refused before the first step
    return vocab


def _build_number_vocab(settings: NTLSettings, tokenizer: Any, padded_vocab_size: int) -> NumberVocab:
    rule = settings.number_vocab
    source = table_source(rule)
    if isinstance(source, bool):
        try:
            return NumberVocab.from_tokenizer(tokenizer, vocab_size=padded_vocab_size, digit_level=source)
        except (NotImplementedError, TypeError) as e:
            # NullTokenizer and similar raise NotImplementedError from inv_vocab.
            name = type(tokenizer).__name__
            if _is_null_tokenizer(tokenizer):  # token ids without text (mock data): no table to read
                fix = (
                    "Its ids have no text, so say which ids are numbers: with --mock-data pass "
                    "--ntl-number-vocab configs/megatron/null_tokenizer_numbers.json (ids 48-57 are the digits "
                    "0-9, their ASCII codes; a placeholder for a smoke run), or write your own with "
                    "NumberVocab.from_id_to_token({id: token, ...}).save(PATH) and pass --ntl-number-vocab PATH"
                )
            else:
                fix = (
                    "Pass --ntl-number-vocab PATH with a table saved by `python launch/save_number_vocab.py "
                    "TOKENIZER --out PATH` or NumberVocab.from_tokenizer(...).save(PATH)"
                )
            raise ValueError(
                f"--ntl-number-vocab {rule!r} reads the number tokens from the tokenizer, but "
                f"{name} has no token table ({type(e).__name__}: {e}). {fix}"
            ) from None
    if not os.path.isfile(rule):
        raise ValueError(
            f"--ntl-number-vocab {rule!r} is neither one of {VOCAB_RULES} nor an existing file; "
            "build a table with NumberVocab.from_tokenizer(...).save(path)"
        )
    return NumberVocab.load(rule, vocab_size=padded_vocab_size)


def _is_null_tokenizer(tokenizer: Any) -> bool:
    """Megatron's NullTokenizer: its own class (<= 0.16), or inside ``DefaultTokenizerText`` (library ``null-text``)."""
    inner = getattr(tokenizer, "_tokenizer", None)
    names = (type(tokenizer).__name__, type(inner).__name__)
    return any("NullTokenizer" in n for n in names) or "null" in str(getattr(tokenizer, "library", ""))
