"""The GPU scaling study (issue 42, item 4): NTL's text cost at 20 tokens per parameter, 25 M to 1 B.

    python experiments/gpu_study.py plan  --config configs/gpu_study/study.yaml   # tasks, tokens, iterations
    python experiments/gpu_study.py cost  --config configs/gpu_study/study.yaml   # the cost table (markdown)
    python experiments/gpu_study.py argv  --config ... --data DATA.yaml --task I --phase train|eval --run-dir D
    python experiments/gpu_study.py collect --config ... --runs RUNS --out OUT     # tables and figure

One study file (``configs/gpu_study/study.yaml``) holds everything but the site's data: the Megatron
flags every run shares, the sizes (Llama-style shapes), the arms (``--ntl-*`` flags), the seeds, the
tokens-per-parameter rule, the number-rich share of the training mix, the evaluation sets and the
cost model. The data file (``configs/gpu_study/data.example.yaml``: the user's tokenizer and indexed
corpora) is the site's. Array task ``I`` is (size, arm, seed) in the order
``for size: for arm: for seed`` (:func:`tasks`); ``launch/slurm/gpu_study.sbatch`` runs one per
Slurm array task through ``launch/pretrain_gpt_ntl.py`` (Megatron-LM): ``train`` (resumable from its
checkpoints), then ``eval`` (``--skip-train`` on the last checkpoint: perplexity on each held-out set
and the number metrics, with the same ``--ntl-*`` evaluation flags for every arm so that CE's number
metrics are measured too). ``collect`` reads every run's ``eval.log``, writes a ``results.json`` per
size in ``experiments/study.py``'s layout and tabulates them with ``experiments/size_sweep.py``
(:func:`size_sweep.tabulate`, :func:`size_sweep.markdown`, :func:`figures.sweep_figure`): the same
per-seed paired differences, intervals, tests and trend over log10(parameters) as the CPU size sweep.

Parameters are counted from the shape (:func:`parameters`; tests check the count against a Hugging
Face Llama built on the meta device). Tokens per run are ``tokens_per_parameter`` x the
non-embedding parameters (as the CPU size sweep counts them), rounded up to whole iterations.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import sys
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
DATA_KEYS = ("tokenizer", "text", "number_rich", "valid")
"""The keys of the site's data file."""


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
    kinds = {"megatron_args": dict, "sizes": dict, "arms": dict, "seeds": list, "eval": dict, "cost": dict}
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
    if not all(isinstance(s, int) and s >= 0 for s in study["seeds"]):
        raise ValueError(f"{path}: seeds = {study['seeds']!r}: expected whole numbers >= 0")
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
    wanted = study["tokens_per_parameter"] * counts["non_embedding"]
    iters = math.ceil(wanted / per_iter)
    tokens = iters * per_iter
    compute_params = counts["non_embedding"] + counts["output"]
    flops = 6 * compute_params * tokens
    peak = float(study["cost"]["peak_flops"])
    hours = flops / (float(size["mfu"]) * peak) / 3600
    return {"size": name, **counts, "compute_parameters": compute_params, "tokens": tokens, "iterations": iters,
            "tokens_per_parameter": tokens / counts["non_embedding"], "flops": flops, "mfu": float(size["mfu"]),
            "gpu_hours": hours}  # fmt: skip


def tasks(study: dict[str, Any]) -> list[Task]:
    """Every run of the study in array order: for each size, each arm, each seed."""
    out = []
    for size in study["sizes"]:
        for arm in study["arms"]:
            for seed in study["seeds"]:
                out.append(Task(len(out), size, arm, seed))
    return out


def task(study: dict[str, Any], index: int) -> Task:
    """Array task ``index``; a clear error outside the array."""
    every = tasks(study)
    if not 0 <= index < len(every):
        raise ValueError(f"task {index}: the study has tasks 0-{len(every) - 1} (sbatch --array=0-{len(every) - 1})")
    return every[index]


def argv(study: dict[str, Any], data: dict[str, Any], index: int, phase: str, run_dir: str) -> list[str]:
    """The Megatron arguments of array task ``index`` in ``phase`` (``train`` or ``eval``)."""
    if phase not in ("train", "eval"):
        raise ValueError(f"phase {phase!r}: expected 'train' or 'eval'")
    t = task(study, index)
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


def results(study: dict[str, Any], runs: str, size: str) -> dict[str, Any]:
    """One size's runs in ``experiments/study.py``'s ``results.json`` layout: per arm, per split
    ``heldout:<set>``, per metric, ``seeds`` (in the study's seed order; ``None`` where a run has no
    evaluation yet)."""
    out: dict[str, Any] = {}
    for arm in study["arms"]:
        per_seed = []
        for seed in study["seeds"]:
            path = os.path.join(runs, Task(0, size, arm, seed).run_name, "eval.json")
            per_seed.append(json.load(open(path)) if os.path.isfile(path) else {})
        splits: dict[str, Any] = {}
        for name in study["eval"]["sets"]:
            metrics = sorted({m for e in per_seed for m in e.get(name, {})})
            splits[f"heldout:{name}"] = {m: {"seeds": [e.get(name, {}).get(m) for e in per_seed]} for m in metrics}
        out[arm] = splits
    return out


