"""The GPU scaling study: NTL's text cost and number gain at 20 tokens per total parameter, 25 M to 1 B.

    python experiments/gpu_study_submit.py --data DATA.yaml [--runs RUNS]  # the whole study on Slurm (its own file)
    python experiments/gpu_study.py plan  --stage pilot|main|secondary            # tasks, tokens, iterations
    python experiments/gpu_study.py cost  --stage main [--write-doc]              # the cost table (markdown)
    python experiments/gpu_study.py argv  --data DATA.yaml --task I --phase train|eval|harness --run-dir D
    python experiments/gpu_study.py seeds --runs RUNS --write STUDY.yaml          # the pilot's power step
    python experiments/gpu_study.py prepare-text --data DATA.yaml --out DIR       # corpora as JSON lines
    python experiments/gpu_study.py collect --stage main --runs RUNS --out OUT    # tables, figure, verdicts

One study file (``configs/gpu_study/study.yaml``) holds everything but the site's data: the Megatron
flags every run shares, the sizes (Llama-style shapes), the arms (``--ntl-*`` flags), the stages (sizes,
arms and seeds of each: the noise pilot, the main stage, the secondary arm), the power calculation's
settings, the tokens-per-parameter rule, the number-rich share of the training mix, the evaluation sets,
the harness's tasks, the analysis (metrics, verdict rule) and the cost model. The data file
(``configs/gpu_study/data.example.yaml``: the tokenizer, the downloaded corpora and their indexed
datasets) is the site's. Array task ``I`` of a stage is (size, arm, seed) in the order
``for size: for arm: for seed`` (:func:`tasks`); stages share run folders, so a run an earlier stage did
is not run again. ``launch/slurm/gpu_study.sbatch`` runs one task per Slurm array task through
``launch/pretrain_gpt_ntl.py`` (Megatron-LM): ``train`` (resumable from its checkpoints), ``eval``
(``--skip-train`` on the last checkpoint: perplexity on each held-out set and the number metrics, with
the same ``--ntl-*`` evaluation flags for every arm so that CE's number metrics are measured too), then
``harness`` (lm-evaluation-harness's Megatron-LM backend on the same checkpoint: :func:`harness_argv`).
``seeds`` turns the pilot's measured seed-to-seed sd into the main stage's seeds (``experiments/power.py``).
``experiments/gpu_study_submit.py`` chains the stages on Slurm, each after the one before.
``collect`` reads every run's ``eval.json`` and ``harness.json``, writes a ``results.json`` per size in
``experiments/study.py``'s layout, tabulates them with ``experiments/size_sweep.py`` (the same per-seed
paired differences, intervals, tests and trend over log10(total parameters) as the CPU size sweep) and
applies the verdict rule of ``docs/gpu_study.md`` (:func:`verdict`).

Parameters are counted from the shape (:func:`parameters`; tests check the count against a Hugging
Face Llama built on the meta device). Tokens per run are ``tokens_per_parameter`` x the parameters of
``parameter_basis`` (``total`` by default, embeddings included), rounded up to whole iterations.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import re
import shlex
import shutil
import statistics
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import yaml

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)

from launch.megatron_args import flags  # noqa: E402  (one reading of {flag: value} as Megatron's argv)

SHAPE_KEYS = ("num-layers", "hidden-size", "ffn-hidden-size", "num-attention-heads", "num-query-groups")
"""The Megatron flags of a size's shape (all required)."""
SIZE_KEYS = (*SHAPE_KEYS, "global-batch-size", "lr", "mfu")
"""The keys a size entry must have; any other key of it is a Megatron flag for that size."""
POWER_KEYS = ("stage", "alpha", "family", "power", "max_seeds", "effects")
"""The keys of the ``power`` section (the pilot's power step), required where a stage's seeds are 'power'."""
DATA_KEYS = ("tokenizer", "text", "number_rich", "valid")
"""The keys of the site's data file."""
BASES = ("total", "non_embedding")
"""What ``tokens_per_parameter`` multiplies (``parameter_basis``): every parameter (Chinchilla's count,
embeddings included), or the non-embedding ones (Kaplan's)."""


@dataclass(frozen=True)
class Task:
    """One array task: a size, an arm and a seed."""

    index: int
    size: str
    arm: str
    seed: int

    @property
    def run_name(self) -> str:
        """The run's folder under the study's runs folder: ``<size>/<arm slug>/seed<S>``."""
        return f"{slug(self.size)}/{slug(self.arm)}/seed{self.seed}"


def slug(text: str) -> str:
    """``CE + NTL-WAS 0.1`` -> ``ce-ntl-was-0.1``: a folder name."""
    return re.sub(r"[^a-z0-9.]+", "-", text.lower()).strip("-")


