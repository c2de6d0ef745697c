"""The ``ntl_numeracy`` tasks' data as JSONL, from local files (GSM8K, a run's predictions) and seeded
generators (arithmetic, number-format perplexity slices); nothing is downloaded.
"""

from __future__ import annotations

import gzip
import json
import os
import random
import re
from collections.abc import Callable, Iterable
from dataclasses import replace

from ...data.arithmetic import ArithmeticConfig, Example, generate

__all__ = [
    "ARITHMETIC",
    "SLICES",
    "arithmetic_examples",
    "comparison_examples",
    "copy_gsm8k",
    "segments",
    "slice_texts",
    "write_jsonl",
]

ARITHMETIC = ("add", "sub", "mul", "cmp")
SLICES = ("integers", "decimals", "dates", "amounts")
_SPAN = re.compile(r"\d+(?:[.,/:-]\d+)*")
_CONFIG = ArithmeticConfig(kinds=("add",), train_digits=5, extrapolate_digits=6, mul_digits=3, negative_share=0.0)


def write_jsonl(path: str, rows: Iterable[dict]) -> int:
    """Writes one JSON object per line; returns the number of rows."""
    count = 0
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
            count += 1
    return count


def copy_gsm8k(source: str, out_dir: str) -> dict[str, int]:
    """``gsm8k_test.jsonl`` and ``gsm8k_train.jsonl`` in ``out_dir`` from a local GSM8K folder."""
    found = {}
    for split in ("test", "train"):
        plain, packed = os.path.join(source, f"{split}.jsonl"), os.path.join(source, f"{split}.jsonl.gz")
        if os.path.exists(plain):
            with open(plain, encoding="utf-8") as f:
                lines = f.read().splitlines()
        elif os.path.exists(packed):
            with gzip.open(packed, "rt", encoding="utf-8") as f:
                lines = f.read().splitlines()
        else:
            raise FileNotFoundError(
                f"no {split}.jsonl or {split}.jsonl.gz in {source}: pass --gsm8k DIR, a folder with GSM8K's "
                "test.jsonl and train.jsonl(.gz) (github.com/openai/grade-school-math, grade_school_math/data)"
            )
        rows = [json.loads(line) for line in lines if line.strip()]
        found[split] = write_jsonl(os.path.join(out_dir, f"gsm8k_{split}.jsonl"),
                                   ({"question": r["question"], "answer": r["answer"]} for r in rows))  # fmt: skip
    return found


def arithmetic_examples(op: str, count: int, split: str, seed: int) -> list[Example]:
    """``count`` questions of one operation (``add``, ``sub``, ``mul``) with up-to-5-digit operands
    (3-digit second factors), from the generator's ``interpolate`` (held-out) or ``train`` split."""
    if op == "cmp":
        return comparison_examples(count, split, seed)
    kind = {"add": "add", "sub": "add_sub", "mul": "mul"}[op]
    config = replace(_CONFIG, kinds=(kind,))
    if op != "sub":
        return generate(count, split, seed=seed, config=config)
    pool: list[Example] = []
    drawn = 2 * count + 8
    while len(pool) < count:  # add_sub draws either operation: keep the subtractions
        pool = [e for e in generate(drawn, split, seed=seed, config=config) if " - " in e.question]
        drawn *= 2
    return pool[:count]


def comparison_examples(count: int, split: str, seed: int) -> list[Example]:
    """``Which is larger, A or B?`` with A != B of the same length sharing a leading digit or more
    (the ``test`` and ``train`` streams are disjoint by the parity of A + B)."""
    rng = random.Random(f"{seed}/cmp/{split}")
    seen: set[tuple[int, int]] = set()
    out: list[Example] = []
    while len(out) < count:
        digits = rng.randint(2, 6)
        a = rng.randint(10 ** (digits - 1), 10**digits - 1)
        keep = rng.randint(1, digits - 1)  # digits shared with a from the left
        head = a // 10 ** (digits - keep)
        b = head * 10 ** (digits - keep) + rng.randint(0, 10 ** (digits - keep) - 1)
        if a == b or (a + b) % 2 != (split == "train") or (a, b) in seen:
            continue
        seen.add((a, b))
        out.append(Example(f"Which is larger, {a} or {b}?", str(max(a, b)), "cmp"))
    return out


