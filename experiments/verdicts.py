"""The current verdicts of docs/results.md, made from the studies' results files (never typed by hand).

    python experiments/verdicts.py                          # prints the table, writes docs/img/verdicts.json
    python experiments/verdicts.py --doc docs/results.md    # and rewrites the table's block in the page

Each row is one arm against CE on one headline metric of one study (:data:`VERDICTS`), at the seed
level: the mean of the per-seed differences with its 95 % t-interval clipped to the metric's range,
the paired t-test, Holm's adjustment over that study's whole family of seed-level tests (every arm x
split x metric of its results file, :func:`seed_stats.seed_tests`, recomputed here from the per-seed
values) and the exact sign-flip test. The reading: *shown* where Holm's p < 0.05, else *not shown*,
with the interval as the effects the data exclude (a null excludes only what lies outside it); per-seed
differences that are all equal have neither interval nor test: *unresolved: no spread over n seeds*.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Sequence
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # experiments/seed_stats.py, loaded by path too
import seed_stats

# (metric key, label, scale, unit, higher is better): scale turns a difference into the unit shown.
METRICS: dict[tuple[str, str], tuple[str, float, str, bool]] = {
    ("interpolate", "accuracy"): ("held-out question accuracy", 100.0, "points", True),
    ("extrapolate", "accuracy"): ("longer-number accuracy", 100.0, "points", True),
    ("questions", "accuracy"): ("held-out question accuracy", 100.0, "points", True),
    ("questions", "mae"): ("held-out question MAE", 1.0, "", False),
    ("heldout", "number_token_mae"): ("number-token MAE (expected digit)", 1.0, "", False),
    ("heldout", "number_token_ppl"): ("number-token perplexity", 1.0, "", False),
    ("heldout:prose", "text_ppl"): ("prose perplexity", 1.0, "", False),
}

_PRETRAIN = [("heldout", "number_token_mae"), ("heldout", "number_token_ppl"), ("heldout:prose", "text_ppl"),
             ("questions", "accuracy")]  # fmt: skip
VERDICTS: list[dict[str, Any]] = [
    {"study": "2-digit addition, held-out split", "file": "docs/img/study_cpu_heldout_results.json",
     "arms": ["CE + NTL-WAS", "CE + 0.8 NTL-WAS", "CE + NTL-Huber", "CE + NTL-MAE", "CE + NTL-number"],
     "metrics": [("interpolate", "accuracy")]},
    {"study": "DEL vs NTL, 2-digit addition", "file": "docs/img/study_del_8seeds_results.json",
     "arms": ["CE + NTL-WAS", "CE + DEL", "CE + DEL (0.32)"], "metrics": [("interpolate", "accuracy")]},
    {"study": "coupled positions, extrapolation", "file": "docs/img/study_extrapolation_8seeds_results.json",
     "arms": ["CE + NTL-WAS", "CE + NTL-MSE"], "metrics": [("extrapolate", "accuracy")]},
    # pretraining: the cells whose data were drawn per seed (the strongest data) lead; the sweep's one-draw
    # cells (data seed 0 in every run) are in docs/results.md's size sweep, but for NTL-Huber, run there only
    {"study": "pretraining, 0.21 M, 38.4 tok/param, data varied", "arms": ["CE + NTL-WAS"], "metrics": _PRETRAIN,
     "file": "docs/img/study_pretrain_factorial_s_38p4_results.json"},
    {"study": "pretraining, 0.85 M, 9.6 tok/param, data varied", "arms": ["CE + NTL-WAS"], "metrics": _PRETRAIN,
     "file": "docs/img/study_pretrain_factorial_m_9p6_results.json"},
    {"study": "pretraining, 3.4 M, 2.4 tok/param, data varied", "arms": ["CE + NTL-WAS"], "metrics": _PRETRAIN,
     "file": "docs/img/study_pretrain_factorial_l_2p4_results.json"},
    {"study": "pretraining, 0.85 M, 9.6 tok/param, one data draw", "file": "docs/img/study_pretrain_cpu_results.json",
     "arms": ["CE + NTL-Huber"], "metrics": _PRETRAIN},
    {"study": "DEL vs NTL in pretraining, 0.85 M", "file": "docs/img/study_del_pretrain_results.json",
     "arms": ["CE + DEL", "CE + DEL (0.32)"], "metrics": [*_PRETRAIN, ("questions", "mae")]},
]  # fmt: skip
"""The headline rows: per study (its results file), the arms and metrics the verdicts rest on."""


def rows(verdicts: Sequence[dict[str, Any]] = VERDICTS, root: str = ".") -> list[dict[str, Any]]:
    """One dict per (study, arm, metric): the seed-level numbers of the verdict table."""
    out = []
    for spec in verdicts:
        path = os.path.join(root, spec["file"])
        with open(path) as f:
            summary = json.load(f)
        tested = seed_stats.seed_tests(summary)
        baseline = tested["baseline"]
        for arm in spec["arms"]:
            for split, metric in spec["metrics"]:
                try:
                    t = tested["tests"][baseline][arm][split][metric]
                except KeyError:
                    raise SystemExit(f"{path}: no seed test of {arm!r} on {split} {metric}; its arms: "
                                     f"{list(summary['results'])}") from None  # fmt: skip
                label, scale, unit, higher = METRICS[(split, metric)]
                base = summary["results"][baseline][split][metric]["mean"]
                low, high = t["ci95"]
                holm = t["p_holm"]
                if t.get("no_spread"):  # every seed's difference the same: no interval, no test, no verdict
                    reading = "unresolved: " + seed_stats.spread_note(t["n"])
                elif math.isfinite(holm) and holm < 0.05:
                    better = (t["mean_diff"] > 0) == higher
                    reading = "shown: " + ("better" if better else "worse")
                else:
                    reading = "not shown"
                out.append({"study": spec["study"], "file": spec["file"], "seeds": t["n"],
                            "family": tested["family_size"], "arm": arm, "split": split, "metric": metric,
                            "label": label, "unit": unit, "scale": scale, "higher_is_better": higher,
                            "baseline_mean": base, "mean_diff": t["mean_diff"], "ci95": [low, high],
                            "p_seed_t": t["p_seed_t"], "p_holm": holm, "p_sign_flip": t["p_sign_flip"],
                            "no_spread": bool(t.get("no_spread")), "reading": reading})  # fmt: skip
    return out


def _p(p: float) -> str:
    return "n/a" if not math.isfinite(p) else ("< 0.001" if p < 0.001 else f"{p:.3f}")


def _num(x: float, scale: float) -> str:
    v = x * scale
    return f"{v:+.1f}" if scale != 1.0 else f"{v:+.3g}"


def markdown(table: Sequence[dict[str, Any]]) -> str:
    """The verdict table: study, seeds, Holm family, arm, metric (CE's mean), difference [95 % interval],
    t-test p, Holm p, sign-flip p, reading."""
    lines = ["| study (file in `docs/img`) | seeds | family | arm | metric (CE's mean) | arm - CE [95 % interval] "
             "| t p | Holm p | sign-flip p | reading |", "|---|---:|---:|---|---|---|---:|---:|---:|---|"]  # fmt: skip
    for r in table:
        unit = f" {r['unit']}" if r["unit"] else ""
        ce = f"{r['baseline_mean'] * r['scale']:.3g}" + (" %" if r["unit"] == "points" else "")
        test = {"mean_diff": r["mean_diff"], "ci95": r["ci95"], "n": r["seeds"], "no_spread": r.get("no_spread")}
        diff = seed_stats.interval_text(test, lambda x, scale=r["scale"]: _num(x, scale))
        lines.append(f"| {r['study']} (`{os.path.basename(r['file'])}`) | {r['seeds']} | {r['family']} | {r['arm']} | "
                     f"{r['label']} ({ce}) | {diff}{unit} | {_p(r['p_seed_t'])} | {_p(r['p_holm'])} | "
                     f"{_p(r['p_sign_flip'])} | {r['reading']} |")  # fmt: skip
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", default="docs/img/verdicts.json", help="where the table's numbers go")
    parser.add_argument("--doc", default=None, help="a page whose block 'verdicts' gets the table (docs/results.md)")
    args = parser.parse_args(argv)
    table = rows()
    with open(args.json, "w") as f:
        json.dump({"command": "python experiments/verdicts.py", "rows": table}, f, indent=1)
        f.write("\n")
    text = markdown(table)
    print(text)
    if args.doc:
        from doc_blocks import replace_block

        replace_block(args.doc, "verdicts", text)
    return table


if __name__ == "__main__":
    main()
