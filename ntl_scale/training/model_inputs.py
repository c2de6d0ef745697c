"""What the model reads: the tokenizer and number table, the training micro-batches, their device copies.

:func:`tokenizer_and_table` and :func:`load_data` come first; :class:`Inputs` once DeepSpeed has built its
groups: this data-parallel rank's micro-batches in a resumable order, on the engine's device.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from ..data.collate import collate
from ..number_vocab import NumberVocab, pad_vocab_size
from .build import build_tokenizer, model_vocab_size
from .collectives import rank_zero_first
from .config import DataConfig, ModelConfig

__all__ = [
    "Inputs", "check_one_token_per_digit", "check_position_ids", "load_data", "to_device", "tokenizer_and_table",
]  # fmt: skip


def to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """Every tensor of a host batch on ``device`` (DeepSpeed's ``engine(...)`` does not move inputs)."""
    return {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def tokenizer_and_table(model: ModelConfig, digit_level: bool) -> tuple[Any, NumberVocab, int]:
    """The tokenizer, the number table and the model's vocabulary size (the config's, else the tokenizer's
    padded to a multiple of 8); a model vocabulary smaller than the tokenizer is an error."""
    tokenizer = build_tokenizer(model)
    vocab_size = model_vocab_size(model) or pad_vocab_size(len(tokenizer), divisible_by=8)
    if vocab_size < len(tokenizer):
        raise ValueError(f"model vocab_size {vocab_size} is smaller than the tokenizer ({len(tokenizer)} tokens)")
    return tokenizer, NumberVocab.from_tokenizer(tokenizer, vocab_size=vocab_size, digit_level=digit_level), vocab_size


def load_data(data: DataConfig, tokenizer: Any, *, kind: str, seq_length: int, rank: int) -> tuple[Any, dict]:
    """The tokenised training set (rank 0 fills the Arrow cache first, the others read it) and the
    generation-evaluation splits; a packed corpus logs what packing left out (rank 0)."""
    from .sources import eval_sets, packing_summary, train_dataset

    train_set = rank_zero_first(rank, lambda: train_dataset(data, tokenizer, kind=kind, seq_length=seq_length))
    summary = packing_summary(train_set)  # packed corpora: every count of what was left out
    if summary and rank == 0:
        print(summary, flush=True)
    return train_set, eval_sets(data)


def check_one_token_per_digit(tokenizer: Any, vocab: NumberVocab, name: str) -> None:
    """Position coupling gives every digit token a place value: every token that holds a digit must be
    one digit and a number token of the table (``name``: ``model.tokenizer``, for the message)."""
    numbers = set(vocab.ids.tolist())
    digits_in = {(t, i): sum(c.isdigit() for c in t) for t, i in tokenizer.get_vocab().items()}
    wide = sorted(t for (t, i), n in digits_in.items() if n and (i not in numbers or n != 1))
    if wide:
        raise ValueError(
            f"data.position_coupling=true needs a tokenizer with one token per digit; {name!r} "
            f"has {len(wide)} other tokens with digits ({', '.join(map(repr, wide[:5]))}"
            f"{', ...' if len(wide) > 5 else ''}): use a digit-level tokenizer (builtin:char, or one that "
            "splits numbers into single digits)"
        )


def check_position_ids(model: Any, data: DataConfig) -> None:
    """Position coupling passes ``position_ids``: the model must take them, and (absolute position
    tables) have a row for the largest id, ``data.position_offset + data.max_length``."""
    if "position_ids" not in inspect.signature(model.forward).parameters:
        raise ValueError(
            f"data.position_coupling=true passes position_ids, and {type(model).__name__}.forward takes "
            "none: use a model that does (Llama-style rotary models, GPT-2, ...)"
        )
    config, largest = model.config, data.position_offset + data.max_length
    limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if limit is not None and largest >= limit:
        raise ValueError(
            f"data.position_coupling=true: ids reach data.position_offset + data.max_length = {largest}, and the "
            f"model has {limit} positions; lower data.position_offset or raise the model's position count"
        )


class Inputs:
    """This data-parallel rank's training micro-batches, on the device."""

    def __init__(
        self,
        data: DataConfig,
        train_set: Any,
        tokenizer: Any,
        vocab: NumberVocab,
        *,
        micro_batch_size: int,
        accumulation: int,
        seed: int,
        rank: int,
        dp_rank: int,
        dp: int,
        device: torch.device,
    ) -> None:
        from .sources import Batches

        self.data, self.tokenizer, self.vocab, self.seed = data, tokenizer, vocab, seed
        self.rank, self.dp_rank, self.device = rank, dp_rank, device
        self.order = Batches(train_set, micro_batch_size, dp_rank, dp, data.seed, accumulation, data.shuffle_buffer)

    @property
    def position(self) -> int:
        """Examples consumed by all data-parallel ranks: the resumable data state of a checkpoint."""
        return self.order.position

    @position.setter
    def position(self, value: int) -> None:
        self.order.position = value

    def next_micro_batch(self) -> dict[str, torch.Tensor]:
        """The next micro-batch of this rank as host tensors: ``input_ids``, ``labels`` (unshifted; -100 =
        no loss) and optionally ``attention_mask`` / ``position_ids``."""
        rows = self.order.next()
        return rows if isinstance(rows, dict) else collate(rows, self.tokenizer.pad_token_id)

    def device_batch(self, host: dict[str, torch.Tensor], *, training: bool) -> dict[str, torch.Tensor]:
        """A host micro-batch on the device, with ``data.position_coupling``'s position ids (made there)."""
        batch = to_device(host, self.device)
        if self.data.position_coupling:
            ids = self.coupled_positions(batch["input_ids"], batch["labels"], training=training)
            batch["position_ids"] = ids.masked_fill(batch["attention_mask"] == 0, 0)  # padding: 0, not counted on
        return batch

    def coupled_positions(
        self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, *, training: bool = False
    ) -> torch.Tensor:
        """:func:`~ntl_scale.data.positions.coupled_position_ids` of token rows; the answer starts at the
        first label that is not -100 (``labels=None``: generation prompts); ``training``: with the random
        offsets of ``data.position_offset``."""
        from ..data.positions import coupled_position_ids, training_position_ids

        digits = self.vocab.number_mask(input_ids)
        if labels is None:
            return coupled_position_ids(digits)
        offset = None
        if training and self.data.position_offset:
            # a function of the seed, the data position and the data-parallel rank: tensor-parallel ranks
            # agree, a resumed run draws the same offsets, and no other random stream moves
            seed = (self.seed * 1_000_003 + self.order.position) * 4099 + self.dp_rank
            generator = torch.Generator().manual_seed(seed)
            offset = torch.randint(0, self.data.position_offset + 1, (input_ids.shape[0],), generator=generator)
            offset = offset.to(input_ids.device)
        return training_position_ids(digits, labels, offset)
