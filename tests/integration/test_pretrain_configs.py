"""The shipped 2B-3B pretraining configs start and train, at reduced width and depth, from the same files.

A config is launched as users launch it (``deepspeed launch/train.py --config FILE``) on 2 CPU
processes with ``key=value`` overrides that shrink only sizes: hidden size, intermediate size, layers,
heads, the vocabulary (a tiny tokenizer of the same family trained offline), the sequence length, the
corpus (a JSON-lines file written here), 2 steps, fp32.
Everything else comes from the file: the architecture family and its published settings (Granite's
multipliers, Llama 3's rope scaling, tied embeddings), the ZeRO stage and DeepSpeed JSON, AutoTP, the
chunked loss, activation checkpointing, the attention implementation, the NTL table rule.

Sections:
1. The files hold the published shapes (checked against the models' published ``config.json``
   values, written out here) and resolve for their GPU counts; no launch.
2. Each family once and each layout once take two steps on 2 processes: Granite's AutoTP 2 x ZeRO-1
   file (its odd vocabulary split unevenly over the tensor-parallel ranks, digit-level NTL) and Llama's
   ZeRO-3 file (rope scaling, multi-digit NTL with its squash factor). The two files of a family differ
   only in the layout (``tensor_parallel_size`` and the DeepSpeed JSON), which section 1 resolves for
   all four; Llama under AutoTP with tied embeddings trains in tests/integration/test_train_deepspeed.py.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path

import pytest

from tests.helpers.distributed import free_port, run_launch
from tests.helpers.spawn_ranks import deepspeed_command

ROOT = Path(__file__).resolve().parents[2]
SHIM = ROOT / "tests" / "helpers" / "ds_launch.py"
CONFIGS = ROOT / "configs" / "train"

# The published config.json values (ibm-granite/granite-3.2-2b-instruct, meta-llama/Llama-3.2-3B).
PUBLISHED = {
    "granite-3.2-2b": {
        "model_type": "granite", "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 40,
        "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 49155, "rope_theta": 5000000.0,
        "tie_word_embeddings": True, "attention_multiplier": 0.015625, "embedding_multiplier": 12.0,
        "residual_multiplier": 0.22, "logits_scaling": 8.0, "rms_norm_eps": 1e-5,
    },
    "llama-3.2-3b": {
        "model_type": "llama", "hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 28,
        "num_attention_heads": 24, "num_key_value_heads": 8, "vocab_size": 128256, "rope_theta": 500000.0,
        "tie_word_embeddings": True, "rms_norm_eps": 1e-5,
        "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                         "original_max_position_embeddings": 8192},
    },
}  # fmt: skip
FAMILIES = {  # config files, sequence length, GPUs named in the header
    "granite-3.2-2b": {"pretrain_zero3": 8, "pretrain_tp2_zero1": 16},
    "llama-3.2-3b": {"pretrain_zero3": 32, "pretrain_tp2_zero1": 32},
}
SEQ_LENGTH = {"granite-3.2-2b": 4096, "llama-3.2-3b": 8192}
LAUNCHED = {"granite-3.2-2b": "pretrain_tp2_zero1", "llama-3.2-3b": "pretrain_zero3"}  # each layout once


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_configs_hold_the_published_shapes(family):
    from ntl_scale.integrations.deepspeed.resolved import resolve_deepspeed_config
    from ntl_scale.training.config import load_config

    for variant, gpus in FAMILIES[family].items():
        path = CONFIGS / f"{family}_{variant}.yaml"
        cfg = load_config(str(path))
        for key, value in PUBLISHED[family].items():
            assert cfg.model.architecture[key] == value, (path.name, key)
        assert cfg.model.path is None and cfg.model.gradient_checkpointing and cfg.model.attn_implementation == "sdpa"
        assert cfg.train.bf16 is True and cfg.train.chunked_loss is True
        with open(cfg.train.deepspeed_config) as f:
            ds = resolve_deepspeed_config(json.load(f), cfg.train, world_size=gpus)
        tp = cfg.train.tensor_parallel_size
        assert ds["bf16"]["enabled"] is True
        if "tp2" in variant:
            assert tp == 2 and ds["zero_optimization"]["stage"] == 1
            assert ds["tensor_parallel"] == {"autotp_size": 2, "vocab_parallel_lm_head": True}
        else:
            assert tp == 1 and ds["zero_optimization"]["stage"] == 3
        accumulation = ds["gradient_accumulation_steps"]
        assert cfg.train.micro_batch_size * accumulation * (gpus // tp) == cfg.train.global_batch_size
        header = path.read_text().split("run_dir:")[0]
        assert "launch/train.py" in header and f"configs/train/{path.name}" in header  # the launch command


def _tokenizer_dir(family: str, tmp_path: Path) -> tuple[str, int]:
    """A tiny offline tokenizer of the family's kind: Granite's writes digits singly, Llama 3's in 1-3 digit
    groups. Returns its directory and the model vocabulary size to use (Granite's stays odd, as 49155 is, so
    AutoTP splits it unevenly)."""
    from tests.helpers import tokenizers

    tok = tokenizers.byte_level_bpe() if family.startswith("granite") else tokenizers.llama3_style_bpe()
    path = tmp_path / "tokenizer"  # EOS only, no padding token: packed sequences need none (as Llama 3's)
    tok.save_pretrained(path)
    size = len(tok)
    return str(path), size + 3 if family.startswith("granite") else size


def _tiny(family: str, tmp_path: Path) -> tuple[str, ...]:
    """Overrides that shrink sizes only: width, depth, heads, vocabulary, sequence, steps, data."""
    from tests.helpers import tokenizers

    tokenizer, vocab = _tokenizer_dir(family, tmp_path)
    corpus = tmp_path / "corpus.jsonl"  # number-rich documents of 1-6 sentences
    lines = tokenizers.corpus(400, seed=1)
    corpus.write_text(
        "".join(json.dumps({"text": " ".join(lines[i : i + 1 + i % 6])}) + "\n" for i in range(0, 400, 4))
    )
    arch = "model.architecture."
    return (
        f"model.tokenizer={tokenizer}", f"{arch}vocab_size={vocab}", f"{arch}hidden_size=64",
        f"{arch}intermediate_size=128", f"{arch}num_hidden_layers=2", f"{arch}num_attention_heads=4",
        f"{arch}num_key_value_heads=2", "train.seq_length=32", "train.steps=2", "train.bf16=false",
        "train.micro_batch_size=2", "train.global_batch_size=4", "train.log_every=1", "train.save_every=0",
        "tracking.wandb=disabled", "tracking.plot=false", f"data.train_path={corpus}", "data.eval_sequences=2",
        "data.num_proc=1",
    )  # fmt: skip


def _launch(config: Path, run_dir: Path, overrides: tuple[str, ...]) -> subprocess.CompletedProcess:
    script = [str(SHIM), str(ROOT / "launch" / "train.py"), "--config", str(config), f"run_dir={run_dir}"]
    cmd = deepspeed_command(2, str(free_port()), *script, *overrides)  # the ranks `deepspeed` starts
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONUNBUFFERED": "1"}
    out = run_launch(cmd, cwd=ROOT, env=env, timeout=600)
    if out.returncode != 0:
        raise AssertionError(f"{config.name} failed ({out.returncode}):\n{out.stdout[-4000:]}\n{out.stderr[-4000:]}")
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_configs_take_two_steps_at_reduced_size(tmp_path, family):
    pytest.importorskip("deepspeed")
    overrides = _tiny(family, tmp_path)
    vocab = int(next(o for o in overrides if ".vocab_size=" in o).split("=")[1])
    variant = LAUNCHED[family]
    run = tmp_path / variant
    out = _launch(CONFIGS / f"{family}_{variant}.yaml", run, overrides)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(math.isfinite(r["ce"]) and math.isfinite(r["ntl"]) and r["grad_norm"] > 0 for r in rows)
    saved = json.loads((run / "config.json").read_text())
    assert saved["model"]["gradient_checkpointing"] is True and saved["train"]["chunked_loss"] is True
    assert "packed training corpus" in out.stdout and math.isfinite(rows[-1]["eval/ppl"])  # held out at the end
    exported = json.loads((run / "hf_model" / "config.json").read_text())
    rope = dict(exported.get("rope_parameters") or {})  # transformers 5 keeps theta and scaling here
    exported.setdefault("rope_theta", None)
    exported["rope_theta"] = exported["rope_theta"] or rope.pop("rope_theta", None)
    exported["rope_scaling"] = exported.get("rope_scaling") or rope
    for key, value in PUBLISHED[family].items():  # the published settings reach the model
        if key not in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                       "num_key_value_heads", "vocab_size"):  # fmt: skip
            assert exported[key] == value, (variant, key, exported[key])
    assert exported["vocab_size"] == vocab and exported["num_hidden_layers"] == 2
    layouts = [json.loads((run / f"zero_rank{r}.json").read_text()) for r in (0, 1)]
    if "tp2" in variant:  # the vocabulary split over the two ranks (unevenly for Granite's odd size)
        half = (vocab + 1) // 2
        assert [x["vocab_shard"] for x in layouts] == [[0, half], [half, vocab]]
    else:  # ZeRO-3: each rank holds about half of every weight
        assert all(0.4 < x["held"] / x["total"] < 0.6 for x in layouts)
