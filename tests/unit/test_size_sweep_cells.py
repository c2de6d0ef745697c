"""experiments/size_sweep.py: a size's paired differences and how a cell of the table states them.

The mean, 95 % t-interval and seed-level paired t-test are checked against numbers computed here from
the definitions (float64, scipy's t quantile and ``ttest_rel``); a size with one seed so far states its
difference without an interval or a test (not a zero-width interval), in the table, the JSON and the
figure; the trend's slope is the mean of each seed's numpy least-squares line, tested across the seeds
(scipy's one-sample t-test), and no verdict is given while a size has one seed. Every test across cells has
the seed as the unit (issue 56): a contrast of two cells is scipy's paired ``ttest_rel`` of the cells' per-seed
differences, a slope the one-sample t-test of the per-seed slopes.
"""

from __future__ import annotations

import math
import statistics

import numpy as np
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
    mean, p = statistics.fmean(diffs), stats.ttest_rel(ntl, ce).pvalue
    assert cell["n"] == 4 and cell["seeds"] == pytest.approx(diffs, rel=1e-12)
    assert (cell["mean"], cell["low"], cell["high"]) == pytest.approx((mean, mean - half, mean + half), rel=1e-12)
    assert cell["p_seed_t"] == pytest.approx(p, rel=1e-12)
    assert cell["p_sign_flip"] == 2 / 16  # every seed's cost has the same sign: the floor of 4 seeds
    assert (
        sweep._cell(cell) == f"{mean:+.2f} [{mean - half:+.2f}, {mean + half:+.2f}], p = {p:.3f}; sign-flip p = 0.125"
    )


def test_intervals_are_clipped_to_what_a_difference_can_take():
    # question accuracy in points: one seed from 0 to 100 %, the others unchanged; the t-interval's upper
    # end would pass +100 points, which no accuracy difference can
    results = {arm: {"questions": {"accuracy": {"seeds": seeds}}}
               for arm, seeds in (("CE", [0.0, 0.5, 0.5, 0.5]), ("NTL", [1.0, 0.5, 0.5, 0.5]))}  # fmt: skip
    cell = sweep.difference(results, "NTL", "CE", "question_acc")
    half = stats.t.ppf(0.975, 3) * statistics.stdev([100.0, 0, 0, 0]) / 2
    assert 25.0 + half > 100 and cell["high"] == 100.0 and cell["low"] == pytest.approx(25.0 - half)


def test_factorial_slopes_contrasts_and_their_reading():
    """Two sizes, three and two levels of tokens per parameter; the slope on log2(tokens per parameter) is
    the mean of the seeds' numpy least-squares lines with scipy's one-sample t-test over them, each contrast
    scipy's paired t-test of the two cells' per-seed differences (seed s against seed s, not Welch's), Holm
    over the primary family counts the 2 slopes and 1 contrast of each primary metric, and the reading
    follows the rule."""
    gains = {("s", 2.4): [-1.0, -1.5, -0.5, -1.2], ("s", 9.6): [-5.0, -5.5, -4.8, -5.2],
             ("s", 38.4): [-9.0, -9.4, -8.9, -9.3], ("m", 2.4): [-2.0, -2.5, -1.0, -2.2],
             ("m", 9.6): [-2.2, -2.0, -1.9, -2.6]}  # fmt: skip
    rows = []
    for (size, tpp), diffs in gains.items():
        cells = {key: None for key in sweep.METRICS}
        cells["number_token_mae"] = {"seeds": diffs, "n": len(diffs), "mean": float(np.mean(diffs))}
        rows.append({"label": f"{size} @ {tpp}", "size": size, "tokens_per_parameter": tpp,
                     "differences": {"NTL": cells}})  # fmt: skip
    spec = {"arms": ["NTL"], "factorial": {"primary": ["number_token_mae"],
            "contrasts": [{"name": "tokens at m", "a": "m @ 2.4", "b": "m @ 9.6"}]}}  # fmt: skip
    out = sweep.factorial(spec, rows)
    assert out["family_size"] == 3
    fit = out["slopes"]["NTL"]["s"]["number_token_mae"]
    xs = [math.log2(t) for t in (2.4, 9.6, 38.4)]
    slopes = [np.polyfit(xs, [gains[("s", t)][seed] for t in (2.4, 9.6, 38.4)], 1)[0] for seed in range(4)]
    ref = stats.ttest_1samp(slopes, 0.0)
    ci = ref.confidence_interval(0.95)
    assert (fit["slope"], fit["low"], fit["high"], fit["p"]) == pytest.approx(
        (np.mean(slopes), ci.low, ci.high, ref.pvalue), rel=1e-10
    )
    assert fit["n"] == 12 and fit["n_seeds"] == 4 and fit["df"] == 3
    assert fit["reading"] == "the gain falls as tokens per parameter fall"  # MAE closer to 0 at 2.4
    a, b = gains[("m", 2.4)], gains[("m", 9.6)]
    paired = stats.ttest_rel(a, b)
    ci = paired.confidence_interval(0.95)
    got = out["contrasts"]["NTL"]["tokens at m"]["number_token_mae"]
    assert (got["diff"], got["low"], got["high"], got["p"]) == pytest.approx(
        (np.mean(a) - np.mean(b), ci.low, ci.high, paired.pvalue), rel=1e-10
    )
    assert got["n"] == 4 and got["seed_ids"] == [0, 1, 2, 3]
    assert got["reading"] == "not resolved"


