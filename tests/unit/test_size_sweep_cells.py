"""experiments/size_sweep.py: a size's paired differences and how a cell of the table states them.

The mean, 95 % t-interval and seed-level paired t-test are checked against numbers computed here from
the definitions (float64, scipy's t quantile and ``ttest_rel``); a size with one seed so far states its
difference without an interval or a test, instead of a zero-width interval.
"""

from __future__ import annotations

import math
import statistics

import pytest
from scipy import stats

from tests.helpers.scripts import load_script

sweep = load_script("experiments/size_sweep.py", "size_sweep_cells_under_test")


def _results(ce: list[float], ntl: list[float]) -> dict:
    return {arm: {"heldout:prose": {"text_ppl": {"seeds": seeds}}} for arm, seeds in (("CE", ce), ("NTL", ntl))}


def test_relative_difference_interval_and_test_match_the_definitions():
    ce, ntl = [3.30, 3.35, 3.28, 3.41], [3.39, 3.40, 3.36, 3.44]
    cell = sweep.difference(_results(ce, ntl), "NTL", "CE", "prose_text_ppl")
    scale = 100.0 / statistics.fmean(ce)
    diffs = [(x - y) * scale for x, y in zip(ntl, ce)]
    half = stats.t.ppf(0.975, 3) * statistics.stdev(diffs) / math.sqrt(4)
    assert cell["n"] == 4 and cell["seeds"] == pytest.approx(diffs, rel=1e-12)
    assert (cell["mean"], cell["low"], cell["high"]) == pytest.approx(
        (statistics.fmean(diffs), statistics.fmean(diffs) - half, statistics.fmean(diffs) + half), rel=1e-12
    )
    assert cell["p_seed_t"] == pytest.approx(stats.ttest_rel(ntl, ce).pvalue, rel=1e-12)
    text = sweep._cell(cell)
    assert text.startswith(f"{statistics.fmean(diffs):+.2f} [") and "p " in text


def test_one_seed_is_stated_without_an_interval_or_a_test():
    cell = sweep.difference(_results([3.339], [3.391]), "NTL", "CE", "prose_text_ppl")
    assert cell["n"] == 1 and cell["mean"] == pytest.approx((3.391 - 3.339) * 100 / 3.339, rel=1e-12)
    text = sweep._cell(cell)
    assert text == f"{cell['mean']:+.2f} (one seed: no interval, no test)"
    assert "[" not in text
