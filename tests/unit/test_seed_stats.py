"""experiments/seed_stats.py: the seed-level statistics against independent computations.

The sign-flip test against scipy's own permutation test (``scipy.stats.permutation_test``, exact for
these sizes) and against an enumeration of the sign patterns written here with numpy's binary
expansion; Holm's adjustment against its textbook form written here (each hypothesis rejected at
level a iff every smaller p_(j) <= a / (m - j + 1), scanned over levels); the clipped interval against
scipy's ``t.interval``; the study-level wiring (family size, also_against, Holm over the file) on a
results dict built here.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from tests.helpers.scripts import load_script

stats = pytest.importorskip("scipy.stats")
seed_stats = load_script("experiments/seed_stats.py", "seed_stats_under_test")


def _enumerated(diffs: list[float]) -> float:
    n = len(diffs)
    bits = (np.arange(2**n)[:, None] >> np.arange(n)[None, :]) & 1  # every sign pattern, as bits
    means = ((1 - 2 * bits) * np.asarray(diffs, dtype=np.float64)).mean(axis=1)
    return float(np.mean(np.abs(means) >= abs(np.mean(diffs)) - 1e-12))


@pytest.mark.parametrize(
    "diffs",
    [
        [0.3, 0.5, 0.2, 0.4],
        [0.3, -0.5, 0.2, 0.4],
        [1.0, -1.0, 2.0, -2.5, 0.1, 0.7],
        [0.02, 0.01, -0.03, 0.05, 0.04, 0.06, -0.01, 0.03],
        [-4.0, 1.0, 2.0],
    ],
)
def test_sign_flip_matches_an_enumeration_and_scipy(diffs):
    p = seed_stats.sign_flip_p(diffs)
    assert p == pytest.approx(_enumerated(diffs), abs=1e-15)
    reference = stats.permutation_test((np.asarray(diffs),), np.mean, permutation_type="samples",
                                       n_resamples=10**6, alternative="two-sided")  # fmt: skip
    assert p == pytest.approx(float(reference.pvalue), rel=1e-9)


def test_sign_flip_floor_at_four_seeds_and_degenerate_input():
    assert seed_stats.sign_flip_p([0.1, 0.2, 0.3, 0.4]) == 2 / 16  # the smallest p 4 seeds can give
    assert seed_stats.sign_flip_p([0.1] * 8) == 2 / 256
    assert seed_stats.sign_flip_p([0.0, 0.0, 0.0]) == 1.0
    assert math.isnan(seed_stats.sign_flip_p([]))
    with pytest.raises(ValueError, match="at most 20"):
        seed_stats.sign_flip_p([1.0] * 21)


def _holm_textbook(ps: list[float]) -> list[float]:
    """The smallest level at which Holm's procedure rejects each hypothesis, found by scanning levels."""
    order = sorted(range(len(ps)), key=lambda i: ps[i])
    m = len(ps)
    out = []
    for i in range(len(ps)):
        # rejected at level a iff all of p_(1..k) pass p_(j) <= a / (m - j + 1), k = rank of i
        k = order.index(i)
        needed = max(min(1.0, ps[order[j]] * (m - j)) for j in range(k + 1))
        out.append(needed)
    return out


def test_holm_matches_the_textbook_procedure():
    rng = np.random.default_rng(3)
    for _ in range(20):
        ps = list(rng.uniform(0, 0.2, size=int(rng.integers(1, 12))))
        got = seed_stats.holm(dict(enumerate(ps)))
        for i, want in enumerate(_holm_textbook(ps)):
            assert got[i] == pytest.approx(want, rel=1e-12)
            # and the rejection rule itself, at a level between the adjusted values
            rejected = all(ps[j] <= 0.05 / (len(ps) - r) for r, j in enumerate(sorted(range(len(ps)),
                           key=lambda x: ps[x])) if ps[j] <= ps[i])  # fmt: skip
            assert (got[i] <= 0.05) == rejected
    got = seed_stats.holm({"a": 0.01, "b": math.nan, "c": 0.04})
    assert got["a"] == pytest.approx(0.02) and got["c"] == pytest.approx(0.04) and math.isnan(got["b"])


