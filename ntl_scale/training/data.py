"""The data of a run, from its data section, through Hugging Face ``datasets``.

``arithmetic``: generated ``train`` examples, ``interpolate``/``extrapolate`` evaluation splits.
``deepmind``: ``train_path`` is a question/answer text file, or a folder written by
``python -m ntl_scale.data.deepmind`` (its ``arithmetic_train.txt`` for training, the first
``eval_examples`` of ``arithmetic_test_interpolate.txt`` / ``arithmetic_test_extrapolate.txt`` as
the evaluation splits). ``jsonl``: ``{question, answer}`` lines. For files, ``eval_path`` (if given)
is the ``eval`` split.
"""

from __future__ import annotations

import os
from typing import Any

from ..data.arithmetic import ArithmeticConfig, Example, generate
from ..data.collate import EncodedExample, ShardedOrder
from ..data.deepmind import SPLIT_FILES
from ..data.hf_datasets import StreamingOrder, datasets_module, load_qa, rows_to_examples, tokenize_qa
from .config import DataConfig

__all__ = ["Batches", "eval_sets", "train_dataset"]


def _task(cfg: DataConfig) -> ArithmeticConfig:
    return ArithmeticConfig(
        kinds=tuple(cfg.kinds), train_digits=cfg.train_digits, extrapolate_digits=cfg.extrapolate_digits,
        negative_share=cfg.negative_share,
    )  # fmt: skip


def _train_file(cfg: DataConfig) -> str:
    assert cfg.train_path is not None  # DataConfig validates this
    if cfg.source == "deepmind" and os.path.isdir(cfg.train_path):
        path = os.path.join(cfg.train_path, SPLIT_FILES["train"])
        if not os.path.isfile(path):
            raise ValueError(
                f"data.train_path={cfg.train_path!r} is a folder without {SPLIT_FILES['train']}; generate it with "
                f"python -m ntl_scale.data.deepmind --out {cfg.train_path}, or point data.train_path at a .txt file"
            )
        return path
    return cfg.train_path


def train_dataset(cfg: DataConfig, tokenizer: Any, *, kind: str = "causal") -> Any:
    """The tokenised training rows: a memory-mapped ``Dataset`` (cached), or an ``IterableDataset``
    when ``data.streaming`` is set."""
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
    """Named evaluation splits, ``eval_examples`` questions each (read lazily: only those are parsed)."""
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


class Batches:
    """This rank's micro-batches of a tokenised dataset, in :class:`ShardedOrder` (a ``Dataset``) or
    :class:`StreamingOrder` (an ``IterableDataset``); ``position`` is the resumable state."""

    def __init__(self, dataset: Any, micro_batch_size: int, rank: int, world_size: int, seed: int, accumulation: int,
                 shuffle_buffer: int = 10000) -> None:  # fmt: skip
        self.dataset = dataset
        if hasattr(dataset, "num_rows"):
            self.order: Any = ShardedOrder(len(dataset), micro_batch_size, rank, world_size, seed, accumulation)
        else:
            self.order = StreamingOrder(dataset, micro_batch_size, rank, world_size, seed, accumulation, shuffle_buffer)

    @property
    def position(self) -> int:
        return self.order.position

    @position.setter
    def position(self, value: int) -> None:
        self.order.position = value

    def next(self) -> list[EncodedExample]:
        if isinstance(self.order, ShardedOrder):
            return rows_to_examples(self.dataset[self.order.next_indices()])
        return self.order.next_examples()
