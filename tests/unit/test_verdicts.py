"""experiments/verdicts.py (the current-verdicts table of docs/results.md) and experiments/doc_blocks.py.

Sections: 1. each row against the definitions, worked here with numpy and scipy from the per-seed values
of a results file (the mean difference, its t-interval clipped to the metric's range, the paired t-test,
Holm's step-down over every test of the file, the exact sign-flip test), on a synthetic file and on a
shipped one; 2. the reading; 3. the generated block of a page.
"""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest
from scipy import stats

from tests.helpers.scripts import load_script

verdicts = load_script("experiments/verdicts.py", "verdicts_under_test")
doc_blocks = load_script("experiments/doc_blocks.py", "doc_blocks_under_test")


def _reference(results: dict, baseline: str, arm: str, split: str, metric: str, bounds: tuple[float, float]) -> dict:
    """The row from the definitions: every (arm, split, metric) of the file is one test of Holm's family."""
    ps = {}
    for other, splits in results.items():
        if other == baseline:
            continue
        for s, metrics in splits.items():
            for m, cell in metrics.items():
                a, b = np.asarray(cell["seeds"], float), np.asarray(results[baseline][s][m]["seeds"], float)
                d = a - b
                ps[(other, s, m)] = (
                    stats.ttest_rel(a, b).pvalue if np.ptp(d) > 1e-12 * np.max(abs(a) + abs(b)) else np.nan
                )
    finite = sorted((p, k) for k, p in ps.items() if np.isfinite(p))
    holm, running = {}, 0.0
    for rank, (p, k) in enumerate(finite):
        running = max(running, min(1.0, (len(finite) - rank) * p))
        holm[k] = running
    d = np.asarray(results[arm][split][metric]["seeds"]) - np.asarray(results[baseline][split][metric]["seeds"])
    half = stats.t.ppf(0.975, len(d) - 1) * d.std(ddof=1) / math.sqrt(len(d))
    flips = [abs(sum(s * x for s, x in zip(signs, d))) for signs in itertools.product((1, -1), repeat=len(d))]
    sign_flip = sum(f >= abs(d.sum()) - 1e-12 for f in flips) / len(flips)
    return {"mean": d.mean(), "low": max(bounds[0], d.mean() - half), "high": min(bounds[1], d.mean() + half),
            "p": ps[(arm, split, metric)], "holm": holm.get((arm, split, metric), np.nan), "flip": sign_flip,
            "family": len(finite)}  # fmt: skip


def _write(tmp_path, results: dict) -> str:
    path = tmp_path / "study_x_results.json"
    path.write_text(json.dumps({"preset": {"baseline": "CE"}, "results": results}))
    return path.name


# ------------------------------------------------------------------ 1. rows against the definitions
def test_rows_match_the_definitions_on_a_synthetic_file(tmp_path):
    results = {
        "CE": {"interpolate": {"accuracy": {"seeds": [0.80, 0.70, 0.90, 0.75], "mean": 0.7875},
                               "mae": {"seeds": [1.0, 2.0, 1.5, 1.2], "mean": 1.425}}},
        "A": {"interpolate": {"accuracy": {"seeds": [0.99, 0.95, 0.99, 0.97]}, "mae": {"seeds": [0.5, 1.9, 1.1, 1.0]}}},
        "B": {"interpolate": {"accuracy": {"seeds": [0.60, 0.72, 0.85, 0.70]}, "mae": {"seeds": [1.1, 2.4, 1.4, 1.3]}}},
    }  # fmt: skip
    name = _write(tmp_path, results)
    spec = [{"study": "x", "file": name, "arms": ["A", "B"], "metrics": [("interpolate", "accuracy")]}]
    rows = verdicts.rows(spec, root=str(tmp_path))
    assert [r["arm"] for r in rows] == ["A", "B"]
    for row in rows:
        ref = _reference(results, "CE", row["arm"], "interpolate", "accuracy", (-1.0, 1.0))
        assert row["mean_diff"] == pytest.approx(ref["mean"], rel=1e-12)
        assert row["ci95"] == pytest.approx([ref["low"], ref["high"]], rel=1e-9)
        assert row["p_seed_t"] == pytest.approx(ref["p"], rel=1e-9)
        assert row["p_holm"] == pytest.approx(ref["holm"], rel=1e-9)
        assert row["p_sign_flip"] == pytest.approx(ref["flip"], rel=1e-12)
        assert row["family"] == ref["family"] == 4
        assert row["baseline_mean"] == pytest.approx(0.7875)


