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
import math
import re
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
        "valid": {"prose": "/d/prose", "code": "/d/code", "numeric": "/d/gsm8k"}}  # fmt: skip


@pytest.fixture(scope="module")
def study():
    return gpu_study.load(STUDY)


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
        iters = math.ceil(20 * hf["non_embedding"] / per_iter)
        tokens = iters * per_iter
        flops = 6 * (hf["non_embedding"] + hf["output"]) * tokens
        hours = flops / (size["mfu"] * peak) / 3600
        got = gpu_study.budget(study, name)
        assert (got["iterations"], got["tokens"]) == (iters, tokens), name
        assert 20 <= got["tokens_per_parameter"] < 20 + per_iter / hf["non_embedding"]
        assert got["flops"] == flops and got["gpu_hours"] == pytest.approx(hours, rel=1e-12), name
    # the 1 B size by hand: 973,146,112 + 128,256 x 2,048 parameters multiplied per token
    one_b = gpu_study.budget(study, "1B")
    assert one_b["non_embedding"] == 16 * (2048 * (32 + 16) * 64 + 2048 * 2048 + 3 * 2048 * 8192 + 2 * 2048) + 2048
    assert one_b["compute_parameters"] == 973_146_112 + 128_256 * 2048


def test_cost_table_rows_and_total(study):
    table = gpu_study.cost_markdown(study)
    runs = len(study["arms"]) * len(study["seeds"])
    total = 0.0
    for name in study["sizes"]:
        b = gpu_study.budget(study, name)
        row = next(line for line in table.splitlines() if line.startswith(f"| {name} |"))
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[1] == f"{b['non_embedding']:,}" and cells[3] == f"{b['tokens']:,}"
        assert float(cells[7]) == pytest.approx(b["gpu_hours"], abs=0.05)
        assert int(cells[8]) == runs
        total += b["gpu_hours"] * runs
    last = table.splitlines()[-1]
    assert f"**{total:.0f}**" in last and f"| {runs * len(study['sizes'])} |" in last


# 3. Array tasks ------------------------------------------------------------------------------------


def test_tasks_cover_size_arm_seed_in_order_and_match_the_sbatch_array(study):
    every = gpu_study.tasks(study)
    expected = [(s, a, seed) for s in study["sizes"] for a in study["arms"] for seed in study["seeds"]]
    assert [(t.size, t.arm, t.seed) for t in every] == expected
    assert [t.index for t in every] == list(range(len(expected))) == list(range(36))
    header = (ROOT / "launch" / "slurm" / "gpu_study.sbatch").read_text()
    assert re.search(r"^#SBATCH --array=0-(\d+)$", header, re.M).group(1) == str(len(every) - 1)
    names = {t.run_name for t in every}
    assert len(names) == len(every) and "1b/ce-ntl-was-0.3/seed2" in names
    with pytest.raises(ValueError, match=r"task 36: the study has tasks 0-35"):
        gpu_study.task(study, 36)


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
    index = next(t.index for t in gpu_study.tasks(study) if (t.size, t.arm, t.seed) == ("300M", "CE + NTL-WAS 0.1", 2))
    train = _as_dict(gpu_study.argv(study, DATA, index, "train", "/runs/x"))
    assert train["num-layers"] == ["24"] and train["hidden-size"] == ["1024"] and train["num-query-groups"] == ["8"]
    assert train["seed"] == ["1236"]  # Megatron's seed must be > 0: 1234 + the study's seed
    assert train["train-iters"] == [str(gpu_study.budget(study, "300M")["iterations"])]
    assert train["train-data-path"] == ["0.9", "/d/text", "0.1", "/d/num"]
    assert train["ntl-weight"] == ["0.1"] and train["ntl-loss"] == ["was"]
    assert train["save"] == train["load"] == ["/runs/x/checkpoints"]
    assert "valid-data-path" not in train and "skip-train" not in train and "mfu" not in train
    ev = _as_dict(gpu_study.argv(study, DATA, index, "eval", "/runs/x"))
    assert ev["skip-train"] == [] and ev["full-validation"] == [] and ev["multiple-validation-sets"] == []
    assert ev["valid-data-path"] == ["/d/prose", "/d/code", "/d/gsm8k"]
    assert ev["validation-set-names"] == ["prose", "code", "numeric"]
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
        ({"seeds": [-1]}, r"seeds = \[-1\]"),
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
