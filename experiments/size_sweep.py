"""The pretraining study over model sizes: does NTL's text cost shrink as the model grows?

    python experiments/size_sweep.py --sweep configs/sweep/size_sweep.yaml           # runs what is missing
    python experiments/size_sweep.py --sweep configs/sweep/size_sweep.yaml --no-run  # tabulates what is there

A sweep file lists the sizes, each a study preset of ``experiments/study.py`` (same corpus, tokenizer,
held-out sequences, questions and token budget; only the model differs), optionally with
``overrides`` appended to the preset's (the merged preset is written to the size's folder), the
folder its runs go to (``out``), or a ``results`` file of that preset measured before (the published
0.85 M study). Each size is
run by ``study.py`` (resumable: a finished run is not redone). Then, for each arm against the
baseline (CE), paired by seed (same initialisation seed, same data order):

* per size, the difference of every headline metric (prose text perplexity and number-token MAE as a
  relative change in % of the baseline's mean; number-token and question accuracy in points), every
  seed's difference, the mean with its 95 % t-interval, and the seed-level paired t-test;
* over sizes, per seed the least-squares line of its differences on log10(parameters), and the mean of
  the per-seed slopes (change per 10x parameters) with its 95 % t-interval over the seeds (n - 1 degrees
  of freedom, n seeds; :func:`seed_stats.across_seeds`): seed S shares its corpus, held-out sets and data
  order at every size, so the sizes' points are not independent and the seed stays the unit. The
  verdict: the effect *shrinks* (the slope's interval lies on the side opposite to the effect at the
  smallest size), *grows* (the same side), or *cannot be told at this scale* (the interval holds 0).

Every test across cells (a slope, a contrast of two cells, a fit over the cells, the pooled effect) is a
per-seed statistic tested across the seeds (issue 56): per-seed contrasts and slopes, then the one-sample
t-test and the exact sign-flip test over the seeds.

Writes ``OUT/sweep.json`` (every number), ``OUT/sweep.md`` and ``OUT/size_sweep.png``
(:func:`figures.sweep_figure`). Parameters are counted on the meta device from each preset's model
architecture, without the (tied) embedding table, whose size is the tokenizer's and not the model's.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import statistics
import sys
import time
from typing import Any

import yaml

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)

import figures  # noqa: E402
import seed_stats  # noqa: E402
import study  # noqa: E402

BETTER = {"prose_text_ppl": -1, "number_token_mae": -1, "number_token_acc": 1, "question_acc": 1,
          "number_token_ppl": -1, "prose_ppl": -1, "code_ppl": -1, "numeric_ppl": -1, "numeric_number_token_was": -1,
          "numeric_number_token_acc": 1, **{k: -1 for k in ("prose_text_byte_ppl", "code_text_byte_ppl",
          "math_number_byte_ppl", "arith_rel_error", "gsm8k_bpb", "math_number_token_was")},
          "arith_exact_match": 1, "math_number_token_acc": 1}  # fmt: skip
"""The sign of a gain for NTL on each difference (lower perplexity and error, higher accuracy)."""

# key -> (split, metric, relative (% of the baseline mean) or absolute (points), label)
METRICS: dict[str, tuple[str, str, bool, str]] = {
    "prose_text_ppl": ("heldout:prose", "text_ppl", True, "prose text perplexity: cost, % of CE"),
    "number_token_mae": ("heldout", "number_token_mae", True, "number-token MAE: change, % of CE"),
    "number_token_acc": ("heldout", "number_token_acc", False, "number-token accuracy: change, points"),
    "question_acc": ("questions", "accuracy", False, "held-out question accuracy: change, points"),
}
"""The headline differences of the CPU studies (a sweep's default ``metrics``)."""

MORE_METRICS: dict[str, tuple[str, str, bool, str]] = {
    "prose_ppl": ("heldout:prose", "ppl", True, "prose perplexity: cost, % of CE"),
    "code_ppl": ("heldout:code", "ppl", True, "code perplexity: cost, % of CE"),
    "number_token_ppl": ("heldout", "number_token_ppl", True, "number-token perplexity: change, % of CE"),
    "numeric_ppl": ("heldout:numeric", "ppl", True, "numeric-text perplexity: change, % of CE"),
    "numeric_number_token_was": (
        "heldout:numeric",
        "number_token_was",
        True,
        "numeric text, number-token expected absolute error: change, % of CE",
    ),
    "numeric_number_token_acc": (
        "heldout:numeric",
        "number_token_acc",
        False,
        "numeric text, number-token accuracy: change, points",
    ),
    # the GPU study's harness metrics (gpu_study.parse_harness) and its number-rich held-out set
    "prose_text_byte_ppl": ("heldout:prose", "text_byte_ppl", True, "prose without numbers, perplexity/byte: cost, %"),
    "code_text_byte_ppl": ("heldout:code", "text_byte_ppl", True, "code without numbers, perplexity/byte: cost, %"),
    "math_number_byte_ppl": ("heldout:math", "number_byte_ppl", True, "math text's numbers, perplexity/byte: %"),
    "arith_rel_error": ("harness", "arith_rel_error", True, "arithmetic relative error (harness): change, %"),
    "arith_exact_match": ("harness", "arith_exact_match", False, "arithmetic exact match (harness): points"),
    "gsm8k_bpb": ("harness", "gsm8k_bpb", True, "GSM8K gold bits per byte (harness): change, %"),
    "math_number_token_was": ("heldout:math", "number_token_was", True, "math text, number-token E|v - t|: %"),
    "math_number_token_acc": ("heldout:math", "number_token_acc", False, "math text, number-token accuracy: points"),
}
"""Differences a sweep can ask for by name (``metrics: [...]``): the number-token perplexity of the CPU studies
(the cost NTL-WAS puts on the digits' likelihood), and the GPU study's (experiments/gpu_study.py),
measured by Megatron's evaluation (perplexity over all tokens of a held-out set; NTL-WAS's E|v - t| and
number-token accuracy)."""


def metric_keys(sweep: dict[str, Any]) -> list[str]:
    """The differences a sweep tabulates: its ``metrics`` list, by default :data:`METRICS`'s keys."""
    keys = list(sweep.get("metrics") or METRICS)
    unknown = [k for k in keys if k not in METRICS and k not in MORE_METRICS]
    if unknown:
        raise ValueError(f"sweep metrics {unknown}: expected names of {[*METRICS, *MORE_METRICS]}")
    return keys


def _spec(key: str) -> tuple[str, str, bool, str]:
    return METRICS[key] if key in METRICS else MORE_METRICS[key]


RANGES: dict[str, tuple[float, float]] = {
    "prose_text_ppl": (-100.0, math.inf),  # a relative change cannot fall below -100 %
    "number_token_mae": (-100.0, math.inf),
    "number_token_acc": (-100.0, 100.0),  # points of an accuracy
    "question_acc": (-100.0, 100.0),
    "prose_ppl": (-100.0, math.inf),
    "code_ppl": (-100.0, math.inf),
    "number_token_ppl": (-100.0, math.inf),
    "numeric_ppl": (-100.0, math.inf),
    "numeric_number_token_was": (-100.0, math.inf),
    "numeric_number_token_acc": (-100.0, 100.0),
    **{
        k: (-100.0, math.inf)
        for k in (
            "prose_text_byte_ppl",
            "code_text_byte_ppl",
            "math_number_byte_ppl",
            "arith_rel_error",
            "gsm8k_bpb",
            "math_number_token_was",
        )
    },
    "arith_exact_match": (-100.0, 100.0),
    "math_number_token_acc": (-100.0, 100.0),
}
"""The values each difference can take: intervals are clipped to them."""


def _config(preset: dict[str, Any]) -> dict[str, Any]:
    """The preset's base run config with its ``overrides`` (dotted keys) applied."""
    with open(os.path.join(ROOT, preset["base_config"])) as f:
        config = yaml.safe_load(f)
    for item in preset.get("overrides", []):
        key, _, value = item.partition("=")
        node = config
        *path, last = key.split(".")
        for part in path:
            node = node.setdefault(part, {})
        node[last] = yaml.safe_load(value)
    return config


def tokens(preset: dict[str, Any]) -> int:
    """Training tokens of one run of the preset: steps x micro-batch x sequence length x gradient
    accumulation (one data-parallel process, as every CPU preset)."""
    train = _config(preset)["train"]
    accumulation = int(train.get("gradient_accumulation_steps") or 1)
    return int(train["steps"]) * int(train["micro_batch_size"]) * int(train["seq_length"]) * accumulation


def parameters(preset: dict[str, Any]) -> int:
    """Parameters of the preset's model without its embedding table (counted on the meta device)."""
    import torch
    import transformers

    with open(os.path.join(ROOT, preset["base_config"])) as f:
        arch = dict(yaml.safe_load(f)["model"]["architecture"])
    for item in preset.get("overrides", []):
        key, _, value = item.partition("=")
        if key.startswith("model.architecture."):
            arch[key.removeprefix("model.architecture.")] = yaml.safe_load(value)
    config = transformers.AutoConfig.for_model(**{**arch, "vocab_size": 128})
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    embedding = model.get_input_embeddings().weight
    return sum(p.numel() for p in model.parameters() if p is not embedding)


def difference(
    results: dict[str, Any], arm: str, baseline: str, key: str, seed_ids: list[Any] | None = None
) -> dict[str, Any] | None:
    """The arm's per-seed difference to the baseline on metric ``key``, its mean, 95 % t-interval and t-test;
    ``seed_ids``: each seed's name (default its position), kept for the tests across cells (``"seed_ids"``)."""
    split, metric, relative, _ = _spec(key)
    try:
        a = results[arm][split][metric]["seeds"]
        b = results[baseline][split][metric]["seeds"]
    except KeyError:
        return None
    ids = list(range(len(a))) if seed_ids is None else list(seed_ids)
    kept = [(i, x, y) for i, x, y in zip(ids, a, b) if x is not None and y is not None and math.isfinite(x + y)]
    pairs = [(x, y) for _, x, y in kept]
    if not pairs:
        return None
    scale = 100.0 / statistics.fmean(y for _, y in pairs) if relative else 100.0
    seeds = [(x - y) * scale for x, y in pairs]
    mean, low, high = seed_stats.t_interval(seeds, bounds=RANGES[key])
    # the test is seed_stats' (differences equal but for rounding get none; a t-test is scale-free)
    test = seed_stats.seed_test([x for x, _ in pairs], [y for _, y in pairs], metric)
    if len(seeds) < 2 or test["no_spread"]:  # one seed, or no spread: no interval (not a zero-width one)
        low = high = math.nan
    return {"seeds": seeds, "mean": mean, "low": low, "high": high, "p_seed_t": test["p_seed_t"],
            "p_sign_flip": seed_stats.sign_flip_p(seeds), "n": len(pairs), "no_spread": test["no_spread"],
            "seed_ids": [i for i, _, _ in kept]}  # fmt: skip


def _seeded(points: list[tuple[Any, ...]]) -> list[tuple[float, float, Any]]:
    """Points as ``(x, y, seed)``; an ``(x, y)`` point is the seed of its rank among the points at its x (the
    k-th point at each x is seed k, as a cell lists its seeds)."""
    out, rank = [], collections.Counter()
    for point in points:
        if len(point) == 3:
            out.append((point[0], point[1], point[2]))
        else:
            out.append((point[0], point[1], rank[point[0]]))
            rank[point[0]] += 1
    return out


def _seed_slope(points: list[tuple[float, float, Any]], log: Any) -> dict[str, Any]:
    """Per seed the least-squares line of its differences on ``log(x)``; the mean slope tested across the
    seeds (:func:`seed_stats.across_seeds`): slope, 95 % interval (seeds - 1 degrees of freedom), p, sign-flip p."""
    lines = seed_stats.seed_slopes([(log(x), y, seed) for x, y, seed in points])
    test = seed_stats.across_seeds([slope for slope, _ in lines.values()])
    intercept = statistics.fmean(b for _, b in lines.values()) if lines else math.nan
    return {"slope": test["mean"], "low": test["low"], "high": test["high"], "intercept": intercept, "p": test["p"],
            "p_sign_flip": test["p_sign_flip"], "n": len(points), "n_seeds": test["n"], "df": test["df"],
            "per_seed": {str(seed): slope for seed, (slope, _) in lines.items()}, "no_spread": test["no_spread"],
            "method": "per-seed least-squares slopes, one-sample t over the seeds"}  # fmt: skip


def trend(points: list[tuple[Any, ...]]) -> dict[str, Any] | None:
    """Per seed, the least-squares line of its differences on log10(parameters); the mean per-seed slope per
    10x with its 95 % t-interval over the seeds (points: ``(parameters, difference[, seed])``).

    No verdict while a size has fewer than 2 seeds: a single seed at the end of the range has the
    leverage to decide it alone (the slope and its interval are still given)."""
    from scipy import stats

    points = _seeded(points)
    if len({x for x, _, _ in points}) < 2 or len(points) < 3:
        return None
    if seed_stats.no_spread([y for _, y, _ in points]):  # the same difference at every seed and size: nothing to fit
        verdict = f"not given: no spread over {len(points)} seeds (every difference {points[0][1]:+.3g})"
        return {"slope": 0.0, "low": math.nan, "high": math.nan, "intercept": points[0][1], "p": math.nan,
                "n": len(points), "no_spread": True, "verdict": verdict}  # fmt: skip
    fit = _seed_slope(points, math.log10)
    slope, half_open = fit["slope"], not (math.isfinite(fit["low"]) and math.isfinite(fit["high"]))
    # the effect's sign is the fitted line's at the smallest size: a pooled mean would flip with how far
    # an effect that changes sign overshoots, and relabel one and the same slope
    start = fit["intercept"] + slope * math.log10(min(x for x, _, _ in points))
    if min(collections.Counter(x for x, _, _ in points).values()) < 2:  # seeds per size
        verdict = "not given: a size has one seed"
    elif fit["no_spread"]:
        verdict = f"not given: {seed_stats.spread_note(fit['n_seeds'])} (every per-seed slope {slope:+.3g})"
    elif half_open:
        verdict = "not given: fewer than 2 seeds span two sizes"
    elif fit["low"] <= 0 <= fit["high"]:
        verdict = "cannot be told at this scale"
    else:
        verdict = "shrinks" if (slope < 0) == (start > 0) else "grows"
    means = None  # the same line through the sizes' means: the sizes, not the seeds, as the replicates
    by_size = collections.defaultdict(list)
    for x, y, _ in points:
        by_size[x].append(y)
    if len(by_size) >= 3:
        xs = sorted(by_size)
        on_means = stats.linregress([math.log10(x) for x in xs], [statistics.fmean(by_size[x]) for x in xs])
        half_means = float(stats.t.ppf(0.975, len(xs) - 2)) * float(on_means.stderr)
        means = {"slope": float(on_means.slope), "low": float(on_means.slope) - half_means,
                 "high": float(on_means.slope) + half_means, "p": float(on_means.pvalue), "n": len(xs)}  # fmt: skip
    return {**fit, "verdict": verdict, "on_size_means": means}


def slope_per_doubling(points: list[tuple[Any, ...]]) -> dict[str, Any] | None:
    """Per seed, the least-squares line of its differences on log2(x) (x: tokens per parameter); the mean
    per-seed slope per doubling of x with its 95 % t-interval over the seeds (seeds - 1 degrees of freedom),
    the one-sample t p and the exact sign-flip p (points: ``(x, difference[, seed])``); None with fewer
    than 2 distinct x or 3 points."""
    points = _seeded(points)
    if len({x for x, _, _ in points}) < 2 or len(points) < 3:
        return None
    if seed_stats.no_spread([y for _, y, _ in points]):  # every difference the same: no interval, no test
        return {"slope": 0.0, "low": math.nan, "high": math.nan, "intercept": points[0][1], "p": math.nan,
                "n": len(points), "no_spread": True}  # fmt: skip
    return _seed_slope(points, math.log2)


def contrast(
    a: list[float], b: list[float], seeds_a: list[Any] | None = None, seeds_b: list[Any] | None = None
) -> dict[str, Any] | None:
    """Cell a's per-seed difference minus cell b's, seed by seed (seed S of both cells: the same corpus,
    held-out sets and data order, and within a size the same initialisation, so the cells are paired, not
    independent samples), tested across the seeds: mean, 95 % t-interval (seeds - 1 degrees of freedom),
    one-sample t p and exact sign-flip p (:func:`seed_stats.across_seeds`). ``seeds_a``/``seeds_b``: the
    seeds' names (default their positions); seeds in one cell only are left out. None with fewer than 2
    seeds in both cells."""
    ids_a = list(range(len(a))) if seeds_a is None else list(seeds_a)
    ids_b = dict(zip(list(range(len(b))) if seeds_b is None else list(seeds_b), b))
    common = [(seed, x - ids_b[seed]) for seed, x in zip(ids_a, a) if seed in ids_b]
    if len(common) < 2:
        return None
    test = seed_stats.across_seeds([d for _, d in common])
    out = {"diff": test["mean"], "low": test["low"], "high": test["high"], "p": test["p"],
           "p_sign_flip": test["p_sign_flip"], "df": test["df"], "n": len(common), "seed_ids": [s for s, _ in common],
           "per_seed": [d for _, d in common], "method": "per-seed contrasts, one-sample t over the seeds"}  # fmt: skip
    if test["no_spread"]:  # every seed's contrast the same: no interval (not a zero-width one), no test, no reading
        out["no_spread"] = True
    return out


def pooled(rows: list[dict[str, Any]], arm: str, key: str) -> dict[str, Any] | None:
    """The effect pooled over cells with the seed as the unit: per seed the mean of its differences over
    every cell (seeds found in every cell), tested across the seeds (:func:`seed_stats.across_seeds`), and
    the direction count over every seed pair of every cell (descriptive: pairs of one seed share its corpus)."""
    cells = [row["differences"][arm].get(key) for row in rows]
    cells = [cell for cell in cells if cell]
    if not cells:
        return None
    per_seed: dict[Any, list[float]] = collections.defaultdict(list)
    for cell in cells:
        for seed, d in zip(cell.get("seed_ids") or range(len(cell["seeds"])), cell["seeds"]):
            per_seed[seed].append(d)
    complete = [seed for seed, values in per_seed.items() if len(values) == len(cells)]
    bounds = RANGES.get(key, (-math.inf, math.inf))
    test = seed_stats.across_seeds([statistics.fmean(per_seed[s]) for s in complete], bounds)
    every = [d for cell in cells for d in cell["seeds"]]
    return {"cells": len(cells), "pairs": len(every), "below_zero": sum(1 for d in every if d < 0),
            "above_zero": sum(1 for d in every if d > 0), "seeds": complete, **test}  # fmt: skip


MODELS: dict[str, tuple[str, tuple[float, float]]] = {
    "training tokens only": ("the size coefficient is 0", (1.0, 0.0)),
    "tokens per parameter only": ("the size and tokens coefficients sum to 0", (1.0, 1.0)),
    "size only": ("the tokens coefficient is 0", (0.0, 1.0)),
}
"""Models of a cell's effect, each a restriction of "size plus tokens" (effect = a + b_size log2(parameters) +
b_tokens log2(tokens)): the combination (weights on b_size, b_tokens) the restriction sets to 0 (tokens per
parameter only: b_size = -b_tokens)."""


def models(rows: list[dict[str, Any]], arm: str, key: str) -> dict[str, Any] | None:
    """Which variable the cells' effects follow, with the seed as the unit: per seed, the least-squares fit of
    its differences over the cells on log2(parameters) and log2(training tokens) ("size plus tokens"); each
    single-variable model (:data:`MODELS`) is that fit with one combination of the coefficients at 0, tested
    across the seeds (one-sample t of the per-seed combination; a small p rejects the model). None without
    the cells' tokens and parameters or with fewer than 4 distinct cells."""
    import numpy as np

    cells = [(row, row["differences"][arm].get(key)) for row in rows]
    cells = [(row, cell) for row, cell in cells if cell and row.get("tokens") and row.get("parameters")]
    if len({(row["parameters"], row["tokens"]) for row, _ in cells}) < 4:
        return None
    per_seed: dict[Any, list[tuple[float, float, float]]] = collections.defaultdict(list)
    for row, cell in cells:
        for seed, d in zip(cell.get("seed_ids") or range(len(cell["seeds"])), cell["seeds"]):
            per_seed[seed].append((math.log2(row["parameters"]), math.log2(row["tokens"]), d))
    coefficients = {}
    for seed, points in per_seed.items():
        if len(points) == len(cells):
            design = np.array([[1.0, p, t] for p, t, _ in points])
            coefficients[seed] = np.linalg.lstsq(design, np.array([d for _, _, d in points]), rcond=None)[0]
    out: dict[str, Any] = {"cells": len(cells), "seeds": list(coefficients),
                           "b_size": seed_stats.across_seeds([float(c[1]) for c in coefficients.values()]),
                           "b_tokens": seed_stats.across_seeds([float(c[2]) for c in coefficients.values()]),
                           "restrictions": {}}  # fmt: skip
    for name, (restriction, (w_size, w_tokens)) in MODELS.items():
        values = [float(w_size * c[1] + w_tokens * c[2]) for c in coefficients.values()]
        out["restrictions"][name] = {"restriction": restriction, **seed_stats.across_seeds(values)}
    return out


def _seed_pairs(cell: dict[str, Any] | None) -> list[tuple[Any, float]]:
    """A cell's ``(seed, difference)`` pairs (a seed's name: its ``seed_ids`` entry, else its position)."""
    if not cell:
        return []
    return list(zip(cell.get("seed_ids") or range(len(cell["seeds"])), cell["seeds"]))


def _reading(low: float, high: float, better: int, p_holm: float, smaller: str, larger: str) -> str:
    """The pre-registered reading of an interval on a gain's change: ``smaller`` where the interval
    lies wholly on the side of a smaller gain and Holm's p < 0.05, ``larger`` on the other side, else
    not resolved (also with no interval: one seed, or no spread)."""
    if not (math.isfinite(low) and math.isfinite(high)) or not math.isfinite(p_holm) or p_holm >= 0.05:
        return "not resolved"
    lo, hi = sorted((low * better, high * better))
    return smaller if hi < 0 else (larger if lo > 0 else "not resolved")


def factorial(sweep: dict[str, Any], rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The size x tokens-per-parameter factorial (the sweep file's ``factorial``; docs/results.md's
    question and reading rule): per size with 3 or more tokens-per-parameter levels... or 2, the slope of
    the per-seed differences on log2(tokens per parameter) (Q1); the contrasts it names, each a Welch
    interval of one cell's mean difference minus another's (Q2); Holm over the primary metrics' tests."""
    spec = sweep["factorial"]
    keys = metric_keys(sweep)
    primary = spec.get("primary", keys)
    out: dict[str, Any] = {"primary": primary, "slopes": {}, "contrasts": {}}
    by_label = {row["label"]: row for row in rows}
    family: dict[tuple[str, ...], float] = {}
    for arm in sweep["arms"]:
        slopes: dict[str, Any] = {}
        for size in sorted({row["size"] for row in rows}):
            cells = [row for row in rows if row["size"] == size]
            for key in keys:
                points = [(row["tokens_per_parameter"], d, seed) for row in cells
                          for seed, d in _seed_pairs(row["differences"][arm][key])]  # fmt: skip
                fit = slope_per_doubling(points)
                if fit:
                    fit["levels"] = sorted({row["tokens_per_parameter"] for row in cells})
                    per_level = [sum(1 for t, _, _ in points if t == level) for level in fit["levels"]]
                    # a level with one seed has the leverage to decide the slope alone: the slope is
                    # given, but it is no test of the family and gets no reading (as the size trend)
                    fit["one_seed_level"] = min(per_level) < 2
                    slopes.setdefault(size, {})[key] = fit
                    if key in primary and not fit["one_seed_level"]:
                        family[(arm, "slope", size, key)] = fit["p"]
        contrasts: dict[str, Any] = {}
        further: dict[str, Any] = {}
        for items, into, in_family in ((spec.get("contrasts", []), contrasts, True),
                                       (spec.get("further_contrasts", []), further, False)):  # fmt: skip
            for item in items:
                a, b = by_label.get(item["a"]), by_label.get(item["b"])
                if not a or not b:
                    continue
                for key in keys:
                    cell_a, cell_b = a["differences"][arm][key], b["differences"][arm][key]
                    got = None
                    if cell_a and cell_b:
                        got = contrast(cell_a["seeds"], cell_b["seeds"], cell_a.get("seed_ids"), cell_b.get("seed_ids"))
                    if got:
                        got.update(a=item["a"], b=item["b"])
                        into.setdefault(item["name"], {})[key] = got
                        if key in primary and in_family:
                            family[(arm, "contrast", item["name"], key)] = got["p"]
        out["slopes"][arm], out["contrasts"][arm] = slopes, contrasts
        out.setdefault("further_contrasts", {})[arm] = further
        out.setdefault("pooled", {})[arm] = {key: pooled(rows, arm, key) for key in keys}
        out.setdefault("models", {})[arm] = {key: models(rows, arm, key) for key in keys}
    declared = spec.get("family")  # the family written before the runs; tests not yet possible count in it
    adjusted = seed_stats.holm(family, declared)
    out["family_size"] = max(sum(1 for p in family.values() if math.isfinite(p)), declared or 0)
    out["tests_run"] = sum(1 for p in family.values() if math.isfinite(p))
    for arm in sweep["arms"]:
        for size, by_key in out["slopes"][arm].items():
            for key, fit in by_key.items():
                fit["p_holm"] = adjusted.get((arm, "slope", size, key), math.nan)
                if fit["one_seed_level"]:
                    fit["reading"] = "no reading yet: a level has one seed"
                    continue
                # a gain that falls as tokens per parameter fall: it grows with them, slope x BETTER > 0
                fit["reading"] = _reading(-fit["low"], -fit["high"], BETTER[key], fit["p_holm"],
                                          "the gain falls as tokens per parameter fall",
                                          "the gain rises as tokens per parameter fall")  # fmt: skip
        for name, by_key in out["contrasts"][arm].items():
            for key, got in by_key.items():
                got["p_holm"] = adjusted.get((arm, "contrast", name, key), math.nan)
                got["reading"] = _reading(got["low"], got["high"], BETTER[key], got["p_holm"],
                                          f"smaller gain at {got['a']}", f"larger gain at {got['a']}")  # fmt: skip
    return out


def tabulate(sweep: dict[str, Any], sizes: list[dict[str, Any]]) -> dict[str, Any]:
    """The sweep's differences per size and their trends (see the module docstring)."""
    arms, baseline = sweep["arms"], sweep.get("baseline", "CE")
    keys = metric_keys(sweep)
    rows = []
    for size in sizes:
        rows.append({
            "label": size["label"], "parameters": size["parameters"], "results": size["results_path"],
            "size": size.get("size", size["label"]), "tokens": size.get("tokens"),
            "data_varied": size.get("data_varied"),
            "tokens_per_parameter": size.get("tokens_per_parameter"),
            "differences": {arm: {key: difference(size["results"], arm, baseline, key, size.get("seeds"))
                                  for key in keys} for arm in arms},
        })  # fmt: skip
    trends: dict[str, Any] = {}
    for arm in arms if not sweep.get("factorial") else []:  # a factorial's cells differ in tokens too
        trends[arm] = {}
        for key in keys:
            points = [(row["parameters"], d, seed) for row in rows
                      for seed, d in _seed_pairs(row["differences"][arm][key])]  # fmt: skip
            trends[arm][key] = trend(points)
    labels = {key: {"label": _spec(key)[3]} for key in keys}
    table = {"baseline": baseline, "arms": arms, "metrics": labels, "sizes": rows, "trend": trends}
    if sweep.get("factorial"):
        table["factorial"] = factorial(sweep, rows)
    return table


def _cell(cell: dict[str, Any] | None) -> str:
    if not cell:
        return "-"
    if cell["n"] < 2:  # a size with one seed so far: a difference, no interval and no test
        return f"{cell['mean']:+.2f} (one seed: no interval, no test)"
    if cell.get("no_spread"):  # every seed's difference the same: no interval, no t-test, no verdict
        return f"{cell['mean']:+.2f} ({seed_stats.spread_note(cell['n'])}: no interval, no t-test)"
    flip = cell.get("p_sign_flip")
    extra = f"; sign-flip {figures.p_label(flip)}" if flip is not None and math.isfinite(flip) else ""
    return (
        f"{cell['mean']:+.2f} [{cell['low']:+.2f}, {cell['high']:+.2f}], "
        f"{figures.p_label(cell['p_seed_t']) or 'p n/a'}{extra}"
    )


def _bounds(fit: dict[str, Any]) -> str:
    """``[low, high]`` of an interval, or why there is none (no spread: every difference the same)."""
    if fit.get("no_spread"):
        return "(no spread: no interval)"
    return f"[{fit['low']:+.2f}, {fit['high']:+.2f}]"


def _tpp(row: dict[str, Any]) -> str:
    tpp = row.get("tokens_per_parameter")
    return f"{tpp:.1f}" if tpp else "-"


def markdown(table: dict[str, Any]) -> str:
    lines = []
    for arm in table["arms"]:
        lines += [
            f"**{arm} minus {table['baseline']}** (mean [95 % t-interval, clipped to the difference's range] "
            "over seeds, seed-level paired t-test p; exact sign-flip p over the seeds; n = seeds)",
            "",
        ]
        lines.append("| cell | parameters | tokens per parameter | data | seeds | "
                     + " | ".join(spec["label"] for spec in table["metrics"].values()) + " |")  # fmt: skip
        lines.append("|---|---:|---:|---|---:|" + "---|" * len(table["metrics"]))
        for row in table["sizes"]:
            cells = [_cell(row["differences"][arm][key]) for key in table["metrics"]]
            seeds = max(((row["differences"][arm][key] or {}).get("n", 0) for key in table["metrics"]), default=0)
            data = {True: "varied with the seed", False: "one draw"}.get(row.get("data_varied"), "-")
            head = f"| {row['label']} | {row['parameters']:,} | {_tpp(row)} | {data} | {seeds} | "
            lines.append(head + " | ".join(cells) + " |")
        if table["trend"].get(arm):
            lines += ["", "Trend over log10(parameters), the seed as the unit: per seed the least-squares slope of its "
                      "differences, then the mean slope per 10x parameters [95 % t-interval over the seeds], the "
                      "one-sample t p and the exact sign-flip p over the seeds; verdict:", ""]  # fmt: skip
        for key, spec in table["metrics"].items():
            t = table["trend"].get(arm, {}).get(key)
            if t:
                counts = ", ".join(str((row["differences"][arm][key] or {}).get("n", 0)) for row in table["sizes"])
                fit = f"{t['slope']:+.2f} " + _bounds(t)
                p = figures.p_label(t["p"]) or "p n/a"
                if t.get("p_sign_flip") is not None and math.isfinite(t["p_sign_flip"]):
                    p += f"; sign-flip {figures.p_label(t['p_sign_flip'])}"
                on_means = t.get("on_size_means")
                means = ""
                if on_means:
                    means = (f"; through the {on_means['n']} size means ({on_means['n'] - 2} degree(s) of freedom): "
                             f"{on_means['slope']:+.2f} [{on_means['low']:+.2f}, {on_means['high']:+.2f}], "
                             f"{figures.p_label(on_means['p']) or 'p n/a'}")  # fmt: skip
                lines.append(f"- {spec['label']}: {fit} ({t.get('n_seeds', '?')} seeds; {counts} seeds by size, {p}): "
                             f"**{t['verdict']}**{means}")  # fmt: skip
        if table.get("factorial"):
            lines += _factorial_markdown(table, arm)
        lines.append("")
    return "\n".join(lines)


def _test_cell(got: dict[str, Any], value: str = "slope") -> str:
    """``mean [low, high]`` of a test across seeds, or why there is no interval."""
    return f"{got[value]:+.2f} {_bounds(got)}"


def _flip(got: dict[str, Any]) -> str:
    p = got.get("p_sign_flip")
    return figures.p_label(p) if p is not None and math.isfinite(p) else "n/a"


def _factorial_markdown(table: dict[str, Any], arm: str) -> list[str]:
    fac, labels = table["factorial"], table["metrics"]
    lines = ["", f"Q1, per size: per seed the least-squares slope of its differences on log2(tokens per parameter), "
             f"then the mean slope per doubling [95 % t-interval over the seeds], the one-sample t p, Holm's p over "
             f"the primary family ({fac['family_size']} tests declared, {fac.get('tests_run', fac['family_size'])} "
             f"possible so far; {', '.join(fac['primary'])}) and the exact sign-flip p over the seeds (its floor at 4 "
             "seeds: 0.125); reading by the rule written before the runs.", "",
             "| size | difference | levels | points (seeds) | slope per doubling | t p | Holm p | sign-flip p "
             "| reading |",
             "|---|---|---|---:|---|---:|---:|---:|---|"]  # fmt: skip
    for size, by_key in fac["slopes"].get(arm, {}).items():
        for key, fit in by_key.items():
            holm = figures.p_label(fit["p_holm"]) or ("(secondary)" if key not in fac["primary"] else "n/a")
            levels = ", ".join(f"{x:.1f}" for x in fit["levels"])
            lines.append(f"| {size} | {labels[key]['label']} | {levels} | {fit['n']} ({fit.get('n_seeds', '-')}) | "
                         f"{_test_cell(fit)} | {figures.p_label(fit['p']) or 'n/a'} | {holm} | {_flip(fit)} | "
                         f"{fit['reading'] if key in fac['primary'] else '(secondary)'} |")  # fmt: skip
    lines += ["", "Q2, contrasts: per seed, its difference in cell a minus its difference in cell b (the same seed: "
              "corpus, held-out sets, data order and, within a size, initialisation), then the mean [95 % t-interval "
              "over the seeds], the one-sample t p, Holm's p and the exact sign-flip p; reading.", "",
              "| contrast | a - b | difference | seeds | a - b [95 % interval] | t p | Holm p | sign-flip p "
              "| reading |",
              "|---|---|---|---:|---|---:|---:|---:|---|"]  # fmt: skip
    for name, by_key in fac["contrasts"].get(arm, {}).items():
        for key, got in by_key.items():
            primary = key in fac["primary"]
            lines.append(f"| {name} | {got['a']} - {got['b']} | {labels[key]['label']} | {got['n']} | "
                         f"{_test_cell(got, 'diff')} | {figures.p_label(got['p']) or 'n/a'} | "
                         f"{(figures.p_label(got['p_holm']) or 'n/a') if primary else '(secondary)'} | {_flip(got)} | "
                         f"{got['reading'] if primary else '(secondary)'} |")  # fmt: skip
    further = fac.get("further_contrasts", {}).get(arm, {})
    if further:
        lines += ["", "Contrasts outside the declared family (named after the runs, issue 56; unadjusted, no reading): "
                  "the same per-seed computation.", "",
                  "| contrast | a - b | difference | seeds | a - b [95 % interval] | t p | sign-flip p |",
                  "|---|---|---|---:|---|---:|---:|"]  # fmt: skip
        for name, by_key in further.items():
            for key, got in by_key.items():
                lines.append(
                    f"| {name} | {got['a']} - {got['b']} | {labels[key]['label']} | {got['n']} | "
                    f"{_test_cell(got, 'diff')} | {figures.p_label(got['p']) or 'n/a'} | {_flip(got)} |"
                )
    pooled_by_key = {k: v for k, v in fac.get("pooled", {}).get(arm, {}).items() if v}
    if pooled_by_key:
        lines += ["", "Pooled over every cell, the seed as the unit (outside the declared family; issue 56): per "
                  "seed the mean of its differences over the cells, then the mean [95 % t-interval over the seeds], "
                  "the one-sample t p and the exact sign-flip p; and the direction of every seed pair of every cell "
                  "(descriptive: one seed's pairs share its corpus).", "",
                  "| difference | cells | seeds | pooled [95 % interval] | t p | sign-flip p | pairs below 0 "
                  "| pairs above 0 |",
                  "|---|---:|---:|---|---:|---:|---:|---:|"]  # fmt: skip
        for key, got in pooled_by_key.items():
            lines.append(f"| {labels[key]['label']} | {got['cells']} | {got['n']} | {_test_cell(got, 'mean')} | "
                         f"{figures.p_label(got['p']) or 'n/a'} | {_flip(got)} | "
                         f"{got['below_zero']} of {got['pairs']} | "
                         f"{got['above_zero']} of {got['pairs']} |")  # fmt: skip
    fits = {k: v for k, v in fac.get("models", {}).get(arm, {}).items() if v}
    if fits:
        lines += ["", "Which variable the effects follow (outside the declared family, after the runs; issue 56): per "
                  "seed the least-squares fit of its differences over the cells on log2(parameters) and log2(training "
                  "tokens), \"size plus tokens\"; each single-variable model is that fit with one combination of the "
                  "coefficients at 0, tested across the seeds (mean of the per-seed combination [95 % interval], "
                  "one-sample t p: a small p rejects the model; unadjusted).", "",
                  "| difference | cells | seeds | size coefficient, per doubling of parameters "
                  "| tokens coefficient, per doubling of tokens | "
                  + " | ".join(f"{name}: p" for name in MODELS) + " |",
                  "|---|---:|---:|---|---|" + "---:|" * len(MODELS)]  # fmt: skip
        for key, got in fits.items():
            ps = " | ".join(figures.p_label(got["restrictions"][name]["p"]) or "n/a" for name in MODELS)
            lines.append(
                f"| {labels[key]['label']} | {got['cells']} | {len(got['seeds'])} | "
                f"{_test_cell(got['b_size'], 'mean')} | {_test_cell(got['b_tokens'], 'mean')} | {ps} |"
            )
    return lines


def publish(out: str, png: str, text: str, stem: str, doc: str | None, left_out: list[str] | None = None) -> None:
    """Copies the sweep's ``sweep.json`` and figure to ``stem``.json / .png and, with ``doc``, puts the
    tables into that page's generated block named after the stem (:func:`doc_blocks.replace_block`),
    headed by the time it was generated and the sweep's cells ``left_out`` (no finished seed pair)."""
    import shutil

    from doc_blocks import replace_block

    os.makedirs(os.path.dirname(stem) or ".", exist_ok=True)
    shutil.copyfile(os.path.join(out, "sweep.json"), stem + ".json")
    shutil.copyfile(os.path.join(out, png), stem + ".png")
    if doc:
        name = os.path.basename(stem)
        stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        missing = ", ".join(left_out) if left_out else "none"
        head = f"Generated {stamp} (`{name}.json`, `{name}.png`); cells without a finished seed pair: {missing}."
        replace_block(doc, name, f"{head}\n\n{text}")
    print(f"[sweep] published {stem}.json, {stem}.png" + (f"; block {os.path.basename(stem)} of {doc}" if doc else ""))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sweep", default="configs/sweep/size_sweep.yaml", help="sweep file")
    parser.add_argument("--out", default=None, help="output folder (default: runs/<sweep name>)")
    parser.add_argument("--no-run", action="store_true", help="tabulate the sizes whose results exist; run nothing")
    parser.add_argument("--start-until", default=None, metavar="HH:MM",
                        help="start no run after this time (UTC: HH:MM, its next occurrence, or "
                             "YYYY-MM-DDTHH:MM, as study.py): the sweep stops")  # fmt: skip
    parser.add_argument("--publish", default=None, metavar="STEM",
                        help="also write sweep.json and the figure to STEM.json, STEM.png")  # fmt: skip
    parser.add_argument("--doc", default=None, metavar="PAGE",
                        help="with --publish: the tables into PAGE's block named after STEM")  # fmt: skip
    args = parser.parse_args(argv)
    if args.doc and not args.publish:
        raise SystemExit(f"--doc {args.doc}: needs --publish STEM (the block's name and the published files)")
    if not os.path.isfile(args.sweep):
        raise SystemExit(f"--sweep {args.sweep}: no such file (sweeps: configs/sweep/*.yaml)")
    with open(args.sweep) as f:
        sweep = yaml.safe_load(f)
    for key in ("sizes", "arms"):
        if not sweep.get(key):
            raise SystemExit(f"{args.sweep}: expected a non-empty {key!r} list")
    out = args.out or os.path.join("runs", os.path.splitext(os.path.basename(args.sweep))[0])
    os.makedirs(out, exist_ok=True)
    # one deadline for every size: resolved once here, passed as a moment (a study resolving HH:MM itself after
    # the deadline would take tomorrow's)
    deadline = None
    if args.start_until:
        at = study._utc_next(args.start_until)
        deadline = time.strftime("%Y-%m-%dT%H:%M", time.gmtime(at))
        print(f"[sweep] {study._deadline_line(args.start_until, at, time.time())}; every size", flush=True)
    start = time.time()
    sizes, left_out = [], []
    for entry in sweep["sizes"]:
        preset_path = entry["preset"]
        preset = study.load_preset(preset_path)
        if entry.get("overrides"):  # a size as overrides on a shared preset: the merged preset is written out
            preset["overrides"] = [*preset.get("overrides", []), *entry["overrides"]]
            os.makedirs(entry["out"], exist_ok=True)
            preset_path = os.path.join(entry["out"], "preset.yaml")
            with open(preset_path, "w") as f:
                yaml.safe_dump(preset, f, sort_keys=False)
        path = entry.get("results") or os.path.join(entry["out"], "results.json")
        keep = ["--keep", entry["keep"]] if entry.get("keep") else []  # finished runs kept in the repository
        if args.no_run and not entry.get("results") and keep:  # the seeds finished so far (a study under way)
            try:
                study.main(["--preset", preset_path, "--out", entry["out"], *keep, "--no-run"])
            except SystemExit as error:
                print(f"[sweep] {entry['label']}: {error}; left out (--no-run)", flush=True)
                left_out.append(entry["label"])
                continue
        if not os.path.isfile(path) and not entry.get("results"):
            if args.no_run:
                print(f"[sweep] {entry['label']}: no {path}; left out (--no-run)", flush=True)
                left_out.append(entry["label"])
                continue
            until = ["--start-until", deadline] if deadline else []
            study.main(["--preset", preset_path, "--out", entry["out"], *keep, *until])
        if not os.path.isfile(path):
            raise SystemExit(f"[sweep] {entry['label']}: {path} missing; run its preset {entry['preset']}")
        with open(path) as f:
            results = json.load(f)["results"]
        missing = [arm for arm in [sweep.get("baseline", "CE"), *sweep["arms"]] if arm not in results]
        if missing:
            raise SystemExit(f"[sweep] {path} has no arm {missing}; its arms: {list(results)}")
        count = parameters(preset)
        sizes.append({"label": entry["label"], "parameters": count, "results": results, "results_path": path,
                      "size": entry.get("size", entry["label"]), "tokens": tokens(preset),
                      "data_varied": study.data_seeded(preset), "seeds": preset.get("seeds"),
                      "tokens_per_parameter": tokens(preset) / count})  # fmt: skip
    table = tabulate(sweep, sizes)
    table["seconds"] = time.time() - start
    with open(os.path.join(out, "sweep.json"), "w") as f:
        json.dump({"sweep": sweep, **table}, f, indent=2)
    text = markdown(table)
    with open(os.path.join(out, "sweep.md"), "w") as f:
        f.write(text + "\n")
    if table.get("factorial"):
        figures.factorial_figure(table, os.path.join(out, "size_tpp_factorial.png"))
    else:
        figures.sweep_figure(table, os.path.join(out, "size_sweep.png"))
    print(text)
    png = "size_tpp_factorial.png" if table.get("factorial") else "size_sweep.png"
    if args.publish:
        publish(out, png, text, args.publish, args.doc, left_out)
    print(f"[sweep] {time.time() - start:.0f} s; sweep.json, sweep.md, {png} in {out}")
    return table


if __name__ == "__main__":
    main()
