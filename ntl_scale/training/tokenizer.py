"""A character tokenizer built offline (every digit is one token): the tiny default's tokenizer."""

from __future__ import annotations

import string
from typing import Any

from .._runtime import require

ALPHABET = string.digits + string.ascii_letters + " ?.,+-*/()=#:'\n"
SPECIALS = ("<pad>", "<eos>", "<unk>")


def build_char_tokenizer(alphabet: str = ALPHABET) -> Any:
    """A Hugging Face fast tokenizer with one token per character of ``alphabet`` (no download)."""
    tokenizers = require("tokenizers", "hf", "the builtin character tokenizer")
    transformers = require("transformers", "hf", "the builtin character tokenizer")
    vocab = {token: i for i, token in enumerate(SPECIALS)}
    for char in alphabet:
        vocab.setdefault(char, len(vocab))
    raw = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = tokenizers.pre_tokenizers.Split(tokenizers.Regex("."), behavior="isolated")
    raw.decoder = tokenizers.decoders.Fuse()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=raw, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )
