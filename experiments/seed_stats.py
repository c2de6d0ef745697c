"""Seed-level statistics of the studies: the tests at the strength of the data (issue 42).

The unit of every test is the seed: a pair of runs (an arm and the baseline) from one initialisation
and, where a preset varies it, one data draw. Questions and held-out sequences answered by the same
models are not independent pairs (400 questions x 4 seeds are not 1,600 replicates), so no test here
pools them; their counts are descriptive only (``experiments/study.py``).

* :func:`sign_flip_p`: the exact sign-flip permutation test of paired differences (distribution-free;
  with n seeds its smallest two-sided p is 2 / 2^n: 0.125 at 4 seeds, 0.031 at 6, 0.0078 at 8);
* :func:`t_interval`: the mean and its t-interval, clipped to the range the quantity can take
  (:data:`RANGES`; an accuracy interval never leaves [0, 1]);
* :func:`holm`: Holm's step-down adjustment over a study's family of tests;
* :func:`across_seeds`: one statistic per seed computed across cells (seed S's contrast between two cells,
  its slope over cells, a coefficient of its own fit), tested across the seeds: the mean with its t-interval,
  the one-sample t-test (n - 1 degrees of freedom) and the exact sign-flip test. Seed S shares its corpus,
  held-out sets and (within a size) its initialisation in every cell, so cells are not independent samples
  and a cell's per-seed points are not independent of another cell's: the seed stays the unit across cells;
* :func:`seed_slopes`: per seed, the least-squares line of its values over the cells (the input of
  :func:`across_seeds` for a slope);
* :func:`seed_tests`: every arm against the baseline on every metric of a study's ``results.json``
  (the per-seed values it holds): mean difference, its clipped 95 % interval (the effect sizes a null
  does not exclude), the paired t-test, the sign-flip test, and the Holm-adjusted t-test p over the
  study's family (every such test of the file, stated with its size).

    python experiments/seed_stats.py docs/img/study_pretrain_cpu_results.json   # the table, and writes
                                                                                  # "seed_tests" into the file
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

INF = math.inf
RANGES: dict[str, tuple[float, float]] = {
    "accuracy": (0.0, 1.0),
    "number_token_acc": (0.0, 1.0),
    "mae": (0.0, INF),
    "log_mae": (0.0, INF),
    "number_token_mae": (0.0, 9.0),  # the expected digit's distance from the true digit
    "r2": (-INF, 1.0),
    "text_ppl": (1.0, INF),
    "number_token_ppl": (1.0, INF),
    "ppl": (1.0, INF),
}
"""The values a metric can take (a perplexity is at least 1, an accuracy within [0, 1])."""

MAX_EXACT = 20
"""Most seeds the sign-flip test enumerates (2^20 sign patterns)."""


def difference_range(metric: str) -> tuple[float, float]:
    """The values an arm-minus-baseline difference of ``metric`` can take: [low - high, high - low]."""
    low, high = RANGES.get(metric, (-INF, INF))
    return low - high, high - low


def t_interval(
    values: Sequence[float], level: float = 0.95, bounds: tuple[float, float] = (-INF, INF)
) -> tuple[float, float, float]:
    """(mean, low, high): the mean of the finite ``values`` and its two-sided t-interval, clipped to
    ``bounds``; one value: no width (low = high = mean); none: NaNs."""
    from scipy import stats

    clean = [float(v) for v in values if v is not None and math.isfinite(v)]
    if not clean:
        return math.nan, math.nan, math.nan
    mean = statistics.fmean(clean)
    if len(clean) < 2:
        return mean, mean, mean
    half = float(stats.t.ppf(0.5 + level / 2, len(clean) - 1)) * statistics.stdev(clean) / math.sqrt(len(clean))
    return mean, max(bounds[0], mean - half), min(bounds[1], mean + half)


def sign_flip_p(diffs: Sequence[float]) -> float:
    """Exact two-sided sign-flip permutation p of paired differences: the share of the 2^n sign
    patterns whose mean is at least as far from 0 as the observed one (ties within 1e-12 relative
    count as at least as far). NaN for no difference; every difference 0: p = 1."""
    d = [float(x) for x in diffs if x is not None and math.isfinite(x)]
    if not d:
        return math.nan
    if len(d) > MAX_EXACT:
        raise ValueError(f"sign_flip_p: {len(d)} differences; the exact test enumerates at most {MAX_EXACT}")
    observed = abs(sum(d))
    tolerance = 1e-12 * max(sum(abs(x) for x in d), 1e-300)
    hits = 0
    for signs in itertools.product((1.0, -1.0), repeat=len(d)):
        if abs(sum(s * x for s, x in zip(signs, d))) >= observed - tolerance:
            hits += 1
    return hits / 2 ** len(d)


def holm(pvalues: Mapping[Any, float], family: int | None = None) -> dict[Any, float]:
    """Holm's step-down adjusted p of each finite p (``min(1, max_{j <= i} (m - j + 1) p_(j))``, m the
    number of finite ps, or ``family`` where larger: a family declared in advance of which some tests
    cannot be run yet, their ps taken as the largest); a NaN p stays NaN and does not count in m."""
    finite = sorted(((p, key) for key, p in pvalues.items() if p is not None and math.isfinite(p)),
                    key=lambda item: item[0])  # fmt: skip
    m, running, out = max(len(finite), family or 0), 0.0, {key: math.nan for key in pvalues}
    for rank, (p, key) in enumerate(finite):
        running = max(running, min(1.0, (m - rank) * p))
        out[key] = running
    return out


def no_spread(values: Sequence[float], scale: float | None = None) -> bool:
    """Whether two or more values are all equal up to rounding (within ``1e-12 * scale``; default: their
    largest magnitude): no spread, so no interval and no test, only the note :func:`spread_note`."""
    clean = [float(v) for v in values if v is not None and math.isfinite(v)]
    if len(clean) < 2:
        return False
    scale = max(abs(v) for v in clean) if scale is None else scale
    return max(clean) - min(clean) <= 1e-12 * scale


def across_seeds(values: Sequence[float | None], bounds: tuple[float, float] = (-INF, INF)) -> dict[str, Any]:
    """One seed-level statistic per seed (a per-seed contrast between cells, slope or coefficient) tested
    across the seeds: ``mean`` with its 95 % t-interval (``low``, ``high``, clipped to ``bounds``; n - 1
    degrees of freedom), ``p`` the one-sample t-test of mean 0, ``p_sign_flip`` the exact sign-flip test.
    Values all equal up to rounding (:func:`no_spread`): no interval and no test (``no_spread`` True, say
    :func:`spread_note`); one value: no interval, no test."""
    from scipy import stats

    clean = [float(v) for v in values if v is not None and math.isfinite(v)]
    mean, low, high = t_interval(clean, bounds=bounds)
    flat = no_spread(clean)
    p = math.nan
    if len(clean) < 2 or flat:
        low = high = math.nan
    else:
        p = float(stats.ttest_1samp(clean, 0.0).pvalue)
    return {"values": clean, "n": len(clean), "df": len(clean) - 1, "mean": mean, "low": low, "high": high, "p": p,
            "p_sign_flip": sign_flip_p(clean) if clean else math.nan, "no_spread": flat}  # fmt: skip


def seed_slopes(points: Sequence[tuple[float, float, Any]]) -> dict[Any, tuple[float, float]]:
    """Per seed, the least-squares line of its values on x over the cells: ``{seed: (slope, intercept)}``
    from points ``(x, y, seed)``; a seed with fewer than 2 distinct x has no line (left out)."""
    by_seed: dict[Any, list[tuple[float, float]]] = {}
    for x, y, seed in points:
        if y is not None and math.isfinite(y):
            by_seed.setdefault(seed, []).append((float(x), float(y)))
    out = {}
    for seed, xy in by_seed.items():
        if len({x for x, _ in xy}) < 2:
            continue
        mx, my = statistics.fmean(x for x, _ in xy), statistics.fmean(y for _, y in xy)
        slope = sum((x - mx) * (y - my) for x, y in xy) / sum((x - mx) ** 2 for x, _ in xy)
        out[seed] = (slope, my - slope * mx)
    return out


def spread_note(n: int) -> str:
    """What a test of ``n`` equal per-seed differences says instead of an interval and a verdict."""
    return f"no spread over {n} seeds"


def seed_test(arm: Sequence[float | None], baseline: Sequence[float | None], metric: str) -> dict[str, Any]:
    """One arm against the baseline on one metric, paired by seed (index).

    Per-seed differences that are all equal (up to rounding) have no spread: a t-interval of width 0 and
    no t-test would read as certainty, so ``ci95`` is ``[nan, nan]``, ``p_seed_t`` NaN (no test, out of any
    Holm family) and ``no_spread`` True (say :func:`spread_note`, never a verdict). The sign-flip p is
    still exact (every seed's difference has the same sign, or is 0: p = 1)."""
    from scipy import stats

    pairs = [(float(x), float(y)) for x, y in zip(arm, baseline)
             if x is not None and y is not None and math.isfinite(x) and math.isfinite(y)]  # fmt: skip
    diffs = [x - y for x, y in pairs]
    mean, low, high = t_interval(diffs, bounds=difference_range(metric))
    scale = max((abs(x) + abs(y) for x, y in pairs), default=0.0)
    flat = no_spread(diffs, scale)  # equal differences up to rounding: no interval, no test
    if len(diffs) < 2 or flat:
        low = high = math.nan
    p_t = math.nan
    if len(diffs) > 1 and not flat:
        p_t = float(stats.ttest_rel([x for x, _ in pairs], [y for _, y in pairs]).pvalue)
    return {"n": len(diffs), "diffs": diffs, "mean_diff": mean, "ci95": [low, high], "p_seed_t": p_t,
            "p_sign_flip": sign_flip_p(diffs) if diffs else math.nan, "no_spread": flat}  # fmt: skip


def interval_text(t: Mapping[str, Any], number: Any = None) -> str:
    """``diff [low, high]`` of a :func:`seed_test`, or ``diff (no spread over n seeds)``, or ``diff`` alone
    (one seed). ``number``: the formatter of one value (default ``+.4g``)."""
    fmt = number or (lambda x: "n/a" if not math.isfinite(x) else f"{x:+.4g}")
    low, high = t.get("ci95", [math.nan, math.nan])
    if t.get("no_spread"):
        return f"{fmt(t['mean_diff'])} ({spread_note(t['n'])})"
    if not (math.isfinite(low) and math.isfinite(high)):
        return fmt(t["mean_diff"])
    return f"{fmt(t['mean_diff'])} [{fmt(low)}, {fmt(high)}]"


def seed_tests(summary: dict[str, Any]) -> dict[str, Any]:
    """Every arm against the baseline (and against each ``also_against`` arm of the preset) on every
    metric of a study's ``results.json``, with Holm's adjustment of the t-test ps over all of them (the
    study's family). Returns {"baseline", "family_size", "tests": {against: {arm: {split: {metric: ...}}}}}."""
    results, preset = summary["results"], summary.get("preset", {})
    baseline = preset.get("baseline") or next(iter(results))
    tests: dict[str, Any] = {}
    for against in [baseline, *preset.get("also_against", [])]:
        tests[against] = {}
        for arm in results:
            if arm in (baseline, against):
                continue
            tests[against][arm] = {}
            for split, metrics in results[arm].items():
                for metric, cell in metrics.items():
                    base = results[against].get(split, {}).get(metric)
                    if base is None:
                        continue
                    test = seed_test(cell["seeds"], base["seeds"], metric)
                    tests[against][arm].setdefault(split, {})[metric] = test
    keys = {(a, arm, s, m): t["p_seed_t"] for a, by_arm in tests.items() for arm, by_split in by_arm.items()
            for s, by_metric in by_split.items() for m, t in by_metric.items()}  # fmt: skip
    adjusted = holm(keys)
    for (a, arm, s, m), p in adjusted.items():
        tests[a][arm][s][m]["p_holm"] = p
    family = sum(1 for p in keys.values() if math.isfinite(p))
    out = {"baseline": baseline, "family_size": family, "tests": tests}
    declared = declared_family(preset)
    if declared:  # a question's own family, declared in the preset: Holm over those tests, beside the study's
        for against, arm, split, metric in declared:  # an arm not run yet is "not run"; a misspelt name is not
            if arm in results and against in results and metric not in results[arm].get(split, {}):
                raise ValueError(
                    f"declared_family names split {split!r} / metric {metric!r}, which arm {arm!r} has not; its "
                    f"splits: {sorted(results[arm])}"
                )
        found = {key: keys.get(key, math.nan) for key in declared}
        for key, p in holm(found, family=len(declared)).items():
            if key in keys:
                tests[key[0]][key[1]][key[2]][key[3]]["p_holm_declared"] = p
        out["declared_family"] = [list(key) for key in declared]
    return out


def declared_family(preset: Mapping[str, Any]) -> list[tuple[str, str, str, str]]:
    """The tests of a preset's ``declared_family`` (a question's own Holm family, stated before its runs):
    entries ``{against, arms, split, metric}``, each giving a test per arm, as ``(against, arm, split, metric)``."""
    keys: list[tuple[str, str, str, str]] = []
    for entry in preset.get("declared_family") or []:
        if not isinstance(entry, Mapping) or set(entry) != {"against", "arms", "split", "metric"}:
            raise ValueError(
                f"declared_family entries are {{against, arms, split, metric}} (arms a list), got {entry!r}"
            )
        keys += [(entry["against"], arm, entry["split"], entry["metric"]) for arm in entry["arms"]]
    return keys


def _p(p: float) -> str:
    return "n/a" if not math.isfinite(p) else ("< 0.001" if p < 0.001 else f"{p:.3f}")


def _g(x: float) -> str:
    return "n/a" if not math.isfinite(x) else f"{x:+.4g}"


def markdown(tested: dict[str, Any]) -> str:
    """The seed-level table: per comparison, arm, split and metric the mean difference, its 95 %
    interval (clipped to the metric's range), the paired t-test p, Holm's p over the study's family and
    the exact sign-flip p."""
    lines = [f"Seed-level tests (the unit is the seed; Holm's adjustment over the study's family of "
             f"{tested['family_size']} t-tests; sign-flip: exact permutation of the per-seed differences' signs).",
             "", "| against | arm | split | metric | seeds | diff [95 % interval] | t-test p | Holm p | sign-flip p |",
             "|---|---|---|---|---:|---|---:|---:|---:|"]  # fmt: skip
    for against, by_arm in tested["tests"].items():
        for arm, by_split in by_arm.items():
            for split, by_metric in by_split.items():
                for metric, t in by_metric.items():
                    lines.append(f"| {against} | {arm} | {split} | {metric} | {t['n']} | {interval_text(t, _g)} | "
                                 f"{_p(t['p_seed_t'])} | {_p(t['p_holm'])} | {_p(t['p_sign_flip'])} |")  # fmt: skip
    if tested.get("declared_family"):
        lines += ["", f"The preset's declared family ({len(tested['declared_family'])} tests; Holm over them, a "
                      "missing test counted at p = 1):", "", "| against | arm | split | metric | t-test p | Holm p, "
                      "declared family | Holm p, study |", "|---|---|---|---|---:|---:|---:|"]  # fmt: skip
        for against, arm, split, metric in tested["declared_family"]:
            t = tested["tests"].get(against, {}).get(arm, {}).get(split, {}).get(metric)
            cells = (_p(t["p_seed_t"]), _p(t["p_holm_declared"]), _p(t["p_holm"])) if t else ("not run",) * 3
            lines.append(f"| {against} | {arm} | {split} | {metric} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> list[str]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="+", help="a study's results.json (docs/img/study_*_results.json)")
    parser.add_argument("--no-write", action="store_true", help="print the tables; leave the files as they are")
    args = parser.parse_args(argv)
    texts = []
    for path in args.results:
        with open(path) as f:
            raw = f.read()
        summary = json.loads(raw)
        second = raw.split("\n", 2)[1] if "\n" in raw else ""
        indent = len(second) - len(second.lstrip(" ")) or 2  # written back as it was laid out
        if "results" not in summary:
            raise SystemExit(f"{path}: not a study's results.json (no 'results' key)")
        summary["seed_tests"] = seed_tests(summary)
        text = f"**{path}**\n\n" + markdown(summary["seed_tests"])
        print(text + "\n")
        texts.append(text)
        if not args.no_write:
            with open(path, "w") as f:
                f.write(json.dumps(summary, indent=indent) + ("\n" if raw.endswith("\n") else ""))
    return texts


if __name__ == "__main__":
    main()