def load(path: str) -> dict[str, Any]:
    """Reads and checks a study file (see the module docstring); names the value and the fix on errors."""
    if not os.path.isfile(path):
        raise ValueError(f"study file {path!r} does not exist: pass --config configs/gpu_study/study.yaml")
    with open(path, encoding="utf-8") as f:
        study = yaml.safe_load(f)
    kinds = {"megatron_args": dict, "sizes": dict, "arms": dict, "stages": dict, "eval": dict, "cost": dict}
    for key, kind in kinds.items():
        if not isinstance(study, dict) or not isinstance(study.get(key), kind) or not study[key]:
            raise ValueError(f"{path}: expected a non-empty {kind.__name__} {key!r} at the top level")
    for name, size in study["sizes"].items():
        missing = [k for k in SIZE_KEYS if k not in size]
        if missing:
            raise ValueError(f"{path}: size {name!r} lacks {missing}; every size needs {list(SIZE_KEYS)}")
        if size["num-attention-heads"] % size["num-query-groups"] or size["hidden-size"] % size["num-attention-heads"]:
            raise ValueError(
                f"{path}: size {name!r}: hidden-size {size['hidden-size']} must divide by num-attention-heads "
                f"{size['num-attention-heads']}, which must divide by num-query-groups {size['num-query-groups']}"
            )
    share = study.get("number_share")
    if not isinstance(share, (int, float)) or not 0 <= share < 1:
        raise ValueError(
            f"{path}: number_share = {share!r}: expected the number-rich share of training tokens, in [0, 1)"
        )
    tpp = study.get("tokens_per_parameter")
    if not isinstance(tpp, (int, float)) or tpp <= 0:
        raise ValueError(f"{path}: tokens_per_parameter = {tpp!r}: expected a number > 0 (e.g. 20)")
    basis = study.get("parameter_basis", "total")
    if basis not in BASES:
        raise ValueError(f"{path}: parameter_basis = {basis!r}: expected one of {list(BASES)}")
    for name, stage in study["stages"].items():
        if not isinstance(stage, dict) or not all(k in stage for k in ("sizes", "arms", "seeds")):
            raise ValueError(f"{path}: stage {name!r} needs sizes, arms and seeds")
        unknown = [s for s in stage["sizes"] if s not in study["sizes"]] + [
            a for a in stage["arms"] if a not in study["arms"]
        ]
        if unknown:
            raise ValueError(f"{path}: stage {name!r} names {unknown}, which are not in sizes or arms")
        seeds = stage["seeds"]
        counts = seeds.values() if isinstance(seeds, dict) else [seeds]
        if not all(c == "power" or (isinstance(c, int) and not isinstance(c, bool) and c >= 1) for c in counts):
            raise ValueError(
                f"{path}: stage {name!r} seeds = {seeds!r}: expected a whole number >= 1, or per size a number "
                "or 'power' (set by `gpu_study.py seeds` from the pilot)"
            )
    order = list(study["stages"])
    powered = [n for n in order if isinstance(study["stages"][n]["seeds"], dict)
               and "power" in study["stages"][n]["seeds"].values()]  # fmt: skip
    if powered:
        spec = study.get("power")
        missing = [k for k in POWER_KEYS if not isinstance(spec, dict) or k not in spec]
        if missing:
            raise ValueError(
                f"{path}: stages {powered} leave seeds to 'power', but the power section lacks {missing}: "
                f"add power: {{{', '.join(POWER_KEYS)}}} (see configs/gpu_study/study.yaml), or give the seeds"
            )
        if spec["stage"] not in order or order.index(spec["stage"]) >= order.index(powered[0]):
            raise ValueError(
                f"{path}: power.stage = {spec['stage']!r}: expected a stage before {powered[0]!r} "
                f"(the stages are {order}): its runs measure the sd that sets the seeds"
            )
        if "main" not in powered:
            raise ValueError(f"{path}: the stage whose seeds the power sets is 'main'; stages {powered} are not")
    return study


def load_data(path: str) -> dict[str, Any]:
    """Reads the site's data file (tokenizer and Megatron indexed-data prefixes)."""
    if not path or not os.path.isfile(path):
        raise ValueError(
            f"data file {path!r} does not exist: copy configs/gpu_study/data.example.yaml, fill in your tokenizer "
            "and indexed corpora, and pass its path (--data, or NTL_STUDY_DATA for the sbatch script)"
        )
    with open(path, encoding="utf-8") as f:
        data = yaml.safe_load(f)
    missing = [k for k in DATA_KEYS if not isinstance(data, dict) or not data.get(k)]
    if missing:
        raise ValueError(
            f"{path}: missing {missing}; expected {list(DATA_KEYS)} (see configs/gpu_study/data.example.yaml)"
        )
    return data


def parameters(size: dict[str, Any], vocab: int) -> dict[str, int]:
    """Parameters of a Llama-style Megatron GPT (RMSNorm, SwiGLU, no biases, grouped-query attention,
    untied input and output embeddings) with a padded vocabulary of ``vocab``.

    Returns ``non_embedding`` (the transformer layers and the final norm), ``embedding`` (the input
    table), ``output`` (the output layer) and ``total``.
    """
    d, layers, ffn = size["hidden-size"], size["num-layers"], size["ffn-hidden-size"]
    heads, groups = size["num-attention-heads"], size["num-query-groups"]
    head_dim = d // heads
    attention = d * (heads + 2 * groups) * head_dim + heads * head_dim * d  # q, k, v; output projection
    mlp = d * 2 * ffn + ffn * d  # gate and up (SwiGLU), down
    per_layer = attention + mlp + 2 * d  # two RMSNorm weights
    non_embedding = layers * per_layer + d  # + the final norm
    return {"non_embedding": non_embedding, "embedding": vocab * d, "output": vocab * d,
            "total": non_embedding + 2 * vocab * d}  # fmt: skip


