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
* over sizes, a least-squares line of the per-seed differences on log10(parameters), its slope
  (change per 10x parameters) with a 95 % t-interval (n - 2 degrees of freedom), and the verdict:
  the effect *shrinks* (the slope's interval lies on the side opposite to the mean effect), *grows*
  (the same side), or *cannot be told at this scale* (the interval holds 0).

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
import study  # noqa: E402

# key -> (split, metric, relative (% of the baseline mean) or absolute (points), label)
METRICS: dict[str, tuple[str, str, bool, str]] = {
    "prose_text_ppl": ("heldout:prose", "text_ppl", True, "prose text perplexity: cost, % of CE"),
    "number_token_mae": ("heldout", "number_token_mae", True, "number-token MAE: change, % of CE"),
    "number_token_acc": ("heldout", "number_token_acc", False, "number-token accuracy: change, points"),
    "question_acc": ("questions", "accuracy", False, "held-out question accuracy: change, points"),
}


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


def difference(results: dict[str, Any], arm: str, baseline: str, key: str) -> dict[str, Any] | None:
    """The arm's per-seed difference to the baseline on metric ``key``, its mean, 95 % t-interval and t-test."""
    from scipy import stats

    split, metric, relative, _ = METRICS[key]
    try:
        a = results[arm][split][metric]["seeds"]
        b = results[baseline][split][metric]["seeds"]
    except KeyError:
        return None
    pairs = [(x, y) for x, y in zip(a, b) if x is not None and y is not None and math.isfinite(x + y)]
    if not pairs:
        return None
    scale = 100.0 / statistics.fmean(y for _, y in pairs) if relative else 100.0
    seeds = [(x - y) * scale for x, y in pairs]
    mean, low, high = figures.t_interval(seeds)
    if len(seeds) < 2:  # one seed: a difference, no interval (not a zero-width one)
        low = high = math.nan
    p = math.nan
    if len(pairs) > 1 and len(set(seeds)) > 1:
        p = float(stats.ttest_rel([x for x, _ in pairs], [y for _, y in pairs]).pvalue)
    return {"seeds": seeds, "mean": mean, "low": low, "high": high, "p_seed_t": p, "n": len(pairs)}


def trend(points: list[tuple[float, float]]) -> dict[str, Any] | None:
    """Least squares of the differences on log10(parameters): slope per 10x with its 95 % t-interval.

    No verdict while a size has fewer than 2 seeds: a single seed at the end of the range has the
    leverage to decide it alone (the slope and its interval are still given)."""
    from scipy import stats

    if len({x for x, _ in points}) < 2 or len(points) < 3:
        return None
    if len({y for _, y in points}) < 2:  # the same difference at every seed and size: nothing to fit
        return {"slope": 0.0, "low": 0.0, "high": 0.0, "intercept": points[0][1], "p": math.nan,
                "n": len(points), "verdict": "no difference at any size"}  # fmt: skip
    fit = stats.linregress([math.log10(x) for x, _ in points], [y for _, y in points])
    half = float(stats.t.ppf(0.975, len(points) - 2)) * float(fit.stderr)
    slope = float(fit.slope)
    # the effect's sign is the fitted line's at the smallest size: a pooled mean would flip with how far
    # an effect that changes sign overshoots, and relabel one and the same slope
    start = float(fit.intercept) + slope * math.log10(min(x for x, _ in points))
    if min(collections.Counter(x for x, _ in points).values()) < 2:  # seeds per size
        verdict = "not given: a size has one seed"
    elif slope - half <= 0 <= slope + half:
        verdict = "cannot be told at this scale"
    else:
        verdict = "shrinks" if (slope < 0) == (start > 0) else "grows"
    return {"slope": slope, "low": slope - half, "high": slope + half, "intercept": float(fit.intercept),
            "p": float(fit.pvalue), "n": len(points), "verdict": verdict}  # fmt: skip


def tabulate(sweep: dict[str, Any], sizes: list[dict[str, Any]]) -> dict[str, Any]:
    """The sweep's differences per size and their trends (see the module docstring)."""
    arms, baseline = sweep["arms"], sweep.get("baseline", "CE")
    rows = []
    for size in sizes:
        rows.append({
            "label": size["label"], "parameters": size["parameters"], "results": size["results_path"],
            "differences": {arm: {key: difference(size["results"], arm, baseline, key) for key in METRICS}
                            for arm in arms},
        })  # fmt: skip
    trends = {}
    for arm in arms:
        trends[arm] = {}
        for key in METRICS:
            points = [(row["parameters"], d) for row in rows
                      for d in ((row["differences"][arm][key] or {}).get("seeds", []))]  # fmt: skip
            trends[arm][key] = trend(points)
    labels = {key: {"label": spec[3]} for key, spec in METRICS.items()}
    return {"baseline": baseline, "arms": arms, "metrics": labels, "sizes": rows, "trend": trends}


def _cell(cell: dict[str, Any] | None) -> str:
    if not cell:
        return "-"
    if cell["n"] < 2:  # a size with one seed so far: a difference, no interval and no test
        return f"{cell['mean']:+.2f} (one seed: no interval, no test)"
    return (
        f"{cell['mean']:+.2f} [{cell['low']:+.2f}, {cell['high']:+.2f}], {figures.p_label(cell['p_seed_t']) or 'p n/a'}"
    )


def markdown(table: dict[str, Any]) -> str:
    lines = []
    for arm in table["arms"]:
        lines += [
            f"**{arm} minus {table['baseline']}** (mean [95 % t-interval] over seeds, seed-level paired t-test)",
            "",
        ]
        lines.append("| size | parameters | " + " | ".join(spec["label"] for spec in table["metrics"].values()) + " |")
        lines.append("|---|---:|" + "---|" * len(table["metrics"]))
        for row in table["sizes"]:
            cells = [_cell(row["differences"][arm][key]) for key in table["metrics"]]
            lines.append(f"| {row['label']} | {row['parameters']:,} | " + " | ".join(cells) + " |")
        lines += ["", "Trend over log10(parameters) (slope per 10x parameters [95 % interval]; verdict):", ""]
        for key, spec in table["metrics"].items():
            t = table["trend"][arm][key]
            if t:
                counts = ", ".join(str((row["differences"][arm][key] or {}).get("n", 0)) for row in table["sizes"])
                fit = f"{t['slope']:+.2f} [{t['low']:+.2f}, {t['high']:+.2f}]"
                p = figures.p_label(t["p"]) or "p n/a"
                lines.append(f"- {spec['label']}: {fit} (n = {t['n']}: {counts} seeds by size, {p}): "
                             f"**{t['verdict']}**")  # fmt: skip
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sweep", default="configs/sweep/size_sweep.yaml", help="sweep file")
    parser.add_argument("--out", default=None, help="output folder (default: runs/<sweep name>)")
    parser.add_argument("--no-run", action="store_true", help="tabulate the sizes whose results exist; run nothing")
    args = parser.parse_args(argv)
    if not os.path.isfile(args.sweep):
        raise SystemExit(f"--sweep {args.sweep}: no such file (sweeps: configs/sweep/*.yaml)")
    with open(args.sweep) as f:
        sweep = yaml.safe_load(f)
    for key in ("sizes", "arms"):
        if not sweep.get(key):
            raise SystemExit(f"{args.sweep}: expected a non-empty {key!r} list")
    out = args.out or os.path.join("runs", os.path.splitext(os.path.basename(args.sweep))[0])
    os.makedirs(out, exist_ok=True)
    start = time.time()
    sizes = []
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
        if not os.path.isfile(path) and not entry.get("results"):
            if args.no_run:
                print(f"[sweep] {entry['label']}: no {path}; left out (--no-run)", flush=True)
                continue
            keep = ["--keep", entry["keep"]] if entry.get("keep") else []  # finished runs kept in the repository
            study.main(["--preset", preset_path, "--out", entry["out"], *keep])
        if not os.path.isfile(path):
            raise SystemExit(f"[sweep] {entry['label']}: {path} missing; run its preset {entry['preset']}")
        with open(path) as f:
            results = json.load(f)["results"]
        missing = [arm for arm in [sweep.get("baseline", "CE"), *sweep["arms"]] if arm not in results]
        if missing:
            raise SystemExit(f"[sweep] {path} has no arm {missing}; its arms: {list(results)}")
        sizes.append({"label": entry["label"], "parameters": parameters(preset), "results": results,
                      "results_path": path})  # fmt: skip
    table = tabulate(sweep, sizes)
    table["seconds"] = time.time() - start
    with open(os.path.join(out, "sweep.json"), "w") as f:
        json.dump({"sweep": sweep, **table}, f, indent=2)
    text = markdown(table)
    with open(os.path.join(out, "sweep.md"), "w") as f:
        f.write(text + "\n")
    figures.sweep_figure(table, os.path.join(out, "size_sweep.png"))
    print(text)
    print(f"[sweep] {time.time() - start:.0f} s; sweep.json, sweep.md, size_sweep.png in {out}")
    return table


if __name__ == "__main__":
    main()
