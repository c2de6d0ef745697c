"""experiments/pretrain_corpus.py: the offline number-rich corpus of the pretraining study.

Sections: determinism (same seed, same bytes; another seed, other bytes); the alphabet (every
character, and no <unk> from the character tokenizer); the arithmetic of every number-rich document,
re-derived by regexes written here; the held-out questions (format, answers, never in the training
text); the prose (sentences of pydoc_data); the manifest (counts and hashes of the files), reuse and
refusal of an existing folder; bad arguments; the script run once as users run it.
"""

from __future__ import annotations

import calendar
import hashlib
import json
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from ntl_scale.training.tokenizer import ALPHABET
from tests.helpers.scripts import load_script

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "experiments" / "pretrain_corpus.py"

pc = load_script("experiments/pretrain_corpus.py", "pretrain_corpus")

SMALL = {"number_documents": 240, "prose_chars": 40_000, "questions": 60, "heldout_sequences": 16,
         "heldout_prose_sequences": 8, "seq_length": 64}  # fmt: skip


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Path]:
    """Three small builds: seed 0 twice (into separate folders) and seed 1."""
    root = tmp_path_factory.mktemp("corpus")
    out = {}
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        pc.write_corpus(str(root / name), pc.CorpusConfig(seed=seed, **SMALL))
        out[name] = root / name
    return out


@pytest.fixture(scope="module")
def full(tmp_path_factory) -> Path:
    """The default build (all of the pydoc_data prose)."""
    out = tmp_path_factory.mktemp("full")
    pc.write_corpus(str(out), pc.CorpusConfig())
    return out


# --------------------------------------------------------------------------------------------------
# Determinism


def test_same_seed_same_bytes_other_seed_other_bytes(built):
    for name in ("train.jsonl", "questions.jsonl", "manifest.json"):
        assert (built["a"] / name).read_bytes() == (built["b"] / name).read_bytes(), name
    for name in ("train.jsonl", "questions.jsonl"):
        assert (built["a"] / name).read_bytes() != (built["c"] / name).read_bytes(), name


# --------------------------------------------------------------------------------------------------
# The alphabet


def test_every_character_is_in_the_alphabet_and_tokenizes_without_unk(full):
    allowed = set(ALPHABET)
    rows, questions = _rows(full / "train.jsonl"), _rows(full / "questions.jsonl")
    for row in rows:
        assert set(row["text"]) <= allowed, (row["source"], set(row["text"]) - allowed)
    for q in questions:
        assert set(q["question"] + " " + q["answer"]) <= allowed, q
    pytest.importorskip("transformers")
    from ntl_scale.training.tokenizer import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    sample = [r["text"] for r in rows[:300]] + [q["question"] + " " + q["answer"] for q in questions[:50]]
    sample += [r["text"] for r in rows if r["source"] == "prose"][:20]
    for text in sample:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert tokenizer.unk_token_id not in ids, text[:200]
        assert len(ids) == len(text)  # one token per character


# --------------------------------------------------------------------------------------------------
# The arithmetic of the number-rich documents (every number is checked: nothing with a digit is left)

ARITHMETIC = re.compile(r"What is (\d+) ([+-]) (\d+)\? (-?\d+)\n")
TABLE_ROW = re.compile(r"([a-z]+): (\d+) at (\d+) ([a-z]+), total (\d+) ([a-z]+)")
TABLE_SUM = re.compile(r"Sum of all totals: (\d+) ([a-z]+)\.")
BORN = re.compile(r"([A-Z][a-z]+) was born in (\d+)\. In (\d+), \1 turned (\d+)\.")
SPAN = re.compile(r"The [a-z]+ opened in (\d+) and closed in (\d+), after (\d+) years?\.")
MONTH_SPAN = re.compile(r"From ([A-Z][a-z]+) (\d+) to \1 (\d+) is (\d+) days?\.")
AGE_GAP = re.compile(
    r"([A-Z][a-z]+) is (\d+) years? old and [A-Z][a-z]+ is (\d+) years? old, so \1 is (\d+) years? older\."
)
WEEKS = re.compile(r"(\d+) weeks? is (\d+) days\.")
PURCHASE = re.compile(
    r"([A-Z][a-z]+) buys (\d+) [a-z]+ at (\d+) ([a-z]+) each, (\d+) \4 in all\."
    r"(?: \1 pays (\d+) \4 and gets (\d+) \4 back\.)?"
)


