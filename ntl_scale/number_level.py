"""Number-level NTL: whole numbers rebuilt from runs of consecutive digit positions.

Given per-position digit predictions ``yhat`` (expected digit values) and targets, every maximal
run of digit labels in a sequence is one number; its value is ``sum_i digit_i * 10**e_i`` with
``e_i`` the count of digits after position ``i`` in the run. The number is written at the run's
first digit; the loss there is the symmetric MAPE ``|Yhat - Y| / (|Yhat| + |Y| + eps)``.

With ``float_level`` a single decimal-point label between two digits joins both runs into one
(``12.34`` is read as 1234, as the reference does); otherwise it separates them.

The numbers are assembled and compared in float64 whatever the logits' dtype: the target digits are
exact small integers, so a target number is exact up to 2**53 (every number of 15 digits); the
prediction is the float64 sum of the per-digit expectations (computed in the logits' compute dtype).
Every op has a shape fixed by the input's (cumulative sums, a running maximum, scatter-adds into one
bin per position): nothing waits for the device.

Only per-token ``yhat`` enters, so this works unchanged under tensor parallelism, where ``yhat`` is
already identical on every rank. Under context parallelism a number split across a slice border
becomes two numbers (``docs/math.md``); :func:`number_starts` with ``pieces`` counts them so.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["MAX_NUMBER_LENGTH", "SMAPE_EPS", "assemble_numbers", "number_starts", "symmetric_mape"]

# Digits beyond this many in one run share the largest exponent, as in the reference.
MAX_NUMBER_LENGTH = 20
# The reference adds float32's machine epsilon to the sMAPE denominator regardless of dtype.
SMAPE_EPS = float(torch.finfo(torch.float32).eps)


def _shift_right(x: torch.Tensor) -> torch.Tensor:
    """``x[..., t-1]`` at position ``t`` (False/0 at t=0)."""
    return F.pad(x[..., :-1], (1, 0))


def _shift_left(x: torch.Tensor) -> torch.Tensor:
    """``x[..., t+1]`` at position ``t`` (False/0 at the end)."""
    return F.pad(x[..., 1:], (0, 1))


def _runs(is_digit: torch.Tensor, is_dot: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(in_run, starts)``: positions inside a number, and each number's first position (a digit)."""
    in_run = is_digit
    if is_dot is not None:
        in_run = is_digit | (is_dot & _shift_right(is_digit) & _shift_left(is_digit))
    return in_run, in_run & ~_shift_right(in_run)


def number_starts(is_digit: torch.Tensor, is_dot: torch.Tensor | None = None, *, pieces: int = 1) -> torch.Tensor:
    """The first digit of every number: the positions where number-level NTL has a term.

    Args:
        is_digit: bool ``[..., S]``, the label is a digit (and not ignored); ``S`` is the sequence axis.
        is_dot: bool ``[..., S]``, the label is the decimal point (``float_level``), or None.
        pieces: cut the sequence axis into this many equal slices and cut numbers at their borders,
            as context parallelism does (each rank assembles numbers from its own slice only).

    Returns:
        bool ``[..., S]``.
    """
    if isinstance(pieces, bool) or not isinstance(pieces, int) or pieces < 1:
        raise ValueError(f"pieces must be a positive int (1: no cut), got {pieces!r}")
    seq = is_digit.shape[-1]
    if pieces > 1:
        if seq % pieces:
            raise ValueError(f"the sequence length {seq} is not divisible into pieces={pieces} equal slices")
        split = (*is_digit.shape[:-1], pieces, seq // pieces)
        is_digit = is_digit.reshape(split)
        is_dot = None if is_dot is None else is_dot.reshape(split)
    starts = _runs(is_digit, is_dot)[1]
    return starts.reshape(*starts.shape[:-2], seq) if pieces > 1 else starts


def assemble_numbers(
    digit_pred: torch.Tensor,
    digit_target: torch.Tensor,
    is_digit: torch.Tensor,
    is_dot: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rebuilds whole numbers from digit positions, in float64.

    Args:
        digit_pred: predicted digit values, ``[B, S]`` (differentiable; any float dtype).
        digit_target: target digit values, ``[B, S]`` (any value where not a digit; exact small integers).
        is_digit: bool ``[B, S]``, the label is a digit.
        is_dot: bool ``[B, S]``, the label is the decimal point (``float_level``), or None.

    Shape:
        All inputs and outputs are ``[B, S]``; ``S`` is the sequence axis.

    Returns:
        ``(number_pred, number_target, starts)``: the float64 numbers at the first digit of each run
        (0 elsewhere) and the bool mask of those positions (:func:`number_starts`).
    """
    batch, seq = is_digit.shape
    in_run, starts = _runs(is_digit, is_dot)
    run = torch.cumsum(starts.long(), dim=1)
    # One bin per run and row; bin 0 of every row collects positions outside any run.
    row_base = torch.arange(batch, device=is_digit.device).unsqueeze(1) * (seq + 1)
    bins = (row_base + torch.where(in_run, run, 0)).flatten()
    num_bins = batch * (seq + 1)

    digits = is_digit.long()
    digits_in_run = torch.zeros(num_bins, dtype=torch.long, device=bins.device).scatter_add_(0, bins, digits.flatten())
    digit_count = torch.cumsum(digits, dim=1)
    # Digits seen in the row before the current run began: the count at the run's start, carried
    # forward by a running maximum (the count never decreases), so no position is looked up by mask.
    before_run = torch.where(starts, digit_count - 1, 0).cummax(dim=1).values
    exponent = (digits_in_run[bins] - (digit_count - before_run).flatten()).clamp(0, MAX_NUMBER_LENGTH - 1)
    scale = torch.pow(10.0, exponent.to(torch.float64))

    mask = is_digit.flatten()
    zero = torch.zeros((), dtype=torch.float64, device=digit_pred.device)
    pred_terms = torch.where(mask, digit_pred.flatten().to(torch.float64) * scale, zero)
    target_terms = torch.where(mask, digit_target.flatten().to(torch.float64) * scale, zero)
    pred_sum = torch.zeros(num_bins, dtype=torch.float64, device=bins.device).scatter_add(0, bins, pred_terms)
    target_sum = torch.zeros(num_bins, dtype=torch.float64, device=bins.device).scatter_add(0, bins, target_terms)

    start_flat = starts.flatten()
    number_pred = torch.where(start_flat, pred_sum[bins], zero).view(batch, seq)
    number_target = torch.where(start_flat, target_sum[bins], zero).view(batch, seq)
    return number_pred, number_target, starts


def symmetric_mape(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``|pred - target| / (|pred| + |target| + eps)``, bounded in ``[0, 1]``."""
    return (pred - target).abs() / (pred.abs() + target.abs() + SMAPE_EPS)
