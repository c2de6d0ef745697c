"""experiments/figures.py: a verdict figure that draws one arm from its re-run (issue 42: the leaking-split
CPU figure showed the number-level arm before its fix under a table giving the re-run).

The merged arm must be the re-run's values, the baseline must pair seed by seed (else refused), and the
Holm family is recomputed over the arms drawn (checked against scipy's paired t-test and Holm written here).
"""

from __future__ import annotations

import json

import pytest

from tests.helpers.scripts import load_script

stats = pytest.importorskip("scipy.stats")
figures = load_script("experiments/figures.py", "figures_arm_from_under_test")


def _file(tmp_path, name, arms):
    path = tmp_path / name
    results = {arm: {"interpolate": {"accuracy": {"seeds": seeds}}} for arm, seeds in arms.items()}
    path.write_text(json.dumps({"preset": {"baseline": "CE"}, "results": results}))
    return path


def test_an_arm_is_drawn_from_its_rerun_and_the_family_recomputed(tmp_path):
    ce, old, new, was = [0.77, 0.74, 0.89], [0.80, 0.60, 0.90], [0.935, 0.93, 0.955], [0.65, 0.925, 0.845]
    main = json.loads(_file(tmp_path, "main.json", {"CE": ce, "WAS": was, "number": old}).read_text())
    rerun = _file(tmp_path, "rerun.json", {"number": new, "CE": ce})
    merged = figures.with_arm_from(main, str(rerun), "number")
    assert merged["results"]["number"]["interpolate"]["accuracy"]["seeds"] == new
    tests = merged["seed_tests"]["tests"]["CE"]
    ps = {arm: float(stats.ttest_rel(seeds, ce).pvalue) for arm, seeds in (("WAS", was), ("number", new))}
    low, high = sorted(ps.values())
    want = {min(ps, key=ps.get): 2 * low, max(ps, key=ps.get): max(2 * low, high)}
    for arm, p in want.items():
        assert tests[arm]["interpolate"]["accuracy"]["p_holm"] == pytest.approx(min(1.0, p), rel=1e-9)
    assert figures.verdict_figure(merged, str(tmp_path / "v.png")) is not None


def test_a_rerun_with_another_baseline_is_refused(tmp_path):
    main = json.loads(_file(tmp_path, "main.json", {"CE": [0.7, 0.8], "number": [0.8, 0.8]}).read_text())
    rerun = _file(tmp_path, "rerun.json", {"number": [0.9, 0.9], "CE": [0.7, 0.81]})
    with pytest.raises(SystemExit, match="does not pair"):
        figures.with_arm_from(main, str(rerun), "number")
    with pytest.raises(SystemExit, match="no arm 'MSE'"):
        figures.with_arm_from(main, str(rerun), "MSE")