def _ints(match: re.Match, *groups: int) -> list[int]:
    return [int(match.group(g)) for g in groups]


def _check_arithmetic(text: str) -> str:
    for m in ARITHMETIC.finditer(text):
        a, b, answer = _ints(m, 1, 3, 4)
        assert answer == (a + b if m.group(2) == "+" else a - b), m.group(0)
        assert 0 <= a <= 999 and 0 <= b <= 999, m.group(0)
    return ARITHMETIC.sub("", text)


def _check_table(text: str) -> str:
    lines = text.split("\n")
    assert re.fullmatch(r"[A-Z][a-z ]+:", lines[0]), lines[0]
    rows = [TABLE_ROW.fullmatch(line) for line in lines[1:-1]]
    assert rows and all(rows), text
    units = {m.group(4) for m in rows if m} | {m.group(6) for m in rows if m}
    total = 0
    for m in rows:
        assert m is not None
        count, price, line_total = _ints(m, 2, 3, 5)
        assert line_total == count * price, m.group(0)
        total += line_total
    last = TABLE_SUM.fullmatch(lines[-1])
    assert last is not None and int(last.group(1)) == total, (lines[-1], total)
    assert units == {last.group(2)}, text
    return ""


def _check_dates(text: str) -> str:
    months = {calendar.month_name[i]: calendar.monthrange(2001, i)[1] for i in range(1, 13)}  # 2001: no leap day
    for m in BORN.finditer(text):
        born, year, age = _ints(m, 2, 3, 4)
        assert age == year - born > 0, m.group(0)
    for m in SPAN.finditer(text):
        start, end, years = _ints(m, 1, 2, 3)
        assert years == end - start > 0, m.group(0)
    for m in MONTH_SPAN.finditer(text):
        first, last, days = _ints(m, 2, 3, 4)
        assert days == last - first > 0 and first >= 1 and last <= months[m.group(1)], m.group(0)
    for m in AGE_GAP.finditer(text):
        old, young, gap = _ints(m, 2, 3, 4)
        assert gap == old - young > 0, m.group(0)
    for m in WEEKS.finditer(text):
        weeks, days = _ints(m, 1, 2)
        assert days == 7 * weeks, m.group(0)
    for pattern in (BORN, SPAN, MONTH_SPAN, AGE_GAP, WEEKS):
        text = pattern.sub("", text)
    return text


def _check_prices(text: str) -> str:
    for m in PURCHASE.finditer(text):
        count, price, total = _ints(m, 2, 3, 5)
        assert total == count * price, m.group(0)
        if m.group(6) is not None:
            paid, change = _ints(m, 6, 7)
            assert paid >= total and change == paid - total, m.group(0)
    return PURCHASE.sub("", text)


CHECKS = {"arithmetic": _check_arithmetic, "table": _check_table, "dates": _check_dates, "prices": _check_prices}


def test_number_documents_have_correct_arithmetic(full):
    rows = _rows(full / "train.jsonl")
    kinds = Counter(r["source"] for r in rows)
    assert set(kinds) == {*CHECKS, "prose"}
    assert len({kinds[k] for k in CHECKS}) == 1  # equal shares
    checked = Counter()
    for row in rows:
        if row["source"] == "prose":
            continue
        text = row["text"]
        checked[row["source"]] += len(re.findall(r"\d+", text))
        rest = CHECKS[row["source"]](text)
        assert not re.search(r"\d", rest), (row["source"], rest[:300])  # every number was checked
        assert not re.search(r"\b1 (years|days|weeks)\b", text), text
    assert all(checked[k] > 1000 for k in CHECKS), checked


def test_check_helpers_reject_wrong_arithmetic():
    """The checks above are not vacuous: a wrong number fails them."""
    with pytest.raises(AssertionError):
        _check_arithmetic("What is 12 + 30? 43\n")
    with pytest.raises(AssertionError):
        _check_table("Invoice:\napples: 2 at 3 cents, total 6 cents\nSum of all totals: 7 cents.")
    with pytest.raises(AssertionError):
        _check_dates("From May 3 to May 9 is 5 days.")
    with pytest.raises(AssertionError):
        _check_prices("Ada buys 3 cups at 4 coins each, 12 coins in all. Ada pays 20 coins and gets 7 coins back.")


