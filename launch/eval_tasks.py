"""Prepare the ``ntl_numeracy`` lm-eval task folder (``ntl_scale.eval.tasks``), print its path, or compare.

python launch/eval_tasks.py --path            # the default folder (prepared on first use)
python launch/eval_tasks.py prepare --out DIR [--gsm8k DIR] [--examples 250] [--texts 100]
                                    [--seed 0] [--run-dir RUN]
python launch/eval_tasks.py compare --run-dir RUN --results DIR   # harness vs the run's scorer
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout, for ntl_scale

from ntl_scale.eval.tasks import DEFAULT_GSM8K, GROUP, default_dir, prepare

# The harness's scores of a run's held-out questions beside the run's own scorer (eval.json): the same prompts
# and number rule, so each is the other's independent reference.
PAIRS = (("exact_match", "accuracy"), ("abs_error", "mae"), ("parsed", "parsed"))
"""(harness metric, scorer metric) pairs that must agree; the scorer's ``parsed`` is 1 - ``unparseable``."""


def latest_results(path: str) -> dict[str, Any]:
    """The newest ``results_*.json`` that ``lm_eval --output_path PATH`` wrote under ``path`` (or that file)."""
    files = [path] if os.path.isfile(path) else glob.glob(os.path.join(path, "**", "results_*.json"), recursive=True)
    if not files:
        raise FileNotFoundError(f"no results_*.json under {path}: run lm_eval with --output_path {path}")
    with open(max(files, key=os.path.getmtime), encoding="utf-8") as f:
        return json.load(f)


def compare_run(run_dir: str, results: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per held-out split both scored: ``split``, ``questions`` and, per :data:`PAIRS`, the
    harness's and the scorer's value and whether they agree (to 1e-9)."""
    with open(os.path.join(run_dir, "eval.json"), encoding="utf-8") as f:
        own = json.load(f)
    rows = []
    for split, metrics in own.items():
        harness = results.get("results", {}).get(f"ntl_run_{split}")
        if harness is None or "count" not in metrics:
            continue
        scorer = {**metrics, "parsed": 1.0 - metrics["unparseable"]}
        row: dict[str, Any] = {"split": split, "questions": int(metrics["count"]), "equal": True}
        for h, s in PAIRS:
            a, b = float(harness[f"{h},none"]), float(scorer[s])
            same = (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9)
            row[h], row[s if s != h else f"scorer_{s}"] = a, b
            row["equal"] = row["equal"] and same
        rows.append(row)
    return rows


def print_comparison(rows: list[dict[str, Any]]) -> bool:
    """Prints the rows; returns whether every pair agrees."""
    print("held-out questions: lm-evaluation-harness (ntl_run_<split>) beside the run's own scorer (eval.json)")
    print(f"{'split':<13} {'questions':>9} {'exact_match':>12} {'accuracy':>9} {'abs_error':>11} {'mae':>11} "
          f"{'parsed':>7} {'scorer':>7}  agree")  # fmt: skip
    for r in rows:
        print(f"{r['split']:<13} {r['questions']:>9} {r['exact_match']:>12.4f} {r['accuracy']:>9.4f} "
              f"{r['abs_error']:>11.4g} {r['mae']:>11.4g} {r['parsed']:>7.3f} {r['scorer_parsed']:>7.3f}  "
              f"{'yes' if r['equal'] else 'NO'}")  # fmt: skip
    return all(r["equal"] for r in rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python launch/eval_tasks.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--path", action="store_true", help="print the default task folder (preparing it if absent)")
    parser.add_argument(
        "command",
        nargs="?",
        choices=["prepare", "compare"],
        help="prepare: write a task folder; compare: ntl_run_<split> beside eval.json",
    )
    parser.add_argument("--out", default=None, help="the task folder (default: --path's)")
    parser.add_argument(
        "--gsm8k", default=None, help=f"local GSM8K folder (test.jsonl, train.jsonl[.gz]; default {DEFAULT_GSM8K})"
    )
    parser.add_argument("--examples", type=int, default=250, help="test questions per arithmetic operation")
    parser.add_argument("--texts", type=int, default=100, help="sentences per perplexity slice")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--run-dir", default=None, help="also the tasks ntl_run_<split>: this run's held-out questions")
    parser.add_argument("--results", default=None, help="compare: lm_eval's --output_path (or a results JSON)")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="their max_gen_toks (default: the run's)")
    args = parser.parse_args(argv)
    out = args.out or default_dir()
    if args.path and args.command is None:
        if not os.path.exists(os.path.join(out, f"{GROUP}.yaml")):
            prepare(out, gsm8k=args.gsm8k, examples=args.examples, texts=args.texts, seed=args.seed)
        print(os.path.abspath(out))
        return 0
    if args.command == "compare":
        if not args.run_dir or not args.results:
            parser.error("compare needs --run-dir and --results")
        rows = compare_run(args.run_dir, latest_results(args.results))
        if not rows:
            parser.error(f"no ntl_run_<split> results in {args.results} for {args.run_dir}")
        return 0 if print_comparison(rows) else 1
    if args.command != "prepare":
        parser.error("give --path, prepare or compare")
    counts = prepare(out, gsm8k=args.gsm8k, examples=args.examples, texts=args.texts, seed=args.seed,
                     run_dir=args.run_dir, max_new_tokens=args.max_new_tokens)  # fmt: skip
    print(f"{os.path.abspath(out)}: " + ", ".join(f"{k} {v}" for k, v in counts.items()), file=sys.stderr)
    print(os.path.abspath(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
