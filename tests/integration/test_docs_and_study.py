"""The documentation site and the study command.

1. ``mkdocs build --strict`` (warnings are errors; internal links and anchors are checked by mkdocs'
   own validation, the API pages are generated from the docstrings).
2. Every command in the docs' shell blocks names files that exist, and every Python script it runs
   answers ``--help`` (all in one process, tests/helpers/script_help.py); the commands themselves are run
   elsewhere in the suite (the README's two, the DeepSpeed, Megatron and Slurm jobs, the benchmarks' code
   paths, the study below).
3. The CI-sized study preset end to end: 2 seeds x 2 arms through launch/train.py, the results
   table (one row per arm, both splits, mean +- std) and the three plots; then its DEL preset
   (configs/study/del_ci.yaml) on the same folder: one more arm (CE + DEL) through
   experiments/train_baselines.py and the paired tests against CE + NTL-WAS; and ``--harness``'s scoring
   of one run against the study's own scorer.
4. The pretraining study's CI preset (configs/study/pretrain_ci.yaml) as one size of a size sweep, the
   other the published 0.85 M study's results: held-out metrics recomputed from the exported models, the
   sweep's differences and trend from the two results files.
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]
RUNNERS = ("python", "python3", "bash", "make", "sbatch", "deepspeed", "torchrun")


def test_docs_site_builds_strictly(tmp_path):
    if shutil.which("mkdocs") is None and not _has_module("mkdocs"):
        if os.environ.get("CI"):
            pytest.fail("mkdocs missing: scripts/setup.sh --dev installs it")
        pytest.skip("mkdocs not installed")
    out = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    api = (tmp_path / "site" / "api" / "index.html").read_text()
    assert "linear_ce_with_ntl" in api and "NumberVocab" in api  # generated from the docstrings


def _has_module(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def _shell_commands() -> list[tuple[str, str]]:
    """(doc name, command) for every runner line in ``bash``/``sh``/plain fenced blocks."""
    found = []
    for doc in DOCS:
        lang, block = None, []
        for raw in doc.read_text().splitlines():
            line = raw.strip()
            if line.startswith("```"):
                if lang is None:
                    lang, block = line[3:].strip(), []
                    continue
                if lang in ("", "bash", "sh"):
                    for command in "\n".join(block).replace("\\\n", " ").splitlines():
                        command = re.sub(r"^(?:[A-Z_]+=\S+\s+)+", "", command.strip())  # leading VAR=value
                        if command.split(" ", 1)[0] in RUNNERS:
                            found.append((doc.name, command.split("#", 1)[0].strip()))
                lang = None
                continue
            if lang is not None:
                block.append(line)
    return found


def test_docs_commands_name_real_files_and_scripts_answer_help():
    """The scripts' ``--help`` run in one process (tests/helpers/script_help.py: each as ``__main__`` with its
    own folder on ``sys.path``, its sibling modules dropped after it), not one interpreter each."""
    commands = _shell_commands()
    assert len(commands) > 10
    checked: dict[str, str] = {}  # script -> the doc that first names it
    for doc, command in commands:
        words = shlex.split(command.split("&&")[0].split("|")[0].replace("$(", " ").replace(")", " "))
        for word in words:
            if re.match(r"^(launch|configs|scripts|benchmarks|experiments|tests)/[\w./-]+$", word):
                assert (ROOT / word).exists(), f"{doc}: `{command}` names {word}, which does not exist"
                if word.endswith(".py") and word.split("/")[0] in ("launch", "benchmarks", "experiments"):
                    checked.setdefault(word, doc)
    assert "experiments/study.py" in checked and "benchmarks/bench_linear.py" in checked
    scripts = [word for word in checked if word != "launch/pretrain_gpt_ntl.py"]  # needs a Megatron-LM checkout
    out = subprocess.run([sys.executable, "tests/helpers/script_help.py", *scripts], cwd=ROOT, capture_output=True,
                         text=True, timeout=600)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    failed = json.loads(out.stdout.splitlines()[-1])
    assert not failed, "\n".join(f"{checked[word]}: {word} --help failed:\n{why}" for word, why in failed.items())


def _study(out: Path, preset: str = "configs/study/ci.yaml") -> subprocess.CompletedProcess:
    command = [sys.executable, "experiments/study.py", "--preset", preset, "--out", str(out)]
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500)


def test_ci_study_preset_end_to_end(tmp_path):
    pytest.importorskip("deepspeed")
    pytest.importorskip("matplotlib")
    out = tmp_path / "study"
    result = _study(out)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())["results"]
    assert set(results) == {"CE", "CE + NTL-WAS"}
    for arm in results.values():
        assert set(arm) == {"interpolate", "extrapolate"}
        for split in arm.values():
            assert set(split) == {"accuracy", "mae", "log_mae", "r2"}
            assert len(split["accuracy"]["seeds"]) == 2 and 0 <= split["accuracy"]["mean"] <= 1
    # each arm really trained with its own loss: CE's NTL weight is 0, NTL-WAS's 0.3
    for arm, loss, weight in (("ce", "was", 0.0), ("ce_ntl_was", "was", 0.3)):
        config = json.loads((out / arm / "seed0" / "config.json").read_text())
        assert config["ntl"]["weight"] == weight and (weight == 0 or config["ntl"]["loss"] == loss)
    table = (out / "results.md").read_text()
    lines = table.splitlines()
    # 2 splits x (the results row + the paired differences of its 4 metrics), and the seed-level table that
    # leads: 2 splits x 4 metrics against CE, Holm-adjusted over the study's family (1 arm x 8; the DEL preset's
    # family of several arms and a second baseline: _check_del_preset)
    assert sum(line.startswith("| CE + NTL-WAS | ") for line in lines) == 2 * (1 + 4) and "+-" in table
    assert sum(line.startswith("| CE | CE + NTL-WAS | ") for line in lines) == 2 * 4
    summary = json.loads((out / "results.json").read_text())
    finite = _family(summary["results"], [("CE", "CE + NTL-WAS")])
    assert lines[0].startswith("Seed-level tests") and f"family of {finite} t-tests" in lines[0]
    # every run records where it came from, and results.json gathers those records in seed order
    records = json.loads((out / "results.json").read_text())["runs"]
    git = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True)
    for arm, folder in (("CE", "ce"), ("CE + NTL-WAS", "ce_ntl_was")):
        assert len(records[arm]) == 2
        for seed, record in enumerate(records[arm]):
            assert record == json.loads((out / folder / f"seed{seed}" / "run.json").read_text())
            assert record["commit"] == (git.stdout.strip() if git.returncode == 0 else None)
            assert record["seconds"] > 0 and record["runs_at_a_time"] == 2
    assert "Provenance (4 of 4 runs have a `run.json`)" in table
    # the paired tests count the questions only one arm got right, from the predictions themselves
    tests = json.loads((out / "results.json").read_text())["paired_tests"]
    assert set(tests) == {"CE + NTL-WAS"}
    for arm, folder in (("CE + NTL-WAS", "ce_ntl_was"),):
        only_arm = only_ce = 0
        for seed in (0, 1):
            mine = (out / folder / f"seed{seed}" / "predictions_interpolate.jsonl").read_text().splitlines()
            base = (out / "ce" / f"seed{seed}" / "predictions_interpolate.jsonl").read_text().splitlines()
            for a, b in zip(map(json.loads, mine), map(json.loads, base)):
                right_a, right_b = a["parsed"] == float(a["answer"]), b["parsed"] == float(b["answer"])
                only_arm, only_ce = only_arm + (right_a and not right_b), only_ce + (right_b and not right_a)
        counted = tests[arm]["interpolate"]["accuracy"]["questions"]  # descriptive: no pooled test over questions
        assert counted == {"only_arm_right": only_arm, "only_baseline_right": only_ce}
    for png in ("loss_curves.png", "error_by_digits.png", "digit_offsets.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"
    # a finished run is not trained again: the DEL preset's call below reuses this study's CE and NTL-WAS runs
    _check_harness(out)
    _check_del_preset(out)


def _family(results: dict, pairs: list[tuple[str, str]]) -> int:
    """The study's family: every (baseline, arm) x split x metric whose per-seed differences vary (a t-test exists)."""
    finite = 0
    for base, arm in pairs:
        for split, metrics in results[arm].items():
            for metric, cell in metrics.items():
                diffs = [x - y for x, y in zip(cell["seeds"], results[base][split][metric]["seeds"])]
                finite += len(set(diffs)) > 1 and all(math.isfinite(d) for d in diffs)
    return finite


