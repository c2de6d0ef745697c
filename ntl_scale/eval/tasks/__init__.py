"""``ntl_numeracy``: number evaluation of any checkpoint as an lm-evaluation-harness task group.

:func:`prepare` writes a self-contained task folder (JSONL data, the task YAMLs of ``templates/``, a copy of
:mod:`.utils`) that the harness reads offline; ``launch/eval_tasks.py`` is its command line (docs/evaluation.md).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from importlib import resources

from .data import ARITHMETIC, SLICES, arithmetic_examples, copy_gsm8k, segments, slice_texts, write_jsonl

__all__ = ["DEFAULT_GSM8K", "GROUP", "default_dir", "prepare", "run_splits"]

GROUP = "ntl_numeracy"
DEFAULT_GSM8K = os.path.join(os.path.dirname(__file__), "..", "..", "..", "..", "shared", "data", "gsm8k")
"""The project's offline GSM8K (``../shared/data/gsm8k`` beside the repository), when it is there."""


def default_dir() -> str:
    """The default task folder: ``$NTL_SCALE_EVAL_TASKS`` or ``~/.cache/ntl_scale/lm_eval_tasks``."""
    return os.environ.get("NTL_SCALE_EVAL_TASKS") or os.path.join(
        os.path.expanduser("~"), ".cache", "ntl_scale", "lm_eval_tasks"
    )


def run_splits(run_dir: str) -> list[str]:
    """The held-out question splits a training run scored (its ``predictions_<split>.jsonl``)."""
    names = sorted(os.listdir(run_dir)) if os.path.isdir(run_dir) else []
    return [
        n[len("predictions_") : -len(".jsonl")] for n in names if n.startswith("predictions_") and n.endswith(".jsonl")
    ]


def _render(template: str, out: str, **values: str) -> None:
    text = template
    for key, value in values.items():
        text = text.replace(f"@{key}@", value)
    with open(out, "w", encoding="utf-8") as f:
        f.write(text)


def prepare(
    out_dir: str,
    *,
    gsm8k: str | None = None,
    examples: int = 250,
    texts: int = 100,
    seed: int = 0,
    run_dir: str | None = None,
    max_new_tokens: int | None = None,
) -> dict[str, int]:
    """Writes the task folder ``out_dir`` (data, YAMLs, ``utils.py``); returns the rows per data file."""
    data_dir = os.path.abspath(os.path.join(out_dir, "data"))
    os.makedirs(data_dir, exist_ok=True)
    counts: dict[str, int] = {}
    with_gsm8k = gsm8k is not None or os.path.isdir(DEFAULT_GSM8K)
    if with_gsm8k:
        counts.update({f"gsm8k_{k}": v for k, v in copy_gsm8k(gsm8k or DEFAULT_GSM8K, data_dir).items()})
    else:
        print(f"no GSM8K at {os.path.abspath(DEFAULT_GSM8K)}: ntl_numeracy without ntl_gsm8k and ntl_gsm8k_bpb "
              "(pass gsm8k=DIR / --gsm8k DIR)", file=sys.stderr)  # fmt: skip
    for op in ARITHMETIC:
        for split, name in (("interpolate", "test"), ("train", "train")):
            rows = (
                {"question": e.question, "answer": e.answer} for e in arithmetic_examples(op, examples, split, seed)
            )
            counts[f"arith_{op}_{name}"] = write_jsonl(os.path.join(data_dir, f"arith_{op}_{name}.jsonl"), rows)
    for name in SLICES:
        sentences = slice_texts(name, texts, seed)
        counts[f"ppl_{name}"] = write_jsonl(
            os.path.join(data_dir, f"ppl_{name}.jsonl"), ({"text": t} for t in sentences)
        )
        rows_ = (s for t in sentences for s in segments(t))
        counts[f"ppl_{name}_segments"] = write_jsonl(os.path.join(data_dir, f"ppl_{name}_segments.jsonl"), rows_)
    templates = resources.files(__package__) / "templates"
    for entry in templates.iterdir():
        if not (entry.name.endswith(".yaml") or entry.name.endswith("_yaml")):
            continue
        if entry.name.startswith("ntl_gsm8k") and not with_gsm8k:
            continue
        _render(entry.read_text(encoding="utf-8"), os.path.join(out_dir, entry.name), DATA=data_dir,
                GSM8K_TASKS="ntl_gsm8k, ntl_gsm8k_bpb, " if with_gsm8k else "")  # fmt: skip
    shutil.copyfile(os.path.join(os.path.dirname(__file__), "utils.py"), os.path.join(out_dir, "utils.py"))
    if run_dir is not None:
        counts.update(_prepare_run(run_dir, out_dir, data_dir, max_new_tokens))
    return counts


def _run_settings(run_dir: str) -> tuple[int, str | None]:
    """The run's ``eval.max_new_tokens`` and ``eval.answer_until``; refuses what the harness cannot
    reproduce (beam search, reversed answers, coupled position ids)."""
    path = os.path.join(run_dir, "config.json")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} is missing: pass the run_dir of a run of launch/train.py")
    with open(path, encoding="utf-8") as f:
        cfg = json.load(f)
    evaluation, data = cfg.get("eval", {}), cfg.get("data", {})
    unsupported = [
        name
        for name, value in (
            ("eval.num_beams > 1", evaluation.get("num_beams", 1) > 1),
            ("data.reverse_answers", data.get("reverse_answers")),
            ("data.position_coupling", data.get("position_coupling")),
        )
        if value
    ]
    if unsupported:
        raise ValueError(f"{run_dir} was scored with {', '.join(unsupported)}: the harness's hf model generates "
                         "greedily in reading order with the model's own positions; evaluate that run with its own "
                         "scorer (eval.json)")  # fmt: skip
    return int(evaluation.get("max_new_tokens", 12)), evaluation.get("answer_until")


def _prepare_run(run_dir: str, out_dir: str, data_dir: str, max_new_tokens: int | None) -> dict[str, int]:
    splits = run_splits(run_dir)
    if not splits:
        raise FileNotFoundError(
            f"{run_dir} has no predictions_<split>.jsonl: pass the run_dir of a finished run with eval.at_end"
        )
    tokens, until = _run_settings(run_dir)
    tokens = max_new_tokens or tokens
    template = (resources.files(__package__) / "templates" / "ntl_run_split.yaml.in").read_text(encoding="utf-8")
    counts = {}
    for split in splits:
        with open(os.path.join(run_dir, f"predictions_{split}.jsonl"), encoding="utf-8") as f:
            rows = [json.loads(line) for line in f if line.strip()]
        counts[f"run_{split}"] = write_jsonl(
            os.path.join(data_dir, f"run_{split}.jsonl"),
            ({"question": r["question"], "answer": r["answer"]} for r in rows),
        )
        _render(template, os.path.join(out_dir, f"ntl_run_{split}.yaml"), DATA=data_dir, SPLIT=split,
                MAX_NEW_TOKENS=str(tokens), UNTIL=json.dumps([until] if until else []))  # fmt: skip
    return counts
