"""The ``ntl_numeracy`` lm-eval tasks (ntl_scale/eval/tasks).

Sections: the number rule agrees with the project's; each metric function by hand; the data files;
the tasks load with the network off (versions, directions); every metric through the harness on a toy
``LM`` whose answers and loglikelihoods are fixed, against values computed here by hand.
"""

from __future__ import annotations

import json
import math
import os

import pytest

from ntl_scale.eval.numbers import extract_number
from ntl_scale.eval.tasks import prepare, utils
from ntl_scale.eval.tasks.data import arithmetic_examples, comparison_examples, segments, slice_texts


@pytest.fixture(scope="module")
def tasks_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    out = str(tmp_path_factory.mktemp("tasks"))
    gsm8k = str(tmp_path_factory.mktemp("gsm8k"))
    rows = [{"question": f"Q{i}?", "answer": f"step\n#### {v}"} for i, v in enumerate([18, 3, 1000, 7, 0, 100, 42, -5])]
    for split in ("test", "train"):
        with open(os.path.join(gsm8k, f"{split}.jsonl"), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    prepare(out, gsm8k=gsm8k, examples=6, texts=3)
    return out


# ---- the number rule and the metric functions ------------------------------------------------------


def test_number_scores_by_hand() -> None:
    assert utils.number_scores("It is 12.", 12.0) == {"exact_match": 1.0, "parsed": 1.0, "abs_error": 0.0,
                                                      "rel_error": 0.0}  # fmt: skip
    assert utils.number_scores("so 90", 100.0) == {"exact_match": 0.0, "parsed": 1.0, "abs_error": 10.0,
                                                   "rel_error": 0.1}  # fmt: skip
    assert utils.number_scores("-0.5", 0.0)["rel_error"] == 0.5  # |t| < 1: divided by 1
    assert utils.number_scores("none", 3.0) == {"exact_match": 0.0, "parsed": 0.0, "abs_error": None,
                                                "rel_error": None}  # fmt: skip
    assert utils.process_generation({"answer": "a\n#### 1,000"}, ["1000"])["exact_match"] == 1.0
    assert utils.mean_parsed([1.0, None, 3.0]) == 2.0 and math.isnan(utils.mean_parsed([None]))


def test_loglikelihood_metrics_by_hand() -> None:
    assert utils.process_gold_bpb({"answer": "é 4"}, [(-2.0, False)]) == {"bits_per_byte": (-2.0, 4)}
    doc = {"context": "x ", "segment": "12", "kind": "number"}
    assert utils.process_segment(doc, [(-3.0, True)]) == {"bits_per_byte": (-3.0, 2), "number_bits_per_byte": (-3.0, 2)}


# ---- the data ----------------------------------------------------------------------------------------


def test_segments_rebuild_the_text() -> None:
    text = "Paid $1,249.99 on 2019-03-14 at 18:35."
    parts = segments(text)
    assert "".join(p["segment"] for p in parts) == text
    assert [p["segment"] for p in parts if p["kind"] == "number"] == ["1,249.99", "2019-03-14", "18:35"]
    assert [p["context"] for p in parts] == ["".join(q["segment"] for q in parts[:i]) for i in range(len(parts))]


def test_arithmetic_is_seeded_and_correct() -> None:
    for op, sign in (("add", "+"), ("sub", "-"), ("mul", "times")):
        examples = arithmetic_examples(op, 5, "interpolate", 0)
        assert examples == arithmetic_examples(op, 5, "interpolate", 0)
        for e in examples:
            a, b = e.question.removeprefix("What is ").removesuffix("?").split(f" {sign} ")
            value = {"+": int(a) + int(b), "-": int(a) - int(b), "times": int(a) * int(b)}[sign]
            assert int(e.answer) == value
    test, train = comparison_examples(20, "test", 0), comparison_examples(20, "train", 0)
    assert not {e.question for e in test} & {e.question for e in train}
    for e in test:
        a, b = e.question.removeprefix("Which is larger, ").removesuffix("?").split(" or ")
        assert e.answer == str(max(int(a), int(b))) and a != b
    assert slice_texts("dates", 4, 1) == slice_texts("dates", 4, 1)


# ---- the tasks in the harness ------------------------------------------------------------------------


def test_tasks_load_offline(tasks_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager, get_task_dict

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tasks = get_task_dict(["ntl_numeracy"], TaskManager(include_path=tasks_dir, include_defaults=False))
    flat = {}

    def walk(d: dict) -> None:
        for k, v in d.items():
            walk(v) if isinstance(v, dict) else flat.__setitem__(getattr(k, "group_name", k), v)

    walk(tasks)
    names = {n for n in flat if isinstance(n, str)}
    assert {"ntl_gsm8k", "ntl_gsm8k_bpb", "ntl_arith_add", "ntl_arith_sub", "ntl_arith_mul", "ntl_arith_cmp",
            "ntl_ppl_dates", "ntl_ppl_amounts_split"} <= names  # fmt: skip
    for name, task in flat.items():
        assert task.VERSION == 1.0, name
        assert len(list(task.test_docs())) > 0, name
        directions = task.higher_is_better()
        for metric, up in directions.items():
            assert up == (metric in ("exact_match", "parsed")), (name, metric)


class _ToyLM:
    """An lm-eval ``LM`` with known outputs: every answer is ``Answer: 100``; a continuation's
    loglikelihood is -(its characters); a rolling text's is -2 x its characters."""

    @staticmethod
    def build():  # type: ignore[no-untyped-def]
        from lm_eval.api.model import LM

        class Toy(LM):
            def loglikelihood(self, requests):  # type: ignore[no-untyped-def]
                return [(-float(len(r.args[1])), False) for r in requests]

            def loglikelihood_rolling(self, requests):  # type: ignore[no-untyped-def]
                return [-2.0 * len(r.args[0]) for r in requests]

            def generate_until(self, requests):  # type: ignore[no-untyped-def]
                return ["Answer: 100" for _ in requests]

        return Toy()


def _rows(tasks_dir: str, name: str) -> list[dict]:
    with open(os.path.join(tasks_dir, "data", name)) as f:
        return [json.loads(line) for line in f]


def test_metrics_through_the_harness_by_hand(tasks_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("lm_eval")
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    names = ["ntl_gsm8k", "ntl_gsm8k_bpb", "ntl_arith_sub", "ntl_ppl_dates", "ntl_ppl_dates_split"]
    out = simple_evaluate(model=_ToyLM.build(), tasks=names, task_manager=TaskManager(include_path=tasks_dir),
                          bootstrap_iters=0)  # fmt: skip
    res = out["results"]
    for task, file in (("ntl_gsm8k", "gsm8k_test.jsonl"), ("ntl_arith_sub", "arith_sub_test.jsonl")):
        targets = [extract_number(r["answer"]) for r in _rows(tasks_dir, file)]
        assert res[task]["exact_match,none"] == pytest.approx(sum(t == 100 for t in targets) / len(targets))
        assert res[task]["parsed,none"] == 1.0
        assert res[task]["abs_error,none"] == pytest.approx(sum(abs(100 - t) for t in targets) / len(targets))
        rel = sum(abs(100 - t) / max(abs(t), 1) for t in targets) / len(targets)
        assert res[task]["rel_error,none"] == pytest.approx(rel)
    gold = _rows(tasks_dir, "gsm8k_test.jsonl")  # ll = -characters: bpb = chars / bytes / ln 2
    chars, size = sum(len(r["answer"]) for r in gold), sum(len(r["answer"].encode()) for r in gold)
    assert res["ntl_gsm8k_bpb"]["bits_per_byte,none"] == pytest.approx(chars / size / math.log(2))
    texts = [r["text"] for r in _rows(tasks_dir, "ppl_dates.jsonl")]
    assert res["ntl_ppl_dates"]["bits_per_byte,none"] == pytest.approx(
        2 * sum(map(len, texts)) / sum(len(t.encode()) for t in texts) / math.log(2)
    )
    for kind in ("number", "text"):
        parts = [r for r in _rows(tasks_dir, "ppl_dates_segments.jsonl") if r["kind"] == kind]
        bpb = sum(len(p["segment"]) for p in parts) / sum(len(p["segment"].encode()) for p in parts) / math.log(2)
        assert res["ntl_ppl_dates_split"][f"{kind}_bits_per_byte,none"] == pytest.approx(bpb)
