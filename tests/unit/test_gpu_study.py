"""experiments/gpu_study.py: the GPU study's configs, array tasks, Megatron arguments, cost table, log parsing.

Sections:
1. Parameter counts of every size of configs/gpu_study/study.yaml against a Hugging Face Llama of the
   same shape built on the meta device (an independent implementation of the architecture).
2. The token budget and the cost table against the formulas written out here (20 x N tokens rounded up
   to whole iterations; 6 N D FLOPs; GPU-hours at the stated MFU of the H100's 989 TFLOPS).
3. Array tasks: count and order, the sbatch header's --array range, run folders.
4. Megatron arguments: train and eval phases; every arm's --ntl-* flags are valid NTL settings.
5. Evaluation logs (lines as Megatron-LM core_v0.19.0 prints them) and bad input.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import statistics
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "experiments"))

import gpu_study  # noqa: E402
import size_sweep  # noqa: E402

STUDY = str(ROOT / "configs" / "gpu_study" / "study.yaml")
CI = str(ROOT / "configs" / "gpu_study" / "ci.yaml")
DATA = {"tokenizer": "/tok", "text": "/d/text", "number_rich": "/d/num",
        "valid": {"prose": "/d/prose", "code": "/d/code", "math": "/d/math", "gsm8k": "/d/gsm8k"}}  # fmt: skip


@pytest.fixture(scope="module")
def study():
    return gpu_study.load(STUDY)


def _with_seeds(study: dict, seeds: dict[str, int]) -> dict:
    """The study with every stage's power-set seeds filled in (what `gpu_study.py seeds --write` does)."""
    stages = {}
    for name, stage in study["stages"].items():
        count = stage["seeds"]
        stages[name] = {**stage, "seeds": {k: seeds[k] for k in count} if isinstance(count, dict) else count}
    return {**study, "stages": stages}


# 1. Parameter counts -------------------------------------------------------------------------------


def _hf_counts(size: dict, vocab: int) -> dict[str, int]:
    import torch
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=size["hidden-size"], intermediate_size=size["ffn-hidden-size"],
        num_hidden_layers=size["num-layers"], num_attention_heads=size["num-attention-heads"],
        num_key_value_heads=size["num-query-groups"], vocab_size=vocab, tie_word_embeddings=False,
        attention_bias=False, mlp_bias=False,
    )  # fmt: skip
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    embedding = model.get_input_embeddings().weight.numel()
    output = model.get_output_embeddings().weight.numel()
    total = sum(p.numel() for p in model.parameters())
    return {"non_embedding": total - embedding - output, "embedding": embedding, "output": output, "total": total}


def test_parameter_counts_match_a_llama_built_on_the_meta_device(study):
    vocab = gpu_study.padded_vocab(study)
    assert vocab == 128256  # Llama 3's vocabulary is already a multiple of 128
    counts = {}
    for name, size in study["sizes"].items():
        counts[name] = gpu_study.parameters(size, vocab)
        assert counts[name] == _hf_counts(size, vocab), name
    # the sizes the study is named for: about 25 M, 85 M, 300 M and 1 B non-embedding parameters
    targets = {"25M": 25e6, "85M": 85e6, "300M": 300e6, "1B": 1e9}
    for name, target in targets.items():
        assert abs(counts[name]["non_embedding"] / target - 1) < 0.12, (name, counts[name])


# 2. Budget and cost --------------------------------------------------------------------------------


def test_budget_and_cost_follow_the_formulas(study):
    seq, peak = 2048, 989.0e12
    for name, size in study["sizes"].items():
        hf = _hf_counts(size, 128256)
        per_iter = size["global-batch-size"] * seq
        iters = math.ceil(20 * hf["total"] / per_iter)  # 20 tokens per total parameter (Chinchilla's count)
        tokens = iters * per_iter
        flops = 6 * (hf["non_embedding"] + hf["output"]) * tokens
        hours = flops / (size["mfu"] * peak) / 3600
        got = gpu_study.budget(study, name)
        assert (got["iterations"], got["tokens"]) == (iters, tokens), name
        assert 20 <= got["tokens_per_parameter"] == got["tokens_per_total_parameter"] < 20 + per_iter / hf["total"]
        assert got["tokens_per_non_embedding_parameter"] == tokens / hf["non_embedding"]
        assert got["flops"] == flops and got["gpu_hours"] == pytest.approx(hours, rel=1e-12), name
    # the 1 B size by hand: 973,146,112 + 128,256 x 2,048 parameters multiplied per token
    kaplan = gpu_study.budget({**study, "parameter_basis": "non_embedding"}, "1B")
    assert kaplan["tokens"] == math.ceil(20 * kaplan["non_embedding"] / (512 * seq)) * 512 * seq
    one_b = gpu_study.budget(study, "1B")
    assert one_b["non_embedding"] == 16 * (2048 * (32 + 16) * 64 + 2048 * 2048 + 3 * 2048 * 8192 + 2 * 2048) + 2048
    assert one_b["compute_parameters"] == 973_146_112 + 128_256 * 2048


