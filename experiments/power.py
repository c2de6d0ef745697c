"""Seeds from power, before cost (issue 56, item 4): how many seeds a paired study needs to detect an effect.

The unit is the seed (a pair of runs, arm and baseline, from one initialisation and one data draw). A study
tests each arm's mean per-seed difference with the paired (one-sample) t-test at ``alpha``, and Holm's
adjustment over a family of ``family`` tests asks the smallest p to pass ``alpha / family``: the design is
sized at that level (Holm's first step; the later steps are easier). For a true difference of ``effect`` and
a seed-to-seed standard deviation of the differences ``sd`` (measured: a noise pilot, or a study's
``results.json``), the power of the two-sided t-test with n seeds is

    P(|T| > t_{1 - a/2, n-1}),  T ~ noncentral t(n - 1, effect / sd * sqrt(n))

and the design takes the smallest n with power >= ``power`` (default 0.8). The exact sign-flip test, which
assumes no normality, cannot go below p = 2 / 2^n, so n also needs 2 / 2^n <= a for a distribution-free
confirmation (``sign_flip_seeds``).

    python experiments/power.py --sd 1.2 --effect 2.0 --family 10            # seeds for one effect
    python experiments/power.py --results docs/img/study_pretrain_factorial_m_9p6_results.json \\
        --arm "CE + NTL-WAS" --metric heldout:number_token_mae --effect-sd 1.5 --family 10
                                                                               # sd measured from a study
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from collections.abc import Sequence
from typing import Any


def t_power(effect_sd: float, seeds: int, alpha: float) -> float:
    """Power of the two-sided one-sample t-test at level ``alpha`` with ``seeds`` paired differences whose true
    mean is ``effect_sd`` standard deviations from 0 (noncentral t). NaN below 2 seeds."""
    from scipy import stats

    if seeds < 2:
        return math.nan
    df, ncp = seeds - 1, abs(effect_sd) * math.sqrt(seeds)
    crit = float(stats.t.ppf(1 - alpha / 2, df))
    upper = float(stats.nct.sf(crit, df, ncp))
    lower = float(stats.nct.cdf(-crit, df, ncp))  # the wrong-sign rejections: negligible, NaN far in the tail
    upper = 1.0 if math.isnan(upper) else upper
    return min(1.0, upper + (0.0 if math.isnan(lower) else lower))


def seeds_needed(effect_sd: float, alpha: float = 0.05, family: int = 1, power: float = 0.8, most: int = 1000) -> int:
    """The smallest number of seeds whose paired t-test detects ``effect_sd`` (effect / seed-to-seed sd) with
    ``power`` at ``alpha / family`` (Holm's first step); ``most`` + 1 where even ``most`` seeds do not."""
    if effect_sd == 0:
        return most + 1
    for n in range(2, most + 1):
        if t_power(effect_sd, n, alpha / family) >= power:
            return n
    return most + 1


def detectable(seeds: int, alpha: float = 0.05, family: int = 1, power: float = 0.8) -> float:
    """The smallest effect (in seed-to-seed sds) that ``seeds`` seeds detect with ``power`` at ``alpha / family``."""
    from scipy import optimize

    if seeds < 2:
        return math.inf
    level = alpha / family
    high = 1.0
    while t_power(high, seeds, level) < power:
        high *= 2
        if high > 1e6:
            return math.inf
    return float(optimize.brentq(lambda d: t_power(d, seeds, level) - power, 0.0, high, xtol=1e-10))


def sign_flip_seeds(alpha: float = 0.05, family: int = 1) -> int:
    """The fewest seeds whose exact sign-flip test can reach ``alpha / family`` at all (2 / 2^n <= level)."""
    level = alpha / family
    return max(2, math.ceil(math.log2(2 / level)))


def measured_sd(results: dict[str, Any], arm: str, baseline: str, split: str, metric: str) -> tuple[float, int]:
    """The seed-to-seed standard deviation of the arm-minus-baseline differences in a study's ``results.json``
    (``results[arm][split][metric]["seeds"]``, paired by position) and the number of pairs it rests on."""
    a, b = results[arm][split][metric]["seeds"], results[baseline][split][metric]["seeds"]
    diffs = [x - y for x, y in zip(a, b) if x is not None and y is not None and math.isfinite(x) and math.isfinite(y)]
    if len(diffs) < 2:
        raise ValueError(f"{arm} - {baseline} on {split} {metric}: {len(diffs)} seed pair(s), an sd needs 2")
    return statistics.stdev(diffs), len(diffs)


def plan(effect_sd: float, alpha: float = 0.05, family: int = 1, power: float = 0.8) -> dict[str, Any]:
    """Seeds for one effect: by the t-test's power at Holm's first step, and the sign-flip floor."""
    n = seeds_needed(effect_sd, alpha, family, power)
    return {"effect_sd": effect_sd, "alpha": alpha, "family": family, "level": alpha / family, "power": power,
            "seeds_t": n, "power_at_seeds": t_power(effect_sd, n, alpha / family) if n <= 1000 else math.nan,
            "seeds_sign_flip": sign_flip_seeds(alpha, family)}  # fmt: skip


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sd", type=float, help="seed-to-seed sd of the paired differences (measured)")
    parser.add_argument("--effect", type=float, help="the difference to detect, in the sd's unit")
    parser.add_argument("--effect-sd", type=float, help="the difference to detect, in sds (instead of --effect)")
    parser.add_argument("--results", help="a study's results.json: measure the sd there (with --arm, --metric)")
    parser.add_argument("--arm", default="CE + NTL-WAS")
    parser.add_argument("--baseline", default="CE")
    parser.add_argument("--metric", default="heldout:number_token_mae", help="SPLIT:METRIC, the split may hold ':'")
    parser.add_argument("--alpha", type=float, default=0.05)
    parser.add_argument("--family", type=int, default=1, help="Holm's family size (tests declared)")
    parser.add_argument("--power", type=float, default=0.8)
    args = parser.parse_args(argv)
    sd, pairs = args.sd, None
    if args.results:
        with open(args.results) as f:
            results = json.load(f)["results"]
        split, _, metric = args.metric.rpartition(":")
        sd, pairs = measured_sd(results, args.arm, args.baseline, split, metric)
    if args.effect_sd is not None:
        effect_sd = args.effect_sd
    elif args.effect is not None and sd:
        effect_sd = args.effect / sd
    else:
        raise SystemExit("give --effect-sd, or --effect with --sd (or --results to measure the sd)")
    out = plan(effect_sd, args.alpha, args.family, args.power)
    out.update(sd=sd, sd_pairs=pairs, detectable_sd_at={n: detectable(n, args.alpha, args.family, args.power)
                                                        for n in (3, 4, 6, 8, 12, 16)})  # fmt: skip
    source = f" (measured over {pairs} seed pairs of {args.results})" if pairs else ""
    print(f"sd {sd if sd is not None else 'n/a'}{source}; effect {effect_sd:.3g} sd; level {out['level']:.3g} "
          f"(alpha {args.alpha} / family {args.family}); power {args.power}")  # fmt: skip
    print(f"seeds by the paired t-test: {out['seeds_t']}; by the exact sign-flip floor: {out['seeds_sign_flip']}")
    print(
        "smallest effect detected, in sds: "
        + ", ".join(f"{n} seeds {d:.2f}" for n, d in out["detectable_sd_at"].items())
    )
    return out


if __name__ == "__main__":
    main()
