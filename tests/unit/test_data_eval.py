"""Arithmetic data and answer evaluation.

Sections:
1. The generator: answers checked by evaluating the question text independently; seeding; split
   properties (interpolate never repeats a training question, extrapolate has longer operands).
2. Readers: DeepMind text pairs, JSONL with errors naming file and line.
3. Number extraction and metrics against hand-computed values.
"""

from __future__ import annotations

import math
import re

import pytest

from ntl_scale.data import ArithmeticConfig, generate
from ntl_scale.eval import extract_number, number_metrics


def _evaluate(question: str) -> int:
    expression = re.sub(r"^(What is|Calculate) ", "", question).rstrip("?.").replace(" times ", " * ")
    if not re.fullmatch(r"[0-9()+\-* ]+", expression):
        raise AssertionError(f"unexpected question {question!r}")
    return eval(expression)  # the test's independent arithmetic: digits and + - * ( ) only


@pytest.mark.parametrize("split", ["train", "interpolate", "extrapolate"])
def test_answers_are_right(split):
    examples = generate(300, split, seed=3)
    assert len(examples) == 300
    assert {e.kind for e in examples} == {"add_sub", "add_sub_multiple", "mul"}
    for e in examples:
        assert int(e.answer) == _evaluate(e.question), e


@pytest.mark.parametrize("split", ["train", "interpolate", "extrapolate"])
def test_reversed_answers_are_the_right_number_least_significant_digit_first(split):
    """data.reverse_answers: the same questions, each answer's digits in the reverse order (sign first),
    checked against the question evaluated here; zeros that end the number lead the reversed answer."""
    config = ArithmeticConfig(kinds=("add_sub", "add_sub_multiple", "mul"), reverse_answers=True)
    plain = generate(300, split, seed=3)
    examples = generate(300, split, seed=3, config=config)
    assert [e.question for e in examples] == [e.question for e in plain]
    for e in examples:
        value = _evaluate(e.question)
        assert e.answer == ("-" if value < 0 else "") + str(abs(value))[::-1], e
    assert any(e.answer.lstrip("-").startswith("0") for e in examples if e.kind == "mul" or split != "train")


def test_seeded_and_split_properties():
    assert generate(50, seed=1) == generate(50, seed=1)
    assert generate(50, seed=1) != generate(50, seed=2)
    train = {e.question for e in generate(500, "train", seed=0)}
    interpolate = generate(500, "interpolate", seed=0)
    assert not train & {e.question for e in interpolate}
    config = ArithmeticConfig()

    def longest(question):
        return max(len(n) for n in re.findall(r"\d+", question))

    assert max(longest(e.question) for e in generate(300, "train", seed=0)) <= config.train_digits
    extrapolate = [e for e in generate(300, "extrapolate", seed=0) if e.kind != "mul"]
    assert min(longest(e.question) for e in extrapolate) > config.train_digits


@pytest.mark.parametrize(
    "config,train_count",
    [
        # the tiny default (make run) and the CPU study presets: 2-digit additions, 8000 training questions
        (ArithmeticConfig(kinds=("add",), train_digits=2, extrapolate_digits=4, negative_share=0.0), 8000),
        (ArithmeticConfig(), 20000),  # the default mix at 100 times the evaluation size
    ],
)
def test_interpolate_never_holds_a_question_of_any_training_set(config, train_count):
    """The whole training set (not only its first ``eval_examples`` questions), of any size and any seed,
    shares no question with the interpolate split, nor a sum or product with the operands swapped:
    checked by set intersection of the generated texts (swaps written out here by hand)."""
    interpolate = generate(200, "interpolate", seed=0, config=config)
    held_out = {e.question for e in interpolate}
    assert len(held_out) == 200
    for seed in (0, 1):
        train = {e.question for e in generate(train_count, "train", seed=seed, config=config)}
        assert len(train) == train_count
        assert not train & held_out, f"{len(train & held_out)} of 200 held-out questions are training questions"
        swapped = {re.sub(r"^What is (\S+) (\+|times) (\S+)\?$", r"What is \3 \2 \1?", q) for q in held_out}
        assert not train & swapped, f"{len(train & swapped)} held-out questions are training questions swapped"
    # operands still from the training range: the same digits, not a different distribution
    digits = [len(n) for e in interpolate for n in re.findall(r"\d+", e.question)]
    assert max(digits) <= config.train_digits


def test_a_used_up_question_space_is_refused_naming_the_counts():
    """2-digit additions without negatives: 10,000 distinct questions exist (9,000-odd outside the
    held-out pool), so 20,000 distinct training questions cannot be drawn: a clear error, not a hang."""
    config = ArithmeticConfig(kinds=("add",), train_digits=2, extrapolate_digits=4, negative_share=0.0)
    with pytest.raises(ValueError, match=r"could not draw 20000 distinct train questions.*data.train_examples"):
        generate(20000, "train", seed=0, config=config)


def test_generator_errors():
    with pytest.raises(ValueError, match="unknown split 'dev'"):
        generate(3, "dev")
    with pytest.raises(ValueError, match="kinds must be a non-empty subset"):
        ArithmeticConfig(kinds=("div",))
    with pytest.raises(ValueError, match="train_digits < extrapolate_digits"):
        ArithmeticConfig(train_digits=4, extrapolate_digits=4)


@pytest.mark.parametrize(
    "text,value",
    [
        ("The answer is 42.", 42.0),
        ("-17", -17.0),
        ("x = 3, so 2x = 6", 6.0),
        ("It costs 1,234,567 dollars", 1234567.0),
        ("about 3.25 apples", 3.25),
        ("Natalia sold 48 clips... #### 72", 72.0),
        ("#### -1,000.5", -1000.5),
        ("no number here", None),
        ("v2 of the model", None),
        ("-29/5", -29 / 5),  # the DeepMind data's rational answers
        ("so it is 1/12", 1 / 12),
        ("1/0", None),
    ],
)
def test_extract_number(text, value):
    assert extract_number(text) == value


def test_number_metrics():
    metrics = number_metrics([3.0, 10.0, None, -2.0], [3.0, 8.0, 5.0, -2.0])
    assert metrics["accuracy"] == 0.5 and metrics["unparseable"] == 0.25 and metrics["count"] == 4
    assert metrics["mae"] == pytest.approx(2 / 3)
    log_mae = abs(math.log10(11) - math.log10(9)) / 3
    assert metrics["log_mae"] == pytest.approx(log_mae)
    targets = [3.0, 8.0, -2.0]
    mean = sum(targets) / 3
    assert metrics["r2"] == pytest.approx(1 - 4 / sum((t - mean) ** 2 for t in targets))
    with pytest.raises(ValueError, match="2 predictions but 1 targets"):
        number_metrics([1.0, 2.0], [1.0])