def test_rows_of_a_shipped_study_match_the_definitions():
    path = "docs/img/study_pretrain_cpu_results.json"
    with open(path) as f:
        results = json.load(f)["results"]
    spec = [{"study": "p", "file": path, "arms": ["CE + NTL-WAS"], "metrics": [("heldout", "number_token_mae")]}]
    (row,) = verdicts.rows(spec)
    ref = _reference(results, "CE", "CE + NTL-WAS", "heldout", "number_token_mae", (-9.0, 9.0))
    assert (row["mean_diff"], *row["ci95"]) == pytest.approx((ref["mean"], ref["low"], ref["high"]), rel=1e-9)
    assert (row["p_seed_t"], row["p_holm"], row["family"]) == pytest.approx((ref["p"], ref["holm"], ref["family"]))


# ------------------------------------------------------------------ 2. the reading
def test_reading_is_shown_only_after_holm_and_says_the_direction(tmp_path):
    ce = [2.00, 2.02, 1.98, 2.01, 1.99, 2.03]
    results = {
        "CE": {"heldout": {"number_token_mae": {"seeds": ce, "mean": float(np.mean(ce))},
                           "number_token_ppl": {"seeds": [7.0, 7.1, 6.9, 7.05, 6.95, 7.02], "mean": 7.0}}},
        "A": {"heldout": {"number_token_mae": {"seeds": [x - 0.2 + 0.001 * i for i, x in enumerate(ce)]},
                          "number_token_ppl": {"seeds": [7.0, 7.3, 6.8, 7.0, 7.1, 7.0]}}},
    }  # fmt: skip
    name = _write(tmp_path, results)
    spec = [{"study": "x", "file": name, "arms": ["A"], "metrics": [("heldout", "number_token_mae"),
                                                                    ("heldout", "number_token_ppl")]}]  # fmt: skip
    mae, ppl = verdicts.rows(spec, root=str(tmp_path))
    assert mae["p_holm"] < 0.05 and mae["reading"] == "shown: better"  # lower MAE is better
    assert ppl["p_holm"] >= 0.05 and ppl["reading"] == "not shown"
    text = verdicts.markdown([mae, ppl])
    assert "shown: better" in text and f"{mae['mean_diff']:+.3g}" in text


def test_equal_differences_are_unresolved_not_a_verdict(tmp_path):
    """Issue 51, item 5: per-seed differences all the same gave a zero-width interval and p = NaN, read "not shown"
    beside "[d, d]": a certainty the data do not give. Now the row says "unresolved: no spread over n seeds", with
    no interval in the table."""
    ce = [0.5, 0.25, 0.75, 0.125]
    results = {"CE": {"questions": {"accuracy": {"seeds": ce, "mean": float(np.mean(ce))}}},
               "A": {"questions": {"accuracy": {"seeds": [x + 0.125 for x in ce]}}}}  # fmt: skip
    name = _write(tmp_path, results)
    spec = [{"study": "x", "file": name, "arms": ["A"], "metrics": [("questions", "accuracy")]}]
    (row,) = verdicts.rows(spec, root=str(tmp_path))
    assert row["reading"] == "unresolved: no spread over 4 seeds" and row["no_spread"]
    assert all(math.isnan(x) for x in row["ci95"]) and math.isnan(row["p_holm"])
    line = verdicts.markdown([row]).splitlines()[-1]
    assert "+12.5 (no spread over 4 seeds) points" in line and "[" not in line


def test_an_arm_missing_from_the_file_is_named(tmp_path):
    name = _write(tmp_path, {"CE": {"questions": {"accuracy": {"seeds": [0.1, 0.2], "mean": 0.15}}}})
    spec = [{"study": "x", "file": name, "arms": ["Z"], "metrics": [("questions", "accuracy")]}]
    with pytest.raises(SystemExit, match="'Z'"):
        verdicts.rows(spec, root=str(tmp_path))


# ------------------------------------------------------------------ 3. generated blocks
def test_replace_block_swaps_only_the_block(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# T\n\nbefore\n<!-- generated: t (by a command) -->\nold\nrows\n<!-- end: t -->\nafter\n")
    doc_blocks.replace_block(str(page), "t", "new table\n")
    assert (
        page.read_text() == "# T\n\nbefore\n<!-- generated: t (by a command) -->\nnew table\n<!-- end: t -->\nafter\n"
    )
    doc_blocks.replace_block(str(page), "t", "again")  # idempotent markers
    assert page.read_text().count("<!-- generated: t") == 1 and "again\n<!-- end: t -->" in page.read_text()


def test_replace_block_refuses_a_missing_block(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("no block here\n")
    with pytest.raises(ValueError, match="generated: t "):
        doc_blocks.replace_block(str(page), "t", "x")


def test_the_page_holds_the_table_the_json_gives():
    with open("docs/results.md") as f:
        page = f.read()
    assert (
        verdicts.markdown(verdicts.rows()) in page
    )  # regenerate: python experiments/verdicts.py --doc docs/results.md