def test_cost_table_rows_and_total(study):
    seeds = {"25M": 8, "85M": 8, "300M": 5, "1B": 3}
    full = _with_seeds(study, seeds)
    done: set = set()
    for stage in full["stages"]:  # pilot, main, secondary: a run of an earlier stage is not counted again
        table = gpu_study.cost_markdown(full, stage)
        spec = full["stages"][stage]
        total, new_total = 0.0, 0
        for name in spec["sizes"]:
            b = gpu_study.budget(full, name)
            n = spec["seeds"][name] if isinstance(spec["seeds"], dict) else spec["seeds"]
            runs = {(name, a, s) for a in spec["arms"] for s in range(n)}
            new = runs - done
            row = next(line for line in table.splitlines() if line.startswith(f"| {name} |"))
            cells = [c.strip() for c in row.strip("|").split("|")]
            assert cells[1] == f"{b['non_embedding']:,}" and cells[3] == f"{b['tokens']:,}"
            assert float(cells[4]) == pytest.approx(b["tokens"] / b["total"], abs=0.05)
            assert float(cells[5]) == pytest.approx(b["tokens"] / b["non_embedding"], abs=0.05)
            assert float(cells[9]) == pytest.approx(b["gpu_hours"], abs=0.05)
            assert cells[11] == f"{len(runs)} ({len(new)})"
            total += b["gpu_hours"] * len(new)
            new_total += len(new)
            done |= runs
        last = table.splitlines()[-1]
        assert f"**{total:.0f}**" in last and f"| {new_total} new |" in last
    assert gpu_study.cost_markdown(study, "pilot").count("| 8 | 16 (16) |") == 2  # 2 arms x 8 seeds per size


# 3. Array tasks ------------------------------------------------------------------------------------


def test_tasks_cover_size_arm_seed_in_order_and_match_the_sbatch_array(study):
    pilot = study["stages"]["pilot"]
    every = gpu_study.tasks(study, "pilot")
    expected = [(s, a, seed) for s in pilot["sizes"] for a in pilot["arms"] for seed in range(pilot["seeds"])]
    assert [(t.size, t.arm, t.seed) for t in every] == expected
    assert [t.index for t in every] == list(range(len(expected))) == list(range(32))
    header = (ROOT / "launch" / "slurm" / "gpu_study.sbatch").read_text()
    assert re.search(r"^#SBATCH --array=0-(\d+)$", header, re.M).group(1) == str(len(every) - 1)
    names = {t.run_name for t in every}
    assert len(names) == len(every) and "85m/ce-ntl-was-1.0/seed7" in names
    with pytest.raises(ValueError, match=r"task 32: stage 'pilot' has tasks 0-31"):
        gpu_study.task(study, 32)
    with pytest.raises(ValueError, match=r"the seeds of 25M are not set .*gpu_study.py seeds"):
        gpu_study.tasks(study, "main")
    main = gpu_study.tasks(_with_seeds(study, {"25M": 8, "85M": 9, "300M": 4, "1B": 3}), "main")
    assert len(main) == 2 * (8 + 9 + 4 + 3)
    # the pilot's runs are the main stage's: the same run folders
    assert names <= {t.run_name for t in main}


# 4. Megatron arguments -----------------------------------------------------------------------------


