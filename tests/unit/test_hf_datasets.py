"""Training data through Hugging Face ``datasets``: files -> Arrow rows -> tokenised rows -> this rank's
micro-batches, checked against a plain reading of the same files and the tokenizer called directly.

1. ``load_qa``: DeepMind text and JSON lines give the file's own (question, answer) pairs, in order;
   bad files get a message naming the file.
2. ``tokenize_qa``: the same ids as the tokenizer on each example, prompt masked; too-long rows dropped;
   the result is cached (a second call reads the Arrow file) and 2 processes give the same rows.
3. Order: map-style and streaming data give every row exactly once per epoch over the data-parallel
   ranks, and resume at the exact row, also on another number of ranks (same global batch).
"""

from __future__ import annotations

import json
from collections import Counter

import pytest

pytest.importorskip("datasets")
pytest.importorskip("transformers")

from ntl_scale.data import IGNORE_INDEX, StreamingOrder, load_qa, tokenize_qa
from ntl_scale.training.sources import Batches
from ntl_scale.training.tokenizer import build_char_tokenizer

PAIRS = [(f"What is {a} + {b}?", str(a + b)) for a in range(7) for b in range(6)]  # 42 pairs


@pytest.fixture()
def files(tmp_path):
    text = tmp_path / "add.txt"
    text.write_text("".join(f"{q}\n{a}\n" for q, a in PAIRS))
    jsonl = tmp_path / "add.jsonl"
    jsonl.write_text("".join(json.dumps({"q": q, "a": int(a), "other": 1}) + "\n" for q, a in PAIRS))
    return text, jsonl, str(tmp_path / "cache")


def test_files_become_their_own_pairs(files, tmp_path):
    text, jsonl, cache = files
    rows = load_qa("deepmind", str(text), cache_dir=cache)
    assert list(zip(rows["question"], rows["answer"])) == PAIRS
    rows = load_qa("jsonl", str(jsonl), cache_dir=cache, question_key="q", answer_key="a")
    assert rows.column_names == ["question", "answer"] and list(zip(rows["question"], rows["answer"])) == PAIRS
    streamed = load_qa("deepmind", str(text), streaming=True)
    assert [(r["question"], r["answer"]) for r in streamed] == PAIRS
    odd = tmp_path / "odd.txt"
    odd.write_text("q\na\nq2\n")
    with pytest.raises(ValueError, match="odd number of lines"):
        load_qa("deepmind", str(odd), cache_dir=cache)
    with pytest.raises(ValueError, match=r"no \['answer'\] key"):
        load_qa("jsonl", str(jsonl), cache_dir=cache, question_key="q")
    with pytest.raises(ValueError, match="no such data file"):
        load_qa("jsonl", str(tmp_path / "missing.jsonl"))
    with pytest.raises(ValueError, match="source must be 'deepmind' or 'jsonl'"):
        load_qa("csv", str(text))


def test_tokenised_rows_equal_the_tokenizer_and_are_cached(files):
    text, _, cache = files
    tokenizer = build_char_tokenizer()
    rows = load_qa("deepmind", str(text), cache_dir=cache)
    encoded = tokenize_qa(rows, tokenizer, max_length=17)
    expected = []
    for q, a in PAIRS:
        prompt = tokenizer.convert_tokens_to_ids(list(q + " "))  # one token per character
        answer = [*tokenizer.convert_tokens_to_ids(list(a)), tokenizer.eos_token_id]
        if len(prompt) + len(answer) <= 17:
            expected.append((prompt + answer, [IGNORE_INDEX] * len(prompt) + answer))
    assert 0 < len(expected) < len(PAIRS)  # some are longer than 17 tokens and dropped
    assert list(zip(encoded["input_ids"], encoded["labels"])) == expected
    seq2seq = tokenize_qa(rows, tokenizer, kind="seq2seq", max_length=64)
    assert seq2seq[0]["input_ids"] == tokenizer.convert_tokens_to_ids(list(PAIRS[0][0]))
    # cached on disk: the same call reads the same Arrow file; 2 processes give the same rows
    files_first = [f["filename"] for f in encoded.cache_files]
    assert files_first and all(f.startswith(cache) for f in files_first)
    again = tokenize_qa(load_qa("deepmind", str(text), cache_dir=cache), tokenizer, max_length=17)
    assert [f["filename"] for f in again.cache_files] == files_first
    parallel = tokenize_qa(rows, tokenizer, max_length=17, num_proc=2)
    assert list(zip(parallel["input_ids"], parallel["labels"])) == expected


def _epoch(make_batches, ranks: int, micro_batches: int) -> list[list[tuple[int, ...]]]:
    """Each micro-batch's rows over all ranks, as input-id tuples, for ``micro_batches`` micro-batches."""
    orders = [make_batches(r) for r in range(ranks)]
    return [[tuple(e.input_ids) for o in orders for e in o.next()] for _ in range(micro_batches)]


@pytest.mark.parametrize("streaming", [False, True])
def test_every_row_once_per_epoch_and_exact_resume(files, streaming):
    text, _, cache = files
    tokenizer = build_char_tokenizer()
    data = tokenize_qa(load_qa("deepmind", str(text), streaming=streaming, cache_dir=cache), tokenizer)
    every = Counter(tuple(r["input_ids"]) for r in data)
    assert sum(every.values()) == 42

    def batches(rank, world=2, accumulation=1):  # 42 rows = 7 steps of 3 x 2 ranks x 1
        return Batches(data, 3, rank, world, seed=4, accumulation=accumulation, shuffle_buffer=16)

    run = _epoch(batches, 2, 14)  # two epochs
    first, second = run[:7], run[7:]
    assert Counter(x for batch in first for x in batch) == every  # every row exactly once per epoch
    assert Counter(x for batch in second for x in batch) == every
    assert [x for b in first for x in b] != [x for b in second for x in b]  # reshuffled per epoch
    # resumed after 3 steps on one rank with accumulation 2 (the same global batch of 6)
    position = 3 * 6

    def resumed(rank):
        order = batches(rank, world=1, accumulation=2)
        order.position = position
        return order

    again = _epoch(resumed, 1, 2 * (14 - 3))  # one rank: twice the micro-batches, half the width
    assert [x for b in again for x in b] == [x for b in run[3:] for x in b]
    if streaming:
        assert isinstance(batches(0).order, StreamingOrder)


def test_streaming_order_refuses_a_stream_shorter_than_a_step(files):
    text, _, _ = files
    data = tokenize_qa(load_qa("deepmind", str(text), streaming=True), build_char_tokenizer())
    order = StreamingOrder(data, micro_batch_size=8, rank=0, world_size=2, seed=0, accumulation=3)
    with pytest.raises(ValueError, match="fewer rows than one step of 8 sequences x 2 ranks x 3"):
        order.next_examples()
