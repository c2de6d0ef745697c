"""CE vs CE + NTL: train every arm for every seed through launch/train.py, then tabulate and plot.

    python experiments/study.py --preset configs/study/cpu.yaml            # 2 CPU cores, about 35 minutes
    python experiments/study.py --preset configs/study/gpu.yaml            # one GPU (H100/H200)
    python experiments/study.py --preset configs/study/ci.yaml --out runs/study-ci   # minutes, for CI
    python experiments/study.py --preset configs/study/ablation_weight.yaml   # NTL weight 0.3 / 0.8 / 2.0
    python experiments/study.py --preset configs/study/ablation_loss.yaml     # MSE, MAE, Huber, WAS
    python experiments/study.py --preset configs/study/deepmind.yaml          # the DeepMind arithmetic data
    python experiments/study.py --preset configs/study/del_8seeds.yaml --out runs/study-cpu   # DEL vs NTL, 8 seeds

A preset names the base run config, the arms (overrides on top of it: the loss), the seeds (model
init; the data is the same seeded arithmetic for every arm and seed) and the shared overrides (the
budget); optionally ``prepare`` (commands run once first, e.g. generating the DeepMind data),
``parallel`` (runs at once, the cores shared between them), ``entry`` (the training script, default
launch/train.py; experiments/train_baselines.py adds the ``baseline.*`` overrides of DEL and the
digit-only NTL-WAS), ``baseline`` (the arm the others are tested against; default the first),
``also_against`` (arms every other arm is also paired against, e.g. ``[CE + NTL-WAS]``:
``paired_tests_against`` in results.json, a section each in results.md), ``declared_family`` (a
question's own Holm family, stated before its runs: entries ``{against, arms, split, metric}``; each
test's ``p_holm_declared`` beside the study-wide ``p_holm``) and ``heldout_groups`` (a
pretraining corpus: name -> [first, stop)
held-out sequence indices, each tabulated and tested as split ``heldout:<name>``; or the path of a
corpus manifest of experiments/pretrain_corpus.py, whose ``heldout.groups`` are its prose and number
documents, checked against each run's held-out sequences). Each run
lands in ``OUT/<arm>/seed<S>/`` (a finished run is not redone, so an interrupted study continues
where it stopped). With ``--keep DIR`` (a folder of the repository, e.g. ``experiments/finished_runs/<study>``),
the small files of each finished run (:data:`KEPT_FILES`: no checkpoint) are copied to
``DIR/<arm>/seed<S>/`` as it ends, every ``*.jsonl`` compressed (``*.jsonl.xz``), its per-step metrics
compacted (:func:`compact_metrics`: the loss curves at every :data:`KEPT_EVERY`-th step and each column's
mean over every step, 4 KB a run instead of 0.15 MB), and a run found there is restored into ``OUT``
(decompressed: the files the run wrote, its ``metrics.jsonl`` the compacted rows) instead of being
trained: committed with the repository, a study that takes longer than one machine's life continues on
the next machine. Then ``OUT`` gets:

* ``results.json`` and ``results.md``: mean and spread (sample standard deviation) over seeds of
  exact-match accuracy, MAE, log-MAE and R^2 on the interpolation and extrapolation splits, every
  seed's numbers, the seed-level tests of each arm against the baseline with Holm's adjustment over
  the study (``seed_tests``: :mod:`seed_stats`; first in ``results.md``) and per split the paired
  differences with the counts over questions and sequences (see :func:`paired_tests`);
* ``loss_curves.png``: CE and NTL per step (mean over seeds) for each arm (every :data:`KEPT_EVERY`-th
  step for a run restored from ``--keep``);
* ``verdict.png``: every seed of each arm and the arm's mean with its 95 % t-interval, per headline
  metric (:mod:`figures`, from ``results.json``);
* ``error_by_digits.png``: accuracy and MAE by the number of digits of the true answer (an accuracy
  panel that is zero for every arm is left out);
* ``digit_offsets.png``: where wrong digits land relative to the true digit (predicted - true,
  aligned from the last digit), per arm.

With ``--harness`` (or the preset's ``harness: {enabled: true, tasks: [...], limit: N}``; off by default and
in the CI presets: 23 s of CPU a run, measured on a CI preset run) every run is also scored by
lm-evaluation-harness on its ``hf_model`` (:func:`run_harness`: by default ``ntl_run``, the run's own held-out
questions prompted as its scorer prompts them), and ``results.json`` (``harness``) and ``results.md`` report
the harness's exact match, absolute and relative error beside the study's accuracy and MAE.
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
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # experiments/figures.py

import figures  # noqa: E402
import seed_stats  # noqa: E402

from ntl_scale.atomic import atomic_write, write_atomically, write_json_atomically  # noqa: E402
from ntl_scale.eval.numbers import extract_number  # noqa: E402
from ntl_scale.training.scoring import HELDOUT_COLUMNS, heldout_metrics  # noqa: E402

METRICS = ("accuracy", "mae", "log_mae", "r2")
"""Metrics of a split answered by generation (``predictions_<split>.jsonl``)."""
HELDOUT_METRICS = ("text_ppl", "number_token_ppl", "number_token_acc", "number_token_mae", "ppl")
"""Metrics of a pretraining corpus's held-out text (split ``heldout``; ``heldout_sequences.jsonl``)."""
LOWER_BETTER = {
    "text_ppl": True,
    "number_token_ppl": True,
    "number_token_acc": False,
    "number_token_mae": True,
    "ppl": True,
}
"""Held-out metric: whether lower is better (for the per-sequence tests' 'better' count)."""


def metrics_of(split: dict[str, Any]) -> tuple[str, ...]:
    """The metrics tabulated for one split of an ``eval.json``."""
    return METRICS if "accuracy" in split else tuple(m for m in HELDOUT_METRICS if m in split)


DATA_SEED = "{data_seed}"
"""Placeholder of a preset's ``prepare`` commands, ``overrides`` and ``heldout_groups`` path, replaced by
each run's data seed where the preset says ``data_seed: with_seed`` (a corpus built per data seed)."""


def data_seeded(preset: dict[str, Any]) -> bool:
    """Whether the preset varies the data with the seed (``data_seed: with_seed``): each run gets
    ``data.seed=<seed>`` (the order of the training set) and :data:`DATA_SEED` replaced by its seed (e.g.
    the corpus's ``--seed``: the training text and the held-out questions and sequences)."""
    return preset.get("data_seed", "fixed") == "with_seed"


def for_seed(text: str, seed: int) -> str:
    """``text`` with :data:`DATA_SEED` replaced by ``seed``."""
    return text.replace(DATA_SEED, str(seed))


