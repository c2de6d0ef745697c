"""Scoring of the ``ntl_numeracy`` lm-evaluation-harness tasks (``!function utils.<name>`` in their YAML).

Standard library only: the task folder carries a copy of this file. :func:`parse_number` is also the
project's own rule (:func:`ntl_scale.eval.numbers.extract_number`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

_NUMBER = re.compile(r"(?<![\w./])-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?", flags=re.ASCII)


def parse_number(text: str) -> float | None:
    """The answer number of a text (the module's rule), or None."""
    if "####" in text:
        text = text.rsplit("####", 1)[1]
    matches = _NUMBER.findall(text)
    if not matches:
        return None
    numerator, _, denominator = matches[-1].replace(",", "").partition("/")
    if not denominator:
        return float(numerator)
    return float(numerator) / float(denominator) if float(denominator) else None


def number_scores(generated: str, target: float) -> dict[str, float | None]:
    """``exact_match``, ``parsed``, ``abs_error`` and ``rel_error`` of one generated answer (the errors
    None when no number was parsed)."""
    value = parse_number(generated)
    if value is None:
        return {"exact_match": 0.0, "parsed": 0.0, "abs_error": None, "rel_error": None}
    error = abs(value - target)
    return {
        "exact_match": float(value == target),
        "parsed": 1.0,
        "abs_error": error,
        "rel_error": error / max(abs(target), 1.0),
    }


def process_generation(doc: dict[str, Any], results: Sequence[str]) -> dict[str, float | None]:
    """A ``generate_until`` task's scores: the answer number read from ``doc["answer"]`` (the text
    after ``####`` for GSM8K, the whole answer for arithmetic)."""
    target = parse_number(str(doc["answer"]))
    if target is None:
        raise ValueError(f"no number in the reference answer {doc['answer']!r}")
    return number_scores(results[0], target)


def process_gold_bpb(doc: dict[str, Any], results: Sequence[tuple[float, bool]]) -> dict[str, tuple[float, int]]:
    """Bits per byte of the gold answer given the question: ``(loglikelihood, UTF-8 bytes)`` for the harness's
    ``bits_per_byte`` aggregation (-sum ll / sum bytes / ln 2)."""
    loglikelihood, _ = results[0]
    return {"bits_per_byte": (loglikelihood, len(gold_target(doc).encode("utf-8")))}


def gold_target(doc: dict[str, Any]) -> str:
    """The continuation scored by :func:`process_gold_bpb`: the whole reference solution, after the
    task's ``target_delimiter`` (a space)."""
    return str(doc["answer"])


def process_segment(doc: dict[str, Any], results: Sequence[tuple[float, bool]]) -> dict[str, tuple[float, int]]:
    """One segment (a number, or the text between numbers) given the text before it: its ``(loglikelihood,
    bytes)`` under ``bits_per_byte`` and under ``number_bits_per_byte`` or ``text_bits_per_byte``."""
    loglikelihood, _ = results[0]
    pair = (loglikelihood, len(str(doc["segment"]).encode("utf-8")))
    return {"bits_per_byte": pair, f"{doc['kind']}_bits_per_byte": pair}


def mean_parsed(values: Sequence[float | None]) -> float:
    """The mean of the values that are not None (NaN when there are none): the errors of parsed answers."""
    kept = [v for v in values if v is not None]
    return sum(kept) / len(kept) if kept else math.nan