def padded_vocab(study: dict[str, Any]) -> int:
    """The vocabulary Megatron pads the tokenizer's to (``cost.vocab_size`` rounded up to
    ``make-vocab-size-divisible-by`` x the tensor-parallel size)."""
    args = study["megatron_args"]
    multiple = int(args.get("make-vocab-size-divisible-by", 128)) * int(args.get("tensor-model-parallel-size", 1))
    return -(-int(study["cost"]["vocab_size"]) // multiple) * multiple


def budget(study: dict[str, Any], name: str) -> dict[str, Any]:
    """One size's token budget: parameters, tokens (tokens per parameter x non-embedding parameters, up to
    whole iterations), iterations, and the cost model (FLOPs = 6 N D, N the parameters a token's forward
    multiplies with: non-embedding + output layer; GPU-hours at the size's MFU of the peak)."""
    size = study["sizes"][name]
    counts = parameters(size, padded_vocab(study))
    seq = int(study["megatron_args"]["seq-length"])
    per_iter = int(size["global-batch-size"]) * seq
    basis = study.get("parameter_basis", "total")
    wanted = study["tokens_per_parameter"] * counts[basis]
    iters = math.ceil(wanted / per_iter)
    tokens = iters * per_iter
    compute_params = counts["non_embedding"] + counts["output"]
    flops = 6 * compute_params * tokens
    peak = float(study["cost"]["peak_flops"])
    hours = flops / (float(size["mfu"]) * peak) / 3600
    return {"size": name, **counts, "compute_parameters": compute_params, "tokens": tokens, "iterations": iters,
            "tokens_per_parameter": tokens / counts[basis], "tokens_per_total_parameter": tokens / counts["total"],
            "tokens_per_non_embedding_parameter": tokens / counts["non_embedding"], "basis": basis,
            "flops": flops, "mfu": float(size["mfu"]), "gpu_hours": hours}  # fmt: skip


def stage_seeds(study: dict[str, Any], stage: str) -> dict[str, list[int]]:
    """The seeds of each size of ``stage``: ``seeds`` is a count for every size, or a count per size."""
    if stage not in study["stages"]:
        raise ValueError(f"stage {stage!r}: the study file has stages {list(study['stages'])}")
    spec = study["stages"][stage]
    out = {}
    for size in spec["sizes"]:
        count = spec["seeds"].get(size) if isinstance(spec["seeds"], dict) else spec["seeds"]
        if count is None or count == "power":
            raise ValueError(
                f"stage {stage!r}: the seeds of {size} are not set ({count!r}): run the pilot, then "
                "`python experiments/gpu_study.py seeds --runs RUNS --write STUDY.yaml` and submit that file"
            )
        out[size] = list(range(int(count)))
    return out


def tasks(study: dict[str, Any], stage: str = "pilot") -> list[Task]:
    """Every run of ``stage`` in array order: for each size, each arm, each seed. Stages share run folders:
    a run of the pilot is the same run in the main stage (resubmitted, it does nothing)."""
    seeds = stage_seeds(study, stage)
    out = []
    for size in study["stages"][stage]["sizes"]:
        for arm in study["stages"][stage]["arms"]:
            for seed in seeds[size]:
                out.append(Task(len(out), size, arm, seed))
    return out


def task(study: dict[str, Any], index: int, stage: str = "pilot") -> Task:
    """Array task ``index`` of ``stage``; a clear error outside the array."""
    every = tasks(study, stage)
    if not 0 <= index < len(every):
        raise ValueError(
            f"task {index}: stage {stage!r} has tasks 0-{len(every) - 1} (sbatch --array=0-{len(every) - 1})"
        )
    return every[index]


def argv(
    study: dict[str, Any], data: dict[str, Any], index: int, phase: str, run_dir: str, stage: str = "pilot"
) -> list[str]:
    """The Megatron arguments of array task ``index`` of ``stage`` in ``phase`` (``train`` or ``eval``), or in
    ``harness`` lm-evaluation-harness's (:func:`harness_argv`)."""
    if phase not in ("train", "eval", "harness"):
        raise ValueError(f"phase {phase!r}: expected 'train', 'eval' or 'harness'")
    t = task(study, index, stage)
    if phase == "harness":
        return harness_argv(study, data, t, run_dir)
    size = study["sizes"][t.size]
    plan = budget(study, t.size)
    model = {k: v for k, v in size.items() if k != "mfu"}
    valid = data["valid"]
    names = list(study["eval"]["sets"])
    missing = [n for n in names if not valid.get(n)]
    if missing:
        raise ValueError(f"data file: valid lacks {missing}; the study evaluates on {names}")
    share = float(study["number_share"])
    common = {
        **study["megatron_args"], **model,
        "train-iters": plan["iterations"],
        "lr-warmup-iters": max(1, round(float(study.get("warmup_fraction", 0.01)) * plan["iterations"])),
        # Megatron's --seed (> 0; its default 1234 for seed 0): the initialisation and the data order
        "seed": int(study.get("seed_base", 1234)) + t.seed,
        "tokenizer-type": data.get("tokenizer_type", "HuggingFaceTokenizer"), "tokenizer-model": data["tokenizer"],
        "train-data-path": [1 - share, data["text"], share, data["number_rich"]] if share else [data["text"]],
        "save": os.path.join(run_dir, "checkpoints"), "load": os.path.join(run_dir, "checkpoints"),
        # the dataset index caches in the run's folder: array tasks never build the same files at once
        "data-cache-path": os.path.join(run_dir, "data_cache"),
    }  # fmt: skip
    if phase == "train":
        # no validation set, no evaluation (Megatron evaluates at the end unless --eval-iters is 0), yet an interval
        chosen = {**common, **study["arms"][t.arm], "eval-iters": 0, "eval-interval": plan["iterations"] + 1}
    else:  # the same evaluation flags for every arm: CE's number metrics are measured too
        chosen = {**common, **study["eval"]["ntl_args"], "skip-train": True, "eval-interval": plan["iterations"],
                  "valid-data-path": [valid[n] for n in names],
                  # every held-out set in full (Megatron's --multiple-validation-sets needs --full-validation)
                  "multiple-validation-sets": True, "validation-set-names": names, "full-validation": True}  # fmt: skip
    return flags(chosen)


VALID_LINE = re.compile(r"validation-(?P<name>[\w.-]+) loss at .*?\| lm loss value: (?P<loss>[-+.\dEe]+)")
NTL_LINE = re.compile(
    r"validation \(ntl_scale\) \| ntl loss: (?P<ntl>n/a[^|]*|\S+) \| number accuracy: (?P<acc>n/a[^|]*|\S+) \|"
)


def parse_eval(text: str) -> dict[str, dict[str, float]]:
    """The per-set metrics of an evaluation log: ``{set: {ppl, lm_loss, number_token_was, number_token_acc}}``
    (the accuracy a fraction, as in ``experiments/study.py``'s results: size_sweep reports its change in points).

    ``launch/pretrain_gpt_ntl.py`` prints the NTL line of a set right after evaluating it, before Megatron
    prints that set's ``validation-<name> loss`` line: each set line takes the NTL line before it."""
    out: dict[str, dict[str, float]] = {}
    pending: dict[str, float] | None = None
    for line in text.splitlines():
        ntl = NTL_LINE.search(line)
        if ntl:
            # "n/a (no number tokens)": no number token in the whole set
            was, acc = (math.nan if v.startswith("n/a") else float(v) for v in (ntl["ntl"], ntl["acc"]))
            pending = {"number_token_was": was, "number_token_acc": acc}  # a fraction, as study.py's
            continue
        found = VALID_LINE.search(line)
        if found:
            loss = float(found["loss"])
            out[found["name"]] = {"lm_loss": loss, "ppl": math.exp(loss), **(pending or {})}
            pending = None
    return out


HARNESS_SPLIT = "harness"
"""The split of ``results.json`` that holds the harness's task-level metrics (arithmetic, GSM8K)."""


def parse_harness(report: dict[str, Any], sets: list[str]) -> dict[str, dict[str, float]]:
    """The study's metrics from an lm-evaluation-harness results file (``results_<time>.json`` of
    ``--output_path``), in the layout of :func:`parse_eval`:

    * ``harness``: ``arith_exact_match`` (the mean of the four ``ntl_arith_*`` tasks' exact match, a fraction),
      ``arith_rel_error`` (the mean relative error of the parsed answers of addition, subtraction and
      multiplication; comparison answers are one of two given numbers), ``gsm8k_bpb`` (``ntl_gsm8k_bpb``);
    * ``<set>`` for each held-out set with a ``ntl_study_<set>_split`` task: ``text_byte_ppl`` and
      ``number_byte_ppl``, 2 ** the bits per byte of the text without its number spans and of the number
      spans alone (:func:`harness_tasks`): the perplexity per byte, number tokens and the rest apart (each
      where the report has it: a set without number spans has no ``number_bits_per_byte``).

    A task the report lacks leaves its metrics out (NaN where the harness wrote N/A)."""
    found = report.get("results", {})

    def value(task: str, metric: str) -> float | None:
        raw = found.get(task, {}).get(f"{metric},none")
        if raw is None:
            return None
        return math.nan if isinstance(raw, str) else float(raw)

    out: dict[str, dict[str, float]] = {}
    harness: dict[str, float] = {}
    exact = [value(f"ntl_arith_{op}", "exact_match") for op in ("add", "sub", "mul", "cmp")]
    if all(v is not None for v in exact):
        harness["arith_exact_match"] = sum(exact) / len(exact)  # type: ignore[arg-type]
    rel = [value(f"ntl_arith_{op}", "rel_error") for op in ("add", "sub", "mul")]
    if all(v is not None for v in rel):
        harness["arith_rel_error"] = sum(rel) / len(rel)  # type: ignore[arg-type]
    bpb = value("ntl_gsm8k_bpb", "bits_per_byte")
    if bpb is not None:
        harness["gsm8k_bpb"] = bpb
    if harness:
        out[HARNESS_SPLIT] = harness
    for name in sets:
        task = f"ntl_study_{name}_split"
        kinds = {f"{k}_byte_ppl": value(task, f"{k}_bits_per_byte") for k in ("text", "number")}
        if any(v is not None for v in kinds.values()):  # a set without number spans has no number_byte_ppl
            out[name] = {k: 2.0**v for k, v in kinds.items() if v is not None}
    return out


def _run_metrics(run_dir: str) -> dict[str, Any]:
    """A run's ``eval.json`` (Megatron's evaluation) with its ``harness.json`` merged in, per split."""
    merged: dict[str, Any] = {}
    for name in ("eval.json", "harness.json"):
        path = os.path.join(run_dir, name)
        if os.path.isfile(path):
            with open(path) as f:
                for split, metrics in json.load(f).items():
                    merged.setdefault(split, {}).update(metrics)
    return merged


def results(study: dict[str, Any], runs: str, size: str, seeds: list[int]) -> dict[str, Any]:
    """One size's runs in ``experiments/study.py``'s ``results.json`` layout: per arm, per split
    ``heldout:<set>`` (and ``harness``), per metric, ``seeds`` (in the order of ``seeds``; ``None`` where a
    run has no evaluation yet)."""
    out: dict[str, Any] = {}
    for arm in study["arms"]:
        per_seed = [_run_metrics(os.path.join(runs, Task(0, size, arm, seed).run_name)) for seed in seeds]
        splits: dict[str, Any] = {}
        for name in [*study["eval"]["sets"], HARNESS_SPLIT]:
            metrics = sorted({m for e in per_seed for m in e.get(name, {})})
            if not metrics:
                continue
            key = name if name == HARNESS_SPLIT else f"heldout:{name}"
            splits[key] = {m: {"seeds": [e.get(name, {}).get(m) for e in per_seed]} for m in metrics}
        out[arm] = splits
    return out


def verdict(table: dict[str, Any], study: dict[str, Any]) -> list[dict[str, Any]]:
    """The verdict rule of docs/gpu_study.md, per size, for the primary arm: Holm over the stage's primary
    tests (every size x ``analysis.primary`` metric), then cost / gain / adopt as the page writes it."""
    import seed_stats

    rule = study["analysis"]
    arm, cost_key, gain_keys = rule["primary_arm"], rule["cost"], list(rule["gains"])
    bounds = rule["smallest_effects"]
    rows = [r for r in table["sizes"] if r["differences"].get(arm)]
    raw = {(r["label"], k): (r["differences"][arm].get(k) or {}).get("p_seed_t", math.nan)
           for r in rows for k in [cost_key, *gain_keys]}  # fmt: skip
    # the family declared before the runs (power.family): tests not run yet count with p = 1
    adjusted = seed_stats.holm(raw, family=int(study.get("power", {}).get("family", len(raw))))
    out = []
    for r in rows:
        d = r["differences"][arm]
        cost = d.get(cost_key) or {}
        p_cost = adjusted[(r["label"], cost_key)]
        if cost.get("mean", math.nan) > 0 and p_cost < 0.05:
            cost_reading = "cost"
        elif cost.get("high", math.nan) < bounds[cost_key]:
            cost_reading = "no cost"
        else:
            cost_reading = "unresolved"
        gains, harms, excluded = [], [], []
        for k in gain_keys:
            g = d.get(k) or {}
            p = adjusted[(r["label"], k)]
            if p < 0.05 and g.get("mean", math.nan) < 0:
                gains.append(k)
            elif p < 0.05 and g.get("mean", math.nan) > 0:
                harms.append(k)
            excluded.append(g.get("low", math.nan) > -bounds[k])
        gain_reading = "harm" if harms else "gain" if gains else "no gain" if all(excluded) else "unresolved"
        if gain_reading == "gain":
            decision = "adopt" if cost_reading == "no cost" else "trade-off" if cost_reading == "cost" else None
        elif gain_reading in ("no gain", "harm") or cost_reading == "cost":
            decision = "do not adopt" if gain_reading != "unresolved" or cost_reading == "cost" else None
        else:
            decision = None
        out.append({"size": r["label"], "cost": cost_reading, "gain": gain_reading, "gains": gains, "harms": harms,
                    "verdict": decision or "not decided at this scale",
                    "holm": {k: adjusted[(r["label"], k)] for k in [cost_key, *gain_keys]}})  # fmt: skip
    return out


def collect(study: dict[str, Any], runs: str, out: str, stage: str = "main") -> dict[str, Any]:
    """Tabulates the finished runs of ``stage`` with the CPU size sweep's analysis; writes ``OUT/sweep.json``,
    ``OUT/sweep.md``, ``OUT/size_sweep.png`` and ``OUT/<size>/results.json``; the verdict rule's table."""
    import figures
    import size_sweep

    os.makedirs(out, exist_ok=True)
    sizes = []
    seeds = stage_seeds(study, stage)
    for name in study["stages"][stage]["sizes"]:
        by_arm = results(study, runs, name, seeds[name])
        path = os.path.join(out, slug(name), "results.json")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            json.dump({"results": by_arm}, f, indent=2)
        if not any(
            v is not None for arm in by_arm.values() for s in arm.values() for m in s.values() for v in m["seeds"]
        ):
            print(f"[gpu-study] {name}: no evaluated run yet; left out", flush=True)
            continue
        plan = budget(study, name)  # data_varied None: the order varies with the seed; the held-out sets do not
        sizes.append({"label": name, "parameters": plan["total"], "results": by_arm, "results_path": path,
                      "tokens": plan["tokens"], "data_varied": None, "seeds": seeds[name],
                      "tokens_per_parameter": plan["tokens_per_parameter"]})  # fmt: skip
    arms = [a for a in study["stages"][stage]["arms"]]
    sweep = {"baseline": arms[0], "arms": arms[1:], "metrics": study["analysis"]["metrics"]}
    table = size_sweep.tabulate(sweep, sizes)
    rule = study["analysis"]
    if rule.get("primary_arm") in sweep["arms"]:
        table["verdicts"] = verdict(table, study)
    with open(os.path.join(out, "sweep.json"), "w") as f:
        json.dump({"sweep": sweep, **table}, f, indent=2)
    text = size_sweep.markdown(table)
    if table.get("verdicts"):
        text += "\n\n" + verdict_markdown(table["verdicts"], rule)
    with open(os.path.join(out, "sweep.md"), "w") as f:
        f.write(text + "\n")
    if sizes:
        figures.sweep_figure(table, os.path.join(out, "size_sweep.png"))
    print(text)
    return table


def verdict_markdown(rows: list[dict[str, Any]], rule: dict[str, Any]) -> str:
    """The verdict table: per size, the cost and gain readings, the Holm-adjusted p of each primary test."""
    keys = [rule["cost"], *rule["gains"]]
    lines = [f"Verdict rule (docs/gpu_study.md), {rule['primary_arm']} against CE:", "",
             "| size | cost | gain | verdict | " + " | ".join(f"Holm p {k}" for k in keys) + " |",
             "|---|---|---|---|" + "---:|" * len(keys)]  # fmt: skip
    for r in rows:
        ps = [f"{r['holm'][k]:.3g}" if math.isfinite(r["holm"][k]) else "n/a" for k in keys]
        lines.append(f"| {r['size']} | {r['cost']} | {r['gain']} | {r['verdict']} | " + " | ".join(ps) + " |")
    return "\n".join(lines)


def seeds_from_pilot(study: dict[str, Any], runs: str) -> dict[str, Any]:
    """The main stage's seeds per size from the pilot's measured seed-to-seed sd (``experiments/power.py``).

    For each primary metric (``power.effects``: the smallest effect that matters, in the unit of
    ``size_sweep``'s differences) and each pilot size: the sd of the per-seed differences of the pilot's
    NTL arm to CE, and the seeds a paired t-test needs to detect the effect with ``power.power`` at Holm's
    first step over ``power.family`` tests. A size of the main stage the pilot did not run takes the sd of
    the size named in ``power.sd_from``. Seeds per size: the largest over the metrics, at least the pilot's
    where the pilot ran (its runs are reused), at most ``power.max_seeds``."""
    import power
    import size_sweep

    spec = study["power"]
    pilot = study["stages"][spec.get("stage", "pilot")]
    arm, baseline = pilot["arms"][1], pilot["arms"][0]
    pilot_seeds = stage_seeds(study, spec.get("stage", "pilot"))
    measured: dict[str, dict[str, Any]] = {}
    for size in pilot["sizes"]:
        by_arm = results(study, runs, size, pilot_seeds[size])
        measured[size] = {}
        for key, effect in spec["effects"].items():
            cell = size_sweep.difference(by_arm, arm, baseline, key)
            values = cell["seeds"] if cell else []
            if len(values) < 2:
                raise ValueError(
                    f"pilot {size}: {len(values)} finished seed pair(s) on {key}; the sd needs at least 2 "
                    f"(runs in {runs})"
                )
            sd = statistics.stdev(values)
            measured[size][key] = {"sd": sd, "pairs": len(values), "effect": effect,
                                   "seeds": power.seeds_needed(effect / sd if sd else math.inf, spec["alpha"],
                                                               spec["family"], spec["power"])}  # fmt: skip
    main = study["stages"]["main"]
    out: dict[str, Any] = {"measured": measured, "seeds": {}, "assumed": {}}
    for size in main["sizes"]:
        source = size if size in measured else spec.get("sd_from", {}).get(size)
        if source not in measured:
            raise ValueError(f"main size {size}: not in the pilot and no power.sd_from entry names a pilot size")
        if source != size:
            out["assumed"][size] = source
        wanted = max(m["seeds"] for m in measured[source].values())
        floor = len(pilot_seeds.get(size, []))
        out["seeds"][size] = min(max(wanted, floor, 2), int(spec["max_seeds"]))
        if wanted > int(spec["max_seeds"]):
            out.setdefault("underpowered", []).append(size)
    return out


def _stage_counts(study: dict[str, Any], stage: str, seeds: dict[str, int] | None) -> dict[str, int | None]:
    spec = study["stages"][stage]
    out: dict[str, int | None] = {}
    for name in spec["sizes"]:
        count = spec["seeds"].get(name) if isinstance(spec["seeds"], dict) else spec["seeds"]
        out[name] = (seeds or {}).get(name) if count in ("power", None) else int(count)
    return out


def cost_rows(study: dict[str, Any], stage: str, seeds: dict[str, int] | None = None) -> list[dict[str, Any]]:
    """Per size of ``stage``: its budget, its runs (arms x seeds; ``seeds`` for the counts left to power) and
    the runs it adds: a run an earlier stage of the file has (same size, arm and seed) is not run again."""
    order = list(study["stages"])
    earlier: set[tuple[str, str, int]] = set()
    for name in order[: order.index(stage)]:
        for size, count in _stage_counts(study, name, seeds).items():
            earlier |= {(size, a, s) for a in study["stages"][name]["arms"] for s in range(count or 0)}
    rows = []
    for name, count in _stage_counts(study, stage, seeds).items():
        runs = {(name, a, s) for a in study["stages"][stage]["arms"] for s in range(count or 0)}
        rows.append({**budget(study, name), "seeds": count, "runs": len(runs) if count else None,
                     "new_runs": len(runs - earlier) if count else None})  # fmt: skip
    return rows


def cost_markdown(study: dict[str, Any], stage: str, seeds: dict[str, int] | None = None) -> str:
    """The cost table of ``stage``: per size, parameters, tokens (and per parameter, both counts), FLOPs, the
    MFU assumed and GPU-hours per run and for the runs the stage adds. A model, not a measurement."""
    gpu = study["cost"].get("gpu", "GPU")
    lines = [f"| size | non-embedding parameters | total parameters | tokens | tokens / total parameter | "
             f"tokens / non-embedding parameter | iterations | FLOPs per run (6 N D) | MFU assumed | "
             f"{gpu}-hours per run | seeds | runs (new) | {gpu}-hours of the new runs |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    total, runs_total = 0.0, 0
    for b in cost_rows(study, stage, seeds):
        hours = b["gpu_hours"] * b["new_runs"] if b["new_runs"] is not None else math.nan
        total += hours
        runs_total += b["new_runs"] or 0
        cells = [
            b["size"],
            f"{b['non_embedding']:,}",
            f"{b['total']:,}",
            f"{b['tokens']:,}",
            f"{b['tokens_per_total_parameter']:.1f}",
            f"{b['tokens_per_non_embedding_parameter']:.1f}",
            f"{b['iterations']:,}",
            f"{b['flops']:.3g}",
            f"{b['mfu']:.0%}",
            f"{b['gpu_hours']:.1f}",
            str(b["seeds"]),
            f"{b['runs']} ({b['new_runs']})",
            f"{hours:.0f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append(f"| **{stage}** | | | | | | | | | | | {runs_total} new | **{total:.0f}** |")
    return "\n".join(lines)


def read_texts(path: str, column: str = "text") -> Iterator[str]:
    """The documents of a local file or folder: Parquet (``column``) or JSON lines (``.jsonl``, ``.jsonl.gz``,
    the field ``column``), files in sorted order."""
    import gzip

    files = sorted(
        os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs
    ) if os.path.isdir(path) else [path]  # fmt: skip
    kept = [f for f in files if f.endswith((".parquet", ".jsonl", ".jsonl.gz", ".json"))]
    if not kept:
        raise ValueError(f"{path}: no .parquet or .jsonl(.gz) file; point at the downloaded dataset's folder")
    for name in kept:
        if name.endswith(".parquet"):
            import pyarrow.parquet as pq

            for batch in pq.ParquetFile(name).iter_batches(columns=[column], batch_size=4096):
                yield from (t for t in batch.column(0).to_pylist() if t)
        else:
            opener = gzip.open if name.endswith(".gz") else open
            with opener(name, "rt", encoding="utf-8") as f:
                for line in f:
                    text = json.loads(line).get(column) if line.strip() else None
                    if text:
                        yield text


def held_out(text: str, per_10000: int) -> bool:
    """Whether a document is held out: its SHA-256 modulo 10,000 below ``per_10000`` (order-free)."""
    return int(hashlib.sha256(text.encode("utf-8")).hexdigest(), 16) % 10_000 < per_10000


def prepare_text(sources: dict[str, Any], out: str) -> dict[str, dict[str, int]]:
    """JSON lines ``{"text": ...}`` for Megatron's ``tools/preprocess_data.py`` and the harness, from the
    downloaded corpora named in the data file's ``sources`` (``docs/gpu_study.md``): per source
    ``<name>_train.jsonl`` (every document not held out) and ``<name>_heldout.jsonl`` (held out by
    :func:`held_out`, at most ``heldout_documents``, each cut to ``heldout_chars``); a source with
    ``train: false`` gives only its held-out file. Returns the documents written per file."""
    os.makedirs(out, exist_ok=True)
    counts: dict[str, dict[str, int]] = {}
    for name, spec in sources.items():
        per = int(spec.get("heldout_per_10000", 10))
        most, chars = int(spec.get("heldout_documents", 1000)), int(spec.get("heldout_chars", 4000))
        train = bool(spec.get("train", True))
        n_train = n_held = 0
        train_path = os.path.join(out, f"{name}_train.jsonl")
        with (
            open(os.path.join(out, f"{name}_heldout.jsonl"), "w", encoding="utf-8") as held,
            open(train_path, "w", encoding="utf-8") if train else open(os.devnull, "w") as kept,
        ):
            for text in read_texts(spec["path"], spec.get("column", "text")):
                if held_out(text, per):
                    if n_held < most:
                        held.write(json.dumps({"text": text[:chars]}, ensure_ascii=False) + "\n")
                        n_held += 1
                elif train:
                    kept.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
                    n_train += 1
        counts[name] = {"train": n_train, "heldout": n_held}
    return counts


SPLIT_TASK = """# {name}: held-out documents of the GPU study, number spans and the rest apart (harness-tasks)
task: ntl_study_{name}_split
dataset_path: json
dataset_kwargs:
  data_files:
    test: "{data}"
output_type: loglikelihood
test_split: test
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{segment}}}}"
target_delimiter: ""
process_results: !function utils.process_segment
metric_list:
  - metric: bits_per_byte
    aggregation: bits_per_byte
    higher_is_better: false
  - metric: number_bits_per_byte
    aggregation: bits_per_byte
    higher_is_better: false
  - metric: text_bits_per_byte
    aggregation: bits_per_byte
    higher_is_better: false
metadata:
  version: 1.0
"""


def harness_task_names(study: dict[str, Any], data: dict[str, Any]) -> list[str]:
    """The tasks the harness runs: ``eval.harness.tasks`` and ``ntl_study_<set>_split`` per ``heldout_text``."""
    spec = study["eval"].get("harness") or {}
    return [*spec.get("tasks", []), *(f"ntl_study_{name}_split" for name in data.get("heldout_text") or {})]


def harness_tasks(study: dict[str, Any], data: dict[str, Any], out: str) -> list[str]:
    """The harness's task folder for the study (``--include_path OUT``), written once (array tasks share it: a
    finished folder has ``.complete`` and is left alone; it is written aside and renamed into place):
    ``ntl_numeracy``'s tasks (``ntl_scale.eval.tasks.prepare``, GSM8K from the data file's ``gsm8k``) and, per
    held-out set of the data file's ``heldout_text`` (JSON lines), ``ntl_study_<set>_split``: each document
    cut into number spans and the rest (``ntl_scale.eval.tasks.data.segments``), scored as
    ``ntl_numeracy``'s split slices. Returns :func:`harness_task_names`."""
    from ntl_scale.eval.tasks import prepare
    from ntl_scale.eval.tasks.data import segments, write_jsonl

    names = harness_task_names(study, data)
    if os.path.isfile(os.path.join(out, ".complete")):
        return names
    spec = study["eval"].get("harness") or {}
    aside = f"{out.rstrip('/')}.tmp{os.getpid()}"
    prepare(aside, gsm8k=data.get("gsm8k"), examples=int(spec.get("examples", 250)))
    final_data = os.path.join(os.path.abspath(out), "data")
    for name, path in (data.get("heldout_text") or {}).items():
        docs = [t for _, t in zip(range(int(spec.get("documents", 200))), read_texts(path))]
        cut = [t[: int(spec.get("chars", 2000))] for t in docs]
        write_jsonl(os.path.join(aside, "data", f"study_{name}_segments.jsonl"), (g for t in cut for g in segments(t)))
        with open(os.path.join(aside, f"ntl_study_{name}_split.yaml"), "w") as f:
            f.write(SPLIT_TASK.format(name=name, data=os.path.join(final_data, f"study_{name}_segments.jsonl")))
    for entry in os.listdir(aside):  # prepare() wrote the folder's own path into its YAMLs: point them at OUT
        if entry.endswith((".yaml", "_yaml")):
            path = os.path.join(aside, entry)
            with open(path) as f:
                text = f.read().replace(os.path.join(os.path.abspath(aside), "data"), final_data)
            with open(path, "w") as f:
                f.write(text)
    open(os.path.join(aside, ".complete"), "w").close()
    try:
        os.rename(aside, out)
    except OSError:  # another array task put its folder there first: the same files
        shutil.rmtree(aside, ignore_errors=True)
    return names


def harness_argv(study: dict[str, Any], data: dict[str, Any], t: Task, run_dir: str) -> list[str]:
    """lm-evaluation-harness's arguments for task ``t``'s last checkpoint, read by the harness's own Megatron-LM
    backend (``--model megatron_lm``, its ``--use-checkpoint-args``): the task folder
    ``<runs>/harness_tasks`` (beside the run folders), the results under ``RUN/harness``. ``eval.harness``
    adds ``model_args`` (e.g. ``devices``, ``extra_args``) and ``lm_eval_args`` (e.g. ``limit``)."""
    spec = study["eval"].get("harness")
    if not spec:
        raise ValueError("the study file has no eval.harness: the harness phase has nothing to run")
    model = {"load": os.path.join(run_dir, "checkpoints"), "tokenizer_type": data.get("tokenizer_type",
             "HuggingFaceTokenizer"), "tokenizer_model": data["tokenizer"],
             "seq_length": study["megatron_args"]["seq-length"], **spec.get("model_args", {})}  # fmt: skip
    runs = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(run_dir))))  # <runs>/<size>/<arm>/seed<S>
    chosen = {"model": "megatron_lm", "model_args": ",".join(f"{k}={v}" for k, v in model.items()),
              "include_path": os.path.join(runs, "harness_tasks"), "tasks": ",".join(harness_task_names(study, data)),
              "output_path": os.path.join(run_dir, "harness"), "batch_size": 1,
              **spec.get("lm_eval_args", {})}  # fmt: skip
    return flags(chosen)


