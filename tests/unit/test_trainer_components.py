"""The Trainer's components that run without DeepSpeed or a process group (ntl_scale/training/).

The collectives and the status agreement across ranks are tested on two gloo processes in
tests/distributed/test_trainer_collectives.py; the engine, the evaluator and the whole loop by the
launch tests (tests/integration/test_train_deepspeed.py and others).

Sections:
1. Resolved values: the config is read, never written; ``resolved.json`` holds the accumulation, the
   layout, bf16 and the DeepSpeed values, against values computed here from the config and the JSON.
2. Metrics: a step's row from its sums (against the ratios computed here), ``metrics.jsonl`` cut back
   to the resumed step, a progress line every ``train.log_every`` steps, ``eval.json`` at the end.
3. Tokens read and the checkpoint schedule and status file.
"""

from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path

import pytest
import torch

from ntl_scale.integrations.deepspeed.resolved import RESOLVED_FILE, Resolved, resolve_run
from ntl_scale.training.config import TrackingConfig, load_config
from ntl_scale.training.flops import FlopsCounter

ROOT = Path(__file__).resolve().parents[2]

# ---- 1. resolved values ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "overrides", "world", "bf16_default"),
    [
        ("tiny_cpu.yaml", ["train.global_batch_size=64", "train.micro_batch_size=4"], 2, False),  # accumulation 8
        ("tiny_cpu_tp2.yaml", ["train.global_batch_size=32", "train.micro_batch_size=4"], 4, True),  # TP 2 x DP 2
        ("tiny_pretrain_cpu.yaml", ["train.global_batch_size=null", "train.gradient_accumulation_steps=3"], 1, True),
    ],
)
def test_resolved_values_are_kept_apart_from_the_config(tmp_path, name, overrides, world, bf16_default):
    path = str(ROOT / "configs" / "train" / name)
    cfg = load_config(path, overrides)
    given = copy.deepcopy(cfg)
    resolved = resolve_run(cfg.train, world, bf16_default=bf16_default)
    assert cfg == given and cfg.to_dict() == load_config(path, overrides).to_dict()  # nothing written into it
    assert cfg.train.bf16 is None  # auto stays auto in the config

    # the same values, computed here from the config and the DeepSpeed JSON
    train = cfg.train
    tp = train.tensor_parallel_size
    dp = world // tp
    if train.global_batch_size is None:
        accumulation = train.gradient_accumulation_steps
    else:
        accumulation = train.global_batch_size // (train.micro_batch_size * dp)
    with open(train.deepspeed_config) as f:
        json_bf16 = json.load(f).get("bf16", {}).get("enabled", False)
    bf16 = bf16_default if json_bf16 == "auto" else bool(json_bf16)
    assert (resolved.world_size, resolved.tensor_parallel, resolved.data_parallel) == (world, tp, dp)
    assert resolved.gradient_accumulation_steps == accumulation > 0
    assert resolved.global_batch == train.micro_batch_size * accumulation * dp
    assert resolved.bf16 is bf16 and resolved.deepspeed["bf16"]["enabled"] is bf16
    assert resolved.deepspeed["gradient_accumulation_steps"] == accumulation
    assert resolved.deepspeed["train_micro_batch_size_per_gpu"] == train.micro_batch_size
    assert resolved.deepspeed["optimizer"]["params"]["lr"] == train.lr
    if tp == 1:  # with AutoTP DeepSpeed derives the batch itself
        assert resolved.deepspeed["train_batch_size"] == train.micro_batch_size * accumulation * dp
    assert (resolved.layout.data_parallel, resolved.layout.tensor_parallel, resolved.layout.global_batch) == (
        dp,
        tp,
        resolved.global_batch,
    )

    saved = tmp_path / RESOLVED_FILE
    resolved.save(str(saved))
    assert json.loads(saved.read_text()) == resolved.to_dict()
    assert Resolved(**json.loads(saved.read_text())) == resolved


def test_a_universal_resume_is_recorded_in_a_copy():
    cfg = load_config(None, [])
    resolved = resolve_run(cfg.train, 1, bf16_default=False)
    universal = resolved.resuming("universal")
    assert universal.resume == "universal" and universal.deepspeed["checkpoint"] == {"load_universal": True}
    assert "checkpoint" not in resolved.deepspeed and resolved.resume is None  # the first record is unchanged
    same = resolved.resuming("same")
    assert same.resume == "same" and same.deepspeed == resolved.deepspeed


