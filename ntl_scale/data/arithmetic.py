"""Seeded arithmetic problems in the style of the DeepMind mathematics dataset (``add``, ``add_sub``,
``add_sub_multiple``, ``mul``), one integer answer each.

``interpolate`` never holds a question a training split can draw (a fixed hash of the question reserves
it: :func:`is_held_out`); ``extrapolate`` uses operands with more digits than training saw.
"""

from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass, replace

__all__ = [
    "HELD_OUT_BUCKETS",
    "KINDS",
    "SPLITS",
    "ArithmeticConfig",
    "Example",
    "generate",
    "is_held_out",
    "reverse_digits",
]

KINDS = ("add", "add_sub", "add_sub_multiple", "mul")
SPLITS = ("train", "interpolate", "extrapolate")
HELD_OUT_BUCKETS = 10
"""One question text in this many is reserved for ``interpolate`` (:func:`is_held_out`)."""
# A draw that finds no new question this many times in a row means the question space is used up.
_STALL_DRAWS = 100_000
_TWO_OPERANDS = re.compile(r"What is (\S+) (\+|times) (\S+)\?")


@dataclass(frozen=True)
class Example:
    """One question and its answer text."""

    question: str
    answer: str
    kind: str = ""


@dataclass(frozen=True)
class ArithmeticConfig:
    """The generator's settings."""

    kinds: tuple[str, ...] = ("add_sub", "add_sub_multiple", "mul")
    train_digits: int = 3
    extrapolate_digits: int = 5
    mul_digits: int = 2
    negative_share: float = 0.2
    reverse_answers: bool = False

    def __post_init__(self) -> None:
        unknown = [k for k in self.kinds if k not in KINDS]
        if not self.kinds or unknown:
            raise ValueError(f"kinds must be a non-empty subset of {KINDS}, got {self.kinds!r}")
        if not 1 <= self.train_digits < self.extrapolate_digits:
            raise ValueError(
                f"need 1 <= train_digits < extrapolate_digits, got {self.train_digits} and {self.extrapolate_digits}"
            )
        if not 0 <= self.negative_share <= 1:
            raise ValueError(f"negative_share must be in [0, 1], got {self.negative_share}")


def reverse_digits(text: str) -> str:
    """Every run of digits in ``text`` reversed (signs and other characters stay): the answer format of
    ``reverse_answers`` and its inverse (``reverse_digits(reverse_digits(t)) == t``)."""
    return re.sub(r"\d+", lambda m: m.group(0)[::-1], text)


def _commutative_key(question: str) -> str:
    # a + b and b + a (a times b and b times a) ask the same thing: one key, so one side of the split
    match = _TWO_OPERANDS.fullmatch(question)
    if not match:
        return question
    a, op, b = match.groups()
    return f"What is {min(a, b)} {op} {max(a, b)}?"


def is_held_out(question: str) -> bool:
    """Whether ``question`` belongs to the held-out (``interpolate``) pool: a fixed ``blake2b`` hash of its text
    (a two-term sum or product with its operands in a fixed order), the same in every process."""
    digest = hashlib.blake2b(_commutative_key(question).encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") % HELD_OUT_BUCKETS == 0


def _in_split(question: str, split: str) -> bool:
    # extrapolate operands are longer than any train/interpolate operand: disjoint without the hash
    return split == "extrapolate" or is_held_out(question) == (split == "interpolate")


def _operand(rng: random.Random, low_digits: int, high_digits: int, negative_share: float) -> int:
    digits = rng.randint(low_digits, high_digits)
    value = rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10**digits - 1)
    return -value if rng.random() < negative_share else value


def _term(value: int) -> str:
    return f"({value})" if value < 0 else str(value)


def _make(rng: random.Random, kind: str, low: int, high: int, mul_high: int, neg: float) -> Example:
    if kind in ("add", "add_sub"):
        a, b = _operand(rng, low, high, neg), _operand(rng, low, high, 0.0)
        op = rng.choice("+-") if kind == "add_sub" else "+"
        value = a + b if op == "+" else a - b
        return Example(f"What is {_term(a)} {op} {b}?", str(value), kind)
    if kind == "add_sub_multiple":
        terms = [_operand(rng, low, high, neg) for _ in range(rng.randint(3, 5))]
        text, value = _term(terms[0]), terms[0]
        for t in terms[1:]:
            op = rng.choice("+-")
            text += f" {op} {_term(t)}"
            value = value + t if op == "+" else value - t
        return Example(f"Calculate {text}.", str(value), kind)
    a, b = _operand(rng, low, high, neg), _operand(rng, min(low, mul_high), mul_high, 0.0)
    return Example(f"What is {_term(a)} times {b}?", str(a * b), kind)


def generate(
    count: int, split: str = "train", *, seed: int = 0, config: ArithmeticConfig | None = None
) -> list[Example]:
    """``count`` seeded problems of one split (the same seed and config give the same list)."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    config = config or ArithmeticConfig()
    rng = random.Random(f"{seed}/{split}")
    if split == "extrapolate":
        low, high = config.train_digits + 1, config.extrapolate_digits
        mul_high = config.mul_digits + 1
    else:
        low, high, mul_high = 1, config.train_digits, config.mul_digits
    seen: set[str] = set()
    out: list[Example] = []
    misses = 0
    while len(out) < count:
        example = _make(rng, config.kinds[len(out) % len(config.kinds)], low, high, mul_high, config.negative_share)
        if example.question in seen or not _in_split(example.question, split):
            misses += 1
            if misses >= _STALL_DRAWS:
                raise ValueError(
                    f"could not draw {count} distinct {split} questions of kinds {config.kinds} with "
                    f"{low}-{high} digit operands: {len(out)} found, then {_STALL_DRAWS} draws in a row gave "
                    "none new (the question space is used up); ask for fewer examples "
                    "(data.train_examples / data.eval_examples) or widen the digit ranges "
                    f"({'data.extrapolate_digits' if split == 'extrapolate' else 'data.train_digits'})"
                )
            continue
        misses = 0
        seen.add(example.question)
        out.append(replace(example, answer=reverse_digits(example.answer)) if config.reverse_answers else example)
    rng.shuffle(out)
    return out