def harness_report(run_dir: str) -> str:
    """The newest ``results_*.json`` lm-evaluation-harness wrote under ``RUN/harness``."""
    found = sorted(
        (os.path.join(d, f) for d, _, fs in os.walk(os.path.join(run_dir, "harness")) for f in fs
         if f.startswith("results_") and f.endswith(".json")),
        key=os.path.getmtime,
    )  # fmt: skip
    if not found:
        raise ValueError(f"{run_dir}/harness holds no results_*.json: the harness did not finish")
    return found[-1]


def print_seeds(study: dict[str, Any], got: dict[str, Any]) -> None:
    """The power step's reading (:func:`seeds_from_pilot`): each pilot sd and the seeds it asks for, the
    assumptions, the main stage's seeds, and the cost of every later stage at them."""
    for size, metrics in got["measured"].items():
        for key, m in metrics.items():
            print(f"pilot {size} {key}: sd {m['sd']:.4g} over {m['pairs']} seed pairs; effect {m['effect']} "
                  f"-> {m['seeds']} seeds")  # fmt: skip
    for size, source in got["assumed"].items():
        print(f"{size}: not in the pilot; assumes the sd of {source}")
    print("main stage seeds: " + ", ".join(f"{k} {v}" for k, v in got["seeds"].items()))
    for size in got.get("underpowered", []):
        print(f"{size}: the power asks for more than max_seeds: read by its intervals (docs/gpu_study.md)")
    for stage in list(study["stages"])[1:]:
        print(cost_markdown(study, stage, got["seeds"]))
    sys.stdout.flush()