def test_interval_matches_scipy_and_is_clipped_to_the_metric_range():
    values = [0.01, 0.0, 0.03, 0.0]
    low, high = stats.t.interval(0.95, len(values) - 1, loc=np.mean(values), scale=stats.sem(values))
    assert low < 0  # unclipped, an accuracy interval would leave [0, 1]
    mean, got_low, got_high = seed_stats.t_interval(values, bounds=seed_stats.RANGES["accuracy"])
    assert (mean, got_low, got_high) == pytest.approx((np.mean(values), 0.0, high), rel=1e-12)
    free = seed_stats.t_interval(values)
    assert free[1:] == pytest.approx((low, high), rel=1e-12)
    assert seed_stats.difference_range("accuracy") == (-1.0, 1.0)
    test = seed_stats.seed_test([0.9, 0.95, 1.0, 0.2], [0.1, 0.05, 0.0, 0.8], "accuracy")
    assert test["ci95"][1] == 1.0 and test["ci95"][0] >= -1.0  # a wide difference stays within [-1, 1]


def test_seed_tests_cover_the_file_and_adjust_over_the_family():
    ce = {"questions": {"accuracy": {"seeds": [0.10, 0.12, 0.11, 0.09]}, "mae": {"seeds": [5.0, 5.5, 4.8, 5.1]}}}
    was = {"questions": {"accuracy": {"seeds": [0.14, 0.15, 0.16, 0.12]}, "mae": {"seeds": [4.0, 5.6, 4.1, 4.0]}}}
    huber = {"questions": {"accuracy": {"seeds": [0.10, 0.13, 0.10, 0.09]}, "mae": {"seeds": [5.0, 5.0, 5.0, 5.0]}}}
    summary = {"preset": {"baseline": "CE", "also_against": ["WAS"]},
               "results": {"CE": ce, "WAS": was, "Huber": huber}}  # fmt: skip
    out = seed_stats.seed_tests(summary)
    assert set(out["tests"]) == {"CE", "WAS"} and set(out["tests"]["WAS"]) == {"Huber"}
    ps = {}
    for against, by_arm in out["tests"].items():
        for arm, by_split in by_arm.items():
            for metric, t in by_split["questions"].items():
                a = summary["results"][arm]["questions"][metric]["seeds"]
                b = summary["results"][against]["questions"][metric]["seeds"]
                want = stats.ttest_rel(a, b).pvalue
                assert t["p_seed_t"] == pytest.approx(float(want), rel=1e-9)
                assert t["diffs"] == pytest.approx([x - y for x, y in zip(a, b)])
                ps[(against, arm, metric)] = t
    assert out["family_size"] == 6
    raw = sorted(t["p_seed_t"] for t in ps.values())
    smallest = min(ps.values(), key=lambda t: t["p_seed_t"])
    assert smallest["p_holm"] == pytest.approx(min(1.0, 6 * raw[0]))
    assert "family of 6 t-tests" in seed_stats.markdown(out)


def test_holm_over_a_declared_family_counts_the_tests_not_yet_run():
    """A family of 8 declared before the runs, 3 of them possible so far: the adjustment is Holm's over 8
    with the 5 missing ps taken as 1 (the textbook procedure over the padded list, written here)."""
    ps = [0.004, 0.03, 0.2]
    padded = _holm_textbook(ps + [1.0] * 5)[:3]
    got = seed_stats.holm(dict(enumerate(ps)), family=8)
    assert [got[i] for i in range(3)] == pytest.approx(padded, rel=1e-12)
    assert got[0] == pytest.approx(8 * 0.004)


def test_differences_equal_but_for_rounding_get_no_t_test():
    # 0.07 - 0.05 and 0.045 - 0.025 are both 0.02 in exact arithmetic, 1e-17 apart in floats: a t-test
    # on that spread would report p < 0.001 for two seeds
    test = seed_stats.seed_test([0.07, 0.045], [0.05, 0.025], "accuracy")
    assert 0.07 - 0.05 != 0.045 - 0.025 and math.isnan(test["p_seed_t"])