def _check_harness(out: Path) -> None:
    """``study.py --harness`` on one run: lm-evaluation-harness's scores of the run's held-out questions equal
    the study's own scorer's (eval.json; each the other's independent reference); a scored run is not
    scored again. (The switch is off in the CI preset: 23 s of CPU a run.)"""
    from tests.helpers.scripts import load_script

    study = load_script("experiments/study.py", "study_under_test")
    run = out / "ce_ntl_was" / "seed0"
    scored = study.run_harness(str(run))
    own = json.loads((run / "eval.json").read_text())
    for split in ("interpolate", "extrapolate"):
        harness = scored["tasks"][f"ntl_run_{split}"]
        assert harness["exact_match"] == pytest.approx(own[split]["accuracy"], abs=1e-9)
        assert harness["parsed"] == pytest.approx(1 - own[split]["unparseable"], abs=1e-9)
        if math.isfinite(own[split]["mae"]):
            assert harness["abs_error"] == pytest.approx(own[split]["mae"], rel=1e-9)
    assert scored["seconds"] > 0 and study.run_harness(str(run)) == scored
    table = study.harness_table({"CE + NTL-WAS": [str(run)]})
    scorer = {"CE + NTL-WAS": {k: {m: {"mean": v, "std": 0.0} for m, v in own[k].items()} for k in own}}
    text = study.harness_markdown(table, scorer, [scored["seconds"]])
    assert "| CE + NTL-WAS | ntl_run_interpolate |" in text


