"""Position coupling (Cho et al., NeurIPS 2024): position ids that give every digit its place value.

In the prompt the last digit of every number gets 1, the one before it 2, ...; other tokens 0. The
reversed answer continues one id per token, so its units share 1 with the operands' units.
"""

from __future__ import annotations

import torch

__all__ = ["coupled_position_ids", "training_position_ids"]


def coupled_position_ids(
    digits: torch.Tensor, answer_start: torch.Tensor | None = None, offset: torch.Tensor | None = None
) -> torch.Tensor:
    """Coupled position ids of a batch of token rows."""
    if digits.dim() != 2 or digits.dtype != torch.bool:
        raise ValueError(f"digits must be a 2-D bool tensor, got {digits.dtype} of shape {tuple(digits.shape)}")
    rows, width = digits.shape
    columns = torch.arange(width, device=digits.device)
    start = torch.full((rows,), width, device=digits.device) if answer_start is None else answer_start
    prompt = columns[None, :] < start[:, None]
    run = digits & prompt
    ids = torch.zeros((rows, width), dtype=torch.long, device=digits.device)
    after = torch.zeros(rows, dtype=torch.long, device=digits.device)  # digits after this one in its run
    for t in range(width - 1, -1, -1):
        after = torch.where(run[:, t], after + 1, torch.zeros_like(after))
        ids[:, t] = after
    if offset is not None:
        place0 = (columns[None, :] == (start - 1)[:, None]) & ~run  # the last prompt token, when not a digit
        ids = torch.where(run | place0, ids + offset[:, None], ids)
    if answer_start is not None:
        last = ids.gather(1, (start - 1).clamp(min=0)[:, None])  # the last prompt token's id
        counted = last + (columns[None, :] - start[:, None] + 1)
        ids = torch.where(prompt, ids, counted)
    return ids


def training_position_ids(
    digits: torch.Tensor, labels: torch.Tensor, offset: torch.Tensor | None = None, ignore_index: int = -100
) -> torch.Tensor:
    """:func:`coupled_position_ids` of collated causal rows (prompt + answer, right-padded): each row's
    answer starts at its first label that is not ``ignore_index`` (a row without one is all prompt)."""
    answer = labels != ignore_index
    start = torch.where(answer.any(1), answer.int().argmax(1), labels.shape[1])
    return coupled_position_ids(digits, start, offset)
