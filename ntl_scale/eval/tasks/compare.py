"""The harness's scores of a run's held-out questions beside the run's own scorer (``eval.json``): the
same prompts and number rule, so each is the other's independent reference.
"""

from __future__ import annotations

import glob
import json
import math
import os
from typing import Any

__all__ = ["PAIRS", "compare_run", "latest_results", "print_comparison"]

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