# --------------------------------------------------------------------------------------------------
# The held-out questions


def test_heldout_questions_are_correct_balanced_and_never_in_training_text(full, built):
    for folder, count in ((full, 400), (built["a"], SMALL["questions"])):
        questions = _rows(folder / "questions.jsonl")
        assert len(questions) == count and len({q["question"] for q in questions}) == count
        ops = Counter()
        for q in questions:
            assert set(q) == {"question", "answer"}
            m = re.fullmatch(r"What is (\d+) ([+-]) (\d+)\?", q["question"])
            assert m is not None, q
            a, b = int(m.group(1)), int(m.group(3))
            assert q["answer"] == str(a + b if m.group(2) == "+" else a - b), q
            ops[m.group(2)] += 1
            # the corpus writes `question + " " + answer` followed by a newline
            assert ARITHMETIC.fullmatch(q["question"] + " " + q["answer"] + "\n")
        assert ops["+"] == ops["-"] == count // 2
        train = (folder / "train.jsonl").read_text(encoding="utf-8")  # JSON leaves the question characters as they are
        for q in questions:
            assert q["question"] not in train, q
            a, op, b = re.fullmatch(r"What is (\d+) ([+-]) (\d+)\?", q["question"]).groups()
            if op == "+":  # the same sum with the operands swapped is held out too
                assert f"What is {b} + {a}?" not in train, q


# --------------------------------------------------------------------------------------------------
# The prose


def _clean_sentences(raw: str) -> list[str]:
    """Sentences of a pydoc topic made only of letters, spaces and commas (normalisation keeps them)."""
    flat = re.sub(r"\s+", " ", raw)
    return [s for s in re.findall(r"(?<=\. )[A-Z][a-z ,]{40,}\.", flat) if "  " not in s]


def test_prose_comes_from_pydoc_data(full, built):
    from pydoc_data.topics import topics

    sentences = {s for raw in topics.values() for s in _clean_sentences(raw)}
    assert len(sentences) > 300
    prose = [r["text"] for r in _rows(full / "train.jsonl") if r["source"] == "prose"]
    joined = "\n".join(prose)
    found = sum(1 for s in sentences if s in joined)
    assert found >= 0.95 * len(sentences), (found, len(sentences))
    assert all(len(p) <= pc.MAX_PROSE_DOCUMENT for p in prose)
    small = [r["text"] for r in _rows(built["a"] / "train.jsonl") if r["source"] == "prose"]
    assert 0 < sum(len(p) for p in small) <= SMALL["prose_chars"]
    assert sum(1 for s in sentences if s in "\n".join(small)) > 10


def test_normalise_maps_onto_the_alphabet():
    text = 'He said: "Go!"\tThen; [x] {y} <z> __main__ a_b caf\u00e9 \u2014 \u201cq\u201d 50% & \u00b0\n\n  end  '
    out = pc.normalise(text)
    assert out == "He said: 'Go.' Then, (x) (y) z main a b cafe - 'q' 50 percent and\nend"
    assert set(out) <= set(ALPHABET)


# --------------------------------------------------------------------------------------------------
# The manifest, reuse and refusal


def test_manifest_matches_files(full, built):
    for folder in (full, built["a"]):
        manifest = json.loads((folder / "manifest.json").read_text())
        rows = _rows(folder / "train.jsonl")
        assert manifest["train_sha256"] == hashlib.sha256((folder / "train.jsonl").read_bytes()).hexdigest()
        assert manifest["questions_sha256"] == hashlib.sha256((folder / "questions.jsonl").read_bytes()).hexdigest()
        assert manifest["documents"] == dict(Counter(r["source"] for r in rows))
        chars = Counter()
        for r in rows:
            chars[r["source"]] += len(r["text"])
        assert manifest["characters"] == dict(chars)
        assert manifest["questions"] == len(_rows(folder / "questions.jsonl"))
        assert manifest["python"] == ".".join(map(str, sys.version_info[:3]))
    small = json.loads((built["a"] / "manifest.json").read_text())
    assert small["arguments"] == {"seed": 0, **SMALL} and small["seed"] == 0
    assert sum(small["documents"][k] for k in CHECKS) == SMALL["number_documents"]


