"""The data of a run, from its data section, through Hugging Face ``datasets``: ``arithmetic``,
``deepmind`` and ``jsonl`` question/answer sources, and the packed pretraining sources ``text`` and
``megatron`` (their held-out sequences: :func:`heldout_batches`).
"""

from __future__ import annotations

import os
from typing import Any

from ..data.arithmetic import ArithmeticConfig, Example, generate
from ..data.collate import ShardedOrder
from ..data.hf_datasets import (
    HFDocuments,
    PackedStream,
    StreamingOrder,
    datasets_module,
    load_qa,
    load_text,
    packed_stream,
    rows_to_examples,
    tokenize_documents,
    tokenize_qa,
)
from ..data.packing import PackedSequences, collate_packed, heldout_split, pack_documents
from .config import DataConfig

__all__ = ["PACKED_SOURCES", "Batches", "eval_sets", "heldout_batches", "train_dataset"]

PACKED_SOURCES = ("text", "megatron")
"""``data.source`` values whose documents are packed into ``train.seq_length`` sequences."""

SPLIT_FILES = {
    "train": "arithmetic_train.txt",
    "val": "arithmetic_val.txt",
    "interpolate": "arithmetic_test_interpolate.txt",
    "extrapolate": "arithmetic_test_extrapolate.txt",
}
"""The arithmetic subset's file names in a folder of ``launch/deepmind_data.py``, by split."""


def _documents(cfg: DataConfig, tokenizer: Any) -> Any:
    """The tokenised documents of a packed source: a random-access source, or (streaming) an
    ``IterableDataset`` of ``input_ids`` rows."""
    assert cfg.train_path is not None  # DataConfig validates this
    if cfg.source == "megatron":
        from ..data.indexed import IndexedDocuments

        return IndexedDocuments(cfg.train_path)
    rows = load_text(cfg.train_path, text_column=cfg.text_column, streaming=cfg.streaming, cache_dir=cfg.cache_dir)
    documents = tokenize_documents(rows, tokenizer, text_column=cfg.text_column, num_proc=cfg.num_proc)
    return documents if cfg.streaming else HFDocuments(documents)


def _packed_checks(cfg: DataConfig, kind: str, seq_length: int | None) -> int:
    if kind != "causal":
        raise ValueError(f"data.source={cfg.source!r} packs documents for causal models; got model.kind={kind!r}")
    if seq_length is None:
        raise ValueError(f"data.source={cfg.source!r} needs a sequence length (train.seq_length)")
    return seq_length


def _packed_train(cfg: DataConfig, tokenizer: Any, seq_length: int) -> Any:
    documents = _documents(cfg, tokenizer)
    if cfg.streaming:
        tokens = cfg.eval_sequences * seq_length
        return packed_stream(documents, seq_length, document_isolation=cfg.document_isolation, skip_tokens=tokens)
    first = heldout_split(documents.lengths, seq_length, cfg.eval_sequences)
    train = PackedSequences(documents, seq_length, first_document=first, document_isolation=cfg.document_isolation)
    if len(train) == 0:
        raise ValueError(
            f"{cfg.train_path}: {train.stats.tokens} training tokens do not fill one sequence of train.seq_length="
            f"{seq_length}; add data or shorten the sequences"
        )
    return train


def _task(cfg: DataConfig) -> ArithmeticConfig:
    return ArithmeticConfig(
        kinds=tuple(cfg.kinds), train_digits=cfg.train_digits, extrapolate_digits=cfg.extrapolate_digits,
        negative_share=cfg.negative_share, reverse_answers=cfg.reverse_answers,
    )  # fmt: skip


def _train_file(cfg: DataConfig) -> str:
    assert cfg.train_path is not None  # DataConfig validates this
    if cfg.source == "deepmind" and os.path.isdir(cfg.train_path):
        path = os.path.join(cfg.train_path, SPLIT_FILES["train"])
        if not os.path.isfile(path):
            raise ValueError(
                f"data.train_path={cfg.train_path!r} is a folder without {SPLIT_FILES['train']}; generate it with "
                f"python launch/deepmind_data.py --out {cfg.train_path}, or point data.train_path at a .txt file"
            )
        return path
    return cfg.train_path


def train_dataset(cfg: DataConfig, tokenizer: Any, *, kind: str = "causal", seq_length: int | None = None) -> Any:
    """The tokenised training rows: a cached ``Dataset`` or, streaming, an ``IterableDataset``; packed sources
    (which need ``seq_length``): ``PackedSequences`` or, streaming, a ``PackedStream``."""
    if cfg.source in PACKED_SOURCES:
        return _packed_train(cfg, tokenizer, _packed_checks(cfg, kind, seq_length))
    if cfg.source == "arithmetic":
        datasets = datasets_module()
        examples = generate(cfg.train_examples, "train", seed=cfg.seed, config=_task(cfg))
        columns = {"question": [e.question for e in examples], "answer": [e.answer for e in examples]}
        rows = datasets.Dataset.from_dict(columns)
    else:
        rows = load_qa(cfg.source, _train_file(cfg), streaming=cfg.streaming, cache_dir=cfg.cache_dir)
    encoded = tokenize_qa(rows, tokenizer, kind=kind, max_length=cfg.max_length, num_proc=cfg.num_proc)
    if not cfg.streaming and len(encoded) == 0:
        raise ValueError(f"no training example fits data.max_length={cfg.max_length} tokens; raise it")
    return encoded