def _check_del_preset(out: Path) -> None:
    """configs/study/del_ci.yaml on ci.yaml's folder: its CE and CE + NTL-WAS runs are reused, CE + DEL
    trains through experiments/train_baselines.py (each logged objective is CE plus the weighted term), and is
    also paired against CE + NTL-WAS (counted from the predictions). (The digit-only NTL-WAS term takes the
    same training step with another term function: both terms against float64 loops, the entry's name-to-term
    table and the entry with ``del`` in tests/unit/test_del_baseline.py.)"""
    result = _study(out, "configs/study/del_ci.yaml")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stdout.count("already done") == 4
    summary = json.loads((out / "results.json").read_text())
    assert set(summary["results"]) == {"CE", "CE + NTL-WAS", "CE + DEL"}
    assert set(summary["paired_tests"]) == {"CE + NTL-WAS", "CE + DEL"}
    against = summary["paired_tests_against"]["CE + NTL-WAS"]
    assert set(against) == {"CE + DEL"}
    for arm, folder, loss, weight in [("CE + DEL", "ce_del", "del", 0.01)]:
        only_arm = only_was = 0
        for seed in (0, 1):
            run = out / folder / f"seed{seed}"
            assert json.loads((run / "baseline.json").read_text()) == {"loss": loss, "weight": weight}
            assert json.loads((run / "config.json").read_text())["ntl"]["weight"] == 0
            for row in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()):
                assert row["baseline"] > 0 and row["objective"] == pytest.approx(row["ce"] + weight * row["baseline"])
            mine = (run / "predictions_interpolate.jsonl").read_text().splitlines()
            base = (out / "ce_ntl_was" / f"seed{seed}" / "predictions_interpolate.jsonl").read_text().splitlines()
            for a, b in zip(map(json.loads, mine), map(json.loads, base)):
                right_a, right_b = a["parsed"] == float(a["answer"]), b["parsed"] == float(b["answer"])
                only_arm, only_was = only_arm + (right_a and not right_b), only_was + (right_b and not right_a)
        counted = against[arm]["interpolate"]["accuracy"]["questions"]
        assert counted == {"only_arm_right": only_arm, "only_baseline_right": only_was}
    text = (out / "results.md").read_text()
    assert "**Paired against CE + NTL-WAS**" in text
    # the seed-level tests' family: two arms against CE and one against CE + NTL-WAS, Holm-adjusted together
    pairs = [("CE", "CE + NTL-WAS"), ("CE", "CE + DEL"), ("CE + NTL-WAS", "CE + DEL")]
    finite = _family(summary["results"], pairs)
    assert summary["seed_tests"]["family_size"] == finite and f"family of {finite} t-tests" in text.splitlines()[0]