def load_preset(path: str) -> dict[str, Any]:
    """Reads and checks a study preset."""
    with open(path, encoding="utf-8") as f:
        preset = yaml.safe_load(f)
    required = {"base_config": str, "seeds": list, "arms": dict}
    for key, kind in required.items():
        if not isinstance(preset, dict) or not isinstance(preset.get(key), kind):
            raise SystemExit(f"{path}: expected '{key}' ({kind.__name__}) at the top level")
    entry = preset.get("entry", "launch/train.py")
    if not os.path.isfile(os.path.join(ROOT, entry)):
        raise SystemExit(f"{path}: entry {entry!r} is not a file of the repository (e.g. launch/train.py)")
    against = preset.get("also_against", [])
    if not isinstance(against, list) or any(a not in preset["arms"] or a == preset.get("baseline") for a in against):
        raise SystemExit(f"{path}: also_against must list arms other than the baseline, got {against!r}")
    try:
        declared = seed_stats.declared_family(preset)
    except ValueError as error:
        raise SystemExit(f"{path}: {error}") from None
    unknown = sorted({name for a, arm, _, _ in declared for name in (a, arm) if name not in preset["arms"]})
    if unknown:
        raise SystemExit(f"{path}: declared_family names {unknown}, not arms of the preset {list(preset['arms'])}")
    if preset.get("data_seed", "fixed") not in ("fixed", "with_seed"):
        raise SystemExit(f"{path}: data_seed must be 'fixed' (data.seed of the base config in every run) or "
                         f"'with_seed' (data.seed = the run's seed), got {preset['data_seed']!r}")  # fmt: skip
    placeholders = [text for text in [*preset.get("prepare", []), *preset.get("overrides", []),
                                      str(preset.get("heldout_groups", ""))] if DATA_SEED in text]  # fmt: skip
    if placeholders and preset.get("data_seed", "fixed") != "with_seed":
        raise SystemExit(f"{path}: {DATA_SEED} in {placeholders[0]!r} needs data_seed: with_seed")
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


SUMMARY = "metrics_summary.json"
"""A kept run's summary of its whole ``metrics.jsonl`` (:func:`compact_metrics`)."""
KEPT_FILES = ("eval.json", "config.json", "heldout_sequences.jsonl", "baseline.json", "run.json", SUMMARY)
"""The files of a finished run that the tables, tests and plots read, kept as the run wrote them (besides
every ``predictions_*.jsonl``, and ``metrics.jsonl`` compacted: :func:`compact_metrics`), and its
``run.json`` (:func:`provenance`)."""
KEPT_SUFFIX = ".xz"
"""A kept run holds each ``*.jsonl`` as ``*.jsonl.xz`` (xz, :mod:`lzma`): JSON lines of floats shrink about
6x, and what the repository carries (to a GPU machine too) stays small; restored, they are the same bytes
(``metrics.jsonl``: the compacted rows)."""
KEPT_EVERY = 10
"""The steps whose metrics a kept run keeps: every ``KEPT_EVERY``-th, the first and the last."""
KEPT_COLUMNS = ("step", "ce", "ntl")
"""The per-step columns a kept run keeps: those ``loss_curves.png`` plots (:func:`plots`)."""
OBJECTIVE_TERMS = ("ce", "ntl", "baseline")
"""Loss terms whose per-step ratio to the logged ``objective`` (experiments/train_baselines.py) is averaged
over every step into :data:`SUMMARY` (a term's share of the objective: its weight x that mean)."""


def compact_metrics(rows: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The kept form of a run's ``metrics.jsonl`` rows: the rows of every :data:`KEPT_EVERY`-th step, the
    first and the last, with the columns of :data:`KEPT_COLUMNS` as logged; and its :data:`SUMMARY`: the
    steps logged, ``kept_every``, each training column's mean over every step that logged a number in it
    (``mean``; not the ``eval/`` columns, whose last values are ``eval.json``), and where the run logs an
    ``objective``, each :data:`OBJECTIVE_TERMS` term's mean over the steps of term / objective
    (``mean_over_objective``)."""
    last = rows[-1]["step"] if rows else None
    kept = [{k: row[k] for k in KEPT_COLUMNS if k in row} for i, row in enumerate(rows)
            if i == 0 or row["step"] == last or row["step"] % KEPT_EVERY == 0]  # fmt: skip
    values: dict[str, list[float]] = {}
    for row in rows:
        for key, value in row.items():
            if key != "step" and not key.startswith("eval") and type(value) in (int, float) and math.isfinite(value):
                values.setdefault(key, []).append(value)
    summary: dict[str, Any] = {"steps": len(rows), "kept_every": KEPT_EVERY,
                               "mean": {k: statistics.fmean(v) for k, v in values.items()}}  # fmt: skip
    shares = {term: [row[term] / row["objective"] for row in rows if row.get("objective") and term in row]
              for term in OBJECTIVE_TERMS}  # fmt: skip
    if any(shares.values()):
        summary["mean_over_objective"] = {term: statistics.fmean(v) for term, v in shares.items() if v}
    return kept, summary


def checkout() -> dict[str, Any]:
    """The commit of this checkout and whether tracked files differ from it (``dirty``), read as a run
    starts (what its process loads); both None where ``ROOT`` is not the top of a git checkout or git
    cannot tell."""

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", "--no-optional-locks", "-C", ROOT, *args], capture_output=True,
                                  text=True, timeout=60)  # fmt: skip
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    top = git("rev-parse", "--show-toplevel")
    if top is None or os.path.realpath(top) != os.path.realpath(ROOT):  # none, or a repository around it
        return {"commit": None, "dirty": None}
    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no") if commit else None
    return {"commit": commit, "dirty": None if status is None else bool(status)}


PROVENANCE_KEYS = ("commit", "dirty", "started_utc", "ended_utc", "seconds", "torch", "python", "machine", "cpus",
                   "threads_per_run", "runs_at_a_time")  # fmt: skip


def provenance(source: dict[str, Any], started: float, ended: float, threads: int | None, parallel: int) -> dict:
    """Where a finished run's numbers come from, written as its ``run.json`` and kept with it: the
    :func:`checkout` read as it started, torch and Python, the CPU architecture and core count, its start
    and end (UTC) and wall time, and how the machine was shared: threads per run (``OMP_NUM_THREADS``;
    None where unset, the trainer's default) and runs at a time."""
    import platform

    import torch

    stamp = lambda t: time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))  # noqa: E731
    return {"commit": source["commit"], "dirty": source["dirty"], "started_utc": stamp(started),
            "ended_utc": stamp(ended), "seconds": round(ended - started, 1), "torch": torch.__version__,
            "python": platform.python_version(), "machine": platform.machine(),
            "cpus": len(os.sched_getaffinity(0)), "threads_per_run": threads, "runs_at_a_time": parallel}  # fmt: skip


def write_provenance(run_dir: str, record: dict[str, Any]) -> None:
    """Writes ``run.json`` whole or not at all (a temporary file, then a rename)."""
    with atomic_write(os.path.join(run_dir, "run.json")) as f:
        json.dump(record, f, indent=1)


