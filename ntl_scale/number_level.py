"""Number-level NTL: whole numbers rebuilt from runs of consecutive digit positions.

Given per-position digit predictions ``yhat`` (expected digit values) and targets, every maximal
run of digit labels in a sequence is one number; its value is ``sum_i digit_i * 10**e_i`` with
``e_i`` the count of digits after position ``i`` in the run. The number is written at the run's
first digit; the loss there is the symmetric MAPE ``|Yhat - Y| / (|Yhat| + |Y| + eps)``.

With ``float_level`` a single decimal-point label between two digits joins both runs into one
(``12.34`` is read as 1234, as the reference does); otherwise it separates them.

Only per-token ``yhat`` enters, so this works unchanged under tensor parallelism, where ``yhat`` is
already identical on every rank. Under context parallelism a number split across a slice border
becomes two numbers (``docs/math.md``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["MAX_NUMBER_LENGTH", "SMAPE_EPS", "assemble_numbers", "symmetric_mape"]

# Digits beyond this many in one run share the largest exponent, as in the reference.
MAX_NUMBER_LENGTH = 20
# The reference adds float32's machine epsilon to the sMAPE denominator regardless of dtype.
SMAPE_EPS = float(torch.finfo(torch.float32).eps)


def _shift_right(x: torch.Tensor) -> torch.Tensor:
    """``x[:, t-1]`` at position ``t`` (False/0 at t=0)."""
    return F.pad(x[:, :-1], (1, 0))


def _shift_left(x: torch.Tensor) -> torch.Tensor:
    """``x[:, t+1]`` at position ``t`` (False/0 at the end)."""
    return F.pad(x[:, 1:], (0, 1))


def assemble_numbers(
    digit_pred: torch.Tensor,
    digit_target: torch.Tensor,
    is_digit: torch.Tensor,
    is_dot: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rebuilds whole numbers from digit positions.

    Args:
        digit_pred: predicted digit values, ``[B, S]`` (differentiable).
        digit_target: target digit values, ``[B, S]`` (any value where not a digit).
        is_digit: bool ``[B, S]``, the label is a digit.
        is_dot: bool ``[B, S]``, the label is the decimal point (``float_level``), or None.

    Shape:
        All inputs and outputs are ``[B, S]``; ``S`` is the sequence axis.

    Returns:
        ``(number_pred, number_target, starts)``: the numbers at the first digit of each run
        (0 elsewhere) and the bool mask of those positions.
    """
    batch, seq = is_digit.shape
    in_run = is_digit
    if is_dot is not None:
        in_run = is_digit | (is_dot & _shift_right(is_digit) & _shift_left(is_digit))
    starts = in_run & ~_shift_right(in_run)
    run = torch.cumsum(starts.long(), dim=1)
    # One bin per run and row; bin 0 of every row collects positions outside any run.
    row_base = torch.arange(batch, device=is_digit.device).unsqueeze(1) * (seq + 1)
    bins = (row_base + torch.where(in_run, run, 0)).flatten()
    num_bins = batch * (seq + 1)

    digits = is_digit.long()
    digits_in_run = torch.zeros(num_bins, dtype=torch.long, device=bins.device).scatter_add_(0, bins, digits.flatten())
    digit_count = torch.cumsum(digits, dim=1).flatten()
    # Digits seen in the row before each run begins (a run always begins with a digit).
    before_run = torch.zeros(num_bins, dtype=torch.long, device=bins.device)
    start_flat = starts.flatten()
    before_run[bins[start_flat]] = digit_count[start_flat] - 1
    exponent = (digits_in_run[bins] - (digit_count - before_run[bins])).clamp(0, MAX_NUMBER_LENGTH - 1)
    scale = torch.pow(10.0, exponent.to(torch.float64)).to(digit_pred.dtype)

    mask = is_digit.flatten()
    zero = torch.zeros((), dtype=digit_pred.dtype, device=digit_pred.device)
    pred_terms = torch.where(mask, digit_pred.flatten() * scale, zero)
    target_terms = torch.where(mask, digit_target.flatten().to(digit_pred.dtype) * scale, zero)
    pred_sum = torch.zeros(num_bins, dtype=digit_pred.dtype, device=bins.device).scatter_add(0, bins, pred_terms)
    target_sum = torch.zeros(num_bins, dtype=digit_pred.dtype, device=bins.device).scatter_add(0, bins, target_terms)

    number_pred = torch.where(start_flat, pred_sum[bins], zero).view(batch, seq)
    number_target = torch.where(start_flat, target_sum[bins], zero).view(batch, seq)
    return number_pred, number_target, starts


def symmetric_mape(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``|pred - target| / (|pred| + |target| + eps)``, bounded in ``[0, 1]``."""
    return (pred - target).abs() / (pred.abs() + target.abs() + SMAPE_EPS)
