"""Training data through Hugging Face ``datasets``: question/answer files and pretraining corpora as
memory-mapped Arrow tables, tokenised with a cached ``map``; a streaming order for corpora larger than
memory. ``datasets`` is imported lazily.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator
from typing import Any

import numpy as np

from .._runtime import require
from .collate import EncodedExample, encode_pairs, fits
from .packing import PackingStats, logger, pack_documents

__all__ = [
    "HFDocuments",
    "PackedStream",
    "StreamingOrder",
    "document_specials",
    "load_qa",
    "load_text",
    "packed_stream",
    "tokenize_documents",
    "tokenize_qa",
]


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
    """One data file as a ``datasets.Dataset`` (``IterableDataset`` when streaming)."""
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
    """Tokenises ``question``/``answer`` rows as :func:`~ntl_scale.data.encode` does, in batches."""
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


_TEXT_SUFFIXES = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


def _text_files(path: str) -> tuple[str, list[str]]:
    """The ``datasets`` builder and the files of a corpus path (a file, or a folder of one kind of file)."""
    if os.path.isdir(path):
        files = sorted(f for suffix in _TEXT_SUFFIXES for f in glob.glob(os.path.join(path, f"*{suffix}")))
        if not files:
            raise ValueError(
                f"{path}: a folder with no .jsonl, .json or .parquet files and no save_to_disk dataset "
                "(state.json); point data.train_path at a corpus file or folder"
            )
    elif os.path.isfile(path):
        files = [path]
    else:
        raise ValueError(f"no such data file or folder {path!r}")
    kinds = {_TEXT_SUFFIXES.get(os.path.splitext(f)[1].lower()) for f in files}
    if None in kinds or len(kinds) != 1:
        raise ValueError(
            f"{path}: expected .jsonl/.json (JSON lines) or .parquet files of one kind, got "
            f"{sorted({os.path.splitext(f)[1] for f in files})}"
        )
    empty = [f for f in files if os.path.getsize(f) == 0]
    if empty:
        raise ValueError(f"{empty[0]}: an empty file (0 bytes); remove it or fill it")
    return kinds.pop(), files  # type: ignore[return-value]


def locate_bad_line(files: list[str]) -> str | None:
    """The first line of JSON-lines ``files`` that is not UTF-8, not JSON or not an object, as
    ``file:line: why`` (None if every line reads)."""
    for path in files:
        if _TEXT_SUFFIXES.get(os.path.splitext(path)[1].lower()) != "json":
            continue
        with open(path, "rb") as f:
            for number, raw in enumerate(f, start=1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as error:
                    return f"{path}:{number}: not UTF-8 ({error})"
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as error:
                    return f"{path}:{number}: not valid JSON ({error})"
                if not isinstance(record, dict):
                    return f"{path}:{number}: a JSON {type(record).__name__}, expected an object with a text field"
    return None


def _read_error(files: list[str], error: BaseException) -> ValueError:
    where = locate_bad_line(files)
    if where is not None:
        return ValueError(f"{where}; fix or remove that line")
    return ValueError(f"{', '.join(files)}: could not be read ({type(error).__name__}: {error})")


def load_text(path: str, *, text_column: str = "text", streaming: bool = False, cache_dir: str | None = None) -> Any:
    """A pretraining corpus as rows with one ``text_column`` column, in corpus order."""
    datasets = datasets_module()
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, "state.json")):
        rows = datasets.load_from_disk(path)
        if not hasattr(rows, "column_names") or isinstance(rows, dict):
            raise ValueError(f"{path}: a DatasetDict; point data.train_path at one split's folder (e.g. {path}/train)")
        files = [path]
        if streaming:
            rows = rows.to_iterable_dataset()
    else:
        builder, files = _text_files(path)
        try:
            rows = datasets.load_dataset(builder, data_files=files, split="train", streaming=streaming,
                                         cache_dir=cache_dir)  # fmt: skip
            columns = rows.column_names
            if columns is None:  # a JSON stream: its columns are those of the first record
                columns = list(next(iter(rows)))
        except StopIteration:
            raise ValueError(f"{', '.join(files)}: no records (blank lines only)") from None
        except Exception as error:  # pyarrow's errors name a byte offset or a row, never the file and line
            raise _read_error(files, error) from None
    columns = rows.column_names if rows.column_names is not None else list(next(iter(rows)))
    if text_column not in columns:
        raise ValueError(
            f"{path}: no column {text_column!r} (columns: {columns}); set data.text_column to the one holding the text"
        )
    rows = rows.select_columns([text_column])
    rows.files = files
    return rows


def document_specials(tokenizer: Any) -> tuple[int | None, int]:
    """The BOS (or None) and EOS ids each document gets: EOS always; BOS only where the tokenizer itself puts it
    first (Llama, Mistral), never where BOS is EOS (GPT-2) or it adds none (T5, Granite)."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError(
            f"{type(tokenizer).__name__} has no EOS token, which separates packed documents; give the tokenizer "
            "an eos_token"
        )
    bos = tokenizer.bos_token_id
    if bos is None or bos == eos:
        return None, eos
    probe = tokenizer("1", add_special_tokens=True)["input_ids"]
    return (bos if probe and probe[0] == bos else None), eos