def collect(study: dict[str, Any], runs: str, out: str) -> dict[str, Any]:
    """Tabulates the finished runs with the CPU size sweep's analysis; writes ``OUT/sweep.json``,
    ``OUT/sweep.md``, ``OUT/size_sweep.png`` and ``OUT/<size>/results.json``."""
    import figures
    import size_sweep

    os.makedirs(out, exist_ok=True)
    sizes = []
    for name in study["sizes"]:
        by_arm = results(study, runs, name)
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
        sizes.append({"label": name, "parameters": plan["non_embedding"], "results": by_arm, "results_path": path,
                      "tokens": plan["tokens"], "data_varied": None,
                      "tokens_per_parameter": plan["tokens_per_parameter"]})  # fmt: skip
    arms = list(study["arms"])
    sweep = {"baseline": arms[0], "arms": arms[1:], "metrics": study["analysis"]["metrics"]}
    table = size_sweep.tabulate(sweep, sizes)
    with open(os.path.join(out, "sweep.json"), "w") as f:
        json.dump({"sweep": sweep, **table}, f, indent=2)
    text = size_sweep.markdown(table)
    with open(os.path.join(out, "sweep.md"), "w") as f:
        f.write(text + "\n")
    if sizes:
        figures.sweep_figure(table, os.path.join(out, "size_sweep.png"))
    print(text)
    return table


def cost_markdown(study: dict[str, Any]) -> str:
    """The cost table: per size, parameters, tokens, FLOPs, the MFU assumed and GPU-hours per run and per size."""
    runs = len(study["arms"]) * len(study["seeds"])
    gpu = study["cost"].get("gpu", "GPU")
    lines = [f"| size | non-embedding parameters | total parameters | tokens | iterations | FLOPs per run (6 N D) | "
             f"MFU assumed | {gpu}-hours per run | runs | {gpu}-hours per size |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    total = 0.0
    for name in study["sizes"]:
        b = budget(study, name)
        total += b["gpu_hours"] * runs
        cells = [
            name,
            f"{b['non_embedding']:,}",
            f"{b['total']:,}",
            f"{b['tokens']:,}",
            f"{b['iterations']:,}",
            f"{b['flops']:.3g}",
            f"{b['mfu']:.0%}",
            f"{b['gpu_hours']:.1f}",
            str(runs),
            f"{b['gpu_hours'] * runs:.0f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append(f"| **total** | | | | | | | | {runs * len(study['sizes'])} | **{total:.0f}** |")
    return "\n".join(lines)


def main(argv_: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["plan", "cost", "argv", "run-name", "count", "parse-eval", "collect"])
    parser.add_argument("--config", default="configs/gpu_study/study.yaml", help="the study file")
    parser.add_argument("--data", default=None, help="argv: the site's data file")
    parser.add_argument("--task", type=int, default=None, help="argv, run-name: the array task index")
    parser.add_argument("--phase", default="train", help="argv: train or eval")
    parser.add_argument("--run-dir", default=None, help="argv: the task's run folder")
    parser.add_argument("--log", default=None, help="parse-eval: an evaluation log")
    parser.add_argument("--runs", default=None, help="collect: the study's runs folder")
    parser.add_argument("--out", default=None, help="collect: where the tables and the figure go")
    args = parser.parse_args(argv_)
    try:
        study = load(args.config)
        if args.command == "plan":
            for t in tasks(study):
                b = budget(study, t.size)
                print(
                    f"{t.index}\t{t.size}\t{t.arm}\tseed {t.seed}\t{b['tokens']:,} tokens\t{b['iterations']} iterations"
                )
        elif args.command == "cost":
            print(cost_markdown(study))
        elif args.command == "count":
            print(len(tasks(study)))
        elif args.command in ("argv", "run-name"):
            if args.task is None:
                raise ValueError(f"{args.command} needs --task I (the array task index)")
            if args.command == "run-name":
                print(task(study, args.task).run_name)
            else:
                if not args.run_dir:
                    raise ValueError("argv needs --run-dir (the task's run folder)")
                print(shlex.join(argv(study, load_data(args.data), args.task, args.phase, args.run_dir)))
        elif args.command == "parse-eval":
            with open(args.log or "/dev/stdin", errors="replace") as f:
                found = parse_eval(f.read())
            if not found:
                raise ValueError(f"{args.log}: no 'validation-<set> loss' line: the evaluation did not finish")
            print(json.dumps(found, indent=2))
        else:
            if not args.runs or not args.out:
                raise ValueError("collect needs --runs (the study's runs folder) and --out")
            collect(study, args.runs, args.out)
    except ValueError as e:
        raise SystemExit(f"gpu_study.py: {e}") from None


if __name__ == "__main__":
    main()
