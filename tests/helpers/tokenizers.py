"""Tokenizers built offline from generated arithmetic text (no hub downloads).

Each builder trains a tiny tokenizer of one family the project must support:

* ``sentencepiece_model``: a T5-style unigram SentencePiece ``.model`` file (digits split, so the
  vocabulary has ``"3"`` and ``"▁3"``-style pieces);
* ``t5_fast`` / ``sentencepiece_slow``: Hugging Face fast and slow wrappers of that model;
* ``byte_level_bpe``: GPT-2 style byte-level BPE (``"Ġ3"``), digits split into single tokens;
* ``llama3_style_bpe``: byte-level BPE whose pre-tokenizer splits numbers into 1-3 digit groups,
  so multi-digit tokens such as ``"123"`` exist;
* ``mistral_style_sentencepiece``: a Llama 2 / Mistral-style BPE SentencePiece model (digits split,
  byte fallback), the SentencePiece family of Mistral and Gemma;
* ``wordpiece_fast`` / ``wordpiece_slow``: BERT style WordPiece (``"##3"`` continuations).
"""

from __future__ import annotations

import functools
import os
import tempfile
from pathlib import Path

from benchmarks.common import byte_level_bpe as byte_level_bpe
from benchmarks.common import corpus as corpus
from benchmarks.common import llama3_style_bpe as llama3_style_bpe


@functools.cache
def _workdir() -> Path:
    return Path(tempfile.mkdtemp(prefix="ntl_scale_tok_"))


@functools.cache
def sentencepiece_model(vocab_size: int = 120) -> str:
    """Path of a T5-style unigram SentencePiece model trained on :func:`corpus`."""
    import sentencepiece as spm

    text = _workdir() / "corpus.txt"
    text.write_text("\n".join(corpus()), encoding="utf-8")
    prefix = _workdir() / f"sp{vocab_size}"
    spm.SentencePieceTrainer.train(
        input=str(text),
        model_prefix=str(prefix),
        vocab_size=vocab_size,
        model_type="unigram",
        pad_id=0,
        eos_id=1,
        unk_id=2,
        bos_id=-1,
        split_digits=True,
        hard_vocab_limit=False,
        minloglevel=2,
    )
    return f"{prefix}.model"


@functools.cache
def mistral_style_sentencepiece(vocab_size: int = 300) -> str:
    """Path of a BPE SentencePiece model with ``split_digits`` and ``byte_fallback`` (Llama 2, Mistral v1-v3, Gemma)."""
    import sentencepiece as spm

    text = _workdir() / "corpus.txt"
    text.write_text("\n".join(corpus()), encoding="utf-8")
    prefix = _workdir() / f"mistral{vocab_size}"
    spm.SentencePieceTrainer.train(
        input=str(text),
        model_prefix=str(prefix),
        vocab_size=vocab_size,
        model_type="bpe",
        split_digits=True,
        byte_fallback=True,
        minloglevel=2,
    )
    return f"{prefix}.model"


def t5_fast():
    """T5 (fast, ``tokenizers`` backend) tokenizer over :func:`sentencepiece_model`."""
    import sentencepiece as spm
    from transformers import T5Tokenizer

    sp = spm.SentencePieceProcessor(model_file=sentencepiece_model())
    pieces = [(sp.id_to_piece(i), sp.get_score(i)) for i in range(sp.get_piece_size())]
    return T5Tokenizer(vocab=pieces, extra_ids=0)


def sentencepiece_slow():
    """A slow (Python, ``sentencepiece`` backend) Hugging Face tokenizer over the same model."""
    from transformers import BertGenerationTokenizer

    return BertGenerationTokenizer(vocab_file=sentencepiece_model())


def _wordpiece_vocab_file() -> str:
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    trainer = trainers.WordPieceTrainer(
        vocab_size=300, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"], show_progress=False
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    path = _workdir() / "wordpiece_vocab.txt"
    path.write_text("\n".join(t for t, _ in vocab) + "\n", encoding="utf-8")
    return str(path)


@functools.cache
def wordpiece_vocab_file() -> str:
    """Path of a BERT ``vocab.txt`` trained on :func:`corpus`."""
    return _wordpiece_vocab_file()


def wordpiece_fast():
    """BERT (fast) tokenizer over :func:`wordpiece_vocab_file`."""
    from transformers import BertTokenizer

    return BertTokenizer(vocab=wordpiece_vocab_file())


def wordpiece_slow():
    """BERT (slow, Python) tokenizer over :func:`wordpiece_vocab_file`."""
    from transformers.models.bert.tokenization_bert_legacy import BertTokenizerLegacy

    return BertTokenizerLegacy(vocab_file=wordpiece_vocab_file())


def save_dir(tokenizer, name: str) -> str:
    """Saves a tokenizer to a fresh directory and returns it (for ``from_pretrained`` round trips)."""
    path = os.path.join(_workdir(), name)
    tokenizer.save_pretrained(path)
    return path
