"""Greedy evaluation of reversed answers (``data.reverse_answers``) with a real tiny model.

A randomly initialised GPT-2 on the character tokenizer generates answers to generated questions whose
answers are written least-significant digit first. The reference here reads each generation on its own
(cut at the newline, the digits of the last number reversed by slicing) and evaluates each question by
its own arithmetic, then checks the predictions file and the metrics against it; and the same
generations without reversal give the plain numbers.
"""

from __future__ import annotations

import json
import re

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from ntl_scale.data import ArithmeticConfig, generate  # noqa: E402
from ntl_scale.training.scoring import evaluate_generation  # noqa: E402
from ntl_scale.training.tokenizer import build_char_tokenizer  # noqa: E402


def _last_number(text: str, reverse: bool) -> float | None:
    runs = re.findall(r"-?\d+", text)
    if not runs:
        return None
    sign, digits = ("-", runs[-1][1:]) if runs[-1].startswith("-") else ("", runs[-1])
    return float(sign + (digits[::-1] if reverse else digits))


def test_reversed_answers_are_read_back_before_scoring(tmp_path):
    tokenizer = build_char_tokenizer()
    torch.manual_seed(0)
    specials = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}
    config = transformers.GPT2Config(
        vocab_size=len(tokenizer), n_embd=32, n_layer=1, n_head=2, n_positions=64, **specials
    )
    model = transformers.GPT2LMHeadModel(config).eval()
    model.lm_head = torch.nn.Linear(32, len(tokenizer), bias=True)  # a head with a bias: favour digits and
    with torch.no_grad():  # the newline, so that most generations hold a number
        model.lm_head.bias.zero_()
        model.lm_head.bias[[tokenizer.convert_tokens_to_ids(c) for c in "0123456789\n"]] = 4.0
    examples = generate(
        24, "extrapolate", seed=1, config=ArithmeticConfig(kinds=("add",), negative_share=0.0, reverse_answers=True)
    )
    outputs = {}
    for reverse in (True, False):
        path = tmp_path / f"predictions_{reverse}.jsonl"
        metrics = evaluate_generation(model, tokenizer, examples, max_new_tokens=6, batch_size=5, answer_until="\n",
                                      predictions_path=str(path), reverse_answers=reverse)  # fmt: skip
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        outputs[reverse] = (metrics, rows)
    metrics, rows = outputs[True]
    truths = [sum(int(n) for n in re.findall(r"\d+", e.question)) for e in examples]
    parsed = [_last_number(r["generated"].split("\n", 1)[0], reverse=True) for r in rows]
    assert [r["answer"] for r in rows] == [str(t) for t in truths]  # the true number, in the usual order
    assert [r["parsed"] for r in rows] == parsed
    assert sum(p is not None for p in parsed) >= len(parsed) // 2  # the biased head answers with digits
    assert metrics["accuracy"] == pytest.approx(sum(p == t for p, t in zip(parsed, truths)) / len(truths))
    pairs = [(p, t) for p, t in zip(parsed, truths) if p is not None]
    assert metrics["mae"] == pytest.approx(sum(abs(p - t) for p, t in pairs) / len(pairs))
    # the same generations read without reversal: the answers as written and the plain numbers
    plain_rows = outputs[False][1]
    assert [r["generated"] for r in plain_rows] == [r["generated"] for r in rows]
    assert [r["answer"] for r in plain_rows] == [e.answer for e in examples]
    assert [r["parsed"] for r in plain_rows] == [_last_number(r["generated"].split("\n", 1)[0], False) for r in rows]
