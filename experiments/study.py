"""CE vs CE + NTL: train every arm for every seed through launch/train.py, then tabulate and plot.

    python experiments/study.py --preset configs/study/cpu.yaml            # 2 CPU cores, ~25 minutes
    python experiments/study.py --preset configs/study/gpu.yaml            # one GPU (H100/H200)
    python experiments/study.py --preset configs/study/ci.yaml --out runs/study-ci   # minutes, for CI

A preset names the base run config, the arms (overrides on top of it: the loss), the seeds (model
init; the data is the same seeded arithmetic for every arm and seed) and the shared overrides (the
budget). Each run lands in ``OUT/<arm>/seed<S>/`` (a finished run is not redone, so an interrupted
study continues where it stopped). Then ``OUT`` gets:

* ``results.json`` and ``results.md``: mean and spread (sample standard deviation) over seeds of
  exact-match accuracy, MAE, log-MAE and R^2 on the interpolation and extrapolation splits;
* ``loss_curves.png``: CE and NTL per step (mean over seeds) for each arm;
* ``error_by_digits.png``: accuracy and MAE by the number of digits of the true answer;
* ``digit_offsets.png``: where wrong digits land relative to the true digit (predicted - true,
  aligned from the last digit), per arm.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import socket
import statistics
import subprocess
import sys
import time
from typing import Any

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
METRICS = ("accuracy", "mae", "log_mae", "r2")


def load_preset(path: str) -> dict[str, Any]:
    """Reads and checks a study preset."""
    with open(path, encoding="utf-8") as f:
        preset = yaml.safe_load(f)
    required = {"base_config": str, "seeds": list, "arms": dict}
    for key, kind in required.items():
        if not isinstance(preset, dict) or not isinstance(preset.get(key), kind):
            raise SystemExit(f"{path}: expected '{key}' ({kind.__name__}) at the top level")
    if preset.get("launcher", "python") not in ("python", "deepspeed"):
        raise SystemExit(f"{path}: launcher must be 'python' or 'deepspeed', got {preset['launcher']!r}")
    return preset


def _read_json(path: str) -> Any:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _read_jsonl(path: str) -> list[Any]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def _save(fig: Any, path: str, written: list[str]) -> None:
    """Writes one figure as PNG, closes it and records its path."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    written.append(path)


def slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", name).strip("_").lower()


def train_command(preset: dict[str, Any], run_dir: str, arm: list[str], seed: int) -> list[str]:
    """The launch/train.py command of one run."""
    overrides = [*preset.get("overrides", []), *arm, f"train.seed={seed}", f"run_dir={run_dir}"]
    entry = [os.path.join(ROOT, "launch", "train.py"), "--config", os.path.join(ROOT, preset["base_config"])]
    if preset.get("launcher", "python") == "python":
        return [sys.executable, *entry, *overrides]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    launcher = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(preset.get("procs", 1))]
    return [*launcher, "--master_port", str(port), *entry, *overrides]