def _as_dict(argv: list[str]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    key = None
    for word in argv:
        if word.startswith("--"):
            key = word[2:]
            out[key] = []
        else:
            out[key].append(word)
    return out


def test_train_and_eval_arguments(study):
    study = _with_seeds(study, {"25M": 8, "85M": 8, "300M": 4, "1B": 3})
    chosen = ("300M", "CE + NTL-WAS 0.3", 2)
    index = next(t.index for t in gpu_study.tasks(study, "secondary") if (t.size, t.arm, t.seed) == chosen)
    train = _as_dict(gpu_study.argv(study, DATA, index, "train", "/runs/x", "secondary"))
    assert train["num-layers"] == ["24"] and train["hidden-size"] == ["1024"] and train["num-query-groups"] == ["8"]
    assert train["seed"] == ["1236"]  # Megatron's seed must be > 0: 1234 + the study's seed
    assert train["train-iters"] == [str(gpu_study.budget(study, "300M")["iterations"])]
    assert train["train-data-path"] == ["0.9", "/d/text", "0.1", "/d/num"]
    assert train["ntl-weight"] == ["0.3"] and train["ntl-loss"] == ["was"] and train["ntl-squash-factor"] == ["8"]
    assert train["save"] == train["load"] == ["/runs/x/checkpoints"]
    assert "valid-data-path" not in train and "skip-train" not in train and "mfu" not in train
    ev = _as_dict(gpu_study.argv(study, DATA, index, "eval", "/runs/x", "secondary"))
    assert ev["skip-train"] == [] and ev["full-validation"] == [] and ev["multiple-validation-sets"] == []
    assert ev["valid-data-path"] == ["/d/prose", "/d/code", "/d/math", "/d/gsm8k"]
    assert ev["validation-set-names"] == ["prose", "code", "math", "gsm8k"]
    assert ev["ntl-weight"] == ["0.3"] and ev["load"] == ["/runs/x/checkpoints"]
    ce = _as_dict(gpu_study.argv(study, DATA, 0, "eval", "/r"))  # CE is evaluated with the same NTL flags
    assert {k: v for k, v in ce.items() if k.startswith("ntl-")} == {
        k: v for k, v in ev.items() if k.startswith("ntl-")
    }


@pytest.mark.parametrize("path", [STUDY, CI])
def test_every_arm_and_the_eval_flags_are_valid_ntl_settings(path):
    from ntl_scale.integrations.megatron import NTLSettings, add_ntl_args

    study = gpu_study.load(path)
    for flags in [*study["arms"].values(), study["eval"]["ntl_args"]]:
        parser = add_ntl_args(argparse.ArgumentParser())
        args, unknown = parser.parse_known_args(gpu_study.flags(flags))
        assert not unknown
        NTLSettings.from_args(args)  # raises on an invalid combination
    assert float(study["arms"][next(iter(study["arms"]))]["ntl-weight"]) == 0  # the baseline is CE


# 5. Logs and bad input -----------------------------------------------------------------------------

LOG = """\
 [2026-11-27 11:03:44.216897] iteration        5/       5 | lm loss: 7.324047E+00 | ntl loss: 0.000000E+00 |
 validation (ntl_scale) | ntl loss: 4.441964E+02 | number accuracy: 0.000000E+00 |
 validation-prose loss at iteration 5 on validation set | lm loss value: 7.317724E+00 | lm loss PPL: 1.506771E+03 |
 validation (ntl_scale) | ntl loss: 4.614681E+02 | number accuracy: 1.418440E-02 |
 validation-code loss at iteration 5 on validation set | lm loss value: 7.322156E+00 | lm loss PPL: 1.513463E+03 |
 validation (ntl_scale) | ntl loss: n/a (no number tokens) | number accuracy: n/a (no number tokens) |
 validation-numeric loss at iteration 5 on validation set | lm loss value: 7.328597E+00 | lm loss PPL: 1.523243E+03 |
"""


def test_parse_eval_pairs_each_set_with_the_ntl_line_printed_before_it():
    got = gpu_study.parse_eval(LOG)
    assert list(got) == ["prose", "code", "numeric"]
    assert got["prose"]["lm_loss"] == 7.317724 and got["prose"]["ppl"] == pytest.approx(1.506771e3, rel=1e-6)
    assert got["code"]["number_token_was"] == 461.4681 and got["code"]["number_token_acc"] == pytest.approx(0.0141844)
    assert got["numeric"]["ppl"] == pytest.approx(1.523243e3, rel=1e-6)
    assert math.isnan(got["numeric"]["number_token_was"]) and math.isnan(got["numeric"]["number_token_acc"])


def test_bad_study_files_and_sweep_metrics_are_named(tmp_path):
    import yaml

    good = yaml.safe_load(open(CI))
    cases = [
        ({"sizes": {"x": {"num-layers": 2}}}, r"size 'x' lacks \['hidden-size'"),
        ({"number_share": 1.5}, r"number_share = 1.5"),
        ({"tokens_per_parameter": 0}, r"tokens_per_parameter = 0"),
        ({"stages": {"pilot": {"sizes": ["tiny"], "arms": ["CE"], "seeds": 0}}}, r"seeds = 0: expected"),
        ({"stages": {"pilot": {"sizes": ["big"], "arms": ["CE"], "seeds": 2}}}, r"names \['big'\]"),
        ({"parameter_basis": "all"}, r"parameter_basis = 'all'"),
    ]
    for change, message in cases:
        path = tmp_path / "s.yaml"
        path.write_text(yaml.safe_dump({**good, **change}))
        with pytest.raises(ValueError, match=message):
            gpu_study.load(str(path))
    bad = {**good, "sizes": {"x": {**good["sizes"]["tiny"], "num-query-groups": 3}}}
    (tmp_path / "b.yaml").write_text(yaml.safe_dump(bad))
    with pytest.raises(ValueError, match="must divide by num-query-groups 3"):
        gpu_study.load(str(tmp_path / "b.yaml"))
    with pytest.raises(ValueError, match=r"data file .* does not exist: copy configs/gpu_study/data\.example\.yaml"):
        gpu_study.load_data(str(tmp_path / "none.yaml"))
    with pytest.raises(ValueError, match=r"sweep metrics \['nope'\]"):
        size_sweep.metric_keys({"metrics": ["nope"]})
    assert size_sweep.metric_keys({}) == list(size_sweep.METRICS)


# 6. Harness reports, the pilot's power step, the verdict rule, the corpora -----------------------------


def _report(exact: list[float], rel: list[float], bpb: float, text: float, number: float) -> dict:
    """A results file as lm-evaluation-harness 0.4 writes it (``"<metric>,<filter>"`` keys per task)."""
    results = {f"ntl_arith_{op}": {"alias": op, "exact_match,none": e, "exact_match_stderr,none": 0.01}
               for op, e in zip(("add", "sub", "mul", "cmp"), exact)}  # fmt: skip
    for op, r in zip(("add", "sub", "mul"), rel):
        results[f"ntl_arith_{op}"]["rel_error,none"] = r
    results["ntl_arith_cmp"]["rel_error,none"] = 99.0  # comparison: not in the mean
    results["ntl_gsm8k_bpb"] = {"bits_per_byte,none": bpb, "bits_per_byte_stderr,none": "N/A"}
    results["ntl_study_prose_split"] = {"text_bits_per_byte,none": text, "number_bits_per_byte,none": number,
                                        "bits_per_byte,none": 1.0}  # fmt: skip
    return {"results": results, "groups": {"ntl_arith": {"exact_match,none": 0.5}}}


def test_parse_harness_reads_the_study_metrics_of_a_results_file():
    got = gpu_study.parse_harness(_report([0.1, 0.2, 0.3, 0.6], [0.5, 0.25, 2.0], 1.25, 1.5, 3.0), ["prose", "code"])
    assert got["harness"] == {"arith_exact_match": pytest.approx(0.3), "arith_rel_error": pytest.approx(2.75 / 3),
                              "gsm8k_bpb": 1.25}  # fmt: skip
    assert got["prose"] == {"text_byte_ppl": pytest.approx(2**1.5), "number_byte_ppl": pytest.approx(8.0)}
    assert "code" not in got  # no such task in the report
    assert gpu_study.parse_harness({"results": {}}, ["prose"]) == {}


def _fake_runs(tmp_path, study, stage, values):
    """eval.json and harness.json of every run of ``stage``: ``values(size, arm, seed) -> {split: {metric: v}}``."""
    for t in gpu_study.tasks(study, stage):
        run = tmp_path / t.run_name
        run.mkdir(parents=True, exist_ok=True)
        metrics = values(t.size, t.arm, t.seed)
        harness = {k: v for k, v in metrics.items() if k == "harness"}
        (run / "eval.json").write_text(json.dumps({k: v for k, v in metrics.items() if k != "harness"}))
        (run / "harness.json").write_text(json.dumps(harness))


def test_seeds_from_the_pilot_follow_the_measured_sd_and_the_power(tmp_path, study):
    import power

    rng = random.Random(0)
    noise = {(size, seed): rng.gauss(0, 1) for size in ("25M", "85M") for seed in range(8)}

    def values(size, arm, seed):
        ntl = arm != "CE"
        scale = {"25M": 0.5, "85M": 0.2}[size]  # sd of the per-seed differences, in % of CE's 10.0
        text = 10.0 * (1 + (0.01 + scale * noise[size, seed] / 100) * ntl)
        return {"prose": {"text_byte_ppl": text}, "harness": {"arith_rel_error": 1.0 - 0.2 * ntl + 0.01 * seed * ntl,
                                                               "gsm8k_bpb": 1.0 + 0.001 * seed * ntl}}  # fmt: skip

    _fake_runs(tmp_path, study, "pilot", values)
    got = gpu_study.seeds_from_pilot(study, str(tmp_path))
    spec = study["power"]
    for size in ("25M", "85M"):
        ce = [values(size, "CE", s)["prose"]["text_byte_ppl"] for s in range(8)]
        ntl = [values(size, "CE + NTL-WAS 1.0", s)["prose"]["text_byte_ppl"] for s in range(8)]
        diffs = [100 * (a - b) / statistics.fmean(ce) for a, b in zip(ntl, ce)]
        m = got["measured"][size]["prose_text_byte_ppl"]
        assert m["sd"] == pytest.approx(statistics.stdev(diffs), rel=1e-9) and m["pairs"] == 8
        assert m["seeds"] == power.seeds_needed(1.0 / m["sd"], 0.05, spec["family"], spec["power"])
        wanted = max(v["seeds"] for v in got["measured"][size].values())
        assert got["seeds"][size] == min(max(wanted, 8), spec["max_seeds"])  # at least the pilot's 8
    assert got["assumed"] == {"300M": "85M", "1B": "85M"}
    assert (
        got["seeds"]["1B"]
        == got["seeds"]["300M"]
        == max(min(max(v["seeds"] for v in got["measured"]["85M"].values()), spec["max_seeds"]), 2)
    )
    out = tmp_path / "main.yaml"
    gpu_study.write_seeds(STUDY, got["seeds"], str(out))
    written = gpu_study.load(str(out))
    assert {k: v for k, v in written["stages"]["main"]["seeds"].items()} == got["seeds"]
    assert len(gpu_study.tasks(written, "main")) == 2 * sum(got["seeds"].values())


def _cells(means: dict[str, float], sds: dict[str, float], seeds: int = 8) -> dict:
    """size_sweep-style differences with a chosen mean and spread per metric (exactly that sample mean and sd)."""
    out = {}
    for key, mean in means.items():
        base = [(-1) ** i * (1 if i < seeds - seeds % 2 else 0) for i in range(seeds)]
        spread = statistics.stdev(base) if any(base) else 1.0
        values = [mean + sds[key] * b / spread for b in base]
        out[key] = values
    return out


def test_verdict_rule_reads_cost_gain_and_the_family(study):
    from scipy import stats

    rule = study["analysis"]

    def table(per_size):
        sizes = []
        for label, values in per_size.items():
            diffs = {}
            for key, seeds in values.items():
                mean, sd, n = statistics.fmean(seeds), statistics.stdev(seeds), len(seeds)
                half = stats.t.ppf(0.975, n - 1) * sd / math.sqrt(n)
                p = 2 * stats.t.sf(abs(mean) / (sd / math.sqrt(n)), n - 1)
                diffs[key] = {"seeds": seeds, "mean": mean, "low": mean - half, "high": mean + half, "p_seed_t": p}
            sizes.append({"label": label, "differences": {rule["primary_arm"]: diffs}})
        return {"sizes": sizes}

    sd = {"prose_text_byte_ppl": 0.2, "arith_rel_error": 1.0, "gsm8k_bpb": 0.2}
    got = gpu_study.verdict(table({
        "25M": _cells({"prose_text_byte_ppl": 0.1, "arith_rel_error": -20.0, "gsm8k_bpb": -2.0}, sd),  # adopt
        "85M": _cells({"prose_text_byte_ppl": 3.0, "arith_rel_error": -20.0, "gsm8k_bpb": 0.0}, sd),  # trade-off
        "300M": _cells({"prose_text_byte_ppl": 0.0, "arith_rel_error": 0.0, "gsm8k_bpb": 0.0}, sd),  # no gain
        "1B": _cells({"prose_text_byte_ppl": 0.5, "arith_rel_error": -3.0, "gsm8k_bpb": 0.0},
                     {**sd, "prose_text_byte_ppl": 3.0, "arith_rel_error": 30.0}),  # wide: not decided
    }), study)  # fmt: skip
    readings = {r["size"]: (r["cost"], r["gain"], r["verdict"]) for r in got}
    assert readings == {"25M": ("no cost", "gain", "adopt"), "85M": ("cost", "gain", "trade-off"),
                        "300M": ("no cost", "no gain", "do not adopt"),
                        "1B": ("unresolved", "unresolved", "not decided at this scale")}  # fmt: skip
    # Holm over the declared family of 12: the smallest p times 12
    ps = sorted(d["p_seed_t"] for s in table({"25M": _cells({"prose_text_byte_ppl": 3.0, "arith_rel_error": -20.0,
                                                           "gsm8k_bpb": 0.0}, sd)})["sizes"]
                for d in s["differences"][rule["primary_arm"]].values())  # fmt: skip
    one = gpu_study.verdict(table({"25M": _cells({"prose_text_byte_ppl": 3.0, "arith_rel_error": -20.0,
                                                  "gsm8k_bpb": 0.0}, sd)}), study)[0]  # fmt: skip
    assert min(one["holm"].values()) == pytest.approx(min(1.0, 12 * ps[0]))


def test_prepare_text_holds_documents_out_by_their_hash(tmp_path):
    import gzip
    import hashlib

    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = [f"document {i} with {i * 7} apples" for i in range(300)]
    (tmp_path / "web").mkdir()
    pq.write_table(pa.table({"text": docs[:150]}), tmp_path / "web" / "a.parquet")
    with gzip.open(tmp_path / "web" / "b.jsonl.gz", "wt") as f:
        f.writelines(json.dumps({"text": d}) + "\n" for d in docs[150:])
    code = tmp_path / "code.jsonl"
    code.write_text("".join(json.dumps({"content": f"x = {i}"}) + "\n" for i in range(5)))
    sources = {"web": {"path": str(tmp_path / "web"), "heldout_per_10000": 1000, "heldout_documents": 10,
                       "heldout_chars": 12},
               "code": {"path": str(code), "column": "content", "train": False,
                        "heldout_per_10000": 10000}}  # fmt: skip
    out = tmp_path / "out"
    counts = gpu_study.prepare_text(sources, str(out))
    held = [d for d in docs if int(hashlib.sha256(d.encode()).hexdigest(), 16) % 10_000 < 1000]
    read = lambda p: [json.loads(line)["text"] for line in p.read_text().splitlines()]  # noqa: E731
    assert read(out / "web_heldout.jsonl") == [d[:12] for d in held[:10]]
    assert read(out / "web_train.jsonl") == [d for d in docs if d not in held]
    assert read(out / "code_heldout.jsonl") == [f"x = {i}" for i in range(5)]
    assert not (out / "code_train.jsonl").exists()
    assert counts == {"web": {"train": 300 - len(held), "heldout": 10}, "code": {"train": 0, "heldout": 5}}
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"no \.parquet or \.jsonl"):
        list(gpu_study.read_texts(str(tmp_path / "empty")))


