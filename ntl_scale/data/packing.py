"""Packing tokenised documents into fixed-length pretraining sequences, with no padding.

Sequence ``i`` is tokens ``[i * seq_length, (i + 1) * seq_length)`` of the corpus as one stream (as
``run_clm.py``'s ``group_texts``); the tail and empty documents are left out and counted.
``document_isolation`` restarts ``position_ids`` at each document and masks each document's first label.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from .collate import IGNORE_INDEX

__all__ = [
    "DocumentSource",
    "PackedSequences",
    "PackingStats",
    "collate_packed",
    "heldout_split",
    "pack_documents",
    "packed_row",
]

logger = logging.getLogger("ntl_scale.data")


class DocumentSource(Protocol):
    """Tokenised documents with random access: their lengths and a contiguous range of them."""

    lengths: np.ndarray
    """Tokens per document (int64), in corpus order."""

    def read(self, first: int, stop: int) -> np.ndarray:
        """The tokens of documents ``first .. stop - 1``, concatenated (int64)."""
        ...


@dataclass
class PackingStats:
    """What packing did with a corpus, for the log: nothing is dropped without a count here."""

    documents: int = 0
    """Documents read (empty ones included)."""
    empty_documents: int = 0
    """Documents of zero tokens (empty or null text), skipped."""
    long_documents: int = 0
    """Documents longer than one sequence (split across sequences, every part trained)."""
    tokens: int = 0
    """Tokens of all documents (EOS/BOS included)."""
    sequences: int = 0
    """Whole sequences packed."""
    tail_tokens: int = 0
    """Tokens after the last whole sequence, left out."""
    seq_length: int = 0
    extra: dict[str, int] = field(default_factory=dict)

    def describe(self, name: str = "packed") -> str:
        return (
            f"{name}: {self.documents} documents, {self.tokens} tokens -> {self.sequences} sequences of "
            f"{self.seq_length} tokens; {self.empty_documents} empty documents skipped, {self.long_documents} "
            f"longer than a sequence (split across sequences), {self.tail_tokens} tail tokens left out"
        )


def packed_row(tokens: np.ndarray, starts: Sequence[int], document_isolation: bool) -> dict[str, np.ndarray]:
    """One packed sequence as a row: ``input_ids``, ``labels`` and, with isolation, ``position_ids``."""
    input_ids = np.asarray(tokens, dtype=np.int64)
    labels = input_ids.copy()
    row = {"input_ids": input_ids, "labels": labels}
    if document_isolation:
        length = len(input_ids)
        inner = np.asarray(sorted(s for s in set(starts) if 0 < s < length), dtype=np.int64)
        begin = np.zeros(length, dtype=np.int64)  # the offset of the document each position belongs to
        begin[inner] = inner
        begin = np.maximum.accumulate(begin)
        row["position_ids"] = np.arange(length, dtype=np.int64) - begin
        labels[inner] = IGNORE_INDEX
    return row


class PackedSequences:
    """Map-style dataset of packed sequences over documents ``first_document .. stop_document - 1``."""

    def __init__(
        self,
        source: DocumentSource,
        seq_length: int,
        *,
        first_document: int = 0,
        stop_document: int | None = None,
        max_sequences: int | None = None,
        document_isolation: bool = False,
    ) -> None:
        if seq_length < 2:
            raise ValueError(f"seq_length must be >= 2 (a token and its successor), got {seq_length}")
        self.source, self.seq_length, self.document_isolation = source, seq_length, document_isolation
        self.first = first_document
        lengths = np.asarray(source.lengths[first_document:stop_document], dtype=np.int64)
        self.stop = first_document + len(lengths)
        self.offsets = np.concatenate([[0], np.cumsum(lengths)])  # the stream offset of each document
        total = int(self.offsets[-1])
        count = total // seq_length if max_sequences is None else min(total // seq_length, max_sequences)
        self.num_sequences = count
        self.stats = PackingStats(
            documents=len(lengths), empty_documents=int((lengths == 0).sum()),
            long_documents=int((lengths > seq_length).sum()), tokens=total, sequences=count,
            tail_tokens=total - count * seq_length, seq_length=seq_length,
        )  # fmt: skip

    def __len__(self) -> int:
        return self.num_sequences

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        if not 0 <= index < self.num_sequences:
            raise IndexError(f"sequence {index} of {self.num_sequences}")
        start, end = index * self.seq_length, (index + 1) * self.seq_length
        d0 = int(np.searchsorted(self.offsets, start, side="right")) - 1  # holds token `start`
        d1 = int(np.searchsorted(self.offsets, end, side="left"))  # documents beginning before `end`
        tokens = self.source.read(self.first + d0, self.first + d1)
        skip = start - int(self.offsets[d0])
        starts = (self.offsets[d0:d1] - start).tolist()
        return packed_row(tokens[skip : skip + self.seq_length], starts, self.document_isolation)


def heldout_split(lengths: np.ndarray, seq_length: int, sequences: int) -> int:
    """The first document of the training part when the first ``sequences`` sequences are held out."""
    if sequences <= 0:
        return 0
    need = sequences * seq_length
    offsets = np.cumsum(np.asarray(lengths, dtype=np.int64))
    split = int(np.searchsorted(offsets, need, side="left"))
    if split >= len(offsets):
        total = int(offsets[-1]) if len(offsets) else 0
        raise ValueError(
            f"the corpus has {total} tokens, fewer than the {need} that data.eval_sequences={sequences} x "
            f"seq_length={seq_length} holds out; lower data.eval_sequences or add data"
        )
    return split + 1


def pack_documents(
    documents: Iterable[Sequence[int] | np.ndarray],
    seq_length: int,
    *,
    document_isolation: bool = False,
    skip_tokens: int = 0,
    max_sequences: int | None = None,
    stats: PackingStats | None = None,
) -> Iterator[dict[str, np.ndarray]]:
    """Packs a stream of documents as :class:`PackedSequences` does (the streaming path)."""
    stats = stats if stats is not None else PackingStats()
    stats.seq_length = seq_length
    buffer: list[np.ndarray] = []
    buffered = 0
    starts: list[int] = []  # document starts relative to the buffer's first token
    skipped = 0
    for document in documents:
        tokens = np.asarray(document, dtype=np.int64)
        if skipped < skip_tokens:
            skipped += len(tokens)
            continue
        stats.documents += 1
        stats.tokens += len(tokens)
        if len(tokens) == 0:
            stats.empty_documents += 1
            continue
        stats.long_documents += int(len(tokens) > seq_length)
        starts.append(buffered)
        buffer.append(tokens)
        buffered += len(tokens)
        while buffered >= seq_length:
            if max_sequences is not None and stats.sequences >= max_sequences:
                break
            flat = np.concatenate(buffer)
            yield packed_row(flat[:seq_length], starts, document_isolation)
            stats.sequences += 1
            buffer, buffered = [flat[seq_length:]], buffered - seq_length
            starts = [s - seq_length for s in starts if s - seq_length >= 0]
        if max_sequences is not None and stats.sequences >= max_sequences:
            break
    stats.tail_tokens = stats.tokens - stats.sequences * seq_length


def collate_packed(rows: Sequence[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Stacks packed rows into a micro-batch of host tensors, without ``attention_mask`` (no padding; Hugging
    Face builds the per-document mask from ``position_ids`` only when no mask is passed)."""
    return {key: torch.as_tensor(np.stack([np.asarray(r[key]) for r in rows]), dtype=torch.long) for key in rows[0]}