def eval_sets(cfg: DataConfig) -> dict[str, list[Example]]:
    """Named evaluation splits, ``eval_examples`` questions each; for the packed sources the ``questions`` of
    ``data.eval_path`` when given (their loss and perplexity: :func:`heldout_batches`)."""
    if cfg.source in PACKED_SOURCES:
        if not cfg.eval_path:
            return {}
        rows = load_qa("jsonl", cfg.eval_path, streaming=True).take(cfg.eval_examples)
        return {"questions": [Example(r["question"], r["answer"], os.path.basename(cfg.eval_path)) for r in rows]}
    if cfg.source == "arithmetic":
        splits = ("interpolate", "extrapolate")
        return {s: generate(cfg.eval_examples, s, seed=cfg.seed, config=_task(cfg)) for s in splits}
    files = {}
    if cfg.source == "deepmind" and cfg.train_path and os.path.isdir(cfg.train_path):
        files = {s: os.path.join(cfg.train_path, SPLIT_FILES[s]) for s in ("interpolate", "extrapolate")}
    if cfg.eval_path:
        files["eval"] = cfg.eval_path
    out = {}
    for split, path in files.items():
        rows = load_qa(cfg.source, path, streaming=True).take(cfg.eval_examples)
        out[split] = [Example(r["question"], r["answer"], os.path.basename(path)) for r in rows]
    return out


def heldout_batches(
    cfg: DataConfig, tokenizer: Any, *, seq_length: int, micro_batch_size: int, dp_rank: int, dp: int
) -> list[dict[str, Any]]:
    """This data-parallel rank's share of the first ``data.eval_sequences`` packed sequences (never trained on),
    cut to a multiple of ``dp`` so every rank runs the same number of forward passes (host tensors)."""
    if cfg.source not in PACKED_SOURCES or cfg.eval_sequences == 0:
        return []
    if cfg.eval_sequences < dp:
        raise ValueError(
            f"data.eval_sequences={cfg.eval_sequences} is fewer than the {dp} data-parallel ranks that share it; "
            f"hold out at least {dp} sequences"
        )
    documents = _documents(cfg, tokenizer)
    if cfg.streaming:
        tokens = (row["input_ids"] for row in documents)
        rows = list(pack_documents(tokens, seq_length, document_isolation=cfg.document_isolation,
                                   max_sequences=cfg.eval_sequences))  # fmt: skip
    else:
        stop = heldout_split(documents.lengths, seq_length, cfg.eval_sequences)
        held = PackedSequences(documents, seq_length, stop_document=stop, max_sequences=cfg.eval_sequences,
                               document_isolation=cfg.document_isolation)  # fmt: skip
        rows = [held[i] for i in range(len(held))]
    rows = rows[: len(rows) - len(rows) % dp][dp_rank::dp]
    return [collate_packed(rows[s : s + micro_batch_size]) for s in range(0, len(rows), micro_batch_size)]


def packing_summary(dataset: Any) -> str | None:
    """One log line of what packing did (documents, sequences, and every count of what was left out),
    or None for a question/answer or streamed dataset (a stream logs its counts after each pass)."""
    return dataset.stats.describe("packed training corpus") if isinstance(dataset, PackedSequences) else None


class Batches:
    """This rank's micro-batches in :class:`ShardedOrder` or :class:`StreamingOrder`, resumable at ``position``:
    encoded examples, or for packed data a collated batch of host tensors."""

    def __init__(self, dataset: Any, micro_batch_size: int, rank: int, world_size: int, seed: int, accumulation: int,
                 shuffle_buffer: int = 10000) -> None:  # fmt: skip
        self.dataset = dataset
        self.packed = isinstance(dataset, (PackedSequences, PackedStream))
        if isinstance(dataset, PackedStream):
            dataset = dataset.rows
        if hasattr(dataset, "num_rows") or isinstance(dataset, PackedSequences):
            self.order: Any = ShardedOrder(len(dataset), micro_batch_size, rank, world_size, seed, accumulation)
        else:
            self.order = StreamingOrder(dataset, micro_batch_size, rank, world_size, seed, accumulation, shuffle_buffer)

    @property
    def position(self) -> int:
        return self.order.position

    @position.setter
    def position(self, value: int) -> None:
        self.order.position = value

    def next(self) -> Any:
        if self.packed and isinstance(self.order, ShardedOrder):
            return collate_packed([self.dataset[i] for i in self.order.next_indices()])
        if self.packed:
            return collate_packed(self.order.next_rows())
        if isinstance(self.order, ShardedOrder):
            return rows_to_examples(self.dataset[self.order.next_indices()])
        return self.order.next_examples()