def test_the_documented_cost_tables_are_the_study_file_s(study):
    page = (ROOT / "docs" / "gpu_study.md").read_text()
    block = re.search(r"<!-- generated: gpu_study_cost [^\n]*-->\n(.*?)<!-- end: gpu_study_cost -->", page, re.S)
    assumed = study["cost"]["assumed_seeds"]
    assert block.group(1).strip() == "\n\n".join(gpu_study.cost_markdown(study, s, assumed) for s in study["stages"])


# 7. The one command (`gpu_study_submit.py`): what it would submit, and its errors -----------------------


def test_array_spec_lists_the_unfinished_tasks_as_sbatch_ranges(tmp_path):
    import gpu_study_submit

    assert gpu_study_submit.array_spec([8, 0, 1, 2, 5, 7]) == "0-2,5,7-8"
    assert gpu_study_submit.array_spec([3]) == "3"
    ci = gpu_study.load(CI)  # pilot: tiny x (CE, CE + NTL-WAS 0.3) x seeds 0-1 = tasks 0-3
    runs = tmp_path / "runs"
    done = runs / "tiny" / "ce" / "seed0"  # evaluated and scored: done
    done.mkdir(parents=True)
    (done / "eval.json").write_text("{}")
    (done / "harness.json").write_text("{}")
    half = runs / "tiny" / "ce-ntl-was-0.3" / "seed1"  # evaluated, not scored by the harness: not done
    half.mkdir(parents=True)
    (half / "eval.json").write_text("{}")
    assert gpu_study_submit.unfinished(ci, str(runs), "pilot") == [1, 2, 3]
    no_harness = {**ci, "eval": {k: v for k, v in ci["eval"].items() if k != "harness"}}
    assert gpu_study_submit.unfinished(no_harness, str(runs), "pilot") == [1, 2]