def read_provenance(runs: dict[str, list[str]]) -> dict[str, list[dict[str, Any] | None]]:
    """Each run's ``run.json`` per arm in seed order; None where a run has none, or one that cannot be read
    or lacks a field (with a warning: the tables do not depend on it)."""
    records: dict[str, list[dict[str, Any] | None]] = {}
    for arm, dirs in runs.items():
        records[arm] = []
        for run_dir in dirs:
            path, record = os.path.join(run_dir, "run.json"), None
            if os.path.isfile(path):
                try:
                    with open(path) as f:
                        record = json.load(f)
                    missing = [key for key in PROVENANCE_KEYS if key not in record]
                    if missing:
                        raise ValueError(f"no {', '.join(missing)}")
                except (OSError, ValueError, TypeError) as error:
                    print(f"[study] warning: {path} is not a run record ({error}); its provenance is left out",
                          flush=True)  # fmt: skip
                    record = None
            records[arm].append(record)
    return records


def provenance_line(records: dict[str, list[dict[str, Any] | None]]) -> str:
    """One sentence for ``results.md``: which commits, versions and run times the runs record."""
    found = [r for runs in records.values() for r in runs if r]
    total = sum(len(runs) for runs in records.values())
    if not found:
        return f"Provenance: none of the {total} runs has a `run.json` (they finished before study.py wrote one)."
    commits = sorted({(r["commit"] or "unknown")[:7] + (" (with uncommitted changes)" if r["dirty"] else "")
                      for r in found})  # fmt: skip
    seconds = [r["seconds"] for r in found]
    days = sorted({r["started_utc"][:10] for r in found} | {r["ended_utc"][:10] for r in found})
    return (f"Provenance ({len(found)} of {total} runs have a `run.json`): commit {', '.join(commits)}; torch "
            f"{', '.join(sorted({str(r['torch']) for r in found}))}; {min(seconds):.0f}-{max(seconds):.0f} s a run; "
            f"{days[0]}{' to ' + days[-1] if len(days) > 1 else ''} (UTC).")  # fmt: skip


def _kept_names(run_dir: str) -> list[str]:
    """The files of ``run_dir`` that are kept (as the run wrote them, or in their kept form ``*.jsonl.xz``)."""

    def kept(name: str) -> bool:
        return name in (*KEPT_FILES, "metrics.jsonl") or (name.startswith("predictions_") and name.endswith(".jsonl"))

    names = sorted(os.listdir(run_dir))
    return [n for n in names if kept(n) or (n.endswith(".jsonl" + KEPT_SUFFIX) and kept(n[: -len(KEPT_SUFFIX)]))]


def _copy(source_dir: str, target_dir: str, name: str, target_name: str) -> None:
    """Copies one file, compressing (``target_name`` ends in ``.xz``) or decompressing (``name`` does) it;
    written to a temporary name first, so that no half-written file is left under the real name."""
    import lzma
    import shutil

    source, target = os.path.join(source_dir, name), os.path.join(target_dir, target_name)
    compress, decompress = target_name.endswith(KEPT_SUFFIX), name.endswith(KEPT_SUFFIX)
    if compress == decompress:
        shutil.copyfile(source, target)
        return
    with open(source, "rb") as f:
        data = f.read()
    write_atomically(target, lzma.compress(data) if compress else lzma.decompress(data))


def keep_run(run_dir: str, keep_dir: str) -> None:
    """Copies a finished run's small files (:data:`KEPT_FILES`, ``predictions_*.jsonl``) to ``keep_dir``,
    each ``*.jsonl`` compressed (:data:`KEPT_SUFFIX`), its ``metrics.jsonl`` compacted
    (:func:`compact_metrics`; a run restored from a kept folder is compact already: its summary is copied);
    ``eval.json`` last, so a copy interrupted half-way is not taken for a finished run."""
    import lzma

    os.makedirs(keep_dir, exist_ok=True)
    names = _kept_names(run_dir)
    if "eval.json" not in names:
        raise SystemExit(f"{run_dir} has no eval.json: only a finished run is kept")
    for name in [n for n in names if n not in ("eval.json", "metrics.jsonl")]:
        _copy(run_dir, keep_dir, name, name + KEPT_SUFFIX if name.endswith(".jsonl") else name)
    if "metrics.jsonl" in names:
        rows, summary = compact_metrics(_read_jsonl(os.path.join(run_dir, "metrics.jsonl")))
        text = "".join(json.dumps(row) + "\n" for row in rows)
        write_atomically(os.path.join(keep_dir, "metrics.jsonl" + KEPT_SUFFIX), lzma.compress(text.encode()))
        if SUMMARY not in names:
            write_json_atomically(summary, os.path.join(keep_dir, SUMMARY), indent=1)
    _copy(run_dir, keep_dir, "eval.json", "eval.json")


def restore_run(keep_dir: str, run_dir: str) -> bool:
    """Copies a kept run back into ``run_dir`` as the run wrote it (``*.jsonl.xz`` decompressed, the
    ``metrics.jsonl`` as kept: compacted; a plain ``*.jsonl`` of a run kept before they were compressed
    copied as it is), ``eval.json`` last; False if ``keep_dir`` holds none."""
    if not os.path.isfile(os.path.join(keep_dir, "eval.json")):
        return False
    os.makedirs(run_dir, exist_ok=True)
    names = _kept_names(keep_dir)
    for name in [n for n in names if n != "eval.json"] + ["eval.json"]:
        _copy(keep_dir, run_dir, name, name.removesuffix(KEPT_SUFFIX))
    return True


def train_command(preset: dict[str, Any], run_dir: str, arm: list[str], seed: int) -> list[str]:
    """The launch/train.py command of one run."""
    shared = [for_seed(o, seed) for o in preset.get("overrides", [])]
    data = [f"data.seed={seed}"] if data_seeded(preset) else []
    overrides = [*shared, *arm, f"train.seed={seed}", *data, f"run_dir={run_dir}"]
    script = os.path.join(ROOT, preset.get("entry", "launch/train.py"))  # e.g. experiments/train_baselines.py
    entry = [script, "--config", os.path.join(ROOT, preset["base_config"])]
    if preset.get("launcher", "python") == "python":
        return [sys.executable, *entry, *overrides]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    launcher = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(preset.get("procs", 1))]
    return [*launcher, "--master_port", str(port), *entry, *overrides]


def prepare(preset: dict[str, Any]) -> list[str]:
    """Runs the preset's ``prepare`` commands in ``ROOT``, each once, or once per seed where it names
    :data:`DATA_SEED` (a corpus per data seed); returns the commands run."""
    done = []
    for command in preset.get("prepare", []):
        for seed in preset["seeds"] if DATA_SEED in command else [None]:
            text = command if seed is None else for_seed(command, seed)
            print(f"[study] prepare: {text}", flush=True)
            if subprocess.call(text, shell=True, cwd=ROOT) != 0:
                raise SystemExit(f"[study] prepare step failed: {text}")
            done.append(text)
    return done