def write_seeds(path: str, seeds: dict[str, int], out: str) -> None:
    """A copy of the study file ``path`` whose main stage has ``seeds`` (per size): the file to submit (written
    whole or not at all: the chain of ``gpu_study_submit.py`` takes its presence for a finished power step)."""
    from ntl_scale.atomic import atomic_write

    with open(path, encoding="utf-8") as f:
        study = yaml.safe_load(f)
    for stage in study["stages"].values():  # every stage whose seeds are left to power
        if isinstance(stage["seeds"], dict):
            stage["seeds"] = {k: int(seeds[k]) if v == "power" else v for k, v in stage["seeds"].items()}
    with atomic_write(out) as f:
        f.write(f"# {path} with the main stage's seeds set by `gpu_study.py seeds` from the pilot\n")
        yaml.safe_dump(study, f, sort_keys=False, width=120)


def main(argv_: list[str] | None = None) -> None:
    commands = ["plan", "cost", "argv", "run-name", "count", "parse-eval", "parse-harness", "collect", "seeds",
                "harness-tasks", "harness-enabled", "prepare-text"]  # fmt: skip
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=commands)
    parser.add_argument("--config", default="configs/gpu_study/study.yaml", help="the study file")
    parser.add_argument("--stage", default=os.environ.get("NTL_STAGE", "pilot"), help="pilot or main (NTL_STAGE)")
    parser.add_argument("--data", default=None, help="argv, harness-tasks, prepare-text: the site's data file")
    parser.add_argument("--task", type=int, default=None, help="argv, run-name: the array task index")
    parser.add_argument("--phase", default="train", help="argv: train or eval")
    parser.add_argument("--run-dir", default=None, help="argv: the task's run folder")
    parser.add_argument("--log", default=None, help="parse-eval: an evaluation log; parse-harness: a results file")
    parser.add_argument("--runs", default=None, help="collect, seeds: the study's runs folder")
    parser.add_argument("--out", default=None, help="collect, harness-tasks, prepare-text: the output folder")
    parser.add_argument("--write", default=None, help="seeds: write the study file with the main stage's seeds")
    parser.add_argument("--write-doc", action="store_true", help="cost: every stage into docs/gpu_study.md")
    args = parser.parse_args(argv_)
    try:
        study = load(args.config)
        if args.command == "plan":
            for t in tasks(study, args.stage):
                b = budget(study, t.size)
                print(f"{t.index}\t{t.size}\t{t.arm}\tseed {t.seed}\t{b['tokens']:,} tokens "
                      f"({b['tokens_per_total_parameter']:.1f} per total, "
                      f"{b['tokens_per_non_embedding_parameter']:.1f} "
                      f"per non-embedding parameter)\t{b['iterations']} iterations")  # fmt: skip
        elif args.command == "cost":
            assumed = study.get("cost", {}).get("assumed_seeds")
            if args.write_doc:  # every stage into docs/gpu_study.md's generated block
                from doc_blocks import replace_block

                text = "\n\n".join(cost_markdown(study, stage, assumed) for stage in study["stages"])
                replace_block(os.path.join(ROOT, "docs", "gpu_study.md"), "gpu_study_cost", text)
            print(cost_markdown(study, args.stage, assumed))
        elif args.command == "harness-enabled":
            print("yes" if study["eval"].get("harness") else "no")
        elif args.command == "count":
            print(len(tasks(study, args.stage)))
        elif args.command in ("argv", "run-name"):
            if args.task is None:
                raise ValueError(f"{args.command} needs --task I (the array task index)")
            if args.command == "run-name":
                print(task(study, args.task, args.stage).run_name)
            else:
                if not args.run_dir:
                    raise ValueError("argv needs --run-dir (the task's run folder)")
                chosen = argv(study, load_data(args.data), args.task, args.phase, args.run_dir, args.stage)
                print(shlex.join(chosen))
        elif args.command == "parse-eval":
            with open(args.log or "/dev/stdin", errors="replace") as f:
                found = parse_eval(f.read())
            if not found:
                raise ValueError(f"{args.log}: no 'validation-<set> loss' line: the evaluation did not finish")
            print(json.dumps(found, indent=2))
        elif args.command == "parse-harness":
            with open(args.log or harness_report(args.run_dir or ".")) as f:
                found = parse_harness(json.load(f), list(study["eval"]["sets"]))
            if not found:
                raise ValueError(f"{args.log}: no task of the study in this harness report")
            print(json.dumps(found, indent=2))
        elif args.command == "seeds":
            if not args.runs:
                raise ValueError("seeds needs --runs (the study's runs folder, with the pilot's evaluated runs)")
            got = seeds_from_pilot(study, args.runs)
            print_seeds(study, got)
            if args.write:
                write_seeds(args.config, got["seeds"], args.write)
                print(f"wrote {args.write}: NTL_STAGE=main sbatch --array=0-{len(tasks(load(args.write), 'main')) - 1}"
                      f" launch/slurm/gpu_study.sbatch --config {args.write}")  # fmt: skip
        elif args.command == "harness-tasks":
            if not args.out:
                raise ValueError("harness-tasks needs --out (the study's runs folder/harness_tasks)")
            print(",".join(harness_tasks(study, load_data(args.data), args.out)))
        elif args.command == "prepare-text":
            if not args.out:
                raise ValueError("prepare-text needs --out (where the JSON lines go)")
            data = load_data(args.data)
            if not data.get("sources"):
                raise ValueError(f"{args.data}: no sources: (see configs/gpu_study/data.example.yaml)")
            print(json.dumps(prepare_text(data["sources"], args.out), indent=2))
        else:
            if not args.runs or not args.out:
                raise ValueError("collect needs --runs (the study's runs folder) and --out")
            collect(study, args.runs, args.out, args.stage)
    except ValueError as e:
        raise SystemExit(f"gpu_study.py: {e}") from None


if __name__ == "__main__":
    main()