def test_a_declared_family_is_adjusted_over_its_own_tests():
    """A preset's ``declared_family`` (a question's own family): Holm over its tests only, by the textbook
    procedure written here over scipy's t-test ps, a test of an arm not run yet counted at p = 1; the
    study-wide ``p_holm`` is unchanged beside it; a malformed entry is refused with the expected form."""
    ce = {"heldout": {"mae": {"seeds": [5.0, 5.5, 4.8, 5.1]}}, "prose": {"ppl": {"seeds": [3.0, 3.1, 2.9, 3.05]}}}
    low = {"heldout": {"mae": {"seeds": [4.0, 4.6, 4.1, 4.0]}}, "prose": {"ppl": {"seeds": [3.1, 3.1, 3.0, 3.2]}}}
    mid = {"heldout": {"mae": {"seeds": [4.9, 5.4, 4.8, 5.0]}}, "prose": {"ppl": {"seeds": [3.0, 3.2, 2.8, 3.1]}}}
    family = [
        {"against": "CE", "arms": ["low", "mid", "high"], "split": "heldout", "metric": "mae"},
        {"against": "mid", "arms": ["low", "high"], "split": "prose", "metric": "ppl"},
    ]
    summary = {"preset": {"baseline": "CE", "also_against": ["mid"], "declared_family": family},
               "results": {"CE": ce, "low": low, "mid": mid}}  # fmt: skip
    out = seed_stats.seed_tests(summary)
    chosen = [("CE", "low", "heldout", "mae"), ("CE", "mid", "heldout", "mae"), ("mid", "low", "prose", "ppl")]
    ps = []
    for against, arm, split, metric in chosen:
        a = summary["results"][arm][split][metric]["seeds"]
        b = summary["results"][against][split][metric]["seeds"]
        ps.append(float(stats.ttest_rel(a, b).pvalue))
    want = _holm_textbook([*ps, 1.0, 1.0])[:3]  # 5 declared, "high" not run: two tests at p = 1
    got = [out["tests"][a][arm][s][m]["p_holm_declared"] for a, arm, s, m in chosen]
    assert got == pytest.approx(want, rel=1e-12)
    assert out["family_size"] == 6 and len(out["declared_family"]) == 5
    study_wide = seed_stats.seed_tests({**summary, "preset": {"baseline": "CE", "also_against": ["mid"]}})
    for a, arm, s_, m in chosen:  # the study-wide adjustment untouched beside the declared one
        assert out["tests"][a][arm][s_][m]["p_holm"] == study_wide["tests"][a][arm][s_][m]["p_holm"]
    assert "declared family (5 tests" in seed_stats.markdown(out) and "not run" in seed_stats.markdown(out)
    misspelt = [{"against": "CE", "arms": ["low"], "split": "held-out", "metric": "mae"}]
    with pytest.raises(ValueError, match="split 'held-out' / metric 'mae'"):
        seed_stats.seed_tests({**summary, "preset": {"baseline": "CE", "declared_family": misspelt}})
    with pytest.raises(ValueError, match=r"\{against, arms, split, metric\}"):
        seed_stats.seed_tests({**summary, "preset": {"baseline": "CE", "declared_family": [{"against": "CE"}]}})


@pytest.mark.parametrize("diff", [0.125, 0.0, -0.0625])
def test_equal_differences_have_no_spread_and_no_interval(diff):
    """Issue 51, item 5: per-seed differences all equal gave a zero-width interval [d, d] and p = NaN, which read as
    certainty. Now no interval (NaN bounds), no t-test, ``no_spread`` set and said as "no spread over n seeds" in
    the table; the sign-flip p stays the exact enumeration (every seed's sign the same)."""
    baseline = [0.5, 0.25, 0.75, 0.125]
    arm = [b + diff for b in baseline]
    assert len({a - b for a, b in zip(arm, baseline)}) == 1  # exactly equal differences (binary fractions)
    test = seed_stats.seed_test(arm, baseline, "accuracy")
    assert test["no_spread"] is True and test["n"] == 4 and test["mean_diff"] == pytest.approx(diff, abs=1e-15)
    assert all(math.isnan(x) for x in test["ci95"]) and math.isnan(test["p_seed_t"])
    assert test["p_sign_flip"] == _enumerated([diff] * 4)
    tested = seed_stats.seed_tests({"results": {"CE": {"q": {"accuracy": {"seeds": baseline}}},
                                                "A": {"q": {"accuracy": {"seeds": arm}}}}})  # fmt: skip
    assert tested["family_size"] == 0 and math.isnan(tested["tests"]["CE"]["A"]["q"]["accuracy"]["p_holm"])
    text = seed_stats.markdown(tested)
    assert "no spread over 4 seeds" in text and "[" not in text.splitlines()[-1]
    # a control: differences that vary get their interval and test
    varied = seed_stats.seed_test([b + diff + 0.01 * i for i, b in enumerate(baseline)], baseline, "accuracy")
    assert varied["no_spread"] is False and all(math.isfinite(x) for x in varied["ci95"])