def _submit_files(tmp_path, study_change=None, data_change=None):
    import yaml

    study = yaml.safe_load(open(CI))
    study.update(study_change or {})
    (tmp_path / "study.yaml").write_text(yaml.safe_dump(study, sort_keys=False))  # the stages' order matters
    (tmp_path / "data.yaml").write_text(yaml.safe_dump({**DATA, **(data_change or {})}))
    return ["--config", str(tmp_path / "study.yaml"), "--data", str(tmp_path / "data.yaml"),
            "--runs", str(tmp_path / "runs")]  # fmt: skip


def test_submit_errors_name_the_fix(tmp_path, monkeypatch):
    import gpu_study_submit

    args = _submit_files(tmp_path)
    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch
    with pytest.raises(SystemExit, match=r"sbatch is not on PATH: run `gpu_study_submit.py` on a Slurm login node"):
        gpu_study_submit.main(args)
    monkeypatch.undo()
    power = {k: v for k, v in gpu_study.load(CI)["power"].items() if k not in ("effects", "max_seeds")}
    with pytest.raises(SystemExit, match=r"leave seeds to 'power', but the power section lacks \['max_seeds', "
                       r"'effects'\]: add power: \{stage, alpha"):  # fmt: skip
        gpu_study_submit.main(_submit_files(tmp_path, {"power": power}))
    with pytest.raises(SystemExit, match=r"power.stage = 'main': expected a stage before 'main'"):
        gpu_study_submit.main(_submit_files(tmp_path, {"power": {**gpu_study.load(CI)["power"], "stage": "main"}}))
    with pytest.raises(SystemExit, match=r"slurm.array = \['partition=gpu'\]: expected sbatch options such as"):
        gpu_study_submit.main(_submit_files(tmp_path, data_change={"slurm": {"array": ["partition=gpu"]}}))
    with pytest.raises(SystemExit, match=r"data file .*none.yaml' does not exist"):
        gpu_study_submit.main([*args[:3], str(tmp_path / "none.yaml"), *args[4:]])
    # a runs folder started from another study file
    runs = tmp_path / "runs"
    runs.mkdir(exist_ok=True)
    (runs / "submit.json").write_text(json.dumps({"config": "/x.yaml", "config_sha256": "0" * 64, "jobs": []}))
    with pytest.raises(SystemExit, match=r"holds a study submitted from /x.yaml .*choose another --runs"):
        gpu_study_submit.main(_submit_files(tmp_path))
    assert gpu_study_submit.STATE == "submit.json"