def test_two_seeds_get_an_interval():
    cell = sweep.difference(_results([3.30, 3.35], [3.39, 3.41]), "NTL", "CE", "prose_text_ppl")
    assert cell["n"] == 2 and math.isfinite(cell["low"]) and cell["low"] < cell["mean"] < cell["high"]
    assert "[" in sweep._cell(cell)


def test_one_seed_is_stated_without_an_interval_or_a_test():
    cell = sweep.difference(_results([3.339], [3.391]), "NTL", "CE", "prose_text_ppl")
    assert cell["n"] == 1 and cell["mean"] == pytest.approx((3.391 - 3.339) * 100 / 3.339, rel=1e-12)
    assert math.isnan(cell["low"]) and math.isnan(cell["high"]) and math.isnan(cell["p_seed_t"])
    text = sweep._cell(cell)
    assert "[" not in text and "one seed" in text


def _points(last: list[float]) -> list[tuple[float, float]]:
    return (
        [(2e5, d) for d in (3.2, 3.9, 3.5, 3.8)] + [(8e5, d) for d in (3.0, 3.3, 2.9, 3.2)] + [(3.4e6, d) for d in last]
    )


def test_trend_is_the_least_squares_line_and_waits_for_a_second_seed():
    for last, verdict_given in (([1.5], False), ([1.5, 1.7], True)):
        points = _points(last)
        by_seed: dict[int, list[tuple[float, float]]] = {}
        for k, (x, y) in enumerate(points):  # the k-th point at each size is seed k
            by_seed.setdefault(sum(1 for xx, _ in points[:k] if xx == x), []).append((math.log10(x), y))
        lines = [np.polyfit([x for x, _ in xy], [y for _, y in xy], 1) for xy in by_seed.values()]
        ref = stats.ttest_1samp([line[0] for line in lines], 0.0)
        t = sweep.trend(points)
        assert (t["slope"], t["intercept"], t["p"]) == pytest.approx(
            (np.mean([line[0] for line in lines]), np.mean([line[1] for line in lines]), ref.pvalue), rel=1e-10
        )
        assert t["low"] < t["slope"] < t["high"] and t["n"] == len(points) and t["n_seeds"] == 4
        assert (t["verdict"] != "not given: a size has one seed") is verdict_given


def test_trend_verdict_reads_the_effect_at_the_smallest_size():
    # a gain that starts at +3 and ends below 0: its pooled mean is negative, yet the effect shrinks;
    # the same points mirrored grow from -3 (a cost that grows), and a flat effect cannot be told
    falling = [(2e5, d) for d in (3.1, 2.9)] + [(8e5, d) for d in (0.1, -0.1)] + [(3.2e6, d) for d in (-3.9, -4.4)]
    assert statistics.fmean(d for _, d in falling) < 0
    assert sweep.trend(falling)["verdict"] == "shrinks"
    assert sweep.trend([(x, -d) for x, d in falling])["verdict"] == "shrinks"
    rising = [(x, 7.0 + d) for (x, _), (_, d) in zip(falling, reversed(falling))]  # +3 .. +10: away from zero
    assert sweep.trend(rising)["verdict"] == "grows"
    flat = [(x, 2.0 + d) for x, d in zip([2e5, 2e5, 8e5, 8e5, 3.2e6, 3.2e6], (0.3, -0.3, 0.0, 0.0, -0.3, 0.3))]
    assert sweep.trend(flat)["verdict"] == "cannot be told at this scale"


def test_the_figure_draws_a_one_seed_size(tmp_path):
    sizes = []
    for parameters, ce, ntl in ((2e5, [4.0, 3.9], [4.1, 4.1]), (3.4e6, [3.339], [3.391])):
        results: dict = {"CE": {}, "NTL": {}}
        for split, metric, _, _ in sweep.METRICS.values():  # every headline metric, as a study writes them
            for arm, seeds in (("CE", ce), ("NTL", ntl)):
                results[arm].setdefault(split, {})[metric] = {"seeds": seeds}
        sizes.append({"label": f"{parameters:g}", "parameters": parameters, "results_path": "-", "results": results})
    table = sweep.tabulate({"arms": ["NTL"], "baseline": "CE"}, sizes)
    assert math.isnan(table["sizes"][1]["differences"]["NTL"]["prose_text_ppl"]["low"])
    path = sweep.figures.sweep_figure(table, str(tmp_path / "sweep.png"))
    assert open(path, "rb").read(4) == b"\x89PNG"


