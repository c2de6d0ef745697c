"""Command line: the number table of a local tokenizer, saved for ``NumberVocab.load`` and ``--ntl-number-vocab``.

Usage::

    python launch/save_number_vocab.py path/to/tokenizer_or_checkpoint --out numbers.json [--multi-digit]

It prints the tokenizer's number-token census (digits, multi-digit number tokens, what the table leaves
out) and the recipe for its family, and refuses the default digit table where that leaves out most number
tokens (a Llama 3-style tokenizer): pass ``--multi-digit`` (the recipe), or ``--digits`` to keep it anyway.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Sequence
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout, for ntl_scale
from ntl_scale.number_vocab import NumberTableWarning, NumberVocab, number_token_census


def _tokenizer(path: str) -> Any:
    if os.path.isdir(path):
        from ntl_scale._runtime import require

        return require("transformers", "hf", "save_number_vocab").AutoTokenizer.from_pretrained(path)
    from ntl_scale._runtime import require

    return require("sentencepiece", "hf", "save_number_vocab").SentencePieceProcessor(model_file=path)


def main(argv: Sequence[str] | None = None) -> None:
    """``python launch/save_number_vocab.py TOKENIZER --out numbers.json``: save a table for training ranks.

    ``TOKENIZER`` is a local Hugging Face tokenizer or checkpoint directory (its ``config.json``
    gives the padded vocabulary size) or a SentencePiece ``.model`` file. The saved table is what
    ``--ntl-number-vocab PATH`` (Megatron) and ``NumberVocab.load`` read, for runs whose tokenizer
    has no token table of its own (Megatron's ``NullTokenizer``) or to keep tokenizers off the ranks.
    """
    import argparse

    parser = argparse.ArgumentParser(prog="python launch/save_number_vocab.py", description=main.__doc__)
    parser.add_argument("tokenizer", help="a local Hugging Face tokenizer/checkpoint directory or a .model file")
    parser.add_argument("--out", required=True, help="where to write the JSON table")
    parser.add_argument("--vocab-size", type=int, default=None, help="the model's padded vocabulary size")
    rule = parser.add_mutually_exclusive_group()
    rule.add_argument("--multi-digit", action="store_true", help="multi-digit number tokens (default: digits)")
    rule.add_argument(
        "--digits", action="store_true", help="the digit table even where it leaves out most number tokens"
    )
    parser.add_argument("--prefixed", action="store_true", help="include word-prefixed digits (▁3, Ġ3, ##3)")
    args = parser.parse_args(argv)
    is_model = args.tokenizer.endswith(".model") and os.path.isfile(args.tokenizer)
    if not (os.path.isdir(args.tokenizer) or is_model):
        parser.error(f"{args.tokenizer!r} is neither a local tokenizer directory nor a SentencePiece .model file")
    census = number_token_census(_tokenizer(args.tokenizer), digit_level=not args.multi_digit, prefixed=args.prefixed)
    print(census.summary())
    if census.loses_most and not args.digits:
        parser.error(
            f"the digit table would leave out {census.left_out} of this tokenizer's number tokens, keeping "
            f"{census.kept}; build the {census.recipe()} with --multi-digit, or pass --digits to keep the digits"
        )
    options = {"vocab_size": args.vocab_size, "digit_level": not args.multi_digit, "prefixed": args.prefixed}
    with warnings.catch_warnings():
        if args.digits:  # asked for: the census above already said what it leaves out
            warnings.simplefilter("ignore", NumberTableWarning)
        if os.path.isdir(args.tokenizer):
            from ntl_scale.integrations.hf import number_vocab_from_pretrained

            vocab = number_vocab_from_pretrained(args.tokenizer, **options)
        else:
            vocab = NumberVocab.from_sentencepiece(args.tokenizer, **options)
    vocab.save(args.out)
    print(f"{args.out}: {len(vocab)} number tokens over a vocabulary of {vocab.vocab_size}")
    if args.multi_digit and census.multi_digit_squash is not None:
        print(f"NTL-WAS on this table: set squash_factor {census.multi_digit_squash:.1f} (docs/number_vocab.md)")


if __name__ == "__main__":
    main()