def run_all(preset: dict[str, Any], out: str) -> dict[str, list[str]]:
    """Trains every (arm, seed); returns the run directories per arm."""
    runs: dict[str, list[str]] = {}
    total = len(preset["arms"]) * len(preset["seeds"])
    done = 0
    for arm, overrides in preset["arms"].items():
        for seed in preset["seeds"]:
            run_dir = os.path.join(out, slug(arm), f"seed{seed}")
            runs.setdefault(arm, []).append(run_dir)
            done += 1
            if os.path.isfile(os.path.join(run_dir, "eval.json")):
                print(f"[study] {done}/{total} {arm} seed {seed}: already done", flush=True)
                continue
            print(f"[study] {done}/{total} {arm} seed {seed} -> {run_dir}", flush=True)
            os.makedirs(run_dir, exist_ok=True)
            start = time.time()
            with open(os.path.join(run_dir, "train.log"), "w") as log:
                command = train_command(preset, run_dir, list(overrides), seed)
                code = subprocess.call(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
            if code != 0 or not os.path.isfile(os.path.join(run_dir, "eval.json")):
                raise SystemExit(f"[study] {arm} seed {seed} failed (exit {code}); see {run_dir}/train.log")
            print(f"[study]    {time.time() - start:.0f} s", flush=True)
    return runs


def _mean_spread(values: list[float]) -> tuple[float, float]:
    finite = [v for v in values if v is not None and math.isfinite(v)]
    if not finite:
        return math.nan, math.nan
    return statistics.fmean(finite), statistics.stdev(finite) if len(finite) > 1 else 0.0


def aggregate(runs: dict[str, list[str]]) -> dict[str, Any]:
    """Mean and spread over seeds of every metric, per arm and split."""
    table: dict[str, Any] = {}
    for arm, dirs in runs.items():
        evals = [_read_json(os.path.join(d, "eval.json")) for d in dirs]
        table[arm] = {}
        for split in evals[0]:
            table[arm][split] = {}
            for metric in METRICS:
                values = [e[split].get(metric) for e in evals]
                mean, spread = _mean_spread(values)
                table[arm][split][metric] = {"mean": mean, "std": spread, "seeds": values}
    return table


def markdown(table: dict[str, Any], preset_path: str, seeds: list[int]) -> str:
    """The results table: one row per arm, mean +- std over seeds for each split and metric."""
    splits = list(next(iter(table.values())))
    lines = [f"Preset `{preset_path}`, {len(seeds)} seeds; mean +- standard deviation over seeds.", ""]
    for split in splits:
        lines += [f"**{split}**", "", "| arm | accuracy | MAE | log-MAE | R^2 |", "|---|---:|---:|---:|---:|"]
        for arm, splits_of_arm in table.items():
            cells = []
            for metric in METRICS:
                m = splits_of_arm[split][metric]
                cells.append(f"{m['mean']:.3f} +- {m['std']:.3f}" if math.isfinite(m["mean"]) else "n/a")
            lines.append(f"| {arm} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def _predictions(dirs: list[str], split: str) -> list[dict[str, Any]]:
    rows = []
    for d in dirs:
        path = os.path.join(d, f"predictions_{split}.jsonl")
        if os.path.isfile(path):
            rows += _read_jsonl(path)
    return rows


def plots(runs: dict[str, list[str]], out: str) -> list[str]:
    """Writes the three PNGs; returns their paths."""
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    # loss curves, mean over seeds
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for arm, dirs in runs.items():
        curves = [_read_jsonl(os.path.join(d, "metrics.jsonl")) for d in dirs]
        steps = [r["step"] for r in curves[0]]
        for ax, key in zip(axes, ("ce", "ntl")):
            ax.plot(steps, [statistics.fmean(c[i][key] for c in curves) for i in range(len(steps))], label=arm)
    # each arm logs the NTL term of its own loss (the CE arm: NTL-WAS at weight 0, logged only)
    for ax, title in zip(axes, ("cross entropy", "NTL term of the arm's loss")):
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend()
    _save(fig, os.path.join(out, "loss_curves.png"), written)

    # error by number of digits of the true answer
    splits = ("interpolate", "extrapolate")
    fig, axes = plt.subplots(2, len(splits), figsize=(11, 7), squeeze=False)
    for col, split in enumerate(splits):
        for arm, dirs in runs.items():
            by_digits: dict[int, list[tuple[bool, float]]] = {}
            for row in _predictions(dirs, split):
                truth = float(row["answer"])
                digits = len(str(abs(int(truth))))
                pred = row["parsed"]
                error = abs(pred - truth) if pred is not None else math.nan
                by_digits.setdefault(digits, []).append((pred is not None and pred == truth, error))
            xs = sorted(by_digits)
            accuracy = [statistics.fmean(ok for ok, _ in by_digits[x]) for x in xs]
            mae = [statistics.fmean([e for _, e in by_digits[x] if math.isfinite(e)] or [math.nan]) for x in xs]
            axes[0][col].plot(xs, accuracy, marker="o", label=arm)
            axes[1][col].plot(xs, mae, marker="o", label=arm)
        axes[0][col].set_title(f"{split}: exact-match accuracy")
        axes[1][col].set_title(f"{split}: mean absolute error")
        axes[1][col].set_yscale("log")
        for ax in (axes[0][col], axes[1][col]):
            ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
            ax.set_xlabel("digits in the true answer")
            ax.grid(alpha=0.3)
            ax.legend()
    _save(fig, os.path.join(out, "error_by_digits.png"), written)

    # wrong digits: predicted - true digit, aligned from the last digit
    fig, ax = plt.subplots(figsize=(8, 4))
    offsets = list(range(-9, 10))
    width = 0.8 / max(len(runs), 1)
    for k, (arm, dirs) in enumerate(runs.items()):
        counts = dict.fromkeys(offsets, 0)
        for split in splits:
            for row in _predictions(dirs, split):
                if row["parsed"] is None:
                    continue
                truth, pred = str(abs(int(float(row["answer"])))), str(abs(int(row["parsed"])))
                for a, b in zip(reversed(pred), reversed(truth)):
                    counts[int(a) - int(b)] += 1
        wrong = sum(v for o, v in counts.items() if o != 0) or 1
        ax.bar([o + (k - len(runs) / 2) * width for o in offsets], [counts[o] / wrong if o else 0 for o in offsets],
               width=width, label=arm)  # fmt: skip
    ax.set_xlabel("predicted digit - true digit (wrong digits only)")
    ax.set_ylabel("share of wrong digits")
    ax.set_xticks(offsets)
    ax.grid(alpha=0.3)
    ax.legend()
    _save(fig, os.path.join(out, "digit_offsets.png"), written)
    return written


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="configs/study/cpu.yaml", help="study preset YAML")
    parser.add_argument("--out", default=None, help="output folder (default: runs/study-<preset name>)")
    args = parser.parse_args(argv)
    if not os.path.isfile(args.preset):
        raise SystemExit(f"--preset {args.preset}: no such file (presets: configs/study/*.yaml)")
    preset = load_preset(args.preset)
    out = args.out or os.path.join("runs", "study-" + os.path.splitext(os.path.basename(args.preset))[0])
    os.makedirs(out, exist_ok=True)
    start = time.time()
    runs = run_all(preset, out)
    table = aggregate(runs)
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump({"preset": preset, "results": table, "seconds": time.time() - start}, f, indent=2)
    text = markdown(table, args.preset, preset["seeds"])
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(text + "\n")
    pngs = plots(runs, out)
    print(text)
    print(f"[study] {time.time() - start:.0f} s; results and plots in {out}: {', '.join(map(os.path.basename, pngs))}")
    return table


if __name__ == "__main__":
    main()
