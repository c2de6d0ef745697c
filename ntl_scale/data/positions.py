"""Position coupling: position ids that give every digit its place value (Cho et al., "Position Coupling:
Improving Length Generalization of Arithmetic Transformers Using Task Structure", NeurIPS 2024).

In the prompt, the last digit of every number gets position 1, the digit before it 2, and so on; every
other prompt token gets 0. The answer (written least-significant digit first, ``data.reverse_answers``)
continues from the last prompt token one position per token, so its first digit, the units, shares
position 1 with the units of every operand, its second digit position 2 with the tens, and so on. With
rotary positions a head then reads "the operand digits of my place" at the same relative offset for
every place, including places no training question had: this is what lets a model trained on short
numbers add longer ones. The ids grow by one per answer token, as Hugging Face's ``generate`` extends
``position_ids``, so generation needs only the prompt's ids.

``What is 57 + 68? 521`` (125 reversed) in characters has ids
``0 0 0 0 0 0 0 0 2 1 0 0 0 2 1 0 0 1 2 3 4``: ``5``/``6`` share 2 (tens), ``7``/``8``/the answer's
``5`` share 1 (units), the answer's ``2`` has 2 and its ``1`` 3 (hundreds), EOS 4.
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
