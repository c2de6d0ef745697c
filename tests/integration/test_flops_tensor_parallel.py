"""Model FLOPs under DeepSpeed AutoTP count the whole model, not a rank's slice (issue 29).

A real one-step run of ``launch/train.py`` with tensor parallelism 2 (2 CPU processes over gloo, the
tiny Llama-style config): the step's model FLOPs in ``metrics.jsonl`` (``tflops`` x time x ranks) over
its tokens must be ``6 N + 12 n_layer width S`` with ``N`` the exported (whole) model's own parameter
count less its untied input table, and ``S``, the micro-batch's padded length, a whole number between
the mean and the longest allowed sequence length. Counting after AutoTP split the layers gave
N = 39,744 of 79,168 (S would come out at about -110).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from tests.helpers.distributed import free_port, run_launch
from tests.helpers.spawn_ranks import deepspeed_command

pytest.importorskip("deepspeed")
transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[2]
SHIM = ROOT / "tests" / "helpers" / "ds_launch.py"
MICRO_BATCH, MAX_LENGTH = 16, 48  # configs/train/tiny_cpu_tp2.yaml, set here explicitly


def test_tensor_parallel_flops_count_the_whole_model(tmp_path):
    run = tmp_path / "tp2"
    overrides = [f"run_dir={run}", "train.tensor_parallel_size=2", "train.steps=1",
                 "train.gradient_accumulation_steps=1", f"train.micro_batch_size={MICRO_BATCH}",
                 f"data.max_length={MAX_LENGTH}", "eval.at_end=false", "tracking.wandb=disabled", "tracking.plot=false",
                 "train.log_every=1"]  # fmt: skip
    # the ranks `deepspeed --num_gpus 2` starts, with its variables, without its launcher's interpreters
    cmd = deepspeed_command(2, str(free_port()), str(SHIM), str(ROOT / "launch" / "train.py"), "--config",
                            str(ROOT / "configs" / "train" / "tiny_cpu_tp2.yaml"), *overrides)  # fmt: skip
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONUNBUFFERED": "1"}
    out = run_launch(cmd, cwd=ROOT, env=env, timeout=600)
    assert out.returncode == 0, f"train.py failed:\n{out.stdout[-4000:]}\n{out.stderr[-4000:]}"
    (row,) = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert json.loads((run / "zero_rank0.json").read_text())["tp"] == 2

    # the reference: the whole model, as exported, counts its own parameters
    model = transformers.AutoModelForCausalLM.from_pretrained(run / "hf_model")
    table, output = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    whole = sum(p.numel() for p in model.parameters()) - (0 if table is output else table.numel())
    config = model.config
    layers, width = config.num_hidden_layers, config.num_attention_heads * config.head_dim

    step_flops = row["tflops"] * 1e12 * row["time_s"] * 2  # per device x 2 ranks
    padded = (step_flops / row["tokens"] - 6 * whole) / (12 * layers * width)
    assert math.ceil(row["tokens"] / MICRO_BATCH) <= round(padded) <= MAX_LENGTH, (whole, padded, row)
    assert padded == pytest.approx(round(padded), abs=1e-6), (whole, padded, row)