def test_across_seeds_is_the_one_sample_test_of_the_per_seed_values():
    """Issue 56: a statistic per seed (a contrast of two cells, a slope over cells) tested across the seeds, the seed
    the unit: against scipy's one-sample t-test and its interval, and the sign-flip enumeration written here."""
    values = [4.1, 6.3, 2.2, 7.0]
    got = seed_stats.across_seeds(values)
    ref = stats.ttest_1samp(values, 0.0)
    ci = ref.confidence_interval(0.95)
    assert (got["mean"], got["low"], got["high"]) == pytest.approx((np.mean(values), ci.low, ci.high), rel=1e-12)
    assert got["p"] == pytest.approx(ref.pvalue, rel=1e-12) and got["df"] == 3 and got["n"] == 4
    assert got["p_sign_flip"] == _enumerated(values) == 0.125 and got["no_spread"] is False
    clipped = seed_stats.across_seeds([0.9, 0.1, 0.5, 0.95], bounds=(-1.0, 1.0))
    assert clipped["high"] == 1.0 and clipped["low"] < 1.0


def test_a_per_seed_contrast_of_two_cells_is_the_paired_test_of_the_cells():
    """The contrast of two cells seed by seed is the paired t-test of the cells' per-seed differences (scipy's
    ``ttest_rel``), not Welch's: the seeds' shared corpus cancels; the mean is the difference of the cells' means."""
    cell_a = [-4.1, -3.6, -5.0, -4.0]  # seed s's NTL-minus-CE difference in cell a
    cell_b = [-9.4, -8.2, -11.3, -7.5]
    got = seed_stats.across_seeds([a - b for a, b in zip(cell_a, cell_b)])
    ref = stats.ttest_rel(cell_a, cell_b)
    ci = ref.confidence_interval(0.95)
    assert got["mean"] == pytest.approx(np.mean(cell_a) - np.mean(cell_b), rel=1e-12)
    assert (got["low"], got["high"], got["p"]) == pytest.approx((ci.low, ci.high, ref.pvalue), rel=1e-12)
    assert got["p"] != pytest.approx(stats.ttest_ind(cell_a, cell_b, equal_var=False).pvalue, rel=1e-3)


def test_seed_slopes_are_each_seed_s_least_squares_line():
    xs = [1.0, 3.0, 5.0]
    ys = {0: [2.0, 1.0, -1.5], 1: [1.0, 0.2, -2.0], 2: [3.0, 2.5, 0.0]}
    points = [(x, y, seed) for seed, values in ys.items() for x, y in zip(xs, values)] + [(1.0, 9.0, 3)]
    lines = seed_stats.seed_slopes(points)
    assert set(lines) == {0, 1, 2}  # seed 3 has one x: no line
    for seed, values in ys.items():
        slope, intercept = np.polyfit(xs, values, 1)
        assert lines[seed] == pytest.approx((slope, intercept), rel=1e-12)
    got = seed_stats.across_seeds([slope for slope, _ in lines.values()])
    ref = stats.ttest_1samp([np.polyfit(xs, v, 1)[0] for v in ys.values()], 0.0)
    assert got["p"] == pytest.approx(ref.pvalue, rel=1e-10)


@pytest.mark.parametrize("value", [0.0, 2.5, -0.0625])
def test_equal_per_seed_values_have_no_spread_and_no_test(value):
    """Every seed's contrast (or slope) the same: no interval, no t-test ("no spread over n seeds"); the sign-flip p
    stays exact; one seed: no interval, no test."""
    got = seed_stats.across_seeds([value] * 4)
    assert got["no_spread"] is True and math.isnan(got["low"]) and math.isnan(got["high"]) and math.isnan(got["p"])
    assert (
        got["p_sign_flip"] == _enumerated([value] * 4) and seed_stats.spread_note(got["n"]) == "no spread over 4 seeds"
    )
    one = seed_stats.across_seeds([1.5])
    assert one["n"] == 1 and math.isnan(one["low"]) and math.isnan(one["p"]) and one["no_spread"] is False