def _encode_documents(
    batch: dict[str, list[Any]], indices: list[int], tokenizer: Any, column: str, bos: int | None, eos: int
) -> dict[str, list[Any]]:
    texts = batch[column]
    for text, index in zip(texts, indices):
        if text is not None and not isinstance(text, str):
            raise ValueError(
                f"row {index}: data.text_column {column!r} holds a {type(text).__name__} ({text!r:.40}), expected text"
            )
    present = [i for i, t in enumerate(texts) if t]
    encoded = tokenizer([texts[i] for i in present], add_special_tokens=False)["input_ids"] if present else []
    ids: list[list[int]] = [[] for _ in texts]  # None or "": an empty document, skipped and counted by packing
    head = [bos] if bos is not None else []
    for i, tokens in zip(present, encoded):
        ids[i] = [*head, *tokens, eos] if tokens else []
    return {"input_ids": ids, "length": [len(t) for t in ids]}


def tokenize_documents(rows: Any, tokenizer: Any, *, text_column: str = "text", num_proc: int = 1) -> Any:
    """One row per document: ``input_ids`` (``[BOS] + tokens + [EOS]``; empty for an empty text) and ``length``;
    cached on a ``Dataset`` (``num_proc`` processes), computed as rows stream on an ``IterableDataset``."""
    bos, eos = document_specials(tokenizer)
    options: dict[str, Any] = {"num_proc": num_proc if num_proc > 1 else None} if hasattr(rows, "num_rows") else {}
    try:
        encoded = rows.map(
            _encode_documents, batched=True, with_indices=True, remove_columns=[text_column],
            fn_kwargs={"tokenizer": tokenizer, "column": text_column, "bos": bos, "eos": eos}, **options,
        )  # fmt: skip
    except Exception:  # pyarrow reads invalid UTF-8 into the table; decoding it here fails without a line number
        where = locate_bad_line(list(getattr(rows, "files", [])))
        if where is None:
            raise
        raise ValueError(f"{where}; fix or remove that line") from None
    encoded.files = getattr(rows, "files", [])
    return encoded


class HFDocuments:
    """The tokenised documents of a ``Dataset`` (from :func:`tokenize_documents`) as a
    :class:`~ntl_scale.data.packing.DocumentSource`: lengths and ranges read straight from Arrow."""

    def __init__(self, dataset: Any) -> None:
        if getattr(dataset, "_indices", None) is not None:
            dataset = dataset.flatten_indices()
        self.table = dataset.data.table
        self.lengths = self.table.column("length").to_numpy().astype(np.int64)

    def __len__(self) -> int:
        return len(self.lengths)

    def read(self, first: int, stop: int) -> np.ndarray:
        import pyarrow.compute as pc

        column = self.table.slice(first, max(stop - first, 0)).column("input_ids")
        return pc.list_flatten(column).to_numpy(zero_copy_only=False).astype(np.int64)


class PackedStream:
    """Packed sequences of a streamed corpus (an ``IterableDataset``, ``rows``), for :class:`StreamingOrder`."""

    def __init__(self, rows: Any, seq_length: int) -> None:
        self.rows, self.seq_length = rows, seq_length


def _packed_rows(documents: Any, files: tuple[str, ...], name: str, **packing: Any) -> Iterator[dict[str, Any]]:
    stats = PackingStats()
    tokens = (row["input_ids"] for row in documents)
    try:
        yield from pack_documents(tokens, stats=stats, **packing)
    except Exception:  # a bad line met while streaming: name it (pyarrow's error names neither file nor line)
        where = locate_bad_line(list(files))
        if where is None:
            raise
        raise ValueError(f"{where}; fix or remove that line") from None
    dropped = stats.empty_documents or stats.tail_tokens
    logger.log(30 if dropped else 20, "%s (one pass of the stream)", stats.describe(name))


def packed_stream(
    documents: Any,
    seq_length: int,
    *,
    document_isolation: bool = False,
    skip_tokens: int = 0,
    max_sequences: int | None = None,
    name: str = "train",
) -> PackedStream:
    """Packs a stream of tokenised documents (an ``IterableDataset`` from :func:`tokenize_documents`) as
    :class:`~ntl_scale.data.packing.PackedSequences` does; counts are logged after each pass."""
    datasets = datasets_module()
    packing = {"seq_length": seq_length, "document_isolation": document_isolation, "skip_tokens": skip_tokens,
               "max_sequences": max_sequences}  # fmt: skip
    rows = datasets.IterableDataset.from_generator(
        _packed_rows, gen_kwargs={"documents": documents, "files": tuple(getattr(documents, "files", [])),
                                  "name": name, **packing}
    )  # fmt: skip
    return PackedStream(rows, seq_length)


class StreamingOrder:
    """:class:`~ntl_scale.data.ShardedOrder` for an ``IterableDataset``: the same cut into micro-batches
    and steps, without knowing the length."""

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

    def next_rows(self) -> list[dict[str, Any]]:
        """This rank's rows of the next micro-batch, as the stream holds them."""
        batch = next(self._stream)
        return batch[self.rank * self.micro_batch_size : (self.rank + 1) * self.micro_batch_size]

    def next_examples(self) -> list[EncodedExample]:
        """This rank's examples of the next micro-batch."""
        return [EncodedExample(list(r["input_ids"]), list(r["labels"])) for r in self.next_rows()]
