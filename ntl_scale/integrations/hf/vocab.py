"""Number tables of local Hugging Face checkpoints (tokenizer + ``config.json``).

``transformers`` is imported on first use; without it the function raises an ImportError that
names the extra to install (``pip install 'ntl_scale[hf]'``).
"""

from __future__ import annotations

import os

from ..._runtime import require
from ...number_vocab import NumberVocab

__all__ = ["number_vocab_from_pretrained"]


def number_vocab_from_pretrained(
    path: str | os.PathLike[str],
    *,
    vocab_size: int | None = None,
    digit_level: bool = True,
    prefixed: bool = False,
) -> NumberVocab:
    """Builds the number table of a local Hugging Face checkpoint or tokenizer directory."""
    transformers = require("transformers", "hf", "ntl_scale.integrations.hf")
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise ValueError(
            f"number_vocab_from_pretrained: {path!r} is not a local directory; ntl_scale never downloads. "
            "Save the tokenizer first (tokenizer.save_pretrained(dir)) and pass that directory."
        )
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    if vocab_size is None and os.path.isfile(os.path.join(path, "config.json")):
        config = transformers.AutoConfig.from_pretrained(path)
        vocab_size = getattr(config, "vocab_size", None)
    if vocab_size is not None:
        vocab_size = max(int(vocab_size), len(tokenizer))
    return NumberVocab.from_tokenizer(tokenizer, vocab_size=vocab_size, digit_level=digit_level, prefixed=prefixed)
