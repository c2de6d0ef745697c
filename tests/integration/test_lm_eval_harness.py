"""lm-evaluation-harness on a tiny Hugging Face checkpoint (ntl_scale/eval/tasks), offline.

Sections: the harness's exact match, absolute error and parsed share on a run's held-out questions
equal the project's own scorer (``evaluate_generation``) on the same questions; the whole
``ntl_numeracy`` group end to end (a few examples per task) prints its table with every task's metrics.
Both read one task folder and one ``TaskManager`` (indexing lm-eval's task registry costs about 10 CPU-s).
"""

from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("lm_eval")
pytest.importorskip("transformers")

from launch.eval_tasks import compare_run
from ntl_scale.data.arithmetic import ArithmeticConfig, generate
from ntl_scale.eval.tasks import prepare


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A run directory as launch/train.py leaves it: an HF export (a tiny GPT-2, character tokenizer,
    40 Adam steps on 2-digit sums: it answers with numbers, 11 of the 12 interpolation questions parsed; the
    comparison needs parsed answers, not right ones), config.json, and the project's scorer's predictions and
    eval.json on 24 held-out questions."""
    import torch
    import transformers

    from ntl_scale.training.scoring import evaluate_generation
    from ntl_scale.training.tokenizer import build_char_tokenizer

    run = str(tmp_path_factory.mktemp("run"))
    tok = build_char_tokenizer()
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=2, n_head=2, n_positions=1024,
                                     eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)  # fmt: skip
    model = transformers.GPT2LMHeadModel(config)
    train = generate(2000, "train", seed=3, config=ArithmeticConfig(kinds=("add",), train_digits=2))
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for step in range(40):
        batch = train[(step * 32) % 1984 : (step * 32) % 1984 + 32]
        enc = tok([f"{e.question} {e.answer}<eos>" for e in batch], return_tensors="pt", padding=True,
                  add_special_tokens=False)  # fmt: skip
        labels = enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)
        model(**enc, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    model.save_pretrained(os.path.join(run, "hf_model"))
    tok.save_pretrained(os.path.join(run, "hf_model"))
    with open(os.path.join(run, "config.json"), "w") as f:
        json.dump({"eval": {"max_new_tokens": 6, "num_beams": 1}, "data": {}}, f)
    results = {}
    for split in ("interpolate", "extrapolate"):
        examples = generate(12, split, seed=3, config=ArithmeticConfig(kinds=("add",), train_digits=2))
        results[split] = evaluate_generation(
            model,
            tok,
            examples,
            max_new_tokens=6,
            batch_size=5,
            predictions_path=os.path.join(run, f"predictions_{split}.jsonl"),
        )
    with open(os.path.join(run, "eval.json"), "w") as f:
        json.dump(results, f)
    return run


@pytest.fixture(scope="module")
def task_manager(run_dir: str):  # type: ignore[no-untyped-def]
    """The task folder (the ``ntl_numeracy`` group and the run's ``ntl_run`` tasks) and its ``TaskManager``."""
    from lm_eval.tasks import TaskManager

    prepare(os.path.join(run_dir, "tasks"), examples=4, texts=2, run_dir=run_dir)
    return TaskManager(include_path=os.path.join(run_dir, "tasks"))


def _evaluate(run: str, tasks: list[str], task_manager, monkeypatch: pytest.MonkeyPatch, **kwargs):  # type: ignore[no-untyped-def]
    from lm_eval import simple_evaluate

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return simple_evaluate(model="hf", model_args=f"pretrained={run}/hf_model", device="cpu", tasks=tasks,
                           task_manager=task_manager, **kwargs)  # fmt: skip


def test_harness_equals_the_projects_scorer(run_dir: str, task_manager, monkeypatch: pytest.MonkeyPatch) -> None:
    out = _evaluate(run_dir, ["ntl_run"], task_manager, monkeypatch, batch_size=8)
    rows = compare_run(run_dir, out)
    assert {r["split"] for r in rows} == {"interpolate", "extrapolate"}
    for row in rows:
        assert row["equal"], row
    assert any(r["parsed"] > 0 for r in rows)  # the comparison saw numbers, not only empty answers


def test_group_end_to_end(
    run_dir: str, task_manager, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    from lm_eval.utils import make_table

    out = _evaluate(run_dir, ["ntl_numeracy"], task_manager, monkeypatch, limit=2, batch_size=4,
                    gen_kwargs="max_gen_toks=8")  # fmt: skip
    table = make_table(out)
    print(table)
    res = out["results"]
    for task in ("ntl_arith_add", "ntl_arith_sub", "ntl_arith_mul", "ntl_arith_cmp"):
        assert 0 <= res[task]["exact_match,none"] <= 1 and "rel_error,none" in res[task]
    for name in ("integers", "decimals", "dates", "amounts"):
        assert res[f"ntl_ppl_{name}"]["bits_per_byte,none"] > 0
        assert res[f"ntl_ppl_{name}_split"]["bits_per_byte,none"] > 0
    if "ntl_gsm8k" in res:  # the project's offline GSM8K is there
        assert res["ntl_gsm8k_bpb"]["bits_per_byte,none"] > 0
    assert out["versions"]["ntl_arith_add"] == 1.0 and out["higher_is_better"]["ntl_arith_add"]["abs_error"] is False
    assert "ntl_arith" in table and "exact_match" in table