# ---- 2. metrics ------------------------------------------------------------------------------------------


def _logger(run_dir: Path, *, steps: int = 4, log_every: int = 2, world: int = 2, rank: int = 0):
    from ntl_scale.training.metrics import MetricsLogger

    flops = FlopsCounter(matmul_params=1000, layers=2, width=8, peak_tflops=100.0)
    tracking = TrackingConfig(wandb="disabled", plot=False)
    return MetricsLogger(tracking, str(run_dir), steps=steps, log_every=log_every, flops=flops, rank=rank,
                         world_size=world)  # fmt: skip


def test_a_step_row_holds_the_ratios_of_its_sums(tmp_path):
    logger = _logger(tmp_path)
    sums = [12.0, 3.0, 40.0, 6.0, 2.0, 55.0, 6.6e6]  # ce ntl tokens numbers hits read flops
    row = logger.step_row(3, sums, lr=1e-3, grad_norm=0.5, seconds=2.0, data_s=0.25)
    columns = ("step", "ce", "ntl", "number_acc", "lr", "grad_norm", "tokens", "time_s", "data_s", "flops")
    assert tuple(row)[: len(columns)] == columns  # metrics.jsonl's column order
    assert (row["step"], row["ce"], row["ntl"], row["number_acc"]) == (3, 12.0 / 40.0, 3.0 / 6.0, 2.0 / 6.0)
    assert (row["lr"], row["grad_norm"], row["tokens"], row["time_s"], row["data_s"]) == (1e-3, 0.5, 55, 2.0, 0.25)
    assert row["flops"] == 6.6e6
    assert row["tokens_per_s_per_device"] == 55 / 2.0 / 2
    assert row["tflops"] == pytest.approx(6.6e6 / 2.0 / 2 / 1e12, rel=1e-15)
    assert row["mfu"] == pytest.approx(row["tflops"] / 100.0, rel=1e-15)
    no_numbers = logger.step_row(1, [4.0, 0.0, 2.0, 0.0, 0.0, 2.0, 0.0], lr=0.0, grad_norm=0.0, seconds=1, data_s=0)
    # no number targets: no NTL mean and no accuracy (a 0 would read as 0 % right), CE as before
    assert "ntl" not in no_numbers and "number_acc" not in no_numbers and no_numbers["ce"] == 2.0


def _strict_json(line: str) -> dict:
    """A metrics.jsonl row parsed as strict JSON: NaN / Infinity (which json.dumps writes) refused."""

    def refuse(constant: str) -> None:
        raise ValueError(f"{constant} in a metrics row: {line}")

    return json.loads(line, parse_constant=refuse)


def test_a_step_whose_labels_are_all_ignored_is_logged_without_its_means(tmp_path, capsys):
    """Issue 51, item 5: a step with no target token (every label ignored: tokens == 0) raised ZeroDivisionError in
    step_row and stopped the run. Now its row has no ``ce`` / ``ntl`` / ``number_acc`` (no null, no NaN), keeps
    everything else, goes to metrics.jsonl and the progress line (``n/a``), and the steps around it are logged as
    before; the loss plot's reader skips the missing values."""
    logger = _logger(tmp_path, steps=3, log_every=1)
    logger.open(0, {})
    empty = [0.0, 0.0, 0.0, 0.0, 0.0, 12.0, 3e6]  # ce ntl tokens numbers hits read flops: nothing to average
    for step, sums in ((1, [8.0, 1.0, 4.0, 2.0, 1.0, 4.0, 1e6]), (2, empty), (3, [6.0, 3.0, 3.0, 1.0, 1.0, 4.0, 1e6])):
        logger.log(logger.step_row(step, sums, lr=1e-3, grad_norm=0.5, seconds=0.5, data_s=0.1))
    rows = [_strict_json(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert not {"ce", "ntl", "number_acc"} & set(rows[1]) and None not in rows[1].values()
    assert (rows[1]["tokens"], rows[1]["flops"], rows[1]["lr"], rows[1]["grad_norm"]) == (12, 3e6, 1e-3, 0.5)
    assert (rows[0]["ce"], rows[0]["ntl"], rows[0]["number_acc"]) == (8.0 / 4.0, 1.0 / 2.0, 1.0 / 2.0)
    assert (rows[2]["ce"], rows[2]["ntl"], rows[2]["number_acc"]) == (6.0 / 3.0, 3.0 / 1.0, 1.0 / 1.0)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert "ce n/a  ntl n/a  number acc n/a" in lines[1] and "ce 2.0000  ntl 0.5000" in lines[0]
    if importlib.util.find_spec("matplotlib") is not None:
        from ntl_scale.training.tracking import plot_curves

        plot_curves(str(tmp_path / "metrics.jsonl"), str(tmp_path / "curves.png"))
        assert (tmp_path / "curves.png").stat().st_size > 0


def test_metrics_are_cut_back_to_the_resumed_step_and_logged(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "ce": float(s)}) + "\n" for s in range(1, 6)))  # stopped at 5
    logger = _logger(tmp_path, steps=6, log_every=2)
    logger.open(3, {"run_dir": str(tmp_path)})  # the checkpoint is at step 3: steps 4 and 5 are redone
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3]
    for step in (4, 5, 6):
        logger.log(logger.step_row(step, [8.0, 1.0, 4.0, 2.0, 1.0, 4.0, 1e6], lr=1e-3, grad_norm=1.0, seconds=0.5,
                                   data_s=0.1))  # fmt: skip
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6] and rows[-1]["ce"] == 2.0
    assert [r["step"] for r in logger.history] == [4, 5, 6]
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in lines] == ["4/6", "6/6"]  # every log_every steps and the last
    assert "ce 2.0000  ntl 0.5000  number acc 0.500" in lines[0]