def test_existing_folder_is_reused_refused_or_forced(tmp_path, capsys):
    out = tmp_path / "corpus"
    args = ["--out", str(out), "--number-documents", "20", "--prose-chars", "3000", "--questions", "8",
            "--heldout-sequences", "0"]  # fmt: skip
    first = pc.main(args)
    assert not first["reused"]
    before = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in out.iterdir()}
    assert sorted(before) == ["manifest.json", "questions.jsonl", "train.jsonl"]  # no temporary files left
    again = pc.main(args)
    assert again["reused"] and "reusing" in capsys.readouterr().out
    assert {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in out.iterdir()} == before
    with pytest.raises(SystemExit) as info:
        pc.main([*args, "--seed", "3"])
    message = str(info.value)
    assert '"seed": 0' in message and '"seed": 3' in message and "--force" in message and "--out" in message
    assert (out / "train.jsonl").read_bytes() == before["train.jsonl"][0]
    forced = pc.main([*args, "--seed", "3", "--force"])
    assert not forced["reused"] and forced["arguments"]["seed"] == 3
    assert (out / "train.jsonl").read_bytes() != before["train.jsonl"][0]
    (out / "train.jsonl").write_text("tampered\n")
    with pytest.raises(SystemExit, match="does not match"):
        pc.main([*args, "--seed", "3"])


# --------------------------------------------------------------------------------------------------
# The held-out block, as the trainer packs and holds it out


@pytest.mark.parametrize("which", ["small", "default"])
def test_heldout_groups_hold_only_their_kind_as_the_trainer_packs_them(built, full, tmp_path, which):
    """The trainer's own held-out sequences (data.eval_sequences x train.seq_length, the character
    tokenizer), cut at EOS: every piece of a sequence in the manifest's prose range is text of a prose
    document, every piece in the number range text of a number document; the ranges tile the held-out
    part but for at most one sequence between them."""
    from ntl_scale.training.config import DataConfig
    from ntl_scale.training.sources import heldout_batches
    from ntl_scale.training.tokenizer import build_char_tokenizer

    folder = built["a"] if which == "small" else full
    held = json.loads((folder / "manifest.json").read_text())["heldout"]
    (p0, p1), (n0, n1) = held["groups"]["prose"], held["groups"]["numbers"]
    wanted = SMALL if which == "small" else {"heldout_sequences": 128, "heldout_prose_sequences": 64, "seq_length": 256}
    assert (p0, p1, n1) == (0, wanted["heldout_prose_sequences"], wanted["heldout_sequences"]) and p1 <= n0 <= p1 + 1
    tokenizer = build_char_tokenizer()
    cfg = DataConfig(source="text", train_path=str(folder / "train.jsonl"), eval_sequences=n1,
                     cache_dir=str(tmp_path / "cache"))  # fmt: skip
    batches = heldout_batches(cfg, tokenizer, seq_length=held["seq_length"], micro_batch_size=8, dp_rank=0, dp=1)
    sequences = [row for batch in batches for row in batch["input_ids"].tolist()]
    assert len(sequences) == n1
    rows = _rows(folder / "train.jsonl")
    texts = {
        kind: [r["text"] for r in rows if (r["source"] == "prose") == (kind == "prose")] for kind in ("prose", "n")
    }
    for index, sequence in enumerate(sequences):
        if p1 <= index < n0:
            continue
        pool = texts["prose"] if index < p1 else texts["n"]
        pieces, current = [], []
        for token in sequence:
            if token == tokenizer.eos_token_id:
                pieces.append(current)
                current = []
            else:
                current.append(token)
        pieces.append(current)
        for piece in filter(None, pieces):
            text = tokenizer.decode(piece)
            assert any(text in doc for doc in pool), (index, text[:60])
    # the manifest counts the held-out block's documents: they come first in train.jsonl
    count = sum(held["documents"].values())
    assert dict(Counter(r["source"] for r in rows[:count])) == held["documents"]
    assert [r["source"] for r in rows[: held["documents"]["prose"]]] == ["prose"] * held["documents"]["prose"]
    # and training starts right after the block: nothing of it is trained on, nothing else is held out
    from ntl_scale.data.packing import heldout_split

    lengths = [len(r["text"]) + 1 for r in rows]  # the character tokenizer: a token per character, and EOS
    assert heldout_split(lengths, held["seq_length"], n1) == count


