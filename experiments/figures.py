"""Figures of the study verdicts, made from a study's ``results.json`` (never from the tables).

    python experiments/figures.py docs/img/study_pretrain_cpu_results.json   # -> ..._verdict.png beside it
    python experiments/figures.py docs/img/study_*_results.json              # every study of docs/results.md

One figure per study: a panel per headline metric, each arm a column, every seed a point, the arm's
mean with its 95 % t-interval over the seeds (``mean +- t(0.975, n - 1) * sd / sqrt(n)``), the
baseline's mean as a dashed line, and the seed-level paired t-test against the baseline (from the
results' ``paired_tests``) under each arm. A panel in which every value is zero (the extrapolation
accuracy of a model that never extrapolates) carries no information and is left out.
``experiments/study.py`` calls :func:`verdict_figure` after each study; ``experiments/size_sweep.py``
draws the size sweep with :func:`sweep_figure`.
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
from seed_stats import RANGES, t_interval

# (split, metric, label): the headline metrics, in the order the verdicts of docs/results.md use them.
PANELS: tuple[tuple[str, str, str], ...] = (
    ("interpolate", "accuracy", "held-out questions: accuracy"),
    ("interpolate", "mae", "held-out questions: MAE"),
    ("extrapolate", "accuracy", "longer numbers: accuracy"),
    ("extrapolate", "mae", "longer numbers: MAE"),
    ("heldout:prose", "text_ppl", "prose: text perplexity"),
    ("heldout", "number_token_mae", "number tokens: MAE of the expected digit"),
    ("heldout", "number_token_acc", "number tokens: accuracy"),
    ("questions", "accuracy", "held-out questions: accuracy"),
)


def _seeds(results: dict[str, Any], arm: str, split: str, metric: str) -> list[float]:
    values = results.get(arm, {}).get(split, {}).get(metric, {}).get("seeds", [])
    return [float(v) for v in values if v is not None and math.isfinite(v)]


def panels_of(summary: dict[str, Any]) -> list[tuple[str, str, str]]:
    """The headline panels present in ``summary`` that carry information (some value is non-zero)."""
    results = summary["results"]
    out = []
    for split, metric, label in PANELS:
        values = [v for arm in results for v in _seeds(results, arm, split, metric)]
        if values and any(v != 0 for v in values):
            out.append((split, metric, label))
    return out


def p_label(p: float | None) -> str:
    """``p = 0.026`` or ``p < 0.001``; empty where there is no p (one seed, no spread)."""
    if p is None or not math.isfinite(p):
        return ""
    return "p < 0.001" if p < 0.001 else f"p = {p:.3f}"


def _holm_label(p: float | None) -> str:
    return f"\n(Holm {p:.3f})" if p is not None and math.isfinite(p) else ""


def verdict_figure(summary: dict[str, Any], path: str, title: str | None = None) -> str | None:
    """Draws the study's verdict figure to ``path`` (PNG); returns the path, or None with no panel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = panels_of(summary)
    if not panels:
        return None
    results, tests = summary["results"], summary.get("paired_tests", {})
    baseline = summary.get("preset", {}).get("baseline") or next(iter(results))
    arms = list(results)
    columns = min(len(panels), 2)
    rows = math.ceil(len(panels) / columns)
    fig, axes = plt.subplots(rows, columns, figsize=(5.6 * columns, 3.6 * rows), squeeze=False)
    for ax, (split, metric, label) in zip(axes.flat, panels):
        raw = {arm: results.get(arm, {}).get(split, {}).get(metric, {}).get("seeds", []) for arm in arms}
        seeds = max((len(v) for v in raw.values()), default=0)
        for seed in range(seeds):  # each seed's runs connected across the arms: the pairing the tests use
            points = [
                (x - 0.12 + (seed - (seeds - 1) / 2) * 0.04, raw[arm][seed])
                for x, arm in enumerate(arms)
                if seed < len(raw[arm]) and raw[arm][seed] is not None and math.isfinite(raw[arm][seed])
            ]
            ax.plot([x for x, _ in points], [y for _, y in points], color="0.6", linewidth=0.7, zorder=1)
        for x, arm in enumerate(arms):
            values = _seeds(results, arm, split, metric)
            if not values:
                continue
            jitter = [(i - (len(values) - 1) / 2) * 0.04 for i in range(len(values))]
            ax.scatter([x - 0.12 + j for j in jitter], values, s=14, color="0.45", zorder=2)
            mean, low, high = t_interval(values, bounds=RANGES.get(metric, (-math.inf, math.inf)))
            ax.errorbar([x + 0.12], [mean], yerr=[[mean - low], [high - mean]], fmt="o", color=f"C{x}",
                        capsize=4, markersize=7, zorder=3)  # fmt: skip
            if arm == baseline:
                ax.axhline(mean, color=f"C{x}", linestyle="--", linewidth=1, zorder=1)
        ax.set_xticks(range(len(arms)))
        holm = summary.get("seed_tests", {}).get("tests", {}).get(baseline, {})
        ax.set_xticklabels(
            [arm + ("" if arm == baseline else "\n" + p_label(
                tests.get(arm, {}).get(split, {}).get(metric, {}).get("p_seed_t")) + _holm_label(
                holm.get(arm, {}).get(split, {}).get(metric, {}).get("p_holm"))) for arm in arms],
            fontsize=7,
            rotation=20,
            ha="right",
        )  # fmt: skip
        ax.set_title(label, fontsize=10)
        ax.grid(alpha=0.3, axis="y")
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    n_seeds = len(summary.get("preset", {}).get("seeds", [])) or "?"
    fig.suptitle(
        (title or "") + f"\ngrey: each seed, its runs connected across the arms; colour: mean, 95 % t-interval "
        f"over {n_seeds} seeds, clipped to the metric's range;\np: seed-level paired t-test against {baseline} "
        "(Holm: adjusted over the study's family, the results file's seed_tests)",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def sweep_figure(sweep: dict[str, Any], path: str) -> str:
    """Draws the size sweep: per headline difference (arm minus CE, paired by seed), every seed's
    difference as a point and the mean with its 95 % t-interval at each size, parameters on a log axis,
    with the fitted trend over log10(parameters) (``sweep["trend"]``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = sweep["metrics"]
    fig, axes = plt.subplots(1, len(metrics), figsize=(4.6 * len(metrics), 4.6), squeeze=False)
    for ax, (key, spec) in zip(axes[0], metrics.items()):
        verdicts = []
        for k, arm in enumerate(sweep["arms"]):
            xs, means, lows, highs = [], [], [], []
            spread = 1 + 0.04 * (k - (len(sweep["arms"]) - 1) / 2)
            _connect_seeds(ax, [(size["parameters"] * spread, size["differences"].get(arm, {}).get(key))
                                for size in sweep["sizes"]], "0.5")  # fmt: skip
            for size in sweep["sizes"]:
                cell = size["differences"].get(arm, {}).get(key)
                if not cell:
                    continue
                shift = 1 + 0.04 * (k - (len(sweep["arms"]) - 1) / 2)
                ax.scatter([size["parameters"] * shift] * len(cell["seeds"]), cell["seeds"], s=12, color="0.5")
                if not math.isfinite(cell["low"]):  # one seed: a hollow marker, no interval, not on the line
                    ax.scatter([size["parameters"] * shift], [cell["mean"]], s=40, facecolors="none",
                               edgecolors=f"C{k + 1}", zorder=3)  # fmt: skip
                    ax.annotate(f"n={cell.get('n', 1)}", (size["parameters"] * shift, cell["mean"]), fontsize=7,
                                xytext=(4, 4), textcoords="offset points")  # fmt: skip
                    continue
                xs.append(size["parameters"] * shift)
                means.append(cell["mean"])
                lows.append(cell["mean"] - cell["low"])
                highs.append(cell["high"] - cell["mean"])
            ax.errorbar(xs, means, yerr=[lows, highs], fmt="o-", color=f"C{k + 1}", capsize=4, label=arm)
            trend = sweep.get("trend", {}).get(arm, {}).get(key)
            if trend and xs:
                grid = [min(xs), max(xs)]
                ax.plot(grid, [trend["intercept"] + trend["slope"] * math.log10(g) for g in grid],
                        linestyle=":", color=f"C{k + 1}", linewidth=1)  # fmt: skip
                bounds = "(no spread)" if trend.get("no_spread") else f"[{trend['low']:+.2f}, {trend['high']:+.2f}]"
                verdicts += [f"{arm}: {trend['slope']:+.2f} {bounds} per 10x", f"{trend['verdict']}"]
        ax.axhline(0, color="0.3", linewidth=0.8)
        ax.set_xscale("log")
        sizes = sweep["sizes"]  # ticks at the sizes, named as the tables name them
        ax.set_xticks([size["parameters"] for size in sizes], [size["label"] + (
            f"\n{size['tokens_per_parameter']:.1f} tok/param" if size.get("tokens_per_parameter") else "")
            for size in sizes])  # fmt: skip
        ax.minorticks_off()
        ax.set_xlabel("parameters (without the embedding table; log axis)")
        ax.set_title(spec["label"] + "".join("\n" + line for line in verdicts), fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    levels = {size.get("tokens_per_parameter") for size in sweep["sizes"]}
    confound = ("; the sizes also differ in tokens per parameter, so size and training length are not separated here"
                if len(levels) > 1 and None not in levels else "")  # fmt: skip
    fig.suptitle("arm minus CE, paired by seed: points = seeds, a thin line joins each seed across the sizes; mean and "
                 "95 % t-interval; dotted: the mean per-seed slope\n(per 10x parameters, 95 % interval over the seeds, "
                 f"and the verdict above each panel){confound}", fontsize=9)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _connect_seeds(ax: Any, cells: Sequence[tuple[float, dict[str, Any] | None]], color: str) -> None:
    """A thin line per seed through its differences in ``cells`` ((x, cell) in order): the seed is the unit
    across cells (the same corpus, held-out sets and data order in each), so its points are drawn as one."""
    by_seed: dict[Any, list[tuple[float, float]]] = {}
    for x, cell in cells:
        if not cell:
            continue
        for seed, d in zip(cell.get("seed_ids") or range(len(cell["seeds"])), cell["seeds"]):
            by_seed.setdefault(seed, []).append((x, d))
    for points in by_seed.values():
        if len(points) > 1:
            ax.plot([x for x, _ in points], [y for _, y in points], color=color, linewidth=0.6, alpha=0.35)


def _short(reading: str) -> str:
    short = {"the gain falls as tokens per parameter fall": "gain falls with fewer tokens/param",
             "the gain rises as tokens per parameter fall": "gain rises with fewer tokens/param"}  # fmt: skip
    return short.get(reading, reading)


def _factorial_says(sweep: dict[str, Any]) -> str:
    """The figure's headline: which tests of the declared family are resolved after Holm (the seed the unit)."""
    fac, labels = sweep.get("factorial", {}), sweep["metrics"]
    resolved = []
    for group, say in (("slopes", _short), ("contrasts", str)):  # {arm: {size or contrast: {metric: test}}}
        for _arm, by_name in fac.get(group, {}).items():
            for name, by_key in by_name.items():
                for key, got in by_key.items():
                    holm = got.get("p_holm")
                    if holm is not None and math.isfinite(holm) and holm < 0.05:
                        resolved.append(f"{name}, {labels[key]['label'].split(':')[0]}: {say(got['reading'])} "
                                        f"(Holm {p_label(holm)})")  # fmt: skip
    size = fac.get("family_size", "?")
    if not resolved:
        return f"NTL-WAS minus CE: none of the {size} declared tests resolved after Holm (the seed the unit)"
    return (f"NTL-WAS minus CE, the seed the unit: of the {size} declared tests, resolved after Holm: "
            + "; ".join(resolved) + "; every other one not resolved at these seeds")  # fmt: skip


def factorial_figure(sweep: dict[str, Any], path: str) -> str:
    """Draws the size x tokens-per-parameter factorial: per headline difference (arm minus CE, paired by
    seed), tokens per parameter on a log2 axis, one line per size through its cells' means with their
    95 % t-intervals, every seed's difference a point, and the fitted slope per doubling of each size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics, rows = sweep["metrics"], sweep["sizes"]
    sizes = list(dict.fromkeys(row["size"] for row in rows))
    fig, axes = plt.subplots(1, len(metrics), figsize=(4.6 * len(metrics), 4.8), squeeze=False)
    for ax, (key, spec) in zip(axes[0], metrics.items()):
        notes = []
        for arm in sweep["arms"]:
            for k, size in enumerate(sizes):
                cells = sorted((r for r in rows if r["size"] == size), key=lambda r: r["tokens_per_parameter"])
                xs, means, lows, highs = [], [], [], []
                shift = 2 ** (0.06 * (k - (len(sizes) - 1) / 2))
                _connect_seeds(ax, [(row["tokens_per_parameter"] * shift, row["differences"].get(arm, {}).get(key))
                                    for row in cells], f"C{k}")  # fmt: skip
                for row in cells:
                    cell = row["differences"].get(arm, {}).get(key)
                    if not cell:
                        continue
                    x = row["tokens_per_parameter"] * shift
                    ax.scatter([x] * len(cell["seeds"]), cell["seeds"], s=10, color=f"C{k}", alpha=0.45)
                    if row.get("data_varied") is False:  # one data draw: a hollow ring around the mean
                        ax.scatter([x], [cell["mean"]], s=110, facecolors="none", edgecolors=f"C{k}", zorder=4)
                    ax.annotate(f"n={cell['n']}", (x, cell["mean"]), fontsize=6, xytext=(4, -8),
                                textcoords="offset points")  # fmt: skip
                    xs.append(x)
                    means.append(cell["mean"])
                    lows.append(cell["mean"] - cell["low"] if math.isfinite(cell["low"]) else 0.0)
                    highs.append(cell["high"] - cell["mean"] if math.isfinite(cell["high"]) else 0.0)
                if xs:
                    ax.errorbar(xs, means, yerr=[lows, highs], fmt="o-", color=f"C{k}", capsize=3,
                                label=f"{size}" + (f" ({arm})" if len(sweep["arms"]) > 1 else ""))  # fmt: skip
                fit = sweep.get("factorial", {}).get("slopes", {}).get(arm, {}).get(size, {}).get(key)
                if fit:
                    bounds = "(no spread)" if fit.get("no_spread") else f"[{fit['low']:+.2f}, {fit['high']:+.2f}]"
                    holm = fit.get("p_holm")
                    said = (f", Holm {p_label(holm)}: {_short(fit.get('reading', ''))}"
                            if holm is not None and math.isfinite(holm) else "")  # fmt: skip
                    notes.append(f"{size}: {fit['slope']:+.2f} {bounds}/doubling{said}")
        ax.axhline(0, color="0.3", linewidth=0.8)
        ax.set_xscale("log", base=2)
        levels = sorted({row["tokens_per_parameter"] for row in rows})
        ax.set_xticks(levels, [f"{x:.1f}" for x in levels])
        ax.minorticks_off()
        ax.set_xlabel("training tokens per parameter (log2 axis)")
        ax.set_title(spec["label"] + "".join("\n" + n for n in notes), fontsize=8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(_factorial_says(sweep) + "\npoints = seeds, a thin line joins each seed across its size's cells; "
                 "mean and 95 % t-interval (n = seeds; ringed: one data draw for every seed); above each panel the "
                 "mean per-seed slope per doubling of tokens per parameter", fontsize=9)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def with_arm_from(summary: dict[str, Any], path: str, arm: str) -> dict[str, Any]:
    """``summary`` with ``arm``'s results and seed-level tests taken from the results file ``path`` (a
    re-run of that arm beside the same baseline): the baseline's per-seed values must be the same in both
    files, else SystemExit (the pairing would not hold)."""
    with open(path) as f:
        other = json.load(f)
    baseline = summary.get("preset", {}).get("baseline") or next(iter(summary["results"]))
    if arm not in other.get("results", {}):
        raise SystemExit(f"--arm-from {path}: no arm {arm!r}; its arms: {list(other.get('results', {}))}")
    mine, theirs = summary["results"][baseline], other["results"].get(baseline, {})
    for split, metrics in mine.items():
        for metric, cell in metrics.items():
            if theirs.get(split, {}).get(metric, {}).get("seeds") != cell["seeds"]:
                raise SystemExit(f"--arm-from {path}: its {baseline} differs on {split} {metric}; the re-run's "
                                 f"{arm} does not pair with this file's {baseline}")  # fmt: skip
    merged = {**summary, "results": {**summary["results"], arm: other["results"][arm]}}
    merged["paired_tests"] = {**summary.get("paired_tests", {}), arm: other.get("paired_tests", {}).get(arm, {})}
    merged["seed_tests"] = seed_stats.seed_tests(merged)  # the family of the arms drawn
    return merged


def main(argv: Sequence[str] | None = None) -> list[str]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="+", help="a study's results.json (docs/img/study_*_results.json)")
    parser.add_argument("--out", default=None, help="folder of the PNGs (default: beside each results file)")
    parser.add_argument("--arm-from", nargs=2, action="append", default=[], metavar=("RESULTS", "ARM"),
                        help="draw ARM from another results.json (a re-run of that arm beside the same baseline, "
                             "whose baseline seeds must equal these); repeatable")  # fmt: skip
    args = parser.parse_args(argv)
    written = []
    for path in args.results:
        with open(path) as f:
            summary = json.load(f)
        if "results" not in summary:
            raise SystemExit(f"{path}: not a study's results.json (no 'results' key); expected the output of "
                             "experiments/study.py")  # fmt: skip
        for other_path, arm in args.arm_from:
            summary = with_arm_from(summary, other_path, arm)
        stem = os.path.basename(path).removesuffix(".json").removesuffix("_results")
        target = os.path.join(args.out or os.path.dirname(path) or ".", f"{stem}_verdict.png")
        if verdict_figure(summary, target, title=stem) is not None:
            written.append(target)
            print(target)
    return written


if __name__ == "__main__":
    main()
