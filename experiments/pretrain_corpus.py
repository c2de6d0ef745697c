"""A small number-rich pretraining corpus, built offline and deterministically, for the CPU study.

    python experiments/pretrain_corpus.py --out data/pretrain_corpus        # 1.7 M characters, a few seconds
    python experiments/pretrain_corpus.py --out DIR --seed 1 --number-documents 2000 --prose-chars 200000

Writes into ``--out``:

* ``train.jsonl``: one ``{"text": ..., "source": kind}`` row per document, shuffled with the seed
  (read it with ``data.source=text data.train_path=DIR/train.jsonl``; the trainer packs the
  documents and holds out whole documents itself). The kinds are

  - ``arithmetic``: several lines ``What is 123 + 45? 168`` (the question style of
    :mod:`ntl_scale.data.arithmetic`: question, one space, the answer, a newline);
  - ``table``: rows ``apples: 12 at 35 cents, total 420 cents`` and the sum of the totals;
  - ``dates``: ages from birth years, spans between years, days between dates of one month, weeks
    in days;
  - ``prices``: count x unit price = total, and the change from a payment;
  - ``prose``: the Python documentation topics shipped with CPython (``pydoc_data.topics``), cut at
    paragraph boundaries and mapped onto the character tokenizer's alphabet.

  Every number in the number-rich documents is computed from the others (totals, differences), so
  numbers can be learnt from their context.
* ``questions.jsonl``: held-out ``{"question": ..., "answer": ...}`` rows of the arithmetic kind in
  the corpus format (half addition, half subtraction); none of them occurs in ``train.jsonl``
  (their operand pairs are reserved before any training document is drawn).
* The first documents of ``train.jsonl`` are the part the trainer holds out (``data.eval_sequences``
  x ``train.seq_length`` tokens; :func:`heldout_block`): prose only in its first
  ``--heldout-prose-sequences`` sequences, number documents in the rest, so held-out text perplexity
  is measured on prose and on number documents separately (``manifest.json`` names the sequence
  ranges: ``heldout.groups``).
* ``manifest.json``: the arguments, the Python version, documents and characters per kind and the
  SHA-256 of both files.

Every character is in :data:`ntl_scale.training.tokenizer.ALPHABET`. The same seed and arguments
give byte-identical files on the same Python version (the prose comes from that version's
``pydoc_data``; on 3.11 it gives about 0.4 MB, all of which the default takes).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import random
import re
import sys
import time
import unicodedata
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from ntl_scale.atomic import write_atomically  # noqa: E402
from ntl_scale.training.tokenizer import ALPHABET  # noqa: E402

__all__ = [
    "NUMBER_KINDS",
    "Corpus",
    "CorpusConfig",
    "build_corpus",
    "document_tokens",
    "heldout_block",
    "heldout_questions",
    "main",
    "normalise",
    "number_documents",
    "prose_documents",
    "write_corpus",
]

NUMBER_KINDS = ("arithmetic", "table", "dates", "prices")
MAX_QUESTIONS = 100_000  # a tenth of the 2 x 1000 x 1000 operand pairs: reserving stays cheap
MAX_PROSE_DOCUMENT = 3000  # characters of one prose document at most
FILES = ("train.jsonl", "questions.jsonl", "manifest.json")

NAMES = ("Ada", "Ben", "Cleo", "Dan", "Eva", "Finn", "Gus", "Hana", "Ivan", "Jo", "Kim", "Liam", "Mia",
         "Noor", "Omar", "Pia", "Raj", "Sara", "Tom", "Uma", "Vera", "Wes", "Yara", "Zoe")  # fmt: skip
ITEMS = ("apples", "pears", "pens", "books", "cups", "lamps", "chairs", "plates", "candles", "shirts",
         "tickets", "bottles", "boxes", "bags", "stamps", "maps", "ropes", "tiles", "bricks", "nails",
         "jars", "hats", "socks", "spoons")  # fmt: skip
MONEY = ("cents", "pence", "dollars", "euros", "coins")
TABLE_TITLES = ("Stock list", "Order sheet", "Market stall", "Store room", "Invoice", "Shopping list")
BUILDINGS = ("bridge", "mill", "school", "theatre", "bakery", "station", "library", "mine", "harbour")
MONTHS = (("January", 31), ("February", 28), ("March", 31), ("April", 30), ("May", 31), ("June", 30),
          ("July", 31), ("August", 31), ("September", 30), ("October", 31), ("November", 30),
          ("December", 31))  # fmt: skip

# Characters outside the alphabet that have a close stand-in; the rest of them are dropped.
_REPLACE = str.maketrans({
    "!": ".", ";": ",", '"': "'", "`": "'", "\u2018": "'", "\u2019": "'", "\u201c": "'", "\u201d": "'",
    "[": "(", "{": "(", "]": ")", "}": ")", "\t": " ", "\u2013": "-", "\u2014": "-", "~": "-",
    "\\": "/", "&": " and ", "%": " percent ", "\u2026": "...", "\u00df": "ss",
})  # fmt: skip
_KEEP = frozenset(ALPHABET)


@dataclass(frozen=True)
class CorpusConfig:
    """What to build.

    Attributes:
        seed: seeds every random choice (questions, documents, prose order, the final shuffle); >= 0,
            as ``random.Random(-s)`` is ``random.Random(s)``.
        number_documents: number-rich documents, the four kinds in equal shares.
        prose_chars: at most this many characters of prose; None takes all of ``pydoc_data``.
        questions: held-out arithmetic questions (additions get the extra one of an odd count).
        heldout_sequences: sequences of ``seq_length`` character-tokenizer tokens the trainer holds
            out (``data.eval_sequences``); 0 = no held-out block (every document shuffled).
        heldout_prose_sequences: of these, how many are prose only (the first ones).
        seq_length: the run's ``train.seq_length``.
    """

    seed: int = 0
    number_documents: int = 6000
    prose_chars: int | None = None
    questions: int = 400
    heldout_sequences: int = 128
    heldout_prose_sequences: int = 64
    seq_length: int = 256

    def __post_init__(self) -> None:
        names = ("seed", "number_documents", "prose_chars", "questions", "heldout_sequences",
                 "heldout_prose_sequences", "seq_length")  # fmt: skip
        for name in names:
            value = getattr(self, name)
            if value is None and name == "prose_chars":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        if self.questions > MAX_QUESTIONS:
            raise ValueError(f"questions must be at most {MAX_QUESTIONS}, got {self.questions}; ask for fewer")
        if self.heldout_prose_sequences >= self.heldout_sequences > 0 or self.seq_length < 2:
            raise ValueError(
                f"need heldout_prose_sequences < heldout_sequences (got {self.heldout_prose_sequences} and "
                f"{self.heldout_sequences}; the rest hold the number documents) and seq_length >= 2 (got "
                f"{self.seq_length})"
            )


# --------------------------------------------------------------------------------------------------
# Number-rich documents


def _operand(rng: random.Random) -> int:
    """A non-negative operand of 1 to 3 digits, the digit count drawn first (as ntl_scale.data.arithmetic)."""
    digits = rng.randint(1, 3)
    return rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10**digits - 1)


def _question(a: int, op: str, b: int) -> str:
    return f"What is {a} {op} {b}?"


def _answer(a: int, op: str, b: int) -> str:
    return str(a + b if op == "+" else a - b)


def heldout_questions(rng: random.Random, count: int) -> list[dict[str, str]]:
    """``count`` distinct held-out arithmetic questions, shuffled (half ``+``, half ``-``).

    Args:
        rng: the generator (advanced).
        count: how many; an odd count gives the extra one to addition.

    Returns:
        Rows ``{"question": "What is a + b?", "answer": "c"}``.
    """
    ops = ["+"] * (count - count // 2) + ["-"] * (count // 2)
    seen: set[tuple[int, str, int]] = set()
    rows = []
    for op in ops:
        while True:
            a, b = _operand(rng), _operand(rng)
            if (a, op, b) not in seen:
                break
        seen.add((a, op, b))
        rows.append({"question": _question(a, op, b), "answer": _answer(a, op, b)})
    rng.shuffle(rows)
    return rows


def reserved_questions(questions: list[dict[str, str]]) -> set[str]:
    """The question texts no training document may hold: each held-out question and, for an addition,
    the same addition with its operands swapped (``b + a`` asks the same sum)."""
    reserved = set()
    for row in questions:
        reserved.add(row["question"])
        match = re.fullmatch(r"What is (-?\d+) \+ (-?\d+)\?", row["question"])
        if match:
            reserved.add(f"What is {match.group(2)} + {match.group(1)}?")
    return reserved


def _arithmetic(rng: random.Random, reserved: set[str]) -> str:
    lines = []
    for _ in range(rng.randint(5, 12)):
        while True:
            a, op, b = _operand(rng), rng.choice("+-"), _operand(rng)
            question = _question(a, op, b)
            if question not in reserved:
                break
        lines.append(f"{question} {_answer(a, op, b)}\n")
    return "".join(lines)


def _table(rng: random.Random) -> str:
    unit = rng.choice(MONEY)
    lines = [f"{rng.choice(TABLE_TITLES)}:"]
    total = 0
    for item in rng.sample(ITEMS, rng.randint(2, 6)):
        count, price = rng.randint(1, 99), rng.randint(1, 250)
        total += count * price
        lines.append(f"{item}: {count} at {price} {unit}, total {count * price} {unit}")
    lines.append(f"Sum of all totals: {total} {unit}.")
    return "\n".join(lines)


def _count(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def _date_sentence(rng: random.Random) -> str:
    kind = rng.randrange(5)
    if kind == 0:
        name, born = rng.choice(NAMES), rng.randint(1900, 2010)
        year = born + rng.randint(1, min(90, 2025 - born))
        return f"{name} was born in {born}. In {year}, {name} turned {year - born}."
    if kind == 1:
        start = rng.randint(1700, 1990)
        end = start + rng.randint(1, min(250, 2025 - start))
        return (
            f"The {rng.choice(BUILDINGS)} opened in {start} and closed in {end}, after {_count(end - start, 'year')}."
        )
    if kind == 2:
        month, days = rng.choice(MONTHS)
        first = rng.randint(1, days - 1)
        last = rng.randint(first + 1, days)
        return f"From {month} {first} to {month} {last} is {_count(last - first, 'day')}."
    if kind == 3:
        older, younger = rng.sample(NAMES, 2)
        young = rng.randint(1, 80)
        old = young + rng.randint(1, 40)
        return (
            f"{older} is {_count(old, 'year')} old and {younger} is {_count(young, 'year')} old, "
            f"so {older} is {_count(old - young, 'year')} older."
        )
    weeks = rng.randint(1, 60)
    return f"{_count(weeks, 'week')} is {7 * weeks} days."


def _dates(rng: random.Random) -> str:
    return " ".join(_date_sentence(rng) for _ in range(rng.randint(3, 6)))


def _purchase(rng: random.Random) -> str:
    name, item, unit = rng.choice(NAMES), rng.choice(ITEMS), rng.choice(MONEY)
    count, price = rng.randint(2, 30), rng.randint(1, 99)
    total = count * price
    text = f"{name} buys {count} {item} at {price} {unit} each, {total} {unit} in all."
    if rng.random() < 0.6:
        step = rng.choice((5, 10, 20, 50, 100))
        paid = (total // step + 1) * step
        text += f" {name} pays {paid} {unit} and gets {paid - total} {unit} back."
    return text


def _prices(rng: random.Random) -> str:
    return " ".join(_purchase(rng) for _ in range(rng.randint(2, 4)))


def number_documents(rng: random.Random, count: int, reserved: set[str]) -> list[tuple[str, str]]:
    """``count`` number-rich documents, the kinds of :data:`NUMBER_KINDS` in turn.

    Args:
        rng: the generator (advanced).
        count: how many documents.
        reserved: question texts an arithmetic document must not contain (the held-out ones).

    Returns:
        ``(kind, text)`` pairs in generation order.
    """
    out = []
    for i in range(count):
        kind = NUMBER_KINDS[i % len(NUMBER_KINDS)]
        if kind == "arithmetic":
            text = _arithmetic(rng, reserved)
        elif kind == "table":
            text = _table(rng)
        elif kind == "dates":
            text = _dates(rng)
        else:
            text = _prices(rng)
        out.append((kind, text))
    return out


# --------------------------------------------------------------------------------------------------
# Prose


def normalise(text: str) -> str:
    """``text`` mapped onto the tokenizer alphabet.

    Stand-ins for close characters (``!`` -> ``.``, ``;`` -> ``,``, quotes and backticks -> ``'``,
    brackets -> parentheses, tabs -> spaces, underscores inside a name -> spaces and around it
    dropped), accents stripped, everything else dropped; runs of spaces collapsed, lines stripped,
    empty lines removed.
    """
    text = re.sub(r"(?<=[A-Za-z0-9])_+(?=[A-Za-z0-9])", " ", text).replace("_", "")  # a_b -> a b, __x__ -> x
    text = unicodedata.normalize("NFKD", text.translate(_REPLACE))
    text = "".join(ch for ch in text if ch in _KEEP)
    lines = (re.sub(r" {2,}", " ", line).strip() for line in text.split("\n"))
    return "\n".join(line for line in lines if line)


def _paragraphs(topic: str) -> list[str]:
    """A pydoc topic's paragraphs, normalised: wrapped lines joined, code blocks kept line by line,
    heading underlines and lines without a letter or digit dropped."""
    out = []
    for block in re.split(r"\n\s*\n", topic):
        lines = [line for line in block.split("\n") if re.search(r"[A-Za-z0-9]", line)]
        if not lines:
            continue
        # an indented block is code (kept line by line) unless it is wrapped text: an indented
        # paragraph, list item or note, whose lines but the last run near the wrap width
        wrapped = all(len(line.strip()) >= 45 for line in lines[:-1]) and ">>>" not in block
        code = all(line[:1].isspace() for line in lines) and not wrapped
        text = normalise("\n".join(lines) if code else " ".join(line.strip() for line in lines))
        if text:
            out.append(text)
    return out


def _cut(paragraph: str, limit: int) -> list[str]:
    """A paragraph longer than ``limit`` cut at line ends, else sentence ends, else spaces."""
    pieces, rest = [], paragraph
    while len(rest) > limit:
        window = rest[: limit + 1]
        at = max(window.rfind("\n"), window.rfind(". ") + 1, 0) or window.rfind(" ")
        at = at if at > 0 else limit
        pieces.append(rest[:at].strip())
        rest = rest[at:].strip()
    if rest:
        pieces.append(rest)
    return [p for p in pieces if p]


def prose_documents(seed: int, max_chars: int | None, limit: int = MAX_PROSE_DOCUMENT) -> list[str]:
    """Documents of the CPython documentation topics (``pydoc_data.topics``), normalised.

    Each topic (in sorted order) is cut at paragraph boundaries into documents of at most ``limit``
    characters (a paragraph that an earlier topic already had is left out: the topics repeat some);
    the documents are shuffled with ``seed`` and taken in that order, each one that
    would bring the total past ``max_chars`` skipped (None: all of them).

    Args:
        seed: the shuffle's seed.
        max_chars: the most characters to take.
        limit: the most characters of one document.

    Returns:
        The documents, in their shuffled order.
    """
    if max_chars == 0:
        return []
    try:
        from pydoc_data.topics import topics
    except ImportError as e:  # some distributions split pydoc_data off the standard library
        raise SystemExit(
            f"this Python ({sys.executable}) has no pydoc_data.topics, the corpus's prose source; "
            "use a full CPython install or pass --prose-chars 0"
        ) from e
    documents = []
    seen: set[str] = set()  # topics repeat paragraphs: each is kept once (held-out prose is never trained on)
    for name in sorted(topics):
        current = ""
        for paragraph in _paragraphs(topics[name]):
            if paragraph in seen:
                continue
            seen.add(paragraph)
            for piece in _cut(paragraph, limit):
                if current and len(current) + 1 + len(piece) > limit:
                    documents.append(current)
                    current = ""
                current = f"{current}\n{piece}" if current else piece
        if current:
            documents.append(current)
    random.Random(f"{seed}/prose").shuffle(documents)
    if max_chars is None:
        return documents
    taken, total = [], 0
    for doc in documents:
        if total + len(doc) <= max_chars:
            taken.append(doc)
            total += len(doc)
    return taken


# --------------------------------------------------------------------------------------------------
# The corpus and its files


@dataclass(frozen=True)
class Corpus:
    """A built corpus: the training rows (shuffled) and the held-out questions."""

    rows: list[dict[str, str]]
    questions: list[dict[str, str]]
    heldout: dict[str, Any]


_QUESTION = re.compile(r"What is \d+ [+-] \d+\?")


def build_corpus(config: CorpusConfig) -> Corpus:
    """Builds the corpus in memory (see the module docstring).

    Raises:
        RuntimeError: if a character outside the alphabet or a held-out question slipped into the
            training text (a bug here, never expected).
    """
    rng = random.Random(config.seed)
    questions = heldout_questions(rng, config.questions)
    reserved = reserved_questions(questions)
    pairs = number_documents(rng, config.number_documents, reserved)
    pairs += [("prose", doc) for doc in prose_documents(config.seed, config.prose_chars)]
    random.Random(f"{config.seed}/mix").shuffle(pairs)
    pairs, heldout = heldout_block(pairs, config)
    rows = [{"text": text, "source": kind} for kind, text in pairs]
    for row in rows:  # the guarantees, checked once more on the final text
        stray = set(row["text"]) - _KEEP
        leaked = [q for q in _QUESTION.findall(row["text"]) if q in reserved]
        if stray or leaked:
            raise RuntimeError(f"corpus bug: characters {sorted(stray)!r} or held-out questions {leaked!r} in {row}")
    return Corpus(rows, questions, heldout)


def document_tokens(text: str) -> int:
    """Tokens of one document as the trainer packs it with ``model.tokenizer: builtin:char``: one per
    character, plus the BOS (if that tokenizer adds one) and the EOS that end each document."""
    from ntl_scale.data.hf_datasets import document_specials
    from ntl_scale.training.tokenizer import build_char_tokenizer

    bos, _ = document_specials(build_char_tokenizer())
    return len(text) + 1 + (bos is not None)


def heldout_block(pairs: list[tuple[str, str]], config: CorpusConfig) -> tuple[list[tuple[str, str]], dict[str, Any]]:
    """Moves the documents the trainer holds out to the front, with a fixed composition.

    The trainer holds out the corpus's first ``heldout_sequences x seq_length`` tokens. Left to the
    shuffle, that part is whatever documents came first (often no prose at all). Here it is prose
    documents (in shuffled order) until the first ``heldout_prose_sequences`` sequences are filled,
    then number documents until every held-out sequence is: sequences ``[0, heldout_prose_sequences)``
    hold prose only (the last prose document is cut to end exactly there) and
    ``[heldout_prose_sequences, heldout_sequences)`` number documents only.

    Returns:
        The reordered ``(kind, text)`` pairs and the block's description (for the manifest): the
        sequence ranges of each group, its documents and characters per kind.
    """
    if config.heldout_sequences == 0:
        return pairs, {}
    length = config.seq_length
    need = {"prose": config.heldout_prose_sequences * length, "numbers": config.heldout_sequences * length}
    overhead = document_tokens("")
    held: list[tuple[str, str]] = []
    chosen: set[int] = set()
    tokens = 0
    for group in ("prose", "numbers"):
        for i, (kind, text) in enumerate(pairs):
            if tokens >= need[group]:
                break
            if (kind == "prose") == (group == "prose"):
                room = need[group] - tokens - overhead
                if group == "prose" and room == 0 and held:  # one token short: end the one before a character
                    held[-1] = (held[-1][0], held[-1][1][:-1])  # earlier, so that this one fits with one
                    tokens, room = tokens - 1, 1
                if group == "prose" and 0 < room < len(text):  # cut the last one to end the prose exactly
                    text = text[:room]
                held.append((kind, text))
                chosen.add(i)
                tokens += document_tokens(text)
        if tokens < need[group]:
            raise ValueError(
                f"the corpus has too few {group} documents for {need[group]} held-out tokens "
                f"(heldout_sequences={config.heldout_sequences}, heldout_prose_sequences="
                f"{config.heldout_prose_sequences}, seq_length={length}); add documents or hold out fewer sequences"
            )
        if group == "prose" and tokens != need["prose"]:
            raise RuntimeError(f"corpus bug: the held-out prose ends at token {tokens}, not {need['prose']}")
    groups = {"prose": [0, config.heldout_prose_sequences],
              "numbers": [config.heldout_prose_sequences, config.heldout_sequences]}  # fmt: skip
    if config.heldout_prose_sequences == 0:  # no prose held out: no prose group
        del groups["prose"]
    description = {
        "seq_length": length,
        "sequences": config.heldout_sequences,
        "groups": groups,
        "documents": dict(Counter(kind for kind, _ in held)),
        "characters": {k: sum(len(t) for kind, t in held if kind == k) for k in dict.fromkeys(k for k, _ in held)},
    }
    return held + [p for i, p in enumerate(pairs) if i not in chosen], description


def _jsonl(rows: Sequence[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(row) + "\n" for row in rows).encode("utf-8")


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _arguments(config: CorpusConfig) -> dict[str, Any]:
    return asdict(config)


def _reuse(out: str, config: CorpusConfig) -> dict[str, Any] | None:
    """The manifest of a finished build of the same arguments in ``out`` (None when there is none).

    Raises:
        SystemExit: when ``out`` holds a build of other arguments, or one whose files do not match
            its manifest.
    """
    path = os.path.join(out, "manifest.json")
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as f:
        manifest = json.load(f)
    wanted = _arguments(config)
    if manifest.get("arguments") != wanted:
        raise SystemExit(
            f"{out} holds a corpus built with {json.dumps(manifest.get('arguments'), sort_keys=True)}, not the "
            f"requested {json.dumps(wanted, sort_keys=True)}; "
            "pass --force to overwrite it or choose another --out"
        )
    for name, key in (("train.jsonl", "train_sha256"), ("questions.jsonl", "questions_sha256")):
        file = os.path.join(out, name)
        if not os.path.exists(file) or _sha256(_read(file)) != manifest.get(key):
            raise SystemExit(f"{file} is missing or does not match {path}; pass --force to rebuild it")
    return dict(manifest)


def write_corpus(out: str, config: CorpusConfig, *, force: bool = False) -> dict[str, Any]:
    """Builds the corpus into ``out`` (each file written atomically, the manifest last).

    A finished build of the same arguments is reused (not rewritten) unless ``force``.

    Args:
        out: the folder (created if missing).
        config: what to build.
        force: rebuild even over an existing build, of the same or other arguments.

    Returns:
        The manifest, with ``reused`` True when the folder already held this build.
    """
    if os.path.exists(out) and not os.path.isdir(out):
        raise SystemExit(f"--out {out} is a file; pass a folder")
    if not force:
        existing = _reuse(out, config)
        if existing is not None:
            return {**existing, "reused": True}
    start = time.perf_counter()
    corpus = build_corpus(config)
    train, questions = _jsonl(corpus.rows), _jsonl(corpus.questions)
    kinds = (*NUMBER_KINDS, "prose")
    manifest: dict[str, Any] = {
        "arguments": _arguments(config),
        "seed": config.seed,
        "python": platform.python_version(),
        "documents": {k: sum(1 for r in corpus.rows if r["source"] == k) for k in kinds},
        "characters": {k: sum(len(r["text"]) for r in corpus.rows if r["source"] == k) for k in kinds},
        "questions": len(corpus.questions),
        "heldout": corpus.heldout,
        "train_bytes": len(train),
        "train_sha256": _sha256(train),
        "questions_sha256": _sha256(questions),
    }
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "manifest.json")
    if os.path.exists(path):  # a half-rewritten folder must not pass for a finished build
        os.remove(path)
    write_atomically(os.path.join(out, "train.jsonl"), train)
    write_atomically(os.path.join(out, "questions.jsonl"), questions)
    write_atomically(path, (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode("utf-8"))
    return {**manifest, "reused": False, "seconds": time.perf_counter() - start}


def _nonnegative(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        number = -1
    if number < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {value!r}")
    return number


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """The command line (see the module docstring); returns the manifest."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--out", required=True, help="folder for train.jsonl, questions.jsonl, manifest.json")
    parser.add_argument("--seed", type=_nonnegative, default=0, help="seed of every random choice, >= 0 (default 0)")
    parser.add_argument("--number-documents", type=_nonnegative, default=CorpusConfig.number_documents,
                        help="number-rich documents, four kinds in equal shares (default %(default)s)")  # fmt: skip
    parser.add_argument("--prose-chars", type=_nonnegative, default=None,
                        help="at most this many characters of pydoc_data prose (default: all of it)")  # fmt: skip
    parser.add_argument("--questions", type=_nonnegative, default=CorpusConfig.questions,
                        help=f"held-out arithmetic questions, at most {MAX_QUESTIONS} "
                             "(default %(default)s)")  # fmt: skip
    parser.add_argument("--heldout-sequences", type=_nonnegative, default=CorpusConfig.heldout_sequences,
                        help="sequences the trainer holds out (data.eval_sequences; 0: none placed; "
                             "default %(default)s)")  # fmt: skip
    parser.add_argument("--heldout-prose-sequences", type=_nonnegative,
                        default=CorpusConfig.heldout_prose_sequences,
                        help="of these, the first ones that hold prose only (default %(default)s)")  # fmt: skip
    parser.add_argument(
        "--seq-length",
        type=_nonnegative,
        default=CorpusConfig.seq_length,
        help="the run's train.seq_length (default %(default)s)",
    )
    parser.add_argument("--force", action="store_true", help="rebuild over an existing build in --out")
    args = parser.parse_args(argv)
    try:
        config = CorpusConfig(args.seed, args.number_documents, args.prose_chars, args.questions,
                              args.heldout_sequences, args.heldout_prose_sequences, args.seq_length)  # fmt: skip
    except ValueError as e:
        parser.error(str(e))
    manifest = write_corpus(args.out, config, force=args.force)
    if manifest["reused"]:
        print(f"{args.out}: reusing the corpus already built with these arguments (--force rebuilds it)")
    else:
        chars = sum(manifest["characters"].values())
        parts = ", ".join(
            f"{k} {manifest['documents'][k]} ({manifest['characters'][k]} chars)" for k in manifest["documents"]
        )
        print(f"{args.out}: {chars} characters in {sum(manifest['documents'].values())} documents: {parts}; "
              f"{manifest['questions']} held-out questions; {manifest['seconds']:.1f} s")  # fmt: skip
    return manifest


if __name__ == "__main__":
    main()