def test_heldout_prose_ends_exactly_even_one_token_short():
    """Documents whose tokens (characters + EOS, counted here) fall one short of the prose target: the
    one before ends a character earlier and the next is cut, so the prose fills exactly its sequences;
    the rest of each group's documents come in their shuffled order, the other documents after them."""
    pairs = [("prose", "abcdefgh"), ("table", "1 2 3"), ("prose", "ijklmnop"), ("prose", "qr"), ("dates", "4 5 6 7")]
    config = pc.CorpusConfig(heldout_sequences=2, heldout_prose_sequences=1, seq_length=10)
    moved, held = pc.heldout_block(pairs, config)
    prose = [text for kind, text in moved[:2]]
    assert prose == ["abcdefg", "i"] and sum(len(t) + 1 for t in prose) == 10  # 9 tokens, then 1 short
    assert moved[2:] == [("table", "1 2 3"), ("dates", "4 5 6 7"), ("prose", "qr")]
    assert held["groups"] == {"prose": [0, 1], "numbers": [1, 2]} and held["documents"] == {"prose": 2, "table": 1,
                                                                                              "dates": 1}  # fmt: skip


def test_heldout_prose_is_not_training_prose(full):
    """pydoc topics repeat paragraphs; each is kept once, so the held-out prose (the block's prose
    documents) shares almost no 50-character window with the training prose."""
    rows = _rows(full / "train.jsonl")
    held = json.loads((full / "manifest.json").read_text())["heldout"]
    count = sum(held["documents"].values())
    heldout = " ".join(r["text"] for r in rows[:count] if r["source"] == "prose")
    training = " ".join(r["text"] for r in rows[count:] if r["source"] == "prose")
    windows = [heldout[i : i + 50] for i in range(0, len(heldout) - 50, 25)]
    shared = sum(window in training for window in windows)
    assert len(windows) > 500 and shared / len(windows) < 0.03, (shared, len(windows))


# --------------------------------------------------------------------------------------------------
# Bad arguments


@pytest.mark.parametrize(
    ("flag", "value"),
    [("--number-documents", "-5"), ("--questions", "-1"), ("--prose-chars", "-10"), ("--questions", "many"),
     ("--questions", "100001"), ("--seed", "-2")],
)  # fmt: skip
def test_bad_arguments_name_the_value(tmp_path, capsys, flag, value):
    with pytest.raises(SystemExit) as info:
        pc.main(["--out", str(tmp_path / "x"), flag, value])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert value in err and (">= 0" in err or "at most" in err), err
    assert not (tmp_path / "x").exists()


def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match=r"number_documents must be an integer >= 0, got -1"):
        pc.CorpusConfig(number_documents=-1)
    with pytest.raises(ValueError, match=r"prose_chars must be an integer >= 0, got 1.5"):
        pc.CorpusConfig(prose_chars=1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"seed must be an integer >= 0, got 'x'"):
        pc.CorpusConfig(seed="x")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"heldout_prose_sequences < heldout_sequences \(got 4 and 4"):
        pc.CorpusConfig(heldout_sequences=4, heldout_prose_sequences=4)
    with pytest.raises(ValueError, match=r"too few prose documents for 16384 held-out tokens.*hold out fewer"):
        pc.build_corpus(pc.CorpusConfig(number_documents=40, prose_chars=0, questions=4))
    with pytest.raises(ValueError, match=r"too few numbers documents for 2048 held-out tokens"):
        pc.build_corpus(pc.CorpusConfig(number_documents=4, prose_chars=5000, questions=4, heldout_sequences=32,
                                        heldout_prose_sequences=1, seq_length=64))  # fmt: skip


# --------------------------------------------------------------------------------------------------
# The script, as users run it


def test_script_runs(tmp_path):
    out = tmp_path / "c"
    command = [sys.executable, str(SCRIPT), "--out", str(out), "--number-documents", "8", "--prose-chars", "2000",
               "--questions", "4", "--seed", "5", "--heldout-sequences", "4", "--heldout-prose-sequences", "2",
               "--seq-length", "64"]  # fmt: skip
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "4 held-out questions" in result.stdout
    expected = pc.CorpusConfig(seed=5, number_documents=8, prose_chars=2000, questions=4, heldout_sequences=4,
                               heldout_prose_sequences=2, seq_length=64)  # fmt: skip
    assert (out / "train.jsonl").read_bytes() == b"".join(
        (json.dumps(r) + "\n").encode() for r in pc.build_corpus(expected).rows
    )