def test_other_ranks_write_nothing(tmp_path):
    logger = _logger(tmp_path, rank=1)
    logger.open(0, {})
    logger.log(logger.step_row(1, [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0], lr=0.0, grad_norm=0.0, seconds=1, data_s=0))
    logger.finish({"interpolate": {"accuracy": 1.0}}, {"interpolate": 1})
    assert list(tmp_path.iterdir()) == [] and len(logger.history) == 1


def test_finish_writes_eval_json_and_the_summary(tmp_path, capsys):
    logger = _logger(tmp_path)
    logger.open(0, {})
    (tmp_path / "predictions_interpolate.jsonl").write_text(
        json.dumps({"question": "What is 2 + 3?", "answer": "5", "generated": "5", "parsed": 5.0}) + "\n"
    )
    results = {"interpolate": {"accuracy": 1.0, "mae": 0.0, "unparseable": 0.0}}
    logger.finish(results, {"interpolate": 1})
    assert json.loads((tmp_path / "eval.json").read_text()) == results
    out = capsys.readouterr().out
    assert "interpolate           1    100.0%" in out and "What is 2 + 3?  true        5  model        5  right" in out


# ---- 3. tokens read, checkpoint schedule, status ---------------------------------------------------------


def test_tokens_read_counts_what_the_model_reads():
    from ntl_scale.training.metrics import tokens_read

    ids = torch.tensor([[5, 6, 7, 0], [5, 6, 0, 0]])
    mask = (ids != 0).long()
    labels = torch.tensor([[-100, 6, 7, -100], [-100, 6, -100, -100]])
    assert int(tokens_read({"input_ids": ids, "attention_mask": mask, "labels": labels}, "causal")) == 5
    assert int(tokens_read({"input_ids": ids, "labels": labels}, "causal")) == 8  # packed rows: no padding
    # seq2seq: the encoder reads the inputs, the decoder the answer tokens
    assert int(tokens_read({"input_ids": ids, "attention_mask": mask, "labels": labels}, "seq2seq")) == 5 + 3


def test_checkpoint_schedule_and_status_file(tmp_path):
    from ntl_scale.integrations.deepspeed.checkpointer import Checkpointer
    from ntl_scale.integrations.deepspeed.resume_layout import Layout

    def checkpointer(save_every: int, rank: int = 0) -> Checkpointer:
        return Checkpointer(
            str(tmp_path), Layout(2, 1, 8), save_every=save_every, rank=rank, device=torch.device("cpu")
        )

    assert [s for s in range(1, 11) if checkpointer(4).due(s)] == [4, 8]
    assert not any(checkpointer(0).due(s) for s in range(1, 11))  # 0: only at the end
    assert checkpointer(0).plan() is None  # no checkpoint yet: from step 0
    checkpointer(0, rank=1).write_status("running", 3)  # rank 1 writes nothing
    assert not (tmp_path / "status.json").exists()
    checkpointer(0).write_status("stopped", 7)
    assert json.loads((tmp_path / "status.json").read_text()) == {"state": "stopped", "step": 7}
