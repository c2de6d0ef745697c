"""Hugging Face adapter: number tables from local checkpoints and the causal-LM label shift.

``transformers`` is imported on first use; without it the functions raise an ImportError that
names the extra to install (``pip install 'ntl_scale[hf]'``).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from .._optional import require
from ..losses import CENTLOutput, ce_with_ntl
from ..number_vocab import NumberVocab

__all__ = ["causal_lm_ce_with_ntl", "number_vocab_from_pretrained", "shift_labels"]


def number_vocab_from_pretrained(
    path: str | os.PathLike[str],
    *,
    vocab_size: int | None = None,
    digit_level: bool = True,
    prefixed: bool = False,
) -> NumberVocab:
    """Builds the number table of a local Hugging Face checkpoint or tokenizer directory.

    The model's (possibly padded) vocabulary size is read from its ``config.json`` when the
    directory has one, so the table matches the logits (e.g. Qwen: 151936 columns, 151665 tokens).

    Args:
        path: a local directory with the tokenizer files (and optionally ``config.json``).
        vocab_size: override the model vocabulary size.
        digit_level: exactly the ten ASCII digits (True) or multi-digit literals (False).
        prefixed: include word-prefixed digits (``▁3``, ``Ġ3``, ``##3``).

    Returns:
        The table.
    """
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


def shift_labels(labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Next-token labels of a causal LM: ``labels[..., 1:]`` padded with ``ignore_index`` at the end.

    Hugging Face causal LMs take unshifted ``labels`` and shift inside the model; with this the
    logits at position ``t`` pair with ``shifted[t]`` without slicing (and copying) the logits.
    """
    pad = torch.full((*labels.shape[:-1], 1), ignore_index, dtype=labels.dtype, device=labels.device)
    return torch.cat([labels[..., 1:], pad], dim=-1)


def causal_lm_ce_with_ntl(
    logits: torch.Tensor, labels: torch.Tensor, vocab: NumberVocab, *, ignore_index: int = -100, **options: Any
) -> CENTLOutput:
    """:func:`ntl_scale.ce_with_ntl` with Hugging Face causal-LM label semantics (unshifted labels).

    Args:
        logits: ``[batch, seq, V]`` model output.
        labels: ``[batch, seq]`` the ``labels`` a Hugging Face causal LM takes (not shifted).
        vocab: the number-token table.
        ignore_index: label value to ignore (also fills the shifted-out last position).
        **options: forwarded to :func:`ntl_scale.ce_with_ntl`.

    Returns:
        The :class:`ntl_scale.CENTLOutput`.
    """
    return ce_with_ntl(logits, shift_labels(labels, ignore_index), vocab, ignore_index=ignore_index, **options)
