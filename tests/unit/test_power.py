"""experiments/power.py: the seeds a paired study needs, against independent computations.

The t-test's power against a simulation written here (normal per-seed differences, scipy's one-sample
t-test, a fixed numpy seed); at no effect the power is the level; the issue's figures (3 seeds detect
3.3 sd at alpha 0.05 and about 10 sd under Holm over 10 tests); the sign-flip floor against 2 / 2^n.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from tests.helpers.scripts import load_script

stats = pytest.importorskip("scipy.stats")
power = load_script("experiments/power.py", "power_under_test")


@pytest.mark.parametrize(("effect_sd", "seeds", "alpha"), [(1.0, 6, 0.05), (2.0, 4, 0.05), (1.5, 8, 0.005)])
def test_power_matches_a_simulation(effect_sd, seeds, alpha):
    rng = np.random.default_rng(0)
    draws = rng.normal(effect_sd, 1.0, size=(20000, seeds))
    simulated = float(np.mean(stats.ttest_1samp(draws, 0.0, axis=1).pvalue < alpha))
    assert power.t_power(effect_sd, seeds, alpha) == pytest.approx(simulated, abs=0.012)


def test_no_effect_has_the_level_as_power_and_one_seed_has_none():
    assert power.t_power(0.0, 5, 0.05) == pytest.approx(0.05, abs=1e-9)
    assert math.isnan(power.t_power(1.0, 1, 0.05)) and power.detectable(1) == math.inf


def test_the_issue_s_figures_and_the_seeds_needed():
    assert power.detectable(3, alpha=0.05) == pytest.approx(3.3, abs=0.05)
    assert 10.0 < power.detectable(3, alpha=0.05, family=10) < 10.6
    n = power.seeds_needed(1.0, alpha=0.05, family=10)
    assert power.t_power(1.0, n, 0.005) >= 0.8 > power.t_power(1.0, n - 1, 0.005)
    assert power.seeds_needed(0.0, most=50) == 51


def test_sign_flip_floor():
    for alpha, family in ((0.05, 1), (0.05, 10), (0.01, 8)):
        n = power.sign_flip_seeds(alpha, family)
        assert 2 / 2**n <= alpha / family < 2 / 2 ** (n - 1)
    assert power.sign_flip_seeds(0.05) == 6 and power.sign_flip_seeds(0.05, 10) == 9


def test_measured_sd_is_the_sample_sd_of_the_paired_differences():
    results = {"CE": {"h": {"m": {"seeds": [1.0, 2.0, 3.5, None]}}}, "A": {"h": {"m": {"seeds": [1.5, 2.1, 3.0, 9.0]}}}}
    sd, pairs = power.measured_sd(results, "A", "CE", "h", "m")
    assert pairs == 3 and sd == pytest.approx(float(np.std([0.5, 0.1, -0.5], ddof=1)), rel=1e-12)
    with pytest.raises(ValueError, match="an sd needs 2"):
        power.measured_sd(
            {"CE": {"h": {"m": {"seeds": [1.0]}}}, "A": {"h": {"m": {"seeds": [2.0]}}}}, "A", "CE", "h", "m"
        )