# 8. `submit` against stand-ins for sbatch and squeue (executables on PATH keeping a job table) ------------

FAKE_SBATCH = """
import json, os, sys
table = json.load(open(os.environ["FAKE_SLURM"]))
argv = sys.argv[1:]
table["calls"].append(argv)
for needle, message in table["fail"].items():
    if any(needle in a for a in argv):
        json.dump(table, open(os.environ["FAKE_SLURM"], "w"))
        sys.exit(message)
export = next((a.split("=", 1)[1] for a in argv if a.startswith("--export=")), os.environ.get("SBATCH_EXPORT", "ALL"))
words = export.split(",")  # sbatch's rule: ALL (the environment) or NONE, plus NAME=VALUE pairs
env = {**(dict(os.environ) if "ALL" in words else {}), **dict(w.split("=", 1) for w in words if "=" in w)}
job = str(table["next_id"])
table["next_id"] += 1
table["jobs"][job] = {"user": os.environ.get("FAKE_USER", "me"), "state": "PENDING",
                      "env": {k: v for k, v in env.items() if k.startswith("NTL_STUDY") or k == "NTL_STAGE"}}
json.dump(table, open(os.environ["FAKE_SLURM"], "w"))
print(job)
"""
FAKE_SQUEUE = """
import json, os, sys
table = json.load(open(os.environ["FAKE_SLURM"]))
if table["squeue_fail"]:
    table["squeue_fail"] -= 1
    json.dump(table, open(os.environ["FAKE_SLURM"], "w"))
    sys.exit("squeue: error: slurm_load_jobs error: Socket timed out on send/recv operation")
argv = sys.argv[1:]
ids = argv[argv.index("-j") + 1].split(",") if "-j" in argv else list(table["jobs"])
user = argv[argv.index("-u") + 1] if "-u" in argv else None
if any(i not in table["jobs"] for i in ids):  # the stricter form: an unknown id fails the whole list
    sys.exit("slurm_load_jobs error: Invalid job id specified")
for i in ids:
    if user in (None, table["jobs"][i]["user"]):
        print(f"{i}|{i}|{table['jobs'][i]['state']}|None")
"""


