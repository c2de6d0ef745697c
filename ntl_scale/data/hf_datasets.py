"""Training data through Hugging Face ``datasets``: files become memory-mapped Arrow tables, tokenised
with a cached, multi-process ``map``; a streaming order for corpora larger than memory.

* :func:`load_qa`: DeepMind text (question and answer lines alternate) or JSON lines
  (``{"question": ..., "answer": ...}``) -> a ``Dataset`` (or, with ``streaming=True``, an
  ``IterableDataset``) with ``question`` and ``answer`` columns. Files are read by ``datasets``'
  own ``text`` and ``json`` builders, so the Arrow cache is keyed by the file's content.
* :func:`tokenize_qa`: ``input_ids`` and ``labels`` (the prompt masked), examples longer than
  ``max_length`` dropped; a second run with the same data and tokenizer reads the cache.
* Map-style data are read in :class:`~ntl_scale.data.ShardedOrder`'s order (deterministic,
  sharded over data-parallel ranks, resumable at the exact example); :class:`StreamingOrder` does
  the same for an ``IterableDataset``.

``datasets`` is imported lazily: ``import ntl_scale`` needs only torch.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

from .._optional import require
from .collate import EncodedExample, encode_pairs, fits

__all__ = ["StreamingOrder", "load_qa", "tokenize_qa"]


def datasets_module() -> Any:
    datasets = require("datasets", "deepspeed", "loading training data")
    datasets.disable_progress_bars()  # one line per log interval, not one bar per cached map
    return datasets


def _pair_lines(batch: dict[str, list[str]], path: str) -> dict[str, list[str]]:
    lines = batch["text"]
    if len(lines) % 2:
        raise ValueError(f"{path}: an odd number of lines; expected question/answer pairs")
    return {"question": [q.strip() for q in lines[0::2]], "answer": [a.strip() for a in lines[1::2]]}


def load_qa(
    source: str,
    path: str,
    *,
    streaming: bool = False,
    cache_dir: str | None = None,
    question_key: str = "question",
    answer_key: str = "answer",
) -> Any:
    """One data file as a ``datasets.Dataset`` (``IterableDataset`` when streaming).

    Args:
        source: ``deepmind`` (question and answer lines alternate, the released ``.txt`` files) or
            ``jsonl`` (one JSON object per line, GSM8K's layout).
        path: the file.
        streaming: read lazily instead of building the Arrow table (corpora larger than memory).
        cache_dir: the Arrow cache (default: ``datasets``' own, ``~/.cache/huggingface/datasets``).
        question_key, answer_key: the JSON keys.

    Returns:
        Rows with ``question`` and ``answer`` strings, in file order.
    """
    if source not in ("deepmind", "jsonl"):
        raise ValueError(f"source must be 'deepmind' or 'jsonl', got {source!r}")
    if not os.path.isfile(path):
        raise ValueError(f"no such data file {path!r}")
    datasets = datasets_module()
    if source == "deepmind":
        lines = datasets.load_dataset(
            "text", data_files=path, split="train", streaming=streaming, cache_dir=cache_dir, keep_linebreaks=False
        )
        # even batches start on a question line: the pairs never straddle two batches
        return lines.map(_pair_lines, batched=True, batch_size=2000, remove_columns=["text"], fn_kwargs={"path": path})
    try:
        rows = datasets.load_dataset("json", data_files=path, split="train", streaming=streaming, cache_dir=cache_dir)
    except Exception as error:  # pyarrow's parse errors name the byte offset, not the file
        raise ValueError(f"{path}: not valid JSON lines ({type(error).__name__}: {error})") from None
    columns = rows.column_names if rows.column_names is not None else list(next(iter(rows)))
    missing = [k for k in (question_key, answer_key) if k not in columns]
    if missing:
        raise ValueError(f"{path}: no {missing} key in its records (keys: {columns}); set question_key/answer_key")
    rows = rows.select_columns([question_key, answer_key])
    if (question_key, answer_key) != ("question", "answer"):
        rows = rows.rename_columns({question_key: "question", answer_key: "answer"})
    for column in ("question", "answer"):  # GSM8K-style numbers may arrive as JSON numbers
        rows = rows.cast_column(column, datasets.Value("string"))
    return rows


def _encode_batch(batch: dict[str, list[str]], tokenizer: Any, kind: str) -> dict[str, list[list[int]]]:
    input_ids, labels = encode_pairs(tokenizer, batch["question"], batch["answer"], kind=kind)
    return {"input_ids": input_ids, "labels": labels}


def tokenize_qa(dataset: Any, tokenizer: Any, *, kind: str = "causal", max_length: int = 512, num_proc: int = 1) -> Any:
    """Tokenises ``question``/``answer`` rows as :func:`~ntl_scale.data.encode` does, in batches.

    Causal: ``question + " "`` is the prompt (labels ``-100``), the answer and EOS are the targets.
    Seq2seq: the question is the encoder input, answer + EOS the labels. Rows longer than
    ``max_length`` are dropped. On a ``Dataset`` the result is cached next to its Arrow files and
    ``num_proc`` processes share the work; on an ``IterableDataset`` it is applied as rows stream.
    """
    if kind not in ("causal", "seq2seq"):
        raise ValueError(f"kind must be 'causal' or 'seq2seq', got {kind!r}")
    options: dict[str, Any] = {"num_proc": num_proc if num_proc > 1 else None} if hasattr(dataset, "num_rows") else {}
    columns = ["question", "answer"]
    encoded = dataset.map(
        _encode_batch, batched=True, remove_columns=columns, fn_kwargs={"tokenizer": tokenizer, "kind": kind}, **options
    )
    return encoded.filter(lambda r: fits(r["input_ids"], r["labels"], kind=kind, max_length=max_length), **options)


def rows_to_examples(rows: dict[str, list[list[int]]]) -> list[EncodedExample]:
    """A ``dataset[indices]`` slice (columns of lists) as the examples :func:`collate` takes."""
    return [EncodedExample(list(i), list(label)) for i, label in zip(rows["input_ids"], rows["labels"])]


class StreamingOrder:
    """:class:`~ntl_scale.data.ShardedOrder` for an ``IterableDataset``: the same cut into micro-batches
    and steps, without knowing the length.

    Every rank reads the one global stream (shuffled per epoch through a seeded buffer), each
    micro-batch takes the next ``micro_batch_size x world_size`` rows and rank ``r`` its part; an
    epoch ends in whole optimizer steps (a shorter remainder is skipped). ``position`` counts the rows
    handed out over all ranks, as in ``ShardedOrder``; setting it (at resume) replays the stream to
    that row without training on it, so a run resumes at the exact row, also on another number of
    ranks with the same global batch.

    Args:
        dataset: a tokenised ``IterableDataset`` (rows with ``input_ids`` and ``labels``).
        micro_batch_size, rank, world_size, accumulation: as in ``ShardedOrder``.
        seed: the shuffling seed.
        shuffle_buffer: rows in the shuffling buffer (0: file order).
    """

    def __init__(
        self,
        dataset: Any,
        micro_batch_size: int,
        rank: int,
        world_size: int,
        seed: int,
        accumulation: int = 1,
        shuffle_buffer: int = 10000,
    ) -> None:
        self.dataset, self.micro_batch_size, self.rank, self.world_size = dataset, micro_batch_size, rank, world_size
        self.seed, self.accumulation, self.shuffle_buffer = seed, accumulation, shuffle_buffer
        self._position, self._stream = 0, self._micro_batches()

    @property
    def position(self) -> int:
        return self._position

    @position.setter
    def position(self, value: int) -> None:
        self._position, self._stream = 0, self._micro_batches()
        while self._position < value:
            next(self._stream)

    def _epoch(self, epoch: int) -> Iterator[dict[str, Any]]:
        if not self.shuffle_buffer:
            return iter(self.dataset)
        shuffled = self.dataset.shuffle(seed=self.seed, buffer_size=self.shuffle_buffer)
        shuffled.set_epoch(epoch)
        return iter(shuffled)

    def _micro_batches(self) -> Iterator[list[dict[str, Any]]]:
        width = self.micro_batch_size * self.world_size
        per_step = width * self.accumulation
        epoch = 0
        while True:
            rows, step, produced = self._epoch(epoch), [], False
            for row in rows:
                step.append(row)
                if len(step) == per_step:
                    for start in range(0, per_step, width):
                        self._position += width
                        produced = True
                        yield step[start : start + width]
                    step = []
            if not produced:
                raise ValueError(
                    f"the stream has fewer rows than one step of {self.micro_batch_size} sequences x "
                    f"{self.world_size} ranks x {self.accumulation} accumulation steps"
                )
            epoch += 1

    def next_examples(self) -> list[EncodedExample]:
        """This rank's examples of the next micro-batch."""
        batch = next(self._stream)
        mine = batch[self.rank * self.micro_batch_size : (self.rank + 1) * self.micro_batch_size]
        return [EncodedExample(list(r["input_ids"]), list(r["labels"])) for r in mine]