def test_differences_equal_but_for_rounding_get_no_test():
    # the 0.21 M @ 38.4 re-run's first two seeds: question accuracy +2 points in both, which in floating
    # point differ in the 17th digit; a t-test of two equal differences is undefined (zero spread), and
    # scipy's gave p < 0.001 from the rounding alone
    results = {"CE": {"questions": {"accuracy": {"seeds": [0.05, 0.0275]}}},
               "NTL": {"questions": {"accuracy": {"seeds": [0.07, 0.0475]}}}}  # fmt: skip
    assert 0.07 - 0.05 != 0.0475 - 0.0275  # the rounding the test is about
    cell = sweep.difference(results, "NTL", "CE", "question_acc")
    assert cell["n"] == 2 and cell["mean"] == pytest.approx(2.0, rel=1e-12)
    assert math.isnan(cell["p_seed_t"])
    assert "p < 0.001" not in sweep._cell(cell)


def test_publish_copies_the_files_and_fills_the_page_s_block(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "sweep.json").write_text('{"sizes": []}')
    (out / "size_tpp_factorial.png").write_bytes(b"\x89PNG fake")
    page = tmp_path / "results.md"
    page.write_text("text\n<!-- generated: fx (a command) -->\nstale table\n<!-- end: fx -->\nafter\n")
    stem = tmp_path / "img" / "fx"
    sweep.publish(str(out), "size_tpp_factorial.png", "| new | table |", str(stem), str(page), ["0.85 M @ 9.6"])
    assert (tmp_path / "img" / "fx.json").read_text() == '{"sizes": []}'
    assert (tmp_path / "img" / "fx.png").read_bytes() == b"\x89PNG fake"
    body = page.read_text()
    assert "stale table" not in body and "| new | table |\n<!-- end: fx -->\nafter\n" in body
    assert "cells without a finished seed pair: 0.85 M @ 9.6." in body and body.startswith("text\n<!-- generated: fx")


def test_a_factorial_slope_with_a_one_seed_level_gets_no_reading_and_no_place_in_the_family():
    """A level with one seed decides the slope alone: the slope is stated, but it is no test of Holm's
    family and gets no reading (two levels at 4 seeds and 1 seed give a reading-free slope)."""
    rows = []
    for size, tpp, diffs in (("m", 2.4, [-2.0, -2.5, -1.0, -2.2]), ("m", 9.6, [-11.0])):
        cells = {key: None for key in sweep.METRICS}
        cells["number_token_mae"] = {"seeds": diffs, "n": len(diffs), "mean": float(np.mean(diffs))}
        rows.append({"label": f"{size} @ {tpp}", "size": size, "tokens_per_parameter": tpp,
                     "differences": {"NTL": cells}})  # fmt: skip
    spec = {"arms": ["NTL"], "factorial": {"primary": ["number_token_mae"]}}
    out = sweep.factorial(spec, rows)
    fit = out["slopes"]["NTL"]["m"]["number_token_mae"]
    slope, _ = np.polyfit([math.log2(2.4), math.log2(9.6)], [-2.0, -11.0], 1)  # seed 0, the one seed at both
    assert fit["slope"] == pytest.approx(slope, rel=1e-10) and fit["n_seeds"] == 1 and math.isnan(fit["low"])
    assert fit["reading"] == "no reading yet: a level has one seed"
    assert out["tests_run"] == 0 and math.isnan(fit["p_holm"])


def test_equal_differences_are_stated_as_no_spread_never_a_verdict():
    """Issue 51, item 5: every seed's difference the same (exactly: binary fractions) is no spread over n seeds: no
    interval in the cell (not a zero-width one), no t-test; the trend over sizes and the factorial's slope and
    contrast give no interval and no verdict either."""
    ce, ntl = [0.5, 0.25, 0.75, 0.125], [0.625, 0.375, 0.875, 0.25]  # each + 0.125: 12.5 points
    results = {arm: {"questions": {"accuracy": {"seeds": seeds}}} for arm, seeds in (("CE", ce), ("NTL", ntl))}
    cell = sweep.difference(results, "NTL", "CE", "question_acc")
    assert cell["no_spread"] and cell["n"] == 4 and cell["mean"] == 12.5
    assert math.isnan(cell["low"]) and math.isnan(cell["high"]) and math.isnan(cell["p_seed_t"])
    text = sweep._cell(cell)
    assert "[" not in text and "no spread over 4 seeds" in text
    trend = sweep.trend([(1e5, 12.5), (1e5, 12.5), (1e6, 12.5), (1e6, 12.5)])
    assert trend["verdict"].startswith("not given: no spread") and math.isnan(trend["low"])
    slope = sweep.slope_per_doubling([(2.4, 12.5), (9.6, 12.5), (38.4, 12.5)])
    assert slope["no_spread"] and math.isnan(slope["low"]) and math.isnan(slope["p"])
    got = sweep.contrast([12.5, 12.5], [6.25, 6.25])
    assert got["no_spread"] and math.isnan(got["low"]) and math.isnan(got["p"])
    assert sweep._reading(got["low"], got["high"], 1, got["p"], "smaller", "larger") == "not resolved"