@pytest.fixture()
def fake_slurm(tmp_path, monkeypatch):
    """sbatch and squeue as executables on PATH sharing a job table (``table()`` reads it, ``table(t)`` writes it);
    sbatch gives a job the environment its --export (or SBATCH_EXPORT) would."""
    import os

    import gpu_study_submit

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in (("sbatch", FAKE_SBATCH), ("squeue", FAKE_SQUEUE)):
        (bin_dir / name).write_text(f"#!{sys.executable}\n{body}")
        (bin_dir / name).chmod(0o755)
    path = tmp_path / "slurm.json"
    path.write_text(json.dumps({"next_id": 100, "jobs": {}, "calls": [], "fail": {}, "squeue_fail": 0}))
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_SLURM", str(path))
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.setattr(gpu_study_submit, "RETRY_S", 0.0, raising=False)

    def table(new=None):
        if new is not None:
            path.write_text(json.dumps(new))
        return json.loads(path.read_text())

    return table


def _advance(tmp_path, **data_change):
    import gpu_study_submit

    args = _submit_files(tmp_path, data_change=data_change)
    return gpu_study_submit.advance(args[1], args[3], args[5])


def test_submit_sees_a_teammate_s_jobs_and_retries_squeue(tmp_path, monkeypatch, fake_slurm):
    monkeypatch.setenv("FAKE_USER", "teammate")
    assert _advance(tmp_path) == "submitted"  # the pilot array and its next job, a teammate's
    monkeypatch.setenv("FAKE_USER", "me")
    calls = len(fake_slurm()["calls"])
    assert _advance(tmp_path) == "waiting"
    table = fake_slurm()
    table["squeue_fail"] = 2  # transient: the third try answers
    fake_slurm(table)
    assert _advance(tmp_path) == "waiting"
    assert len(fake_slurm()["calls"]) == calls
    fake_slurm({**fake_slurm(), "squeue_fail": 5})
    with pytest.raises(ValueError, match=r"squeue failed 3 times \(.*Socket timed out.*\): .*squeue -h"):
        _advance(tmp_path)
    assert json.loads((tmp_path / "runs" / "submit.json").read_text())["status"] == "stopped"
    fake_slurm({**fake_slurm(), "squeue_fail": 0, "jobs": {}})  # both ended and purged: Invalid job id
    assert _advance(tmp_path) == "submitted"
    assert len(fake_slurm()["calls"]) == calls + 2


