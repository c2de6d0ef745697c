"""Numbers from generated text, and metrics over predicted vs true numbers."""

from __future__ import annotations

import math
from collections.abc import Sequence

from .tasks.utils import parse_number

__all__ = ["extract_number", "number_metrics"]


def extract_number(text: str) -> float | None:
    """The answer number of a generated text, or None: the *last* number after a GSM8K ``####`` marker (else
    in the whole text), with optional minus, thousands separators, decimal part and denominator (``-29/5``)."""
    return parse_number(text)


def number_metrics(predictions: Sequence[float | None], targets: Sequence[float]) -> dict[str, float]:
    """Exact accuracy, MAE, log-MAE, R^2 and the share of unparseable predictions."""
    if len(predictions) != len(targets):
        raise ValueError(f"{len(predictions)} predictions but {len(targets)} targets; they must align")
    n = len(targets)
    if n == 0:
        raise ValueError("number_metrics needs at least one example")
    pairs = [(float(p), float(t)) for p, t in zip(predictions, targets) if p is not None]
    correct = sum(1 for p, t in pairs if p == t)

    def signed_log(x: float) -> float:
        return math.copysign(math.log10(1 + abs(x)), x)

    nan = float("nan")
    if pairs:
        mae = sum(abs(p - t) for p, t in pairs) / len(pairs)
        log_mae = sum(abs(signed_log(p) - signed_log(t)) for p, t in pairs) / len(pairs)
        mean_t = sum(t for _, t in pairs) / len(pairs)
        total = sum((t - mean_t) ** 2 for _, t in pairs)
        residual = sum((t - p) ** 2 for p, t in pairs)
        r2 = 1 - residual / total if total > 0 else nan
    else:
        mae = log_mae = r2 = nan
    return {
        "accuracy": correct / n,
        "mae": mae,
        "log_mae": log_mae,
        "r2": r2,
        "unparseable": (n - len(pairs)) / n,
        "count": float(n),
    }
