"""Megatron indexed datasets (``PREFIX.bin`` / ``PREFIX.idx``) as a
:class:`~ntl_scale.data.packing.DocumentSource`: ``megatron.core``'s ``IndexedDataset`` when installed,
else :class:`IndexFile`, a small reader of the same format.
"""

from __future__ import annotations

import importlib.util
import os
import struct
from typing import Any

import numpy as np

__all__ = ["IndexFile", "IndexedDocuments"]

_HEADER = b"MMIDIDX\x00\x00"
_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16}


class IndexFile:
    """A ``.idx``/``.bin`` pair read with numpy (megatron-core's layout, without megatron-core)."""

    def __init__(self, prefix: str) -> None:
        idx, bin_path = f"{prefix}.idx", f"{prefix}.bin"
        with open(idx, "rb") as f:
            header = f.read(9)
            if header != _HEADER:
                raise ValueError(f"{idx}: not a Megatron indexed dataset (header {header!r}, expected {_HEADER!r})")
            (version,) = struct.unpack("<Q", f.read(8))
            if version != 1:
                raise ValueError(f"{idx}: index version {version}; this reader knows version 1 (install megatron-core)")
            (code,) = struct.unpack("<B", f.read(1))
            if code not in _DTYPES:
                raise ValueError(f"{idx}: unknown token dtype code {code}")
            sequences, documents = struct.unpack("<QQ", f.read(16))
            offset = f.tell()
        self.dtype = np.dtype(_DTYPES[code])
        buffer = np.memmap(idx, mode="r", dtype=np.uint8)
        self.sequence_lengths = np.frombuffer(buffer, dtype=np.int32, count=sequences, offset=offset)
        offset += self.sequence_lengths.nbytes
        self.sequence_pointers = np.frombuffer(buffer, dtype=np.int64, count=sequences, offset=offset)
        offset += self.sequence_pointers.nbytes
        self.document_indices = np.frombuffer(buffer, dtype=np.int64, count=documents, offset=offset)
        size = os.path.getsize(bin_path)
        self.tokens = np.memmap(bin_path, mode="r", dtype=self.dtype) if size else np.zeros(0, dtype=self.dtype)

    def read(self, first_sequence: int, stop_sequence: int) -> np.ndarray:
        """Tokens of sequences ``first_sequence .. stop_sequence - 1`` (contiguous in ``.bin``)."""
        if first_sequence >= stop_sequence:
            return np.zeros(0, dtype=self.dtype)
        start = int(self.sequence_pointers[first_sequence]) // self.dtype.itemsize
        count = int(self.sequence_lengths[first_sequence:stop_sequence].sum())
        return np.asarray(self.tokens[start : start + count])


def _megatron_reader(prefix: str) -> Any:
    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
        return None
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    return IndexedDataset(prefix, multimodal=False, mmap=True)


class IndexedDocuments:
    """The documents of a Megatron indexed dataset, for :class:`~ntl_scale.data.packing.PackedSequences`."""

    def __init__(self, prefix: str, *, use_megatron: bool | None = None) -> None:
        missing = [p for p in (f"{prefix}.bin", f"{prefix}.idx") if not os.path.isfile(p)]
        if missing:
            raise ValueError(
                f"data.train_path={prefix!r} is a Megatron path prefix, but {' and '.join(missing)} "
                "do not exist; pass the prefix preprocess_data.py wrote (for example out_text_document, without "
                ".bin/.idx)"
            )
        dataset = _megatron_reader(prefix) if use_megatron in (None, True) else None
        if use_megatron and dataset is None:
            raise ValueError("use_megatron=True needs megatron-core (pip install 'ntl_scale[megatron]')")
        self.prefix = prefix
        self._megatron = dataset
        self._file = None if dataset is not None else IndexFile(prefix)
        self.reader = "megatron.core" if dataset is not None else "ntl_scale"
        source: Any = dataset if dataset is not None else self._file
        lengths = np.asarray(source.sequence_lengths, dtype=np.int64)
        self.document_indices = np.asarray(source.document_indices, dtype=np.int64)
        if len(self.document_indices) < 2 or len(lengths) == 0:
            raise ValueError(f"{prefix}.idx holds no documents (an empty corpus)")
        per_sequence = np.concatenate([[0], np.cumsum(lengths)])
        self.lengths = per_sequence[self.document_indices[1:]] - per_sequence[self.document_indices[:-1]]

    def __len__(self) -> int:
        return len(self.lengths)

    def read(self, first: int, stop: int) -> np.ndarray:
        """The tokens of documents ``first .. stop - 1``, concatenated (int64)."""
        s0, s1 = int(self.document_indices[first]), int(self.document_indices[stop])
        if s0 >= s1:
            return np.zeros(0, dtype=np.int64)
        if self._megatron is not None:
            return np.concatenate(self._megatron[s0:s1]).astype(np.int64)
        assert self._file is not None
        return self._file.read(s0, s1).astype(np.int64)

    def documents(self, first: int = 0) -> object:
        """Documents from ``first`` on, one token array each, in corpus order."""
        return (self.read(d, d + 1) for d in range(first, len(self)))
