"""Seeded test inputs: logits and labels over a number table, with the edge cases the losses must meet."""

from __future__ import annotations

import torch


def text_labels(tokenizer, rows: int, seq: int, seed: int = 0, ignore_index: int = -100) -> torch.Tensor:
    """Labels from real tokenized arithmetic text (digit runs, decimal points, words), padded with ignore_index."""
    from .tokenizers import corpus

    lines = corpus(lines=rows * 4, seed=seed)
    out = torch.full((rows, seq), ignore_index, dtype=torch.long)
    for r in range(rows):
        ids = tokenizer(" ".join(lines[4 * r : 4 * r + 4]), add_special_tokens=False)["input_ids"][:seq]
        out[r, : len(ids)] = torch.tensor(ids)
    return out


def random_labels(
    vocab, shape: tuple[int, ...], vocab_size: int, seed: int = 0, number_fraction: float = 0.6, ignore_index=-100
) -> torch.Tensor:
    """Random labels: about ``number_fraction`` number tokens, a few ignored positions."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, vocab_size, shape, generator=g)
    numbers = torch.rand(shape, generator=g) < number_fraction
    picks = vocab.ids[torch.randint(0, len(vocab), (int(numbers.sum()),), generator=g)]
    labels[numbers] = picks
    ignored = torch.rand(shape, generator=g) < 0.1
    labels[ignored] = ignore_index
    return labels


def random_logits(shape: tuple[int, ...], seed: int = 0, dtype=torch.float64, scale: float = 3.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g, dtype=torch.float64) * scale).to(dtype)
