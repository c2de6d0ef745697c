"""Tokenisation with prompt masking, padding-aware collation, and a resumable DP-sharded order."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .arithmetic import Example

__all__ = ["EncodedExample", "ShardedOrder", "collate", "encode", "encode_pairs", "fits"]

IGNORE_INDEX = -100


@dataclass(frozen=True)
class EncodedExample:
    """Token ids of one example; ``labels`` is ``IGNORE_INDEX`` on the prompt (causal LMs)."""

    input_ids: list[int]
    labels: list[int]


def encode_pairs(
    tokenizer: Any, questions: Sequence[str], answers: Sequence[str], *, kind: str = "causal"
) -> tuple[list[list[int]], list[list[int]]]:
    """``input_ids`` and ``labels`` of question/answer pairs, tokenised in one batch per side."""
    prompts = tokenizer([q + " " if kind == "causal" else q for q in questions], add_special_tokens=False)
    targets = tokenizer(list(answers), add_special_tokens=False)
    input_ids, labels = [], []
    for prompt, answer in zip(prompts["input_ids"], targets["input_ids"]):
        target = [*answer, tokenizer.eos_token_id]
        if kind == "seq2seq":
            input_ids.append(prompt)
            labels.append(target)
        else:
            input_ids.append(prompt + target)
            labels.append([IGNORE_INDEX] * len(prompt) + target)
    return input_ids, labels


def fits(input_ids: Sequence[int], labels: Sequence[int], *, kind: str, max_length: int) -> bool:
    """Whether an encoded example is at most ``max_length`` tokens (seq2seq: each side)."""
    return max(len(input_ids), len(labels)) <= max_length if kind == "seq2seq" else len(input_ids) <= max_length


def encode(tokenizer: Any, example: Example, *, kind: str = "causal", max_length: int = 512) -> EncodedExample | None:
    """Tokenises one example as :func:`encode_pairs` does; None if it is longer than ``max_length``."""
    (input_ids,), (labels,) = encode_pairs(tokenizer, [example.question], [example.answer], kind=kind)
    return EncodedExample(input_ids, labels) if fits(input_ids, labels, kind=kind, max_length=max_length) else None


def collate(batch: Sequence[EncodedExample], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pads a micro-batch: ``input_ids``, ``attention_mask``, ``labels`` (padding ignored)."""
    width = max(len(e.input_ids) for e in batch)
    label_width = max(len(e.labels) for e in batch)
    input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(batch), width), dtype=torch.long)
    labels = torch.full((len(batch), label_width), IGNORE_INDEX, dtype=torch.long)
    for row, e in enumerate(batch):
        input_ids[row, : len(e.input_ids)] = torch.tensor(e.input_ids)
        attention[row, : len(e.input_ids)] = 1
        labels[row, : len(e.labels)] = torch.tensor(e.labels)
    return {"input_ids": input_ids, "attention_mask": attention, "labels": labels}


class ShardedOrder:
    """A deterministic, resumable order of example indices for one data-parallel rank."""

    def __init__(
        self, num_examples: int, micro_batch_size: int, rank: int, world_size: int, seed: int, accumulation: int = 1
    ) -> None:
        self.per_step = micro_batch_size * world_size * accumulation
        if num_examples < self.per_step:
            raise ValueError(
                f"{num_examples} examples cannot fill one step of {micro_batch_size} sequences x {world_size} "
                f"ranks x {accumulation} accumulation steps; use more data or a smaller batch"
            )
        self.num_examples, self.micro_batch_size = num_examples, micro_batch_size
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.position = 0
        self._cached_epoch: int | None = None  # the epoch whose permutation _cached_order holds
        self._cached_order = np.empty(0, dtype=np.int64)

    def _epoch(self, epoch: int) -> list[int]:
        """The seeded permutation of epoch ``epoch``: ``random.Random(f"{seed}/{epoch}")`` shuffles
        ``range(num_examples)``."""
        order = list(range(self.num_examples))
        random.Random(f"{self.seed}/{epoch}").shuffle(order)
        return order

    def next_indices(self) -> list[int]:
        """This rank's example indices of the next micro-batch."""
        per_epoch = self.num_examples // self.per_step * self.per_step
        epoch, offset = divmod(self.position, per_epoch)
        if self._cached_epoch != epoch:
            self._cached_order = np.asarray(self._epoch(epoch), dtype=np.int64)
            self._cached_epoch = epoch
        start = offset + self.rank * self.micro_batch_size
        self.position += self.micro_batch_size * self.world_size
        return self._cached_order[start : start + self.micro_batch_size].tolist()