def _integers(rng: random.Random) -> str:
    n = [rng.randint(0, 10 ** rng.randint(1, 6)) for _ in range(3)]
    return rng.choice([
        f"The warehouse shipped {n[0]} boxes to {n[1]} stores, and {n[2]} more are on order.",
        f"Route {n[0]} is closed between exits {n[1]} and {n[2]} until further notice.",
        f"In the census the town had {n[0]} residents, {n[1]} households and {n[2]} registered cars.",
        f"The library lent {n[0]} books this year, up from {n[1]}; {n[2]} were never returned.",
    ])  # fmt: skip


def _decimals(rng: random.Random) -> str:
    x = [round(rng.uniform(0, 10 ** rng.randint(0, 3)), rng.randint(1, 3)) for _ in range(3)]
    return rng.choice([
        f"The sample weighed {x[0]} grams, measured {x[1]} cm and lost {x[2]} percent of its mass.",
        f"The stock closed at {x[0]}, after opening at {x[1]} and touching {x[2]} at noon.",
        f"Average rainfall was {x[0]} mm in spring and {x[1]} mm in autumn, a ratio of {x[2]}.",
        f"The runner's split times were {x[0]}, {x[1]} and {x[2]} seconds.",
    ])  # fmt: skip


_MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
           "November", "December")  # fmt: skip


def _date(rng: random.Random) -> str:
    year, month, day = rng.randint(1900, 2030), rng.randint(1, 12), rng.randint(1, 28)
    return rng.choice([f"{year}-{month:02d}-{day:02d}", f"{day} {_MONTHS[month - 1]} {year}",
                       f"{_MONTHS[month - 1]} {day}, {year}", f"{month:02d}/{day:02d}/{year}"])  # fmt: skip


def _dates(rng: random.Random) -> str:
    a, b = _date(rng), _date(rng)
    return rng.choice([
        f"The meeting planned for {a} was moved to {b}.",
        f"She was born on {a} and emigrated on {b}.",
        f"The contract runs from {a} to {b}, with a review at {rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}.",
        f"Records between {a} and {b} were lost in the fire.",
    ])  # fmt: skip


def _amount(rng: random.Random) -> str:
    value = rng.randint(1, 10 ** rng.randint(1, 7))
    cents = rng.randint(0, 99)
    text = f"{value:,}" if rng.random() < 0.5 else str(value)
    if rng.random() < 0.5:
        text += f".{cents:02d}"
    return rng.choice([f"${text}", f"€{text}", f"{text} dollars", f"£{text}"])


def _amounts(rng: random.Random) -> str:
    a, b = _amount(rng), _amount(rng)
    return rng.choice([
        f"She paid {a} for the laptop and {b} for the case.",
        f"The council's budget grew from {a} to {b} in one year.",
        f"The invoice lists {a} for parts and {b} for labour.",
        f"Tickets cost {a} each, or {b} for a season pass.",
    ])  # fmt: skip


_MAKERS: dict[str, Callable[[random.Random], str]] = {
    "integers": _integers, "decimals": _decimals, "dates": _dates, "amounts": _amounts,
}  # fmt: skip


def slice_texts(name: str, count: int, seed: int) -> list[str]:
    """``count`` distinct seeded sentences of one perplexity slice (:data:`SLICES`)."""
    rng = random.Random(f"{seed}/ppl/{name}")
    texts: list[str] = []
    while len(texts) < count:
        text = _MAKERS[name](rng)
        if text not in texts:
            texts.append(text)
    return texts


def segments(text: str) -> list[dict[str, str]]:
    """``text`` cut into number spans and the text between them, each with all the text before it
    (the segments joined give ``text`` back)."""
    out, start = [], 0
    for match in _SPAN.finditer(text):
        if match.start() > start:
            out.append({"context": text[:start], "segment": text[start : match.start()], "kind": "text"})
        out.append({"context": text[: match.start()], "segment": match.group(0), "kind": "number"})
        start = match.end()
    if start < len(text):
        out.append({"context": text[:start], "segment": text[start:], "kind": "text"})
    return out