def test_pooled_effect_models_and_further_contrasts_take_the_seed_as_the_unit():
    """Issue 56: the effect pooled over cells is scipy's one-sample t-test of each seed's mean over the cells; the
    model comparison tests, across the seeds, one combination of each seed's least-squares coefficients on
    log2(parameters) and log2(tokens); a contrast pairs the cells by seed name, not position; a further contrast
    is reported outside Holm's family."""
    cells = {("s", 2.4): [-1.0, -1.5, -0.5, -1.2], ("s", 9.6): [-5.0, -5.5, -4.8, -5.2],
             ("m", 2.4): [-2.0, -2.5, -1.0, -2.2], ("m", 9.6): [-6.2, -6.0, -5.1, -6.6],
             ("l", 2.4): [-3.1, -2.4, -2.0, -2.9]}  # fmt: skip
    params = {"s": 2.0e5, "m": 8.0e5, "l": 3.2e6}
    rows = []
    for (size, tpp), diffs in cells.items():
        differences = {key: None for key in sweep.METRICS}
        differences["number_token_mae"] = {"seeds": diffs, "n": 4, "mean": float(np.mean(diffs)),
                                           "seed_ids": [0, 1, 2, 3]}  # fmt: skip
        rows.append({"label": f"{size} @ {tpp}", "size": size, "tokens_per_parameter": tpp,
                     "parameters": params[size], "tokens": tpp * params[size],
                     "differences": {"NTL": differences}})  # fmt: skip
    rows[1]["differences"]["NTL"]["number_token_mae"].update(seeds=[-5.2, -4.8, -5.5, -5.0], seed_ids=[3, 2, 1, 0])
    spec = {"arms": ["NTL"], "factorial": {"primary": ["number_token_mae"],
            "contrasts": [{"name": "tokens at s", "a": "s @ 2.4", "b": "s @ 9.6"}],
            "further_contrasts": [{"name": "size at 9.6", "a": "s @ 9.6", "b": "m @ 9.6"}]}}  # fmt: skip
    out = sweep.factorial(spec, rows)
    paired = stats.ttest_rel(cells[("s", 2.4)], cells[("s", 9.6)])  # seed by seed, the names matched
    assert out["contrasts"]["NTL"]["tokens at s"]["number_token_mae"]["p"] == pytest.approx(paired.pvalue, rel=1e-10)
    further = out["further_contrasts"]["NTL"]["size at 9.6"]["number_token_mae"]
    assert further["p"] == pytest.approx(stats.ttest_rel(cells[("s", 9.6)], cells[("m", 9.6)]).pvalue, rel=1e-10)
    assert "p_holm" not in further and out["tests_run"] == 3  # 2 slopes, 1 contrast: not the further one
    per_seed = np.mean([cells[key] for key in cells], axis=0)
    pooled = out["pooled"]["NTL"]["number_token_mae"]
    assert (pooled["mean"], pooled["p"]) == pytest.approx((per_seed.mean(), stats.ttest_1samp(per_seed, 0).pvalue))
    assert pooled["below_zero"] == 20 and pooled["pairs"] == 20 and pooled["cells"] == 5
    design = np.array([[1.0, math.log2(params[size]), math.log2(tpp * params[size])] for size, tpp in cells])
    coef = np.linalg.lstsq(design, np.array([cells[key] for key in cells]), rcond=None)[0]  # 3 x seeds
    fits = out["models"]["NTL"]["number_token_mae"]
    for name, combination in (("training tokens only", coef[1]), ("tokens per parameter only", coef[1] + coef[2]),
                              ("size only", coef[2])):  # fmt: skip
        assert fits["restrictions"][name]["p"] == pytest.approx(stats.ttest_1samp(combination, 0).pvalue, rel=1e-8)
    text = sweep.markdown({"baseline": "CE", "arms": ["NTL"], "metrics": {k: {"label": k} for k in sweep.METRICS},
                           "sizes": [], "trend": {}, "factorial": out})  # fmt: skip
    assert "size at 9.6" in text and "Pooled over every cell" in text and "tokens per parameter only: p" in text