def test_pretrain_study_preset_end_to_end(tmp_path):
    """configs/study/pretrain_ci.yaml (the pretraining study's pipeline, tiny), run as one size of a size sweep
    (experiments/size_sweep.py: the preset with the size's overrides written to the size's folder and run by
    study.py): the corpus builder, 2 seeds x 2 arms through launch/train.py on the packed corpus, the held-out
    text metrics and their per-sequence paired tests (the whole held-out part and each group of the preset's
    ``heldout_groups``: the corpus's prose and number documents), and the greedy answers to the held-out
    questions cut at the answer line. The sweep's other size is the published 0.85 M study's results file
    (configs/sweep/size_sweep.yaml's), so no second size is trained here.

    The held-out metrics are recomputed from each run's exported Hugging Face model with a plain float64
    forward pass over the held-out sequences (CE split by label kind, arg-max hits, the expected digit); the
    sweep's differences, intervals and trend from the two results files."""
    pytest.importorskip("deepspeed")
    pytest.importorskip("matplotlib")
    import numpy as np
    import torch
    import torch.nn.functional as F
    import transformers
    import yaml
    from scipy import stats

    from ntl_scale.eval.numbers import extract_number
    from ntl_scale.training.config import load_config
    from ntl_scale.training.sources import heldout_batches

    corpus = tmp_path / "corpus"  # the preset's own corpus folder under ROOT/runs, moved to this test's folder
    preset = (ROOT / "configs/study/pretrain_ci.yaml").read_text().replace("runs/pretrain-ci-corpus", str(corpus))
    size = ("model.architecture.hidden_size=64", "model.architecture.intermediate_size=128")
    assert all(item in preset for item in size)  # the preset's model, narrowed here and widened back by the sweep
    (tmp_path / "preset.yaml").write_text(preset.replace("hidden_size=64", "hidden_size=32").replace(
        "intermediate_size=128", "intermediate_size=64"))  # fmt: skip
    # the sweep: this preset at h64 (run by the sweep), and the published 0.85 M study (its results file)
    published = next(e for e in yaml.safe_load((ROOT / "configs/sweep/size_sweep.yaml").read_text())["sizes"]
                     if e["label"] == "0.85 M")  # fmt: skip
    out = tmp_path / "study"
    sweep = {
        "baseline": "CE",
        "arms": ["CE + NTL-WAS"],
        "sizes": [
            {"label": "h64", "preset": str(tmp_path / "preset.yaml"), "out": str(out), "overrides": list(size)},
            {"label": "0.85 M", "preset": str(ROOT / published["preset"]), "results": str(ROOT / published["results"])},
        ],
    }  # fmt: skip
    (tmp_path / "sweep.yaml").write_text(yaml.safe_dump(sweep))
    command = [sys.executable, "experiments/size_sweep.py", "--sweep", str(tmp_path / "sweep.yaml"),
               "--out", str(tmp_path / "sweep")]  # fmt: skip
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=1500,
                            env={**os.environ, "DS_ACCELERATOR": "cpu"})  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    preset = (out / "preset.yaml").read_text()  # the merged preset the sweep wrote and ran
    assert all(item in yaml.safe_load(preset)["overrides"] for item in size)
    summary = json.loads((out / "results.json").read_text())
    assert set(summary["results"]) == {"CE", "CE + NTL-WAS"}
    metrics = ("text_ppl", "number_token_ppl", "number_token_acc", "number_token_mae", "ppl")
    for arm in summary["results"].values():
        assert set(arm) == {"questions", "heldout", "heldout:prose", "heldout:numbers"}
        assert tuple(arm["heldout"]) == metrics
    overrides = yaml.safe_load(preset)["overrides"]
    digit_ids = None
    per_sequence: dict[str, list[list[dict[str, float]]]] = {}
    for folder in ("ce", "ce_ntl_was"):
        for seed in (0, 1):
            run = out / folder / f"seed{seed}"
            cfg = load_config(str(ROOT / "configs/train/pretrain_study_cpu.yaml"), overrides)
            model = transformers.AutoModelForCausalLM.from_pretrained(run / "hf_model").double().eval()
            assert (model.config.hidden_size, model.config.intermediate_size) == (64, 128)  # the sweep's size
            tokenizer = transformers.AutoTokenizer.from_pretrained(run / "hf_model")
            digit_ids = {tokenizer.convert_tokens_to_ids(str(d)): d for d in range(10)}
            batches = heldout_batches(cfg.data, tokenizer, seq_length=cfg.train.seq_length, micro_batch_size=4,
                                      dp_rank=0, dp=1)  # fmt: skip
            rows = []
            with torch.no_grad():
                for batch in batches:
                    logits = model(input_ids=batch["input_ids"]).logits[:, :-1]
                    labels = batch["labels"][:, 1:]
                    for z, y in zip(logits, labels):
                        logp = F.log_softmax(z, -1)
                        sums = dict.fromkeys(("ce", "n", "num_ce", "num", "hits", "err"), 0.0)
                        for t in range(len(y)):
                            label = int(y[t])
                            if label == -100:
                                continue
                            sums["ce"] -= float(logp[t, label])
                            sums["n"] += 1
                            if label in digit_ids:
                                p = logp[t, list(digit_ids)].softmax(-1)
                                expected = sum(float(q) * d for q, d in zip(p, digit_ids.values()))
                                sums["num_ce"] -= float(logp[t, label])
                                sums["num"] += 1
                                sums["hits"] += float(int(z[t].argmax()) == label)
                                sums["err"] += abs(expected - digit_ids[label])
                        rows.append(sums)
            assert len(rows) == cfg.data.eval_sequences
            written = [json.loads(line) for line in (run / "heldout_sequences.jsonl").read_text().splitlines()]
            assert [r["sequence"] for r in written] == list(range(len(rows)))
            labels = torch.cat([b["labels"] for b in batches]).to(torch.int64)
            assert [r["labels_crc32"] for r in written] == [zlib.crc32(y.numpy().tobytes()) for y in labels]
            for mine, ref in zip(written, rows):
                assert mine["tokens"] == ref["n"] and mine["number_tokens"] == ref["num"]
                assert mine["number_hits"] == ref["hits"]
                assert mine["ce_sum"] == pytest.approx(ref["ce"], rel=1e-4)
                assert mine["number_ce_sum"] == pytest.approx(ref["num_ce"], rel=1e-4)
                assert mine["number_abs_error_sum"] == pytest.approx(ref["err"], rel=1e-4, abs=1e-4)
            total = {k: sum(r[k] for r in rows) for k in rows[0]}
            heldout = json.loads((run / "eval.json").read_text())["heldout"]
            text_ce = (total["ce"] - total["num_ce"]) / (total["n"] - total["num"])
            assert heldout["text_ppl"] == pytest.approx(math.exp(text_ce), rel=1e-4)
            assert heldout["number_token_ppl"] == pytest.approx(math.exp(total["num_ce"] / total["num"]), rel=1e-4)
            assert heldout["number_token_acc"] == pytest.approx(total["hits"] / total["num"])
            assert heldout["number_token_mae"] == pytest.approx(total["err"] / total["num"], rel=1e-4)
            per_sequence.setdefault(folder, []).append(rows)
            # greedy answers: the number of the answer line, as the preset's eval.answer_until says
            for line in (run / "predictions_questions.jsonl").read_text().splitlines():
                row = json.loads(line)
                assert row["parsed"] == extract_number(row["generated"].split("\n")[0])
    # each group of the preset (the corpus's prose and number documents) is tabulated from its sequences
    groups = json.loads(Path(yaml.safe_load(preset)["heldout_groups"]).read_text())["heldout"]["groups"]
    assert groups == {"prose": [0, 4], "numbers": [4, 8]}  # the prepare step's --heldout-*sequences 8 / 4
    for folder, arm in (("ce", "CE"), ("ce_ntl_was", "CE + NTL-WAS")):
        for name, (first, stop) in groups.items():
            seeds = summary["results"][arm][f"heldout:{name}"]
            for seed, rows in enumerate(per_sequence[folder]):
                part = {k: sum(r[k] for r in rows[first:stop]) for k in rows[0]}
                if part["n"] > part["num"]:
                    text_ce = (part["ce"] - part["num_ce"]) / (part["n"] - part["num"])
                    assert seeds["text_ppl"]["seeds"][seed] == pytest.approx(math.exp(text_ce), rel=1e-4)
                if part["num"]:
                    assert seeds["number_token_acc"]["seeds"][seed] == pytest.approx(part["hits"] / part["num"])
                else:
                    assert "number_token_acc" not in seeds

    # the per-sequence counts: each sequence's text perplexity, arm minus CE averaged over the seeds, counted
    # over the sequences (those of the split; with text labels); no test over them (the same models)
    def text_ppl(r):
        return math.exp((r["ce"] - r["num_ce"]) / (r["n"] - r["num"]))

    for split, (first, stop) in (("heldout", (0, None)), *((f"heldout:{k}", tuple(v)) for k, v in groups.items())):
        diffs = []
        for i in range(first, stop or cfg.data.eval_sequences):
            pairs = [(a[i], b[i]) for a, b in zip(per_sequence["ce_ntl_was"], per_sequence["ce"])]
            if all(a["n"] > a["num"] for a, _ in pairs):
                diffs.append(sum(text_ppl(a) - text_ppl(b) for a, b in pairs) / len(pairs))
        nonzero = [d for d in diffs if abs(d) > 1e-12]
        counted = summary["paired_tests"]["CE + NTL-WAS"][split]["text_ppl"]["sequences"]
        assert counted == {"n": len(diffs), "arm_better": sum(d < 0 for d in nonzero)}
        seeds_of = summary["results"]["CE + NTL-WAS"][split]["text_ppl"]["seeds"]
        base_of = summary["results"]["CE"][split]["text_ppl"]["seeds"]
        want = stats.ttest_rel(seeds_of, base_of).pvalue  # the seed-level test, in the study's Holm family
        assert summary["seed_tests"]["tests"]["CE"]["CE + NTL-WAS"][split]["text_ppl"]["p_seed_t"] == pytest.approx(
            float(want), rel=1e-9, nan_ok=True
        )
    assert "**heldout** (held-out text" in (out / "results.md").read_text()
    assert (out / "verdict.png").read_bytes()[:4] == b"\x89PNG"

    # the size sweep (experiments/size_sweep.py): every difference and interval of each size, and the trend over
    # the two, recomputed here from the two results files
    table = json.loads((tmp_path / "sweep" / "sweep.json").read_text())
    assert (tmp_path / "sweep" / "size_sweep.png").read_bytes()[:4] == b"\x89PNG"
    keys = {
        "prose_text_ppl": ("heldout:prose", "text_ppl", True),
        "number_token_mae": ("heldout", "number_token_mae", True),
        "question_acc": ("questions", "accuracy", False),
    }
    parameters = []
    shapes = {"h64": (64, 128, 2), "0.85 M": (128, 384, 4)}  # hidden, intermediate, layers: the presets' models
    assert [row["label"] for row in table["sizes"]] == list(shapes)
    for row, path in zip(table["sizes"], (out / "results.json", ROOT / published["results"])):
        results = json.loads(Path(path).read_text())["results"]
        hidden, inner, layers = shapes[row["label"]]
        # Llama blocks without the embedding table: attention 4 h^2, MLP 3 h i, two norms per layer, final norm
        assert row["parameters"] == layers * (4 * hidden**2 + 3 * hidden * inner + 2 * hidden) + hidden
        parameters.append(row["parameters"])
        for key, (split, metric, relative) in keys.items():
            arm, ce = (results[a][split][metric]["seeds"] for a in ("CE + NTL-WAS", "CE"))
            scale = 100 / (sum(ce) / len(ce)) if relative else 100
            expected = [(x - y) * scale for x, y in zip(arm, ce)]
            cell = row["differences"]["CE + NTL-WAS"][key]
            assert cell["seeds"] == pytest.approx(expected, rel=1e-9, abs=1e-12)
            mean = sum(expected) / len(expected)
            sd = (sum((d - mean) ** 2 for d in expected) / (len(expected) - 1)) ** 0.5
            half = stats.t.ppf(0.975, len(expected) - 1) * sd / len(expected) ** 0.5
            floor, ceiling = (-100.0, math.inf) if relative else (-100.0, 100.0)  # what the difference can take
            want = (max(floor, mean - half), min(ceiling, mean + half))
            if max(expected) - min(expected) <= 1e-12 * max(map(abs, expected)):  # no spread: no interval at all
                assert cell["no_spread"] and math.isnan(cell["low"]) and math.isnan(cell["high"]), cell
            else:
                assert (cell["low"], cell["high"]) == pytest.approx(want, rel=1e-9, abs=1e-12)
    for key in keys:  # the trend: per seed (the seeds both sizes ran: 0 and 1) its line over log10(parameters)
        seeds = [row["differences"]["CE + NTL-WAS"][key]["seeds"] for row in table["sizes"]]
        xs = [math.log10(p) for p in parameters]
        trend = table["trend"]["CE + NTL-WAS"][key]
        if len({d for ds in seeds for d in ds}) > 1:
            slopes = [float(np.polyfit(xs, [ds[seed] for ds in seeds], 1)[0]) for seed in range(min(map(len, seeds)))]
            assert trend["slope"] == pytest.approx(sum(slopes) / len(slopes), rel=1e-6, abs=1e-9)
        else:
            assert trend["verdict"].startswith("not given: no spread")
