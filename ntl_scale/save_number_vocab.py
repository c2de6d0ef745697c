"""Command line: the number table of a local tokenizer, saved for ``NumberVocab.load`` and ``--ntl-number-vocab``.

Usage::

    python -m ntl_scale.save_number_vocab path/to/tokenizer_or_checkpoint --out numbers.json [--multi-digit]
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from ntl_scale.number_vocab import NumberVocab


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m ntl_scale.save_number_vocab TOKENIZER --out numbers.json``: save a table for training ranks.

    ``TOKENIZER`` is a local Hugging Face tokenizer or checkpoint directory (its ``config.json``
    gives the padded vocabulary size) or a SentencePiece ``.model`` file. The saved table is what
    ``--ntl-number-vocab PATH`` (Megatron) and ``NumberVocab.load`` read, for runs whose tokenizer
    has no token table of its own (Megatron's ``NullTokenizer``) or to keep tokenizers off the ranks.
    """
    import argparse

    parser = argparse.ArgumentParser(prog="python -m ntl_scale.save_number_vocab", description=main.__doc__)
    parser.add_argument("tokenizer", help="a local Hugging Face tokenizer/checkpoint directory or a .model file")
    parser.add_argument("--out", required=True, help="where to write the JSON table")
    parser.add_argument("--vocab-size", type=int, default=None, help="the model's padded vocabulary size")
    parser.add_argument("--multi-digit", action="store_true", help="multi-digit number tokens (default: digits)")
    parser.add_argument("--prefixed", action="store_true", help="include word-prefixed digits (▁3, Ġ3, ##3)")
    args = parser.parse_args(argv)
    options = {"vocab_size": args.vocab_size, "digit_level": not args.multi_digit, "prefixed": args.prefixed}
    if os.path.isdir(args.tokenizer):
        from ntl_scale.integrations.hf import number_vocab_from_pretrained

        vocab = number_vocab_from_pretrained(args.tokenizer, **options)
    elif args.tokenizer.endswith(".model") and os.path.isfile(args.tokenizer):
        vocab = NumberVocab.from_sentencepiece(args.tokenizer, **options)
    else:
        parser.error(f"{args.tokenizer!r} is neither a local tokenizer directory nor a SentencePiece .model file")
    vocab.save(args.out)
    print(f"{args.out}: {len(vocab)} number tokens over a vocabulary of {vocab.vocab_size}")


if __name__ == "__main__":
    main()