def test_a_failed_next_job_is_recorded_and_submitted_alone_on_a_re_run(tmp_path, fake_slurm):
    fake_slurm({**fake_slurm(), "fail": {"gpu_study_next.sbatch": "sbatch: error: QOSMaxSubmitJobPerUserLimit"}})
    with pytest.raises(ValueError, match=r"sbatch failed \(sbatch: error: QOSMaxSubmitJobPerUserLimit\)"):
        _advance(tmp_path)
    state = json.loads((tmp_path / "runs" / "submit.json").read_text())
    assert state["status"] == "stopped" and "QOSMaxSubmitJobPerUserLimit" in state["message"]
    [array] = [j["id"] for j in state["jobs"] if j["kind"] == "array"]
    fake_slurm({**fake_slurm(), "fail": {}})
    assert _advance(tmp_path) == "submitted"
    last = fake_slurm()["calls"][-1]
    assert f"--dependency=afterany:{array}" in last and any(a.endswith("gpu_study_next.sbatch") for a in last)
    assert sum(any(a.startswith("--array") for a in c) for c in fake_slurm()["calls"]) == 1  # no second array
    assert json.loads((tmp_path / "runs" / "submit.json").read_text())["status"] == "submitted"
    assert _advance(tmp_path) == "waiting"


def test_without_flock_an_exclusive_lock_file_names_its_holder(tmp_path, monkeypatch, capsys, fake_slurm):
    import errno
    import fcntl

    import gpu_study_submit

    def no_flock(*_):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_flock)  # a file system mounted without flock (Lustre noflock)
    assert _advance(tmp_path) == "submitted"
    held = tmp_path / "runs" / "submit.held"
    assert not held.exists()
    held.write_text("host login2 pid 4242 since 2026-01-01T00:00:00")
    monkeypatch.setattr(gpu_study_submit, "LOCK_WAIT_S", 0.0, raising=False)
    with pytest.raises(ValueError, match=r"submit.held is held by host login2 pid 4242 .*delete .*submit.held"):
        _advance(tmp_path)
    assert "waiting for another submission" in capsys.readouterr().out


def test_the_array_gets_its_variables_whatever_the_site_exports(tmp_path, monkeypatch, fake_slurm):
    import gpu_study_submit

    monkeypatch.setenv("SBATCH_EXPORT", "NONE")
    assert _advance(tmp_path, slurm={"array": ["--partition=gpu"], "max_running": 2}) == "submitted"
    table = fake_slurm()
    array_call = next(c for c in table["calls"] if any(a.startswith("--array") for a in c))
    assert "--array=0-3%2" in array_call  # the CI pilot's 4 tasks, 2 at a time
    array = next(j for j in table["jobs"].values() if j["env"])
    assert array["env"] == {"NTL_STAGE": "pilot", "NTL_STUDY_DATA": str(tmp_path / "data.yaml"),
                            "NTL_STUDY_RUNS": str(tmp_path / "runs")}  # fmt: skip
    (tmp_path / "x").mkdir()
    for word in ["--array=0-1", "--dependency=afterok:1", "--output=x.out", "--error=x.err", "--job-name=x",
                 "--export=NONE", "--parsable", "-o x.out"]:  # fmt: skip
        name = {"-o": "--output"}.get(word[:2], word.split("=")[0])
        with pytest.raises(SystemExit, match=rf"slurm.array holds '{word}': `submit` sets {name} itself .*remove it"):
            gpu_study_submit.main(_submit_files(tmp_path / "x", data_change={"slurm": {"array": [word]}}))
    with pytest.raises(SystemExit, match=r"slurm.max_running = 0: expected a whole number >= 1"):
        gpu_study_submit.main(_submit_files(tmp_path / "x", data_change={"slurm": {"max_running": 0}}))


def test_a_runs_folder_refuses_another_data_file(tmp_path, fake_slurm):
    assert _advance(tmp_path) == "submitted"
    fake_slurm({**fake_slurm(), "jobs": {}})
    assert _advance(tmp_path, slurm={"step": ["--partition=cpu"]}) == "submitted"  # the site's options may change
    fake_slurm({**fake_slurm(), "jobs": {}})
    with pytest.raises(ValueError, match=r"submitted from .*data.yaml \(another content than the data file .*"
                       r"data.yaml\): submit the same data file.*choose another --runs"):  # fmt: skip
        _advance(tmp_path, tokenizer="/another-tokenizer")