def finished_runs(preset: dict[str, Any], out: str, keep: str | None = None) -> dict[str, list[str]]:
    """The run directories per arm of the seeds at which every arm has finished (in ``out``, or kept in
    ``keep`` and restored into ``out``), training nothing; SystemExit if no seed has."""
    runs: dict[str, list[str]] = {arm: [] for arm in preset["arms"]}
    for seed in preset["seeds"]:
        dirs = {arm: os.path.join(out, slug(arm), f"seed{seed}") for arm in preset["arms"]}
        for arm, run_dir in dirs.items():
            kept = os.path.join(keep, slug(arm), f"seed{seed}") if keep else None
            if not os.path.isfile(os.path.join(run_dir, "eval.json")) and kept:
                restore_run(kept, run_dir)
        if all(os.path.isfile(os.path.join(d, "eval.json")) for d in dirs.values()):
            for arm, run_dir in dirs.items():
                runs[arm].append(run_dir)
    if not next(iter(runs.values())):
        raise SystemExit(f"[study] --no-run: no seed of {out} (or {keep}) has every arm finished")
    return runs


def run_all(
    preset: dict[str, Any], out: str, keep: str | None = None, start_until: float | None = None
) -> dict[str, list[str]]:
    """Trains every (arm, seed), ``parallel`` at a time; returns the run directories per arm. With
    ``keep``, runs kept there are restored instead of trained and each finished run is kept there. With
    ``start_until`` (a time.time()), no run starts after it: the runs started finish, then the study
    stops (SystemExit), the finished ones kept."""
    prepare(preset)
    runs: dict[str, list[str]] = {}
    todo = []
    for seed in preset["seeds"]:  # seed by seed: a study stopped early has every arm at the same seeds
        for arm, overrides in preset["arms"].items():
            run_dir = os.path.join(out, slug(arm), f"seed{seed}")
            runs.setdefault(arm, []).append(run_dir)
            kept = os.path.join(keep, slug(arm), f"seed{seed}") if keep else None
            if os.path.isfile(os.path.join(run_dir, "eval.json")):
                print(f"[study] {arm} seed {seed}: already done", flush=True)
                if kept and not os.path.isfile(os.path.join(kept, "eval.json")):
                    keep_run(run_dir, kept)
            elif kept and restore_run(kept, run_dir):
                print(f"[study] {arm} seed {seed}: restored from {kept}", flush=True)
            else:
                todo.append((arm, seed, run_dir, list(overrides), kept))
    parallel = max(1, int(preset.get("parallel", 1)))
    env = dict(os.environ)
    if parallel > 1 and "OMP_NUM_THREADS" not in env:  # share the cores between the runs
        env["OMP_NUM_THREADS"] = str(max(1, len(os.sched_getaffinity(0)) // parallel))
    active: list[tuple[subprocess.Popen, Any, str, int, str, float, str | None, dict[str, Any]]] = []
    threads = int(env["OMP_NUM_THREADS"]) if env.get("OMP_NUM_THREADS", "").isdigit() else None
    failed = []
    for index, (arm, seed, run_dir, overrides, kept) in enumerate(todo, start=1):
        while len(active) >= parallel:
            failed += _reap(active, threads, parallel)
        if start_until is not None and time.time() > start_until:
            failed.append(f"no run started after {time.strftime('%H:%M UTC', time.gmtime(start_until))} "
                          f"(--start-until): {len(todo) - index + 1} left, from {arm} seed {seed}")  # fmt: skip
            break
        print(f"[study] {index}/{len(todo)} {arm} seed {seed} -> {run_dir}", flush=True)
        os.makedirs(run_dir, exist_ok=True)
        log = open(os.path.join(run_dir, "train.log"), "w")
        source = checkout()  # what the run's process loads
        process = subprocess.Popen(
            train_command(preset, run_dir, overrides, seed), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env
        )
        active.append((process, log, arm, seed, run_dir, time.time(), kept, source))
    while active:
        failed += _reap(active, threads, parallel)
    if failed:
        raise SystemExit("[study] failed: " + "; ".join(failed))
    return runs


def _reap(active: list, threads: int | None, parallel: int) -> list[str]:
    """Waits for one run of ``active`` to end (removing it); returns its failure, if any. A finished run
    gets its ``run.json`` (:func:`provenance`) before it is kept."""
    while True:
        for item in list(active):
            process, log, arm, seed, run_dir, start, kept, source = item
            code = process.poll()
            if code is None:
                continue
            active.remove(item)
            log.close()
            if code != 0 or not os.path.isfile(os.path.join(run_dir, "eval.json")):
                return [f"{arm} seed {seed} (exit {code}; see {run_dir}/train.log)"]
            ended = time.time()
            print(f"[study]    {arm} seed {seed}: {ended - start:.0f} s", flush=True)
            write_provenance(run_dir, provenance(source, start, ended, threads, parallel))
            if kept:
                keep_run(run_dir, kept)
            return []
        time.sleep(1)


def _mean_spread(values: list[float]) -> tuple[float, float]:
    finite = [v for v in values if v is not None and math.isfinite(v)]
    if not finite:
        return math.nan, math.nan
    return statistics.fmean(finite), statistics.stdev(finite) if len(finite) > 1 else 0.0


def sequence_rows(run_dir: str, _cache: dict[str, list[dict[str, Any]]] = {}) -> list[dict[str, Any]]:  # noqa: B006
    """A run's ``heldout_sequences.jsonl`` (read once per study)."""
    if run_dir not in _cache:
        path = os.path.join(run_dir, "heldout_sequences.jsonl")
        if not os.path.isfile(path):
            raise SystemExit(f"{path} is missing: the per-sequence tests of held-out text need it (written at the "
                             "end of a packed run since 2026-11-23); re-run that run")  # fmt: skip
        rows = _read_jsonl(path)
        if rows and "labels_crc32" not in rows[0]:
            raise SystemExit(
                f"{path} has no labels_crc32 (an older run): re-run it so that its sequences can be paired"
            )
        _cache[run_dir] = rows
    return _cache[run_dir]


def sequence_metrics(rows: list[dict[str, Any]]) -> dict[str, float]:
    """The held-out metrics of some sequences' rows together (:func:`heldout_metrics` of their sums)."""
    totals = [sum(r.get(c, 0.0) for r in rows) for c in HELDOUT_COLUMNS]
    with_error = bool(rows) and "number_abs_error_sum" in rows[0]
    metrics = heldout_metrics(totals, 0.0, with_abs_error=with_error)
    return {m: metrics[m] for m in HELDOUT_METRICS if m in metrics}


def _groups(preset: dict[str, Any], runs: dict[str, list[str]] | None = None) -> dict[str, tuple[int, int]]:
    """The preset's ``heldout_groups``: name -> [first, stop) held-out sequence indices, given as a mapping
    or as the path of a corpus manifest (``heldout.groups`` of experiments/pretrain_corpus.py; read once
    the corpus is prepared, with ``runs``: each run must hold out the manifest's sequences of its length)."""
    groups = preset.get("heldout_groups") or {}
    if isinstance(groups, str):
        if runs is None:
            return {}
        template, found = groups, {}
        for run in (d for dirs in runs.values() for d in dirs):
            cfg = _read_json(os.path.join(run, "config.json"))
            path = for_seed(template, cfg["data"]["seed"])  # a corpus per data seed: the run's own manifest
            path = os.path.join(ROOT, path) if not os.path.isabs(path) else path
            if not os.path.isfile(path):
                raise SystemExit(
                    f"heldout_groups: no corpus manifest {path}; give a mapping or the corpus's manifest.json"
                )
            held = _read_json(path).get("heldout") or {}
            found[path] = held.get("groups") or {}
            got = (cfg["data"]["eval_sequences"], cfg["train"]["seq_length"])
            if got != (held.get("sequences"), held.get("seq_length")):
                raise SystemExit(
                    f"{run} held out {got[0]} sequences of {got[1]} tokens, but {path} places {held.get('sequences')} "
                    f"of {held.get('seq_length')}; build the corpus with the run's data.eval_sequences and seq_length"
                )
        if len({json.dumps(g, sort_keys=True) for g in found.values()}) > 1:
            raise SystemExit(f"heldout_groups: the corpora's manifests place different groups: {found}")
        groups = next(iter(found.values()), {})
    if not isinstance(groups, dict) or not all(
        isinstance(v, list) and len(v) == 2 and all(type(i) is int for i in v) and 0 <= v[0] < v[1]
        for v in groups.values()
    ):
        raise SystemExit(f"heldout_groups must map names to [first, stop) sequence indices, got {groups!r}")
    return {str(k): (v[0], v[1]) for k, v in groups.items()}


def run_eval(run_dir: str, groups: dict[str, tuple[int, int]]) -> dict[str, Any]:
    """A run's ``eval.json``, with a split ``heldout:<group>`` per held-out sequence group (metrics of
    the group's sequences of ``heldout_sequences.jsonl``)."""
    result = _read_json(os.path.join(run_dir, "eval.json"))
    if groups and "heldout" not in result:
        raise SystemExit(f"heldout_groups is set, but {run_dir} evaluated no held-out text (data.eval_sequences=0?)")
    if "heldout" in result and groups:
        rows = sequence_rows(run_dir)
        for name, (first, stop) in groups.items():
            if stop > len(rows):
                raise SystemExit(
                    f"heldout_groups {name}: [{first}, {stop}) but {run_dir} held out {len(rows)} sequences"
                )
            result[f"heldout:{name}"] = sequence_metrics(rows[first:stop])
    return result


def aggregate(runs: dict[str, list[str]], groups: dict[str, tuple[int, int]] | None = None) -> dict[str, Any]:
    """Mean and spread over seeds of every metric, per arm and split."""
    table: dict[str, Any] = {}
    for arm, dirs in runs.items():
        evals = [run_eval(d, groups or {}) for d in dirs]
        table[arm] = {}
        for split in evals[0]:
            table[arm][split] = {}
            for metric in metrics_of(evals[0][split]):
                values = [e[split].get(metric) for e in evals]
                mean, spread = _mean_spread(values)
                table[arm][split][metric] = {"mean": mean, "std": spread, "seeds": values}
    return table


def _errors(run_dir: str, split: str) -> list[tuple[str, bool, float]]:
    """(question, right, |error|) per evaluated question; an unparseable answer: wrong, error inf."""
    out = []
    for row in _read_jsonl(os.path.join(run_dir, f"predictions_{split}.jsonl")):
        truth = extract_number(row["answer"])  # as launch/train.py's evaluation reads it
        truth = math.nan if truth is None else truth
        parsed = row["parsed"]
        error = abs(parsed - truth) if parsed is not None and math.isfinite(truth) else math.inf
        out.append((row["question"], parsed is not None and parsed == truth, error))
    return out


def paired_tests(
    runs: dict[str, list[str]], table: dict[str, Any], baseline: str, groups: dict[str, tuple[int, int]] | None = None
) -> dict[str, Any]:
    """Each arm against ``baseline``, paired by seed (same init and data; same questions).

    * per seed, the test of the effect: the mean of the per-seed differences with its 95 % t-interval
      clipped to the metric's range, the paired t-test and the exact sign-flip test
      (:func:`seed_stats.seed_test`; Holm's adjustment over the study in ``results.json``'s ``seed_tests``);
    * per question and per held-out sequence, counts only (descriptive, no test): the questions only one
      arm got right, how often the arm's answer is the closer one (``closer``), how often its sequence
      metric is the better one (``sequences``; see :func:`_sequence_tests`). The same questions answered
      by every seed's models are not independent pairs, so no p is given for them.
    """
    out: dict[str, Any] = {}
    for arm, dirs in runs.items():
        if arm == baseline:
            continue
        out[arm] = {}
        for split in table[arm]:
            result: dict[str, Any] = {}
            for metric in table[arm][split]:
                if metric not in table[baseline][split]:
                    continue
                a, b = table[arm][split][metric]["seeds"], table[baseline][split][metric]["seeds"]
                test = seed_stats.seed_test(a, b, metric)
                kept = ("n", "mean_diff", "ci95", "p_seed_t", "p_sign_flip", "no_spread")
                result[metric] = {k: test[k] for k in kept}
            if split == "heldout" or split.startswith("heldout:"):
                first, stop = (groups or {}).get(split.partition(":")[2], (0, None))
                _sequence_tests(result, dirs, runs[baseline], slice(first, stop))
                out[arm][split] = result
                continue
            if not os.path.isfile(os.path.join(dirs[0], f"predictions_{split}.jsonl")):
                out[arm][split] = result
                continue
            only_arm = only_base = 0
            better = []
            for run, base in zip(dirs, runs[baseline]):
                for (q, right, err), (q0, right0, err0) in zip(_errors(run, split), _errors(base, split)):
                    if q != q0:
                        raise SystemExit(f"{run} and {base} evaluated different questions; cannot pair them")
                    only_arm += right and not right0
                    only_base += right0 and not right
                    if err != err0:
                        better.append(err0 - err)
            result["accuracy"]["questions"] = {"only_arm_right": only_arm, "only_baseline_right": only_base}
            result["mae"]["closer"] = {"n": len(better), "arm_closer": sum(d > 0 for d in better)}
            out[arm][split] = result
    return out


def _sequence_tests(result: dict[str, Any], dirs: list[str], base_dirs: list[str], part: slice) -> None:
    """Per held-out sequence (those of ``part``): each metric's value of the sequence alone, arm minus
    baseline (the arm's and the baseline's run of a seed hold out the same text: their labels' CRC-32
    must match, else the study stops), averaged over the seeds where every seed holds out the same text,
    else each (seed, sequence) on its own (a corpus per data seed). Counted, not tested: the sequences
    answered by the same models are not independent pairs (the seed-level test is the test of the
    effect). A sequence without the metric's label kind is left out of that metric. Adds ``sequences`` =
    {n, arm_better} to the metrics of ``result``."""
    per_seed = []
    for run, base in zip(dirs, base_dirs):  # the arm's and the baseline's run of one seed: the same text
        if [r["labels_crc32"] for r in sequence_rows(run)] != [r["labels_crc32"] for r in sequence_rows(base)]:
            raise SystemExit(f"{run} and {base} hold out different text; cannot pair their sequences")
        rows, base_rows = sequence_rows(run)[part], sequence_rows(base)[part]
        per_seed.append([(sequence_metrics([r]), sequence_metrics([r0])) for r, r0 in zip(rows, base_rows)])
    texts = {tuple(r["labels_crc32"] for r in sequence_rows(base)) for base in base_dirs}
    units = list(zip(*per_seed))  # one held-out sequence, every seed
    if len(texts) > 1:  # a corpus per data seed: sequence i of one seed is not sequence i of another
        units = [(pair,) for pairs in per_seed for pair in pairs]
    for metric in result:
        if metric not in LOWER_BETTER:
            continue
        diffs = []
        for pairs in units:
            if all(metric in a and metric in b for a, b in pairs):
                d = statistics.fmean(a[metric] - b[metric] for a, b in pairs)
                scale = max(abs(a[metric]) + abs(b[metric]) for a, b in pairs)
                diffs.append(d if abs(d) > 1e-12 * scale else 0.0)  # differences that cancel are ties, not 1e-17
        nonzero = [d for d in diffs if d != 0]
        result[metric]["sequences"] = {
            "n": len(diffs),
            "arm_better": sum((d < 0) == LOWER_BETTER[metric] for d in nonzero),
        }


HARNESS_TASKS = ("ntl_run",)
"""The harness's tasks a study scores by default (``--harness``): each run's own held-out questions,
prompted as the run's scorer prompts them (``ntl_scale.eval.tasks``, ``prepare --run-dir``)."""


def run_harness(run_dir: str, tasks: tuple[str, ...] | list[str] = HARNESS_TASKS, limit: int | None = None) -> dict:
    """lm-evaluation-harness on a finished run's ``hf_model`` (``--model hf``), once: the task folder written
    for the run (``RUN/harness_tasks``), the results under ``RUN/harness``; returns and writes
    ``RUN/harness.json``: per task its metrics (``exact_match``, ``abs_error``, ``rel_error``, ``parsed``, ...),
    the wall seconds it took and the harness process's CPU seconds. A run that has one is not scored again."""
    path = os.path.join(run_dir, "harness.json")
    if os.path.isfile(path):
        return _read_json(path)
    import resource

    from launch.eval_tasks import latest_results
    from ntl_scale.eval.tasks import prepare as prepare_tasks

    started, children = time.time(), resource.getrusage(resource.RUSAGE_CHILDREN)
    folder = os.path.join(run_dir, "harness_tasks")
    prepare_tasks(folder, run_dir=run_dir)
    command = [sys.executable, "-m", "lm_eval", "--model", "hf", "--model_args",
               f"pretrained={os.path.join(run_dir, 'hf_model')}", "--include_path", folder, "--tasks",
               ",".join(tasks), "--output_path", os.path.join(run_dir, "harness"), "--batch_size", "8"]  # fmt: skip
    if limit is not None:
        command += ["--limit", str(limit)]
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    with open(os.path.join(run_dir, "harness.log"), "w") as log:
        if subprocess.call(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env) != 0:
            raise SystemExit(f"[study] the harness failed on {run_dir} (see {run_dir}/harness.log)")
    found = latest_results(os.path.join(run_dir, "harness"))["results"]
    scored = {task: {k.split(",")[0]: v for k, v in values.items()
                     if "," in k and "stderr" not in k and isinstance(v, (int, float))}
              for task, values in found.items()}  # fmt: skip
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - children.ru_utime - children.ru_stime
    record = {"tasks": scored, "seconds": time.time() - started, "cpu_seconds": cpu}
    write_json_atomically(record, path)
    return record


def harness_table(runs: dict[str, list[str]]) -> dict[str, Any]:
    """Per arm, per harness task, per metric: mean, spread and every seed's value (as :func:`aggregate`)."""
    table: dict[str, Any] = {}
    for arm, dirs in runs.items():
        records = [_read_json(os.path.join(d, "harness.json"))["tasks"] for d in dirs]
        table[arm] = {}
        for task in records[0]:
            table[arm][task] = {}
            for metric in records[0][task]:
                values = [r.get(task, {}).get(metric) for r in records]
                mean, spread = _mean_spread(values)
                table[arm][task][metric] = {"mean": mean, "std": spread, "seeds": values}
    return table


def harness_markdown(harness: dict[str, Any], table: dict[str, Any], seconds: list[float]) -> str:
    """The harness's metrics beside the study's own (``ntl_run_<split>`` beside the split's accuracy and MAE)."""
    lines = [f"**lm-evaluation-harness beside the study's scorer** ({statistics.fmean(seconds):.1f} s per run; "
             "mean +- standard deviation over seeds)", "",
             "| arm | task | exact_match | accuracy (scorer) | abs_error | MAE (scorer) | rel_error | parsed |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip

    def cell(m: dict[str, Any] | None) -> str:
        return f"{m['mean']:.4g} +- {m['std']:.2g}" if m and math.isfinite(m["mean"]) else "n/a"

    for arm, tasks in harness.items():
        for task, metrics in tasks.items():
            own = table.get(arm, {}).get(task.removeprefix("ntl_run_"), {}) if task.startswith("ntl_run_") else {}
            cells = [cell(metrics.get("exact_match")), cell(own.get("accuracy")), cell(metrics.get("abs_error")),
                     cell(own.get("mae")), cell(metrics.get("rel_error")), cell(metrics.get("parsed"))]  # fmt: skip
            lines.append(f"| {arm} | {task} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _p(p: float) -> str:
    return "n/a" if not math.isfinite(p) else ("< 0.001" if p < 0.001 else f"{p:.3f}")


def markdown(table: dict[str, Any], preset_path: str, seeds: list[int], tests: dict[str, Any], baseline: str) -> str:
    """The results: mean +- std over seeds per arm, every seed's value, and the paired tests."""
    splits = list(next(iter(table.values())))
    lines = [f"Preset `{preset_path}`, {len(seeds)} seeds ({', '.join(map(str, seeds))}); mean +- standard "
             "deviation over seeds.", ""]  # fmt: skip
    for split in splits:
        if "accuracy" not in next(iter(table.values()))[split]:
            lines += _heldout_markdown(table, split, tests, baseline)
            continue
        lines += [f"**{split}**", "", "| arm | accuracy | MAE | log-MAE | R^2 |", "|---|---:|---:|---:|---:|"]
        for arm, splits_of_arm in table.items():
            cells = []
            for metric in METRICS:
                m = splits_of_arm[split][metric]
                cells.append(f"{m['mean']:.3f} +- {m['std']:.3f}" if math.isfinite(m["mean"]) else "n/a")
            lines.append(f"| {arm} | " + " | ".join(cells) + " |")
        lines += ["", f"Per seed ({split}; accuracy / MAE):", ""]
        for arm, splits_of_arm in table.items():
            acc, mae = splits_of_arm[split]["accuracy"]["seeds"], splits_of_arm[split]["mae"]["seeds"]
            lines.append(f"- {arm}: " + ", ".join(f"{a:.3f} / {e:.3g}" for a, e in zip(acc, mae)))
        if tests:
            lines += _tests_markdown(tests, split, baseline, ("accuracy", "mae", "log_mae", "r2"))
        lines.append("")
    return "\n".join(lines)


def _interval(t: dict[str, Any]) -> str:
    """The mean difference and its interval; equal per-seed differences: "no spread over n seeds" (no interval)."""
    return seed_stats.interval_text(t)


def _tests_markdown(tests: dict[str, Any], split: str, baseline: str, metrics: Any) -> list[str]:
    """The paired tests of one split: per arm and metric the mean per-seed difference with its 95 %
    interval (clipped to the metric's range), the seed-level t-test and sign-flip test, and the
    descriptive counts over questions or sequences (no test: not independent pairs)."""
    lines = ["", f"Paired against {baseline} ({split}), by seed: the mean of the per-seed differences [95 % "
             "t-interval, clipped to the metric's range], the paired t-test and the exact sign-flip test over the "
             "seeds (Holm's adjustment over the study: the seed-level table). Counts over questions or held-out "
             "sequences of every seed are descriptive: the same models answer them all, so they are not "
             "independent pairs and get no test ('better': lower perplexity or error, higher accuracy).", "",
             "| arm | metric | diff [95 % interval] | t-test p | sign-flip p | counts (descriptive) |",
             "|---|---|---|---:|---:|---|"]  # fmt: skip
    for arm, per_split in tests.items():
        for metric in metrics:
            t = per_split[split].get(metric)
            if t is None:
                continue
            count = ""
            if "questions" in t:
                count = f"right only here {t['questions']['only_arm_right']}, only {baseline} " \
                        f"{t['questions']['only_baseline_right']}"  # fmt: skip
            elif "closer" in t:
                count = f"closer in {t['closer']['arm_closer']} of {t['closer']['n']} unequal errors"
            elif "sequences" in t:
                count = f"better in {t['sequences']['arm_better']} of {t['sequences']['n']} sequences"
            lines.append(f"| {arm} | {metric} | {_interval(t)} | {_p(t['p_seed_t'])} | "
                         f"{_p(t.get('p_sign_flip', math.nan))} | {count} |")  # fmt: skip
    return lines


def _heldout_markdown(table: dict[str, Any], split: str, tests: dict[str, Any], baseline: str) -> list[str]:
    """The held-out text table: each metric's mean +- std over seeds, then the paired tests."""
    metrics = list(next(iter(table.values()))[split])
    lines = [f"**{split}** (held-out text; ppl: perplexity)", "", "| arm | " + " | ".join(metrics) + " |",
             "|---|" + "---:|" * len(metrics)]  # fmt: skip
    for arm, per_split in table.items():
        cells = [f"{per_split[split][m]['mean']:.4g} +- {per_split[split][m]['std']:.2g}" for m in metrics]
        lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    if tests:
        lines += _tests_markdown(tests, split, baseline, metrics)
    return [*lines, ""]


def _predictions(dirs: list[str], split: str) -> list[dict[str, Any]]:
    rows = []
    for d in dirs:
        path = os.path.join(d, f"predictions_{split}.jsonl")
        if os.path.isfile(path):
            rows += _read_jsonl(path)
    return rows


def _by_digits(runs: dict[str, list[str]], split: str) -> dict[str, dict[int, list[tuple[bool, float]]]]:
    """Per arm: digits of the true answer -> (right, |error|) of every question of ``split`` over the seeds."""
    out: dict[str, dict[int, list[tuple[bool, float]]]] = {}
    for arm, dirs in runs.items():
        by_digits: dict[int, list[tuple[bool, float]]] = out.setdefault(arm, {})
        for row in _predictions(dirs, split):
            truth = extract_number(row["answer"])
            if truth is None or truth != int(truth):  # answers by digits: whole numbers only
                continue
            digits = len(str(abs(int(truth))))
            pred = row["parsed"]
            error = abs(pred - truth) if pred is not None else math.nan
            by_digits.setdefault(digits, []).append((pred is not None and pred == truth, error))
    return out


def plots(runs: dict[str, list[str]], out: str) -> list[str]:
    """Writes the three PNGs; returns their paths."""
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written: list[str] = []
    # loss curves, mean over seeds
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for arm, dirs in runs.items():
        curves = [_read_jsonl(os.path.join(d, "metrics.jsonl")) for d in dirs]
        for ax, key in zip(axes, ("ce", "ntl")):
            # per step, the mean over the seeds that logged it (a step without such tokens has no value: metrics.py)
            by_step: dict[int, list[float]] = {}
            for curve in curves:
                for row in curve:
                    if key in row:
                        by_step.setdefault(row["step"], []).append(row[key])
            steps = sorted(by_step)
            ax.plot(steps, [statistics.fmean(by_step[step]) for step in steps], label=arm)
    # each arm logs the NTL term of its own loss (the CE arm: NTL-WAS at weight 0, logged only)
    for ax, title in zip(axes, ("cross entropy", "NTL term of the arm's loss")):
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend()
    _save(fig, os.path.join(out, "loss_curves.png"), written)

    # error by number of digits of the true answer, for the splits answered by generation
    first = next(iter(runs.values()))[0]
    splits = tuple(s for s in _read_json(os.path.join(first, "eval.json"))
                   if os.path.isfile(os.path.join(first, f"predictions_{s}.jsonl")))  # fmt: skip
    if not splits:
        return written
    by_split = {split: _by_digits(runs, split) for split in splits}
    # a split whose accuracy is zero for every arm and digit count (a model that never extrapolates)
    # keeps only its error row: an all-zero accuracy panel carries no information
    informative = {split: any(ok for cells in by_split[split].values() for rows in cells.values() for ok, _ in rows)
                   for split in splits}  # fmt: skip
    fig, axes = plt.subplots(2, len(splits), figsize=(11, 7), squeeze=False)
    for col, split in enumerate(splits):
        for arm, by_digits in by_split[split].items():
            xs = sorted(by_digits)
            accuracy = [statistics.fmean(ok for ok, _ in by_digits[x]) for x in xs]
            mae = [statistics.fmean([e for _, e in by_digits[x] if math.isfinite(e)] or [math.nan]) for x in xs]
            axes[0][col].plot(xs, accuracy, marker="o", label=arm)
            axes[1][col].plot(xs, mae, marker="o", label=arm)
        axes[0][col].set_title(f"{split}: exact-match accuracy")
        axes[1][col].set_title(f"{split}: mean absolute error")
        axes[1][col].set_yscale("log")
        if not informative[split]:
            axes[0][col].set_visible(False)
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
                value = extract_number(row["answer"])
                if row["parsed"] is None or value is None or value != int(value) or row["parsed"] != int(row["parsed"]):
                    continue  # digit offsets of whole numbers only
                truth, pred = str(abs(int(value))), str(abs(int(row["parsed"])))
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


def _utc_next(text: str, now: float | None = None) -> float:
    """``--start-until`` as a time.time(): ``HH:MM`` (UTC) is its next occurrence (today's, or tomorrow's once
    today's has passed), as ``shutdown HH:MM`` reads it, so a study at 23:40 told ``00:30`` runs past midnight;
    ``YYYY-MM-DDTHH:MM`` (UTC) is that moment (what ``size_sweep.py`` passes each size, so that one deadline
    holds for the whole sweep)."""
    import datetime

    match = re.fullmatch(r"(?:(\d{4})-(\d{2})-(\d{2})T)?([01]?\d|2[0-3]):([0-5]\d)", text)
    if not match:
        raise SystemExit(f"--start-until {text!r}: expected HH:MM (UTC, e.g. 10:05) or YYYY-MM-DDTHH:MM (UTC)")
    hour, minute = int(match[4]), int(match[5])
    if match[1]:
        try:
            moment = datetime.datetime(int(match[1]), int(match[2]), int(match[3]), hour, minute,
                                       tzinfo=datetime.timezone.utc)  # fmt: skip
        except ValueError as e:  # 2026-02-30, month 13
            raise SystemExit(f"--start-until {text!r}: no such date ({e}); expected YYYY-MM-DDTHH:MM (UTC)") from None
        return moment.timestamp()
    now = time.time() if now is None else now
    today = datetime.datetime.fromtimestamp(now, datetime.timezone.utc)
    at = today.replace(hour=hour, minute=minute, second=0, microsecond=0).timestamp()
    return at if at > now else at + 86400


def _deadline_line(text: str, until: float, now: float) -> str:
    """What a study prints of its ``--start-until``: the moment, how far, and why if it is not what HH:MM reads
    as today (tomorrow's, since today's had passed) or has passed already (a moment: nothing will start)."""
    when = f"no run starts after {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(until))}"
    if until <= now:
        return f"{when} (--start-until {text}: already passed, {(now - until) / 3600:.1f} h ago: no run will start)"
    why = ""
    if "T" not in text and time.gmtime(until).tm_yday != time.gmtime(now).tm_yday:
        why = f"; today's {text} had passed, so tomorrow's was taken"
    return f"{when} (--start-until {text}: in {(until - now) / 3600:.1f} h{why})"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="configs/study/cpu.yaml", help="study preset YAML")
    parser.add_argument("--out", default=None, help="output folder (default: runs/study-<preset name>)")
    parser.add_argument("--parallel", type=int, default=None, help="runs at once (default: the preset's parallel)")
    parser.add_argument(
        "--keep",
        default=None,
        help="folder that keeps each finished run's small files, and "
        "from which kept runs are restored instead of trained (e.g. experiments/finished_runs/NAME)",
    )
    parser.add_argument("--no-run", action="store_true",
                        help="train nothing: run the preset's prepare commands, restore the kept runs (--keep) and "
                             "tabulate the seeds at which every arm has finished (a study under way; results.json's "
                             "preset lists those seeds)")  # fmt: skip
    parser.add_argument("--harness", action="store_true",
                        help="also score every run with lm-evaluation-harness (the preset's harness.tasks, "
                             "default ntl_run: the run's held-out questions), reported beside the study's")  # fmt: skip
    parser.add_argument("--start-until", default=None, metavar="HH:MM",
                        help="start no run after this time (UTC; its next occurrence, tomorrow's once today's has "
                             "passed; or YYYY-MM-DDTHH:MM): the started runs finish, the study stops "
                             "without tabulating (a machine shared on a schedule)")  # fmt: skip
    args = parser.parse_args(argv)
    if not os.path.isfile(args.preset):
        raise SystemExit(f"--preset {args.preset}: no such file (presets: configs/study/*.yaml)")
    preset = load_preset(args.preset)
    if args.parallel is not None:
        if args.parallel < 1:
            raise SystemExit(f"--parallel {args.parallel}: expected at least 1 run at a time")
        preset["parallel"] = args.parallel
    out = args.out or os.path.join("runs", "study-" + os.path.splitext(os.path.basename(args.preset))[0])
    os.makedirs(out, exist_ok=True)
    start = time.time()
    _groups(preset)  # a mapping is checked before any run; a manifest once the corpus is prepared
    if args.no_run:
        prepare(preset)  # the corpus the held-out groups are read from (deterministic, seconds)
        runs = finished_runs(preset, out, args.keep)
        preset["seeds"] = [int(os.path.basename(d).removeprefix("seed")) for d in next(iter(runs.values()))]
    else:
        until = _utc_next(args.start_until) if args.start_until else None
        if until is not None:
            print(f"[study] {_deadline_line(args.start_until, until, time.time())}", flush=True)
        runs = run_all(preset, out, args.keep, until)
    groups = _groups(preset, runs)
    table = aggregate(runs, groups)
    baseline = preset.get("baseline", next(iter(preset["arms"])))
    if baseline not in preset["arms"]:
        raise SystemExit(f"{args.preset}: baseline {baseline!r} is not one of the arms {list(preset['arms'])}")
    tests = paired_tests(runs, table, baseline, groups) if len(preset["seeds"]) > 0 else {}
    against = {}  # also_against: the arms other than both baselines, paired against a second arm
    for other in preset.get("also_against", []):
        tested = {arm: dirs for arm, dirs in runs.items() if arm not in (baseline, other)}
        against[other] = paired_tests({other: runs[other], **tested}, table, other, groups) if tested else {}
    records = read_provenance(runs)
    harness, harness_seconds = None, []
    if args.harness or preset.get("harness", {}).get("enabled", False):
        spec = preset.get("harness", {})
        for dirs in runs.values():
            for run_dir in dirs:
                harness_seconds.append(
                    run_harness(run_dir, spec.get("tasks", HARNESS_TASKS), spec.get("limit"))["seconds"]
                )
        harness = harness_table(runs)
    with open(os.path.join(out, "results.json"), "w") as f:
        summary: dict[str, Any] = {"preset": preset, "results": table, "paired_tests": tests,
                                   "seconds": time.time() - start, "runs": records}  # fmt: skip
        if against:
            summary["paired_tests_against"] = against
        if harness is not None:
            summary["harness"] = harness
        summary["seed_tests"] = seed_stats.seed_tests(summary)  # the study's family, Holm-adjusted
        json.dump(summary, f, indent=2)
    text = seed_stats.markdown(summary["seed_tests"]) + "\n\n"
    text += markdown(table, args.preset, preset["seeds"], tests, baseline)
    for other, other_tests in against.items():
        subset = {arm: table[arm] for arm in (other, *other_tests)}
        text += f"\n\n**Paired against {other}**\n\n" + markdown(
            subset, args.preset, preset["seeds"], other_tests, other
        )
    if harness is not None:
        text += "\n\n" + harness_markdown(harness, table, harness_seconds)
    text += "\n\n" + provenance_line(records)
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(text + "\n")
    pngs = plots(runs, out)
    verdict = figures.verdict_figure(summary, os.path.join(out, "verdict.png"), title=os.path.basename(args.preset))
    pngs += [verdict] if verdict else []
    print(text)
    print(f"[study] {time.time() - start:.0f} s; results and plots in {out}: {', '.join(map(os.path.basename, pngs))}")
    return table


if __name__ == "__main__":
    main()
